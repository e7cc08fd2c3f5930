"""The input of an FP8-weight Linear layer rounded to e4m3 in Triton (kernels/fp8_weights.py's
quantize_rows is the contract and the twin), optionally fused with the RMSNorm in front of it.

One program a row: the row's largest |x| (of each group of columns) needs the whole row, so the
norm in front of qkv and gate/up, which normalises a whole row anyway, also writes the e4m3 rows
and their scales instead of the model-dtype row (one launch for both); the inputs of o_proj and
down_proj (the attention kernel's and the gate/up GEMV's outputs) get a launch of their own.
Rounded with the hardware cast on a GPU (cvt.rn.satfinite, round to nearest even), with integer
ops under the interpreter (kernels/e4m3.py): the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import fp8_weights
from .e4m3 import round_to_e4m3
from .fp8_weights import FP8_DTYPE, FP8Weight, QuantizedRows

_FP8_MAX = tl.constexpr(fp8_weights.FP8_MAX)
_SCALE_FLOOR = tl.constexpr(fp8_weights.SCALE_FLOOR)


@triton.jit
def _quantize_rows_kernel(
    X,  # [R, K] model dtype
    NormW,  # [K] RMSNorm weight (NORM), else a dummy
    Static,  # [1] float32 static scale (STATIC), else a dummy
    Q,  # [R, K] uint8: e4m3 bit patterns
    S,  # [R, n_groups] float32
    K,
    n_groups,
    eps,
    stride_x,
    stride_q,
    stride_s,
    BLOCK: tl.constexpr,  # next power of two >= K
    GROUP: tl.constexpr,  # columns per scale (BLOCK: one scale a row)
    NORM: tl.constexpr,
    STATIC: tl.constexpr,
    HW: tl.constexpr,  # the hardware e4m3 cast (else integer rounding: the interpreter)
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    if USE_PDL:  # let the GEMV after us launch and issue its first weight tiles while we wait
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    if NORM:  # RMSNorm as ops.rms_norm rounds it: normalised in float32, rounded, scaled, rounded
        inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)
        w = tl.load(NormW + offs, mask=mask, other=0.0).to(tl.float32)
        xf = ((xf * inv_rms).to(X.dtype.element_ty).to(tl.float32) * w).to(X.dtype.element_ty).to(tl.float32)
    # x times the scale's reciprocal (fp8_weights.quantize_rows): a multiply a value, where an IEEE
    # division a value would make this launch much longer (bench/NOTES-fp8-weights.md)
    if STATIC:
        scale = tl.load(Static)
        y = xf * tl.math.div_rn(1.0, scale)
        tl.store(S + row * stride_s, scale)
    else:
        groups = tl.reshape(xf, [BLOCK // GROUP, GROUP])
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(groups), axis=1), _FP8_MAX), _SCALE_FLOOR)
        y = tl.reshape(groups * tl.math.div_rn(1.0, scale)[:, None], [BLOCK])
        offs_g = tl.arange(0, BLOCK // GROUP)
        tl.store(S + row * stride_s + offs_g, scale, mask=offs_g < n_groups)
    y = tl.minimum(tl.maximum(y, -_FP8_MAX), _FP8_MAX)  # a static scale saturates
    if HW:
        bits = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        bits = round_to_e4m3(y)
    tl.store(Q + row * stride_q + offs, bits, mask=mask)


def quantize_rows(
    x: torch.Tensor,  # [..., K]
    weight: FP8Weight,  # whose input x is: its activation scheme
    norm: tuple[torch.Tensor, float] | None = None,  # (RMSNorm weight [K], eps): normalise first
    use_pdl: bool = False,
) -> QuantizedRows:  # values [R, K] e4m3, scale [R, groups] float32
    K = x.shape[-1]
    rows = x.reshape(-1, K)  # contiguous rows (a copy only for strided views)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    R = rows.shape[0]
    block = triton.next_power_of_2(K)
    static = weight.input_scale is not None
    group = block if static or weight.act_group is None else min(weight.act_group, block)
    n_groups = 1 if static or weight.act_group is None else triton.cdiv(K, group)
    values = torch.empty(R, K, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(R, n_groups, dtype=torch.float32, device=x.device)
    _quantize_rows_kernel[(R,)](
        rows,
        rows if norm is None else norm[0],
        scale if not static else weight.input_scale,
        values.view(torch.uint8),  # the interpreter has no float8 tensors
        scale,
        K,
        n_groups,
        0.0 if norm is None else norm[1],
        rows.stride(0),
        values.stride(0),
        scale.stride(0),
        BLOCK=block,
        GROUP=group,
        NORM=norm is not None,
        STATIC=static,
        HW=x.is_cuda,
        USE_PDL=use_pdl,
        num_warps=min(16, max(1, block // 256)),  # 16 for the 8B's rows (bench/NOTES-fp8-weights.md)
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return QuantizedRows(values, scale, K if n_groups == 1 else group, x.dtype)

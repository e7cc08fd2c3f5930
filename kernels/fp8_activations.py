"""The input of an FP8-weight Linear layer rounded to e4m3 in Triton (kernels/fp8_weights.py's
quantize_rows is the contract and the twin), optionally fused with the RMSNorm in front of it.

`round_row` rounds one row: its largest |x| (of each group of columns) needs the whole row, so
the row is read whole, normalised first where an RMSNorm comes before the layer (qkv, gate/up).
The decode GEMV runs it in its prologue for a few rows (kernels/gemv.py: no launch of its own);
`quantize_rows` is one program a row for more rows (a batch, prefill). Rounded with the hardware
cast on a GPU (cvt.rn.satfinite, round to nearest even), with integer ops under the interpreter
(kernels/e4m3.py): the same bits.
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


# Warps of the rounding of a row, in its own launch or in a GEMV's prologue (kernels/gemv.py): the
# RMSNorm's float32 sum is reduced in the order of the layout, so both take the same one, and a
# row gets the same bits whichever rounds it.
ROUND_WARPS = 4


@triton.jit
def round_row(
    X,  # [K] model dtype: the row
    NormW,  # [K] RMSNorm weight (NORM), else a dummy
    Static,  # [1] float32 static scale (STATIC), else a dummy
    Q,  # [K] the e4m3 values (HW: float8e4nv; else uint8 bit patterns)
    S,  # [n_groups] float32 scales
    K,
    k_lo,  # the values stored: columns k_lo..k_hi-1 (every scale is stored)
    k_hi,
    n_groups,
    eps,
    BLOCK: tl.constexpr,  # next power of two >= K: the whole row in registers
    GROUP: tl.constexpr,  # columns per scale (BLOCK: one scale a row)
    NORM: tl.constexpr,
    STATIC: tl.constexpr,
    HW: tl.constexpr,  # the hardware e4m3 cast (else integer rounding: the interpreter)
):
    """One row rounded to e4m3 as fp8_weights.quantize_rows rounds it (RMSNorm first with NORM):
    scale = largest |x| (of the row, or of each group of GROUP columns) / 448, or the static one;
    the values x * (1 / scale) (a multiply a value: the row's cost is its loads)."""
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(X + offs, mask=mask, other=0.0)
    if NORM:  # RMSNorm as ops.rms_norm rounds it: normalised in float32, rounded, scaled, rounded
        xf = x.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)
        w = tl.load(NormW + offs, mask=mask, other=0.0).to(tl.float32)
        x = ((xf * inv_rms).to(X.dtype.element_ty).to(tl.float32) * w).to(X.dtype.element_ty)
    if STATIC:
        scale = tl.load(Static)
        y = x.to(tl.float32) * tl.math.div_rn(1.0, scale)
        tl.store(S, scale)
    else:  # the largest |x| of the model-dtype values (a max is exact in any dtype and order)
        groups = tl.reshape(x, [BLOCK // GROUP, GROUP])
        amax = tl.max(tl.abs(groups), axis=1).to(tl.float32)
        scale = tl.maximum(tl.math.div_rn(amax, _FP8_MAX), _SCALE_FLOOR)
        y = tl.reshape(groups.to(tl.float32) * tl.math.div_rn(1.0, scale)[:, None], [BLOCK])
        offs_g = tl.arange(0, BLOCK // GROUP)
        tl.store(S + offs_g, scale, mask=offs_g < n_groups)
    y = tl.minimum(tl.maximum(y, -_FP8_MAX), _FP8_MAX)  # a static scale saturates
    if HW:
        values = y.to(tl.float8e4nv)
    else:
        values = round_to_e4m3(y)
    tl.store(Q + offs, values, mask=mask & (offs >= k_lo) & (offs < k_hi))


@triton.jit
def _quantize_rows_kernel(
    X,  # [R, K] model dtype
    NormW,  # [K] RMSNorm weight (NORM), else a dummy
    Static,  # [1] float32 static scale (STATIC), else a dummy
    Q,  # [R, K] e4m3 (HW), else uint8 bit patterns
    S,  # [R, n_groups] float32
    K,
    n_groups,
    eps,
    stride_x,
    stride_q,
    stride_s,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    NORM: tl.constexpr,
    STATIC: tl.constexpr,
    HW: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if USE_PDL:  # let the GEMV after us launch and issue its first weight tiles while we wait
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
    round_row(
        X + row * stride_x, NormW, Static, Q + row * stride_q, S + row * stride_s, K, 0, K, n_groups, eps,
        BLOCK, GROUP, NORM, STATIC, HW,
    )  # fmt: skip


def scheme(weight: FP8Weight, K: int) -> tuple[int, int, int, bool]:
    """How `weight`'s input rows [.., K] are rounded: (BLOCK: K padded to a power of two, GROUP:
    columns per scale (BLOCK: one a row), scales a row, STATIC: the checkpoint's input scale)."""
    block = triton.next_power_of_2(K)
    static = weight.input_scale is not None
    if static or weight.act_group is None:
        return block, block, 1, static
    group = min(weight.act_group, block)
    return block, group, triton.cdiv(K, group), static


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
    block, group, n_groups, static = scheme(weight, K)
    values = torch.empty(R, K, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(R, n_groups, dtype=torch.float32, device=x.device)
    _quantize_rows_kernel[(R,)](
        rows,
        rows if norm is None else norm[0],
        scale if not static else weight.input_scale,
        values if x.is_cuda else values.view(torch.uint8),  # the interpreter has no float8 tensors
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
        num_warps=ROUND_WARPS,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return QuantizedRows(values, scale, K if n_groups == 1 else group, x.dtype)

"""Decode GEMV in Triton: out = x @ W^T for the few rows of a decode step, optionally adding
into the residual stream in place.

A decode step multiplies one token's activations by every weight matrix: each weight byte is
read once for 2 FLOPs, so a GEMV runs at memory speed or not at all. What a 1-row GEMV loses is
around it, not in it: cuBLAS picks split-K kernels with a separate reduce launch for the 4096-wide
outputs, and every launch pays for its start (launch, first DRAM round trip) after the previous
kernel has fully drained. Here each CTA streams a block of output features through the whole of
K in one software-pipelined loop (the rows padded into a `tl.dot`'s M axis; tensor cores do the
arithmetic), and the step's kernels are chained with programmatic dependent launch (PDL): a
kernel starts while its predecessor finishes, issues its first weight tile (weights never depend
on an earlier kernel), and only then waits for the predecessor's results (`gdc_wait`).

`residual` (o_proj and down_proj) adds the result into the residual stream in place, rounded as
transformers rounds `h + o_proj(...)`: the projection to the model dtype first, then the sum.
The RMSNorm in front of qkv and gate/up stays a separate launch: folding it into the loop (x
scaled by the norm weight, x^2 summed alongside) made those GEMVs 3-6x slower, because elementwise
work on x in the loop stops its loads from being pipelined (bench/NOTES-attention.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Rows padded into the dot's M axis (16, or 32 from 17 rows); larger batches go to cuBLAS. At 32
# rows it beats cuBLAS now that one CTA fits an SM (32 x 4k batch step: 8.80 against 9.07 ms).
MAX_ROWS = 32
MAX_OUTPUTS = 16384  # wider weights (gate/up, lm_head) stream as fast or faster through cuBLAS


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters: output features per CTA, reduction chunk, warps, pipeline depth."""

    block_n: int = 32  # N / 32 CTAs: 128 for a 4096-wide output, one per SM
    block_k: int = 256  # a 16 KiB bf16 tile of W (and 8 KiB of x) per pipeline stage
    num_warps: int = 4
    # 6 stages keep 5 tiles in shared memory, 120 KiB: one CTA fits an SM. That is what matters
    # under PDL: a GEMV launched early is placed on whichever SMs its predecessor frees first, and
    # with room for two or three CTAs an SM (4 stages: 72 KiB) they pile onto those SMs and
    # stream from a few SMs (decode step 1-4% slower; bench/NOTES-attention.md).
    num_stages: int = 6


DEFAULT_CONFIG = GemvConfig()


@triton.jit
def _gemv_kernel(
    X,  # [B, K]
    W,  # [N, K], rows contiguous
    Bias,  # [N] or a dummy
    Out,  # [B, N]; with HAS_RESIDUAL the residual stream, updated in place
    B,
    N,
    K,
    stride_xb,
    stride_wn,
    stride_ob,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    offs_m = tl.arange(0, M_PAD)  # rows of x, padded
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # this CTA's output features
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < B
    n_ok = offs_n < N
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]; 64-bit for huge weights
    x_rows = X + offs_m[:, None] * stride_xb  # [M_PAD, 1]
    # The first weight tile is loaded before waiting for the previous kernel: it overlaps that
    # kernel's tail (weights are never written by the step, so there is nothing to wait for).
    w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k < K)[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x (and the residual) are the previous kernels' results
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_rows + offs_k[None, :], mask=row_ok[:, None] & (offs_k < K)[None, :], other=0.0)
    acc = tl.dot(x, tl.trans(w), input_precision=PRECISION)  # [M_PAD, BLOCK_N]
    for k0 in range(BLOCK_K, K, BLOCK_K):  # software-pipelined: num_stages tiles in flight
        k = k0 + offs_k
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = acc.to(Out.dtype.element_ty)
    out_ptrs = Out + offs_m[:, None] * stride_ob + offs_n[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    if HAS_RESIDUAL:
        y = (tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32) + y.to(tl.float32)).to(
            Out.dtype.element_ty
        )
    tl.store(out_ptrs, y, mask=mask)


def gemv(
    x: torch.Tensor,  # [B, K], B <= MAX_ROWS
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    *,
    residual: torch.Tensor | None = None,  # [B, N]: residual += result, in place, and returned
    use_pdl: bool = False,
    config: GemvConfig = DEFAULT_CONFIG,
) -> torch.Tensor:  # [B, N] in x.dtype
    """x @ weight^T + bias (added into residual in place, if given) in one Triton launch."""
    B, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K or B > MAX_ROWS or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(
            f"gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit (contiguous K)"
        )
    out = residual if residual is not None else torch.empty(B, N, dtype=x.dtype, device=x.device)
    block_k = config.block_k // 2 if x.dtype == torch.float32 else config.block_k  # fp32: twice the bytes
    _gemv_kernel[(triton.cdiv(N, config.block_n),)](
        x,
        weight,
        weight if bias is None else bias,
        out,
        B,
        N,
        K,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None,
        USE_PDL=use_pdl,
        M_PAD=16 if B <= 16 else 32,  # tl.dot needs M >= 16
        BLOCK_N=config.block_n,
        BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 models: exact products
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return out

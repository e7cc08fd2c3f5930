"""The context-parallel merge: attention computed over disjoint ranges of the context (one per
rank), each range's normalised output o and log-sum-exp lse, combined exactly.

    softmax over all keys = sum_i exp(lse_i - lse) softmax_i,   lse = log sum_i exp(lse_i)

merge_partials is that rule in PyTorch (prefill's blocks, and the twin). In the decode step each
rank packs its (o, lse) per query head into one float32 row [D + 1] (pack_partials), the rows are
all-gathered (minidecode/distributed.py), and merge_ranks combines them: on GPUs two Triton
launches chained with programmatic dependent launch around the gather, where PyTorch's ops were
seven (cat, compare, where, softmax, multiply, sum, cast) that launch one after another.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def merge_partials(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Exact softmax attention over the union of disjoint key ranges from each range's result:
    o [n, ..., D] (each range's normalised output; finite, zeros for an empty range) and lse
    [n, ...] (its log-sum-exp of the scaled scores, natural log; -inf for an empty range, and at
    least one range not empty) -> o [..., D] in float32 or wider. The weights are a softmax of the
    lse over the ranges (the rule the lean kernel applies inside, in log2 units, to its CTAs'
    partials)."""
    dtype = torch.promote_types(lse.dtype, torch.float32)
    weight = torch.softmax(lse.to(dtype), dim=0).unsqueeze(-1)  # [n, ..., 1]; 0 for an empty range
    return (o * weight).sum(dim=0)


@triton.jit
def _pack_kernel(Out, LSE, Lengths, Packed, HQ, D: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # One program per (sequence, query head): Packed[row] = [o, lse] (o is Out: this range's
    # attention output), or [0, -inf] where the sequence has nothing in this range (the attention
    # kernel wrote neither there).
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # o and lse are the attention kernel's output
    length = tl.load(Lengths + row // HQ)
    # (a vector mask: the interpreter takes no scalar in one)
    o = tl.load(Out + row * D + offs, mask=(offs < D) & (offs * 0 + length > 0), other=0.0).to(tl.float32)
    lse = tl.where(length > 0, tl.load(LSE + row), float("-inf"))
    tl.store(Packed + row * (D + 1) + offs, tl.where(offs == D, lse, o), mask=offs <= D)


@triton.jit
def _merge_kernel(
    Parts, Out, ROWS, R: tl.constexpr, R_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    # One program per (sequence, query head): the R ranks' packed rows [R, D + 1] -> o [D].
    row = tl.program_id(0)
    ranks = tl.arange(0, R_PAD)
    offs = tl.arange(0, BLOCK)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # the gathered rows are the previous kernel's output
    rows = Parts + (ranks * ROWS + row) * (D + 1)  # [R_PAD]
    lse = tl.load(rows + D, mask=ranks < R, other=float("-inf"))
    weight = tl.exp(lse - tl.max(lse, 0))  # an empty range (-inf) weighs 0
    weight = weight / tl.sum(weight, 0)
    o = tl.load(rows[:, None] + offs[None, :], mask=(ranks < R)[:, None] & (offs < D)[None, :], other=0.0)
    tl.store(Out + row * D + offs, tl.sum(o * weight[:, None], 0).to(Out.dtype.element_ty), mask=offs < D)


def pack_partials(
    o: torch.Tensor,  # [B, Hq, D]: this range's attention output (any float dtype)
    lse: torch.Tensor,  # [B, Hq] float32
    lengths: torch.Tensor,  # [B]: positions of this range per sequence (0: none, o and lse unset)
    use_triton: bool,
    pdl: bool = False,
) -> torch.Tensor:  # [B, Hq, D + 1] float32
    B, Hq, D = o.shape
    if not use_triton:
        packed = torch.cat([o.float(), lse[..., None]], dim=-1)
        nothing = torch.zeros(D + 1, device=o.device)
        nothing[-1] = float("-inf")
        return torch.where(lengths[:, None, None] > 0, packed, nothing)
    packed = torch.empty(B, Hq, D + 1, dtype=torch.float32, device=o.device)
    _pack_kernel[(B * Hq,)](
        o.contiguous(), lse.contiguous(), lengths, packed, Hq, D=D, BLOCK=triton.next_power_of_2(D + 1),
        USE_PDL=pdl, num_warps=1, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return packed


def merge_ranks(
    parts: torch.Tensor,  # [R, B, Hq, D + 1] float32: every rank's packed rows, in rank order
    dtype: torch.dtype,
    use_triton: bool,
    pdl: bool = False,
) -> torch.Tensor:  # [B, Hq, D] of dtype
    R, B, Hq, D1 = parts.shape
    if not use_triton:
        return merge_partials(parts[..., :-1], parts[..., -1]).to(dtype)
    out = torch.empty(B, Hq, D1 - 1, dtype=dtype, device=parts.device)
    _merge_kernel[(B * Hq,)](
        parts.contiguous(), out, B * Hq, R=R, R_PAD=triton.next_power_of_2(R), D=D1 - 1,
        BLOCK=triton.next_power_of_2(D1 - 1), USE_PDL=pdl, num_warps=1,
        **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return out

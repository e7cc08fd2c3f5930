"""Triton paths of the context-parallel merge's ops (kernels/ops.py: pack_partials, merge_ranks;
the rule is merge_partials'). In the decode step each rank packs its attention output and
log-sum-exp per query head into one float32 row [D + 1], the rows are all-gathered
(minidecode/distributed.py), and the merge combines them: two launches chained with programmatic
dependent launch around the gather, where PyTorch's ops were seven (cat, compare, where, softmax,
multiply, sum, cast) that launch one after another.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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


def pack_partials(o: torch.Tensor, lse: torch.Tensor, lengths: torch.Tensor, pdl: bool) -> torch.Tensor:
    B, Hq, D = o.shape
    packed = torch.empty(B, Hq, D + 1, dtype=torch.float32, device=o.device)
    _pack_kernel[(B * Hq,)](
        o.contiguous(), lse.contiguous(), lengths, packed, Hq, D=D, BLOCK=triton.next_power_of_2(D + 1),
        USE_PDL=pdl, num_warps=1, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return packed


def merge_ranks(parts: torch.Tensor, dtype: torch.dtype, pdl: bool) -> torch.Tensor:
    R, B, Hq, D1 = parts.shape
    out = torch.empty(B, Hq, D1 - 1, dtype=dtype, device=parts.device)
    _merge_kernel[(B * Hq,)](
        parts.contiguous(), out, B * Hq, R=R, R_PAD=triton.next_power_of_2(R), D=D1 - 1,
        BLOCK=triton.next_power_of_2(D1 - 1), USE_PDL=pdl, num_warps=1,
        **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return out

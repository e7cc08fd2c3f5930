"""The one-shot collectives' kernel (kernels/collectives.py) with real ranks on the CPU: one process
per rank under the Triton interpreter, their buffers in shared memory (each process maps them at
addresses of its own, as GPUs map each other's), so pushes and polls cross processes as they
cross GPUs. Each rank makes the decode step's pattern of calls (small sums, a multi-CTA gather, a
float32 gather, a sum in place, sums with the RMSNorm after them) many times over, through both
slots and across the call counts' wrap, and checks every result against the sums of what each
rank gave (and the norms against float64's). The same for a tensor-parallel projection whose GEMV
sums the ranks' products in its own launch (ops.linear_summed), between plain calls that share its
call counts."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from minidecode.kernels import collectives, ops
from minidecode.kernels.fp8_weights import FP8Weight, quantize_weight
from minidecode.kernels.gemv import gemv

ROUNDS = 3
START = 2**31 - 3  # the call counts start just below int32's wrap: compared as differences
EPS = 1e-5


def messages(rank: int, call: int) -> list[tuple[str, torch.Tensor]]:
    """What rank `rank` contributes to its calls of round `call`: distinct values per rank and round.
    The half-precision sum is fp16: the interpreter rounds float32 to bf16 by truncation (the GPU
    rounds to nearest), so a bf16 sum would differ from float64's in the last place there."""
    gen = torch.Generator().manual_seed(1000 * call + rank)
    return [
        ("sum", torch.randn(4096, generator=gen).to(torch.float16)),  # a [1, 4096] hidden state
        ("gather", torch.randn(3, 7000, generator=gen).to(torch.bfloat16)),  # 41 KiB: 3 CTAs
        ("gather", torch.randn(2, 4, 33, generator=gen)),  # float32 partials, as context parallel
        ("sum_in_place", torch.randn(2, 4100, generator=gen)),  # float32, 2 CTAs, out is x
        ("sum_norm", torch.randn(1, 4096, generator=gen).to(torch.float16)),  # + the RMSNorm
        ("sum_norm", torch.randn(1, 2048, generator=gen)),  # float32: also one CTA
    ]


def norm_weight(x: torch.Tensor) -> torch.Tensor:
    """The RMSNorm weight of a sum_norm message (the same on every rank)."""
    return (1 + torch.randn(x.shape[-1], generator=torch.Generator().manual_seed(x.numel()))).to(x.dtype)


def expected(size: int, call: int) -> list[torch.Tensor]:
    per_rank = [messages(r, call) for r in range(size)]
    out = []
    for i, (kind, x) in enumerate(per_rank[0]):
        parts = [per_rank[r][i][1] for r in range(size)]
        if kind == "gather":
            out.append(torch.stack(parts))
        else:  # the kernel's contract: float32 accumulation in rank order, then the dtype
            total = torch.zeros(x.shape)
            for p in parts:
                total += p.float()
            out.append(total.to(x.dtype))
    return out


def rms_norm_error(total: torch.Tensor, normed: torch.Tensor) -> float:
    """normed against the float64 RMSNorm of the sum the kernel wrote (relative to its largest)."""
    x = total.double()
    ref = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS) * norm_weight(total).double()
    return float((normed.double() - ref).abs().max() / ref.abs().max())


def one_shot_calls(rank: int, size: int, ends: collectives.RankBuffers) -> list[str]:
    """The decode step's pattern of plain calls, ROUNDS times: this rank's errors."""
    errors = []
    for call in range(ROUNDS):
        for (kind, x), want in zip(messages(rank, call), expected(size, call), strict=True):
            if kind == "gather":
                got = collectives.one_shot(x, x.new_empty(size, *x.shape), ends, True)
            elif kind == "sum":
                got = collectives.one_shot(x, torch.empty_like(x), ends, False)
            elif kind == "sum_norm":
                normed = torch.empty_like(x)
                got = collectives.one_shot(
                    x, torch.empty_like(x), ends, False, norm=(norm_weight(x), EPS, normed)
                )
                if (error := rms_norm_error(got, normed)) > (2e-3 if x.dtype == torch.float16 else 1e-6):
                    errors.append(f"round {call} {kind}: RMSNorm off by {error:.1e}")
            else:
                got = collectives.one_shot(x, x, ends, False)
            if not torch.equal(got, want):
                diff = (got.double() - want.double()).abs().max()
                errors.append(f"round {call} {kind}: max diff {diff}")
    return errors


# A row-split projection's cases: (name, dtype, rows, out features, in features, norm after, fp8).
# On the interpreter (4 CTAs) they take the GEMV's configs: weight rows on M (4 blocks of 64);
# x's rows on M, two rows (3 blocks of 32); FP8 with K split in two (the merge stores and pushes);
# and a result larger than one chunk (12 KiB: the product, then the one-shot kernel).
PROJECTIONS = [
    ("weight rows on M", torch.float16, 1, 256, 64, True, False),
    ("x rows on M, float32", torch.float32, 2, 96, 48, False, False),
    ("fp8, K split", torch.float16, 1, 128, 128, True, True),
    ("over a chunk", torch.float16, 3, 2048, 32, False, False),
]


def projection_inputs(name: str, rank: int, call: int):
    """Rank `rank`'s x and weight columns for round `call` of a case, and the residual stream and
    bias every rank holds."""
    case = next(i for i, c in enumerate(PROJECTIONS) if c[0] == name)
    _, dtype, rows, n, k, _, fp8 = PROJECTIONS[case]
    gen = torch.Generator().manual_seed(7919 * call + 31 * rank + case)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen) / k**0.5
    weight = FP8Weight(*quantize_weight(w), 1, k) if fp8 else w.to(dtype)
    shared = torch.Generator().manual_seed(7919 * call + 1000 + case)
    residual = torch.randn(rows, n, generator=shared).to(dtype)
    bias = torch.randn(n, generator=shared).to(dtype)
    return x, weight, residual, bias


def projection_sum(size: int, name: str, call: int) -> torch.Tensor:
    """The reference: each rank's product as the GEMV alone computes it (rank 0's with the bias,
    added into the residual stream), summed in rank order in float32, then the dtype."""
    total = None
    for r in range(size):
        x, weight, residual, bias = projection_inputs(name, r, call)
        if isinstance(weight, FP8Weight):
            x = ops.quantize_input(x, weight, triton=True)
        part = gemv(x, weight, bias, residual=residual) if r == 0 else gemv(x, weight)
        total = part.float() if total is None else total + part.float()
    return total.to(residual.dtype)


def projection_calls(rank: int, size: int, ends: collectives.RankBuffers) -> list[str]:
    """A row-split projection's calls, each case ROUNDS times, a plain sum after each: this rank's
    errors."""
    errors = []
    for call in range(ROUNDS):
        for name, dtype, *_, norm_after, _ in PROJECTIONS:
            x, weight, residual, bias = projection_inputs(name, rank, call)
            norm = (norm_weight(residual), EPS, torch.empty_like(residual)) if norm_after else None
            summed = collectives.SumAfter(ends, residual, norm)
            if rank == 0:  # as models/parallel.py: rank 0 folds the residual and the bias in
                ops.linear_summed(x, weight, bias, summed, residual=residual, triton=True)
            else:
                ops.linear_summed(x, weight, None, summed, triton=True)
            want = projection_sum(size, name, call)
            if not torch.equal(residual, want):
                diff = (residual.double() - want.double()).abs().max()
                errors.append(f"round {call} {name}: max diff {diff}")
            if norm is not None and (error := rms_norm_error(residual, norm[2])) > 2e-3:
                errors.append(f"round {call} {name}: RMSNorm off by {error:.1e}")
            # a plain sum between the projections: the call counts are shared
            part = torch.full((1, 64), float(rank + call), dtype=dtype)
            got = collectives.one_shot(part, torch.empty_like(part), ends, False)
            if not torch.equal(got, torch.full_like(part, sum(r + call for r in range(size)))):
                errors.append(f"round {call} after {name}: the plain sum is {got[0, 0].item()}")
    if ends.ticket.item() != 0:
        errors.append(f"the GEMV's ticket was left at {ends.ticket.item()}")
    return errors


def rank_main(calls, rank: int, size: int, buffers: list[torch.Tensor], results) -> None:
    """One rank under the interpreter: its ends of the buffers (call counts just below the wrap),
    then calls(rank, size, ends); its errors (or what it raised) into results[rank]."""
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        ends = collectives.RankBuffers.of(buffers[rank], [b.data_ptr() for b in buffers], rank)
        ends.calls.fill_(START)
        results[rank] = calls(rank, size, ends)
    except Exception as e:  # reported to the test, not lost in the child
        results[rank] = [repr(e)]


def run_ranks(calls, size: int) -> dict:
    """calls(rank, size, ends) in one process per rank: every rank's list of errors."""
    ctx = mp.get_context("spawn")
    nbytes = collectives.buffer_bytes(size)
    buffers = [torch.zeros(nbytes, dtype=torch.uint8).share_memory_() for _ in range(size)]
    with ctx.Manager() as manager:
        results = manager.dict()
        ranks = [ctx.Process(target=rank_main, args=(calls, r, size, buffers, results)) for r in range(size)]
        for p in ranks:
            p.start()
        deadline = time.monotonic() + 180  # a run takes seconds; a rank that never sees its data hangs
        for p in ranks:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(ranks) if p.is_alive()]
        for p in ranks:
            p.kill()
        assert not hung, f"ranks {hung} still waiting"
        return dict(results)


@pytest.mark.parametrize("size", [2, 3])
def test_ranks_in_processes_sum_and_gather_exactly(size):
    assert run_ranks(one_shot_calls, size) == {r: [] for r in range(size)}


@pytest.mark.parametrize("size", [2, 3])
def test_projection_summed_in_its_gemv_launch(size):
    assert run_ranks(projection_calls, size) == {r: [] for r in range(size)}


def test_fits():
    assert collectives.fits(torch.zeros(1, 4096, dtype=torch.bfloat16))
    assert collectives.fits(torch.zeros(collectives.MAX_BYTES // 4))
    assert not collectives.fits(torch.zeros(collectives.MAX_BYTES // 4 + 1))
    assert not collectives.fits(torch.zeros(2, 8)[:, ::2])  # not contiguous
    assert not collectives.fits(torch.zeros(8, dtype=torch.int64))
    assert not collectives.fits(torch.zeros(0))
    assert not collectives.fits(torch.zeros(4, dtype=torch.bfloat16)[1:3])  # starts mid-word
    assert not collectives.fits(torch.zeros(3, dtype=torch.bfloat16))  # ends mid-word

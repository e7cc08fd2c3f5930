"""Context parallelism in one process: the dealing of positions over ranks (models/sharding.py's
deal), the decode step's slots after it, and the balanced prefill attention of
ContextParallelAttention simulated with one thread per rank (the gathers through a barrier),
against float64 attention over the whole prompt. The ranks as processes, against one process's
tokens: tests/test_distributed.py."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import max_rel_err

from minidecode.kernels.fp8_prefill import causal_reference
from minidecode.models.parallel import ContextParallelAttention
from minidecode.models.sharding import deal


def causal_work(runs: list[tuple[int, int]]) -> int:
    """(query, key) pairs a rank's causal attention computes: position p reads keys 0..p."""
    return sum((lo + 1 + hi) * (hi - lo) // 2 for lo, hi in runs)


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 5])
def test_deal_gives_every_position_once_and_every_rank_the_same_work(cp):
    """Every prompt position on exactly one rank; counts within one of each other, none above
    ceil(T / cp) (the cache's share, sharding.rank_positions); causal work within one row of the
    whole prompt (T pairs) of each other, where contiguous ranges differ by ~T^2 / cp; past the
    2 cp chunks, position p on rank p mod cp at its cache position p // cp (what decode assumes)."""
    for T in range(1, 130):
        shares = deal(T, cp)
        held = sorted(p for runs in shares for lo, hi in runs for p in range(lo, hi))
        assert held == list(range(T)), (T, shares)
        counts = [sum(hi - lo for lo, hi in runs) for runs in shares]
        assert max(counts) - min(counts) <= 1 and max(counts) == -(-T // cp)
        work = [causal_work(runs) for runs in shares]
        assert max(work) - min(work) <= T, (T, work)
        chunked = 2 * cp * (T // (2 * cp))
        for rank, runs in enumerate(shares):
            slots = [p for lo, hi in runs for p in range(lo, hi)]  # slot s holds position slots[s]
            assert slots == sorted(slots)
            for slot, p in enumerate(slots):
                if p >= chunked:
                    assert (p % cp, p // cp) == (rank, slot)
    if cp > 1:  # the dealing is not a contiguous split: rank 0 holds the first and the last chunk
        assert deal(16 * cp, cp)[0] == [(0, 8), (16 * cp - 8, 16 * cp)]


class Rank:
    """A context-parallel rank's Collectives for one thread of a simulated group."""

    tp, tp_rank = 1, 0

    def __init__(self, group: Group, rank: int):
        self.group, self.cp_rank, self.cp = group, rank, group.size

    def all_gather_cp(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack(self.group.exchange(self.cp_rank, x.clone()))

    def broadcast_cp(self, x: torch.Tensor, cp_rank: int) -> None:
        x.copy_(self.group.exchange(self.cp_rank, x.clone())[cp_rank])


class Group:
    """cp threads meeting at a barrier for each collective (a rank that calls fewer collectives
    than the others leaves them waiting: the barrier's timeout fails the test)."""

    def __init__(self, size: int):
        self.size, self.parts = size, [None] * size
        self.barrier = threading.Barrier(size, timeout=30)
        self.calls = [0] * size

    def exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.parts[rank] = x
        self.calls[rank] += 1
        self.barrier.wait()
        parts = list(self.parts)
        self.barrier.wait()  # every rank has read them before the next call writes
        return parts


def run_ranks_in_threads(cp: int, fn) -> list:
    """fn(rank, Collectives) on cp threads -> their results (an exception in one is raised)."""
    group, results, errors = Group(cp), [None] * cp, []

    def main(rank: int) -> None:
        try:
            results[rank] = fn(rank, Rank(group, rank))
        except BaseException as e:  # noqa: BLE001 (re-raised below, in the test's thread)
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=main, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert len(set(group.calls)) == 1  # every rank took part in every collective
    return results


def simulated_prefill_attention(q, k, v, cp, backend=None):
    """The prompt's q [B, Hq, T, D], k/v [B, Hkv, T, D] dealt over cp simulated ranks, each
    running ContextParallelAttention.attention on its rows (k/v as its cache: its rows first,
    then unused positions) -> (the output in position order [B, Hq, T, D], each rank's units)."""
    B, Hq, T, D = q.shape

    def rank_main(rank: int, par: Rank):
        attention = ContextParallelAttention(par)
        rows = attention.rows(T, 0)
        held = rows.positions(torch.device("cpu"))
        q_own = q[:, :, held].clone()
        cache_k = torch.full((B, k.shape[1], rows.count + 3, D), float("nan"), dtype=k.dtype)
        cache_v = cache_k.clone()
        cache_k[:, :, : rows.count], cache_v[:, :, : rows.count] = k[:, :, held], v[:, :, held]
        units = list(attention.attention(q_own, cache_k, cache_v, rows, D**-0.5, backend, 8))
        return held, q_own, units

    out = torch.full_like(q, float("nan"))
    results = run_ranks_in_threads(cp, rank_main)
    for held, q_own, _ in results:
        out[:, :, held] = q_own
    return out, [units for _, _, units in results]


@pytest.mark.parametrize("cp, T", [(2, 37), (3, 50), (4, 7), (3, 4), (2, 301)])
def test_balanced_prefill_attention_matches_float64(cp, T):
    """Each rank's causal attention over the prompt (its chunks, and its round-robin tail, each
    after the keys before it, gathered from every rank) equals float64 attention over the whole
    prompt; prompts not divisible by 2 cp, shorter than 2 cp chunks (a rank with no rows), GQA.
    Every rank yields as many units (a plan runs a number of units on every rank)."""
    gen = torch.Generator().manual_seed(T)
    B, Hq, Hkv, D = 1, 4, 2, 16
    q = torch.randn(B, Hq, T, D, generator=gen)
    k, v = torch.randn(B, Hkv, T, D, generator=gen), torch.randn(B, Hkv, T, D, generator=gen)
    out, units = simulated_prefill_attention(q, k, v, cp)
    exact = causal_reference(q.double(), k.double(), v.double(), D**-0.5)
    assert max_rel_err(out, exact) < 1e-5
    assert len({len(u) for u in units}) == 1
    assert sum(map(sum, units)) >= 2 * Hq * D * T * T  # the causal half of every pair, at least


@pytest.mark.parametrize("cp", [2, 3])
def test_balanced_prefill_attention_with_the_fp8_kernel(cp, monkeypatch):
    """backend "fp8" (the e4m3 kernel under the Triton interpreter, fp16 operands) on each rank's
    runs, each a causal call after its past: float64 attention over the whole prompt within the
    kernel's rounding (as one process's FP8 prefill: tests/test_prefill_fp8.py), and not the
    float32 result (the kernel ran)."""
    from minidecode.kernels import fp8_prefill

    kernel, one_at_a_time = fp8_prefill.fp8_causal_attention, threading.Lock()

    def locked(*args, **kwargs):  # the interpreter is not thread-safe: one kernel call at a time
        with one_at_a_time:
            return kernel(*args, **kwargs)

    monkeypatch.setattr(fp8_prefill, "fp8_causal_attention", locked)
    gen = torch.Generator().manual_seed(cp)
    B, Hq, Hkv, T, D = 1, 4, 1, 45, 32
    q = torch.randn(B, Hq, T, D, generator=gen).half()
    k, v = (torch.randn(B, Hkv, T, D, generator=gen).half() for _ in "kv")
    out, _ = simulated_prefill_attention(q, k, v, cp, backend="fp8")
    exact = causal_reference(q.double(), k.double(), v.double(), D**-0.5)
    assert 1e-3 < max_rel_err(out, exact) < 0.1


def test_decode_slots_continue_the_dealing():
    """After a prompt dealt by `deal`, each decode step's token is written by exactly one rank, at
    the next free cache position of its own in the sequence's region (its region's start plus its
    count so far), the others writing the spare position; each rank's lengths are its count of
    positions 0..p (summing to p + 1), within one of each other, and never past the rank's share
    of the context. Two sequences in one batch, each in its region."""
    cp, context, spare = 3, 40, 999
    share = -(-context // cp)  # a region's positions on a rank (sharding.rank_positions)
    prompts, starts = (11, 7), torch.tensor([0, 2 * share])  # [B]: each sequence's region
    ranks = [ContextParallelAttention(Rank(Group(cp), r)) for r in range(cp)]
    held = [[sum(hi - lo for lo, hi in runs) for runs in deal(T, cp)] for T in prompts]  # [B][cp]
    for step in range(context - max(prompts)):
        position = torch.tensor([T + step for T in prompts])
        slots = [attention.slots(position, spare, starts) for attention in ranks]
        for b in range(2):
            writers = [r for r, (written, _) in enumerate(slots) if int(written[b]) != spare]
            assert len(writers) == 1, (b, position, slots)
            (w,) = writers
            assert int(slots[w][0][b]) == int(starts[b]) + held[b][w]
            held[b][w] += 1
            lengths = [int(length[b]) for _, length in slots]
            assert lengths == held[b] and sum(lengths) == int(position[b]) + 1
            assert max(lengths) - min(lengths) <= 1 and max(lengths) <= share
    idle = ranks[0].slots(torch.tensor([0]), spare, torch.tensor([5]), torch.tensor([0], dtype=torch.int32))
    assert int(idle[0]) == spare and int(idle[1]) == 0  # an idle row writes the spare, reads nothing


@pytest.mark.parametrize("cp, T", [(2, 9), (3, 12), (4, 2)])
def test_prefill_output_is_every_position_in_order_on_every_rank(cp, T):
    """ContextParallelAttention.output: each rank's rows of the residual stream -> on every rank,
    the last position's (broadcast by the rank that holds it, the last of its rows), or every
    position's in order (gathered); a rank with no rows (a prompt shorter than cp) takes part."""
    x = torch.randn(1, T, 8, generator=torch.Generator().manual_seed(T))

    def rank_main(rank: int, par: Rank):
        attention = ContextParallelAttention(par)
        rows = attention.rows(T, 0)
        own = x[:, rows.positions(torch.device("cpu"))]
        return attention.output(own, rows, True), attention.output(own, rows, False)

    for last, every in run_ranks_in_threads(cp, rank_main):
        assert torch.equal(last, x[:, -1]) and torch.equal(every, x)

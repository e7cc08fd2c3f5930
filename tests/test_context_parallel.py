"""Context parallelism in one process: the dealing of positions over ranks (models/sharding.py's
deal: chunks by rounds, prefix-stable), the decode step's slots after it, and the balanced prefill
attention of ContextParallelAttention simulated with one thread per rank (the gathers through a
barrier), fresh and after a cached prefix, against float64 attention over the whole prompt. The
ranks as processes, against one process's tokens: tests/test_distributed.py and
tests/test_torchrun.py."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import max_rel_err

from minidecode.kernels.fp8_prefill import causal_reference
from minidecode.models.parallel import ContextParallelAttention
from minidecode.models.sharding import deal, held, owner, rank_positions


def causal_work(runs: list[tuple[int, int]]) -> int:
    """(query, key) pairs a rank's causal attention computes: position p reads keys 0..p."""
    return sum((lo + 1 + hi) * (hi - lo) // 2 for lo, hi in runs)


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("chunk", [1, 3, 4])
def test_deal_gives_every_position_once_and_every_rank_the_same_work(cp, chunk):
    """Every position of lo..T-1 on exactly one rank, in order at the rank's cache positions
    held(lo).. (owner: the rank and cache position of each); where a position goes does not depend
    on T (a prefix is dealt as in any longer prompt) and lo..T-1 are dealt as in 0..T; the cache's
    share (rank_positions) is the most any rank holds; causal work within about one chunk's rows
    over the whole context of each other, and equal at whole pairs of rounds (a contiguous split differs by
    ~T^2 / cp)."""
    for T in range(1, 90):
        shares = deal(0, T, cp, chunk)
        positions = sorted(p for runs in shares for lo, hi in runs for p in range(lo, hi))
        assert positions == list(range(T)), (T, shares)
        for rank, runs in enumerate(shares):
            mine = [p for lo, hi in runs for p in range(lo, hi)]  # cache position s holds mine[s]
            assert mine == sorted(mine) and held(T, cp, rank, chunk) == len(mine)
            assert [owner(p, cp, chunk) for p in mine] == [(rank, s) for s in range(len(mine))]
        longer = deal(0, T + 7, cp, chunk)
        assert [[(lo, min(hi, T)) for lo, hi in runs if lo < T] for runs in longer] == shares
        for lo in (1, T // 2, T - 1):
            assert deal(lo, T, cp, chunk) == [
                [(max(a, lo), b) for a, b in runs if b > lo] for runs in shares
            ]
        counts = [held(T, cp, r, chunk) for r in range(cp)]
        assert rank_positions(T, cp, chunk) == max(counts)
        work = [causal_work(runs) for runs in shares]
        assert max(work) - min(work) <= chunk * (T + cp * chunk), (T, work)
        if T % (2 * cp * chunk) == 0:
            assert len(set(work)) == 1
    if cp > 1:  # not a contiguous split: rank 0 holds the first chunk and the last of each two rounds
        assert deal(0, 8 * cp, cp, 4)[0] == [(0, 4), (8 * cp - 4, 8 * cp)]


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


def simulated_prefill_attention(q, k, v, cp, chunk, start=0, backend=None):
    """The context's q [B, Hq, T, D], k/v [B, Hkv, T, D] dealt over cp simulated ranks in chunks
    of `chunk`, each running ContextParallelAttention.attention on its rows of positions
    start..T-1 (its cache: its K/V of positions 0..T-1 in its order, a cached prefix's first, then
    unused positions) -> (the new positions' output in position order [B, Hq, T - start, D], each
    rank's units)."""
    B, Hq, T, D = q.shape

    def rank_main(rank: int, par: Rank):
        attention = ContextParallelAttention(par, chunk)
        rows = attention.rows(T - start, start)
        new = rows.positions(torch.device("cpu"))
        mine = [p for lo, hi in deal(0, T, cp, chunk)[rank] for p in range(lo, hi)]
        cached = torch.tensor(mine, dtype=torch.long)  # [held(T)]: the positions its cache holds
        assert rows.first_slot + rows.count == len(cached) and torch.equal(cached[rows.first_slot :], new)
        q_own = q[:, :, new].clone()
        cache_k = torch.full((B, k.shape[1], len(cached) + 3, D), float("nan"), dtype=k.dtype)
        cache_v = cache_k.clone()
        cache_k[:, :, : len(cached)], cache_v[:, :, : len(cached)] = k[:, :, cached], v[:, :, cached]
        units = list(attention.attention(q_own, cache_k, cache_v, rows, D**-0.5, backend, 8))
        return new, q_own, units

    out = torch.full_like(q, float("nan"))
    results = run_ranks_in_threads(cp, rank_main)
    for new, q_own, _ in results:
        out[:, :, new] = q_own
    return out[:, :, start:], [units for _, _, units in results]


@pytest.mark.parametrize(
    "cp, chunk, T, start", [(2, 4, 37, 0), (3, 5, 50, 0), (4, 2, 7, 0), (3, 4, 4, 0), (2, 8, 301, 0),
                            (2, 4, 37, 13), (3, 5, 50, 31), (4, 3, 40, 1), (2, 8, 301, 200)],
)  # fmt: skip
def test_balanced_prefill_attention_matches_float64(cp, chunk, T, start):
    """Each rank's causal attention over the context (its runs, each after the keys before it,
    gathered from every rank) equals float64 attention over the whole context; after a cached
    prefix (start > 0: the new positions attend to it, each rank holding its share of it where the
    prompt's dealing puts it), contexts not divisible by 2 cp chunks, shorter than a round (a rank
    with no rows), GQA. Every rank yields as many units (a plan runs a number of units on every
    rank)."""
    gen = torch.Generator().manual_seed(T + start)
    B, Hq, Hkv, D = 1, 4, 2, 16
    q = torch.randn(B, Hq, T, D, generator=gen)
    k, v = torch.randn(B, Hkv, T, D, generator=gen), torch.randn(B, Hkv, T, D, generator=gen)
    out, units = simulated_prefill_attention(q, k, v, cp, chunk, start)
    exact = causal_reference(q.double(), k.double(), v.double(), D**-0.5)[:, :, start:]
    assert max_rel_err(out, exact) < 1e-5
    assert len({len(u) for u in units}) == 1
    assert sum(map(sum, units)) >= 2 * Hq * D * (T - start) * (T + start)  # the causal part, at least


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
    out, _ = simulated_prefill_attention(q, k, v, cp, 8, backend="fp8")
    exact = causal_reference(q.double(), k.double(), v.double(), D**-0.5)
    assert 1e-3 < max_rel_err(out, exact) < 0.1


def test_decode_slots_continue_the_dealing():
    """After a prompt dealt by `deal`, each decode step's token is written by exactly one rank, the
    one `owner` names, at the next free cache position of its own in the sequence's region (its
    region's start plus its count so far), the others writing the spare position; each rank's
    lengths are its count of positions 0..p (held: summing to p + 1), never past the rank's share
    of the context. Two sequences in one batch, each in its region."""
    cp, chunk, context, spare = 3, 4, 40, 999
    share = rank_positions(context, cp, chunk)  # a region's positions on a rank
    prompts, starts = (11, 7), torch.tensor([0, 2 * share])  # [B]: each sequence's region
    ranks = [ContextParallelAttention(Rank(Group(cp), r), chunk) for r in range(cp)]
    counts = [[held(T, cp, r, chunk) for r in range(cp)] for T in prompts]  # [B][cp]
    for step in range(context - max(prompts)):
        position = torch.tensor([T + step for T in prompts])
        slots = [attention.slots(position, spare, starts) for attention in ranks]
        for b in range(2):
            writers = [r for r, (written, _) in enumerate(slots) if int(written[b]) != spare]
            assert writers == [owner(int(position[b]), cp, chunk)[0]], (b, position, slots)
            (w,) = writers
            assert int(slots[w][0][b]) == int(starts[b]) + counts[b][w]
            counts[b][w] += 1
            lengths = [int(length[b]) for _, length in slots]
            assert lengths == counts[b] and sum(lengths) == int(position[b]) + 1
            assert max(lengths) <= share
    idle = ranks[0].slots(torch.tensor([0]), spare, torch.tensor([5]), torch.tensor([0], dtype=torch.int32))
    assert int(idle[0]) == spare and int(idle[1]) == 0  # an idle row writes the spare, reads nothing


@pytest.mark.parametrize("cp, T, start", [(2, 9, 0), (3, 12, 0), (4, 2, 0), (3, 12, 5), (2, 9, 8)])
def test_prefill_output_is_every_position_in_order_on_every_rank(cp, T, start):
    """ContextParallelAttention.output: each rank's rows of the residual stream (positions
    start..T-1) -> on every rank, the last position's (broadcast by the rank that holds it), or
    every new position's in order (gathered); a rank with no rows takes part."""
    x = torch.randn(1, T, 8, generator=torch.Generator().manual_seed(T))

    def rank_main(rank: int, par: Rank):
        attention = ContextParallelAttention(par, 2)
        rows = attention.rows(T - start, start)
        own = x[:, rows.positions(torch.device("cpu"))]
        return attention.output(own, rows, True), attention.output(own, rows, False)

    for last, every in run_ranks_in_threads(cp, rank_main):
        assert torch.equal(last, x[:, -1]) and torch.equal(every, x[:, start:])

"""Prompt-lookup drafting on the device (kernels/ops.py: prompt_lookup): the Triton path (on the CPU
through the interpreter, tests/conftest.py) and its PyTorch twin against a host-side brute force
of the rule, over rows that share one history with lures
between them; on a GPU the Triton path against the twin at long histories, in a CUDA graph."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import kernel_devices

from minidecode.kernels import ops
from minidecode.kernels.prompt_lookup import BLOCK, _scan_kernel

INTERPRETED, _ = kernel_devices(_scan_kernel)
PATHS = [
    pytest.param(False, id="twin"),
    pytest.param(
        True, id="triton", marks=pytest.mark.skipif(not INTERPRETED, reason="kernel compiled for the GPU")
    ),
]
OUTSIDE = 99  # a token no test sequence holds: what history has right after each row's tokens


def brute(seq: list[int], want: int, min_n: int = 2, max_n: int = 4) -> list[int]:
    """The drafts of seq (its last token is the current one): the longest n-gram of its end seen
    before, its latest occurrence, and what followed it, the period repeating past the end."""
    L = len(seq)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        for e in range(L - 1, n - 1, -1):
            if seq[e - n : e] == seq[L - n :]:
                p = L - e
                return [seq[e + i % p] for i in range(want)]
    return []


def lookup(
    seqs: list[list[int]], wants: list[int], K: int, triton: bool, min_n: int = 2, max_n: int = 4
) -> list[list[int]]:
    """ops.prompt_lookup of rows seqs (each's last token is tokens[b], the rest in one shared
    history): each row's drafts. Right before each row history holds a lure, the max_n tokens
    before the row's current one (an n-gram read on past the row's start, at end 1, matches it),
    right after it OUTSIDE (even rows: a draft read from position P instead of tokens[b] is
    wrong) or tokens[b] (odd rows: an end past P, if scanned, matches)."""
    history, offsets = [], []
    for b, seq in enumerate(seqs):
        history += [OUTSIDE] + seq[-max_n - 1 : -1]
        offsets.append(len(history))
        history += seq[:-1] + [seq[-1] if b % 2 else OUTSIDE]
    B = len(seqs)
    drafts = torch.full((B, K), -7, dtype=torch.int64)
    draft_lens = torch.full((B,), -7, dtype=torch.int64)
    ops.prompt_lookup(
        torch.tensor(history),  # int64, as the engine's TokenHistory
        torch.tensor(offsets),
        torch.tensor([len(s) - 1 for s in seqs]),
        torch.tensor([s[-1] for s in seqs]),
        torch.tensor(wants),
        drafts,
        draft_lens,
        min_n,
        max_n,
        triton=triton,
    )
    return [drafts[b, :n].tolist() for b, n in enumerate(draft_lens.tolist())]


def expected(seqs, wants, K, min_n=2, max_n=4) -> list[list[int]]:
    return [brute(s, min(w, K), min_n, max_n) if w > 0 else [] for s, w in zip(seqs, wants, strict=True)]


@pytest.mark.parametrize("triton", PATHS)
@pytest.mark.parametrize("ngrams", [(2, 4), (1, 3), (3, 8)], ids=lambda n: f"{n[0]}-{n[1]}")
def test_random_rows_match_brute_force(triton, ngrams):
    """14 rows of small vocabularies (3-6 ids: matches of every length, overlapping the end too) at
    ragged lengths 1..300, wants of none, negative, 1, K and more than K."""
    rng = random.Random(sum(ngrams))
    K = 7
    lengths = [1, 2, 3, 5, 300, 257, 128] + [rng.randint(1, 300) for _ in range(7)]
    seqs = [[rng.randrange(rng.randint(3, 6)) for _ in range(n)] for n in lengths]
    wants = [K, K, 0, -2, 1, K + 5, K, 3, 0, K, 1, K + 1, 5, K]
    got = lookup(seqs, wants, K, triton, *ngrams)
    assert got == expected(seqs, wants, K, *ngrams)
    assert sum(map(len, got)) > 20  # most rows drafted something


@pytest.mark.parametrize("triton", PATHS)
def test_periodic_sequences_continue_their_period(triton):
    """A match that overlaps the end (periods 1, 2, 3) copies on through its own drafts."""
    seqs = [[4] * 9, [1, 2] * 6, [0, 1, 2] * 4 + [0], [5, 3, 0, 1, 2, 0, 1, 2, 0, 1]]
    got = lookup(seqs, [8] * 4, 8, triton)
    assert got == expected(seqs, [8] * 4, 8)
    assert got[:3] == [[4] * 8, [1, 2] * 4, [1, 2, 0, 1, 2, 0, 1, 2]]


@pytest.mark.parametrize("triton", PATHS)
def test_a_longer_earlier_match_beats_a_shorter_later_one(triton):
    """A 4-gram match early, 3- and 2-gram ones late: the 4-gram's continuation wins; without it,
    the 3-gram's."""
    suffix = [1, 2, 3, 4]
    seq = [0] + suffix + [7, 8] + [6, 2, 3, 4, 9] + [6, 3, 4, 5] + suffix
    shorter = [0, 1] + [6, 2, 3, 4, 9] + [6, 3, 4, 5] + suffix
    got = lookup([seq, shorter], [3, 3], 4, triton)
    assert got == expected([seq, shorter], [3, 3], 4) == [[7, 8, 6], [9, 6, 3]]


@pytest.mark.parametrize("triton", PATHS)
@pytest.mark.parametrize("where", ["first_block", "last_block", "edges"])
def test_history_of_several_blocks(triton, where):
    """5000 distinct tokens (5 blocks of the backwards scan) with planted matches. first_block: the
    only 4-gram match ends in the first block and 3-grams in later ones, so the scan must go on
    past them. last_block: 4-grams in the last and the first block, the latest wins (the scan may
    stop after one block). edges: a 3-gram match ending on either side of a block edge, the latest
    (an earlier one at 100 beside it)."""
    P = 5000
    seq = torch.randperm(100_000, generator=torch.Generator().manual_seed(1))[: P + 1].add(100).tolist()
    suffix = [1, 2, 3, 4]
    seq[-4:] = suffix

    def plant(tokens: list[int], end: int) -> None:  # tokens as S[end - n : end]
        seq[end - len(tokens) : end] = tokens

    if where == "first_block":
        plant(suffix, 40)
        for end in (1500, 3000, 4900):
            plant(suffix[1:], end)
    elif where == "last_block":
        plant(suffix, 40)
        plant(suffix, 4800)
    else:
        first = P - BLOCK + 1  # the scan's first block holds the ends first..P, its second the BLOCK before
        plant(suffix[1:], 100)
        rows = [list(seq) for _ in range(4)]
        for row, end in zip(rows, (first, first - 1, first - BLOCK, first - BLOCK - 1), strict=True):
            row[end - 3 : end] = suffix[1:]
        got = lookup(rows, [6] * 4, 6, triton)
        assert got == expected(rows, [6] * 4, 6) and all(got)
        return
    got = lookup([seq, seq[: P // 2] + suffix], [6, 6], 6, triton)
    assert got == expected([seq, seq[: P // 2] + suffix], [6, 6], 6)
    assert all(got)


@pytest.mark.parametrize("triton", PATHS)
def test_short_rows(triton):
    """L = 1 (nothing in history: no match), L = 2 (one token before: only a 1-gram), L = 3, and
    a first token equal to the current one (only the lure before the row would make it a match)."""
    seqs = [[3], [3, 3], [2, 3], [3, 3, 3], [1, 2, 1], [2, 5, 7, 2]]
    for min_n in (1, 2):
        got = lookup(seqs, [4] * 6, 4, triton, min_n, 4)
        assert got == expected(seqs, [4] * 6, 4, min_n, 4)
    assert got == [[], [], [], [3] * 4, [], []]  # min_ngram 2


def test_cpu_tensors_take_the_twin_by_default():
    """triton=None on CPU tensors: the twin, which writes 0 past draft_lens."""
    drafts, lens = torch.full((2, 3), -7), torch.full((2,), -7)
    history = torch.tensor([1, 2, 5, 1, 9, 9, 9], dtype=torch.int32)
    ops.prompt_lookup(history, torch.tensor([0, 4]), torch.tensor([4, 3]), torch.tensor([2, 9]),
                      torch.tensor([2, 0]), drafts, lens)  # fmt: skip
    assert lens.tolist() == [2, 0] and drafts.tolist() == [[5, 1, 0], [0, 0, 0]]


@pytest.mark.gpu
def test_gpu_matches_twin_in_a_cuda_graph():
    """8 rows of up to 200k tokens (vocabularies of 4 to 50k ids: early stops and whole-row scans)
    in one int64 history (the engine's), captured in a CUDA graph and replayed with new lengths and
    tokens."""
    gen = torch.Generator().manual_seed(0)
    B, K, cap = 8, 8, 200_000
    vocabs = [4, 16, 50_000, 8, 50_000, 1000, 3, 50_000]
    history = torch.cat([torch.randint(0, v, (cap,), generator=gen) for v in vocabs])
    offsets = torch.arange(B) * cap
    lengths = torch.tensor([200_000, 150_000, 200_000, 1, 0, 99_999, 123_456, 180_000])
    tokens = history[offsets + lengths.clamp(max=cap - 1)].long()  # the token after some rows' last
    want = torch.tensor([K, 3, K, K, K, 0, K + 4, 5])

    args = tuple(t.cuda() for t in (history, offsets, lengths, tokens, want))
    drafts, lens = torch.zeros(B, K, dtype=torch.int64, device="cuda"), torch.zeros_like(args[2])

    def check():
        ref_drafts, ref_lens = torch.zeros(B, K, dtype=torch.int64), torch.zeros(B, dtype=torch.int64)
        ops.prompt_lookup(*(t.cpu() for t in args), ref_drafts, ref_lens)
        assert lens.cpu().tolist() == ref_lens.tolist()
        for b, n in enumerate(ref_lens.tolist()):
            assert drafts[b, :n].cpu().tolist() == ref_drafts[b, :n].tolist()

    ops.prompt_lookup(*args, drafts, lens)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.prompt_lookup(*args, drafts, lens)
    graph.replay()
    check()
    assert int(lens.gt(0).sum()) >= 3
    args[2].sub_(torch.tensor([7, 1, 0, 1, 0, 5, 2, 1000], device="cuda"))  # shorter rows, in place
    args[3].copy_(history[offsets + args[2].cpu()].long())
    graph.replay()
    check()

"""Triton path of prompt-lookup drafting (kernels/ops.py: prompt_lookup, whose docstring is the rule):
each sequence's drafts are what followed the latest, longest earlier occurrence of its last tokens.

It runs inside the decode step's CUDA graph, so it reads every row's bounds from the device and
its grids depend on B only: a row's end positions are scanned backwards a block at a time by
`scan_splits` programs, block i by program i mod splits, each stopping at its first block holding
a match of max_ngram tokens (none of its earlier blocks beats it) and leaving its best match as
one int64 key; then one program a row takes the best key and copies the drafts. A sequence that
repeats recent text costs a block or two even with a history of 1M tokens, and one that matches
nothing a thousand blocks over up to 64 programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import INTERPRETER_CTAS, sm_count

BLOCK = 1024  # end positions a step of the scan compares
NUM_WARPS = 4
MAX_SPLITS = 64  # the most programs one row's scan is split over (a power of 2)
NGRAM_LIMIT = 8  # the longest n-gram the kernel compares (unrolled: one load of BLOCK tokens per token)
_KEY: tl.constexpr = tl.constexpr(1 << 40)  # a match is one int64 key, length * 2**40 + end


@triton.jit(do_not_specialize=["splits"])  # (one compile for every batch size)
def _scan_kernel(
    History, Offsets, Lengths, Tokens, Want, Best, K, splits,
    MIN_NGRAM: tl.constexpr, MAX_NGRAM: tl.constexpr, NGRAM_PAD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # Row b's sequence S (length L = P + 1) is history[o : o + P], then tokens[b]. An end e in
    # 1..P scores m(e): how many of S[e-1], S[e-2], ... equal S[L-1], S[L-2], ... in a row (at most
    # MAX_NGRAM); the best end has the largest (m, e) with m >= MIN_NGRAM. Program (b, p) scans
    # blocks p, p + splits, ... counted back from the end, and writes its best key to Best[b, p].
    b, p = tl.program_id(0), tl.program_id(1)
    o = tl.load(Offsets + b)
    P = tl.load(Lengths + b)
    tok = tl.load(Tokens + b)
    w = tl.minimum(tl.load(Want + b), K)
    row = History + o
    jj = tl.arange(0, NGRAM_PAD)
    # the last tokens S[L-1-j] [NGRAM_PAD]: tokens[b], then history back from P - 1 (j <= P; no
    # compare reaches a j past S's start: by j = P every end's S[e-1-j] lies before the row, a -1)
    suffix = tl.load(row + P - jj, mask=(jj >= 1) & (jj <= P) & (jj < MAX_NGRAM), other=-2)
    suffix = tl.where(jj == 0, tok.to(suffix.dtype), suffix)
    offs = tl.arange(0, BLOCK)
    best = tl.zeros_like(P)  # the best key so far, 0: none
    # the largest end of this program's next block; a row that wants none scans nothing
    hi = tl.where(w > 0, P - p * BLOCK, 0)
    while (hi >= 1) & (best < MAX_NGRAM * _KEY):  # (a full-length match: no earlier block beats it)
        e = hi - BLOCK + 1 + offs  # [BLOCK] ends, ascending (contiguous loads)
        alive = e >= 1  # still matching, j tokens back
        m = tl.zeros([BLOCK], dtype=tl.int32)
        for j in tl.static_range(MAX_NGRAM):
            s = tl.sum(tl.where(jj == j, suffix, 0), 0)  # S[L-1-j]
            # S[e-1-j]: e <= P, so in history; only ends still matching load (-1 before the row: a mismatch)
            x = tl.load(row + e - 1 - j, mask=alive & (e - 1 - j >= 0), other=-1)
            alive = alive & (x == s)
            m += alive.to(tl.int32)
        key = tl.where(m >= MIN_NGRAM, m.to(tl.int64) * _KEY + e, 0)
        # later blocks were scanned first: an equal length there wins, as the max of the keys says
        best = tl.maximum(best, tl.max(key, 0))
        hi -= splits * BLOCK
    tl.store(Best + b * splits + p, best)


@triton.jit(do_not_specialize=["splits"])
def _drafts_kernel(
    History, Offsets, Lengths, Tokens, Want, Best, Drafts, DraftLens, K, drafts_stride, splits,
    SPLITS_PAD: tl.constexpr, K_PAD: tl.constexpr,
):  # fmt: skip
    # Row b's best end over its programs' keys, then the drafts that follow it.
    b = tl.program_id(0)
    o = tl.load(Offsets + b)
    P = tl.load(Lengths + b)
    tok = tl.load(Tokens + b)
    w = tl.minimum(tl.load(Want + b), K)
    ps = tl.arange(0, SPLITS_PAD)
    best = tl.max(tl.load(Best + b * splits + ps, mask=ps < splits, other=0), 0)
    e = best % _KEY
    # the drafts copy on from S[e]; an occurrence that overlaps the end repeats its period L - e
    i = tl.arange(0, K_PAD)
    at = e + i % (P + 1 - e)  # [K_PAD] positions in S, <= P (P: tokens[b], not in history)
    n = tl.where(best > 0, tl.maximum(w, 0), 0)  # the drafts made (a scalar: see the mask below)
    # (the interpreter's vector & scalar is no mask: n folds the scalar condition in)
    d = tl.load(History + o + at, mask=(i < n) & (at < P), other=0).to(tl.int64)
    tl.store(Drafts + b * drafts_stride + i, tl.where(at == P, tok, d), mask=i < n)
    tl.store(DraftLens + b, n)


def scan_splits(device: torch.device, rows: int) -> int:
    """Programs a row's scan is split over: about two a SM over the batch, at most MAX_SPLITS (a
    row without a full-length match scans its whole history: at 1M tokens a thousand blocks)."""
    sms = sm_count(device) if device.type == "cuda" else INTERPRETER_CTAS
    return max(1, min(MAX_SPLITS, 2 * sms // rows))


def prompt_lookup_triton(
    history: torch.Tensor,  # [H] int32 (or int64)
    offsets: torch.Tensor,  # [B] int64
    lengths: torch.Tensor,  # [B] int64
    tokens: torch.Tensor,  # [B] int64
    want: torch.Tensor,  # [B] int64
    drafts: torch.Tensor,  # [B, K] int64, out
    draft_lens: torch.Tensor,  # [B] int64, out
    min_ngram: int,
    max_ngram: int,
) -> None:
    if not 1 <= min_ngram <= max_ngram <= NGRAM_LIMIT:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram <= {NGRAM_LIMIT}, got {min_ngram}, {max_ngram}")
    B, K = drafts.shape
    assert drafts.stride(1) == 1 and history.stride(0) == 1
    splits = scan_splits(history.device, B)
    best = torch.empty(B, splits, dtype=torch.long, device=history.device)  # each program's best key
    rows = (history, offsets, lengths, tokens, want)
    _scan_kernel[(B, splits)](
        *rows, best, K, splits, MIN_NGRAM=min_ngram, MAX_NGRAM=max_ngram,
        NGRAM_PAD=triton.next_power_of_2(max_ngram), BLOCK=BLOCK, num_warps=NUM_WARPS,
    )  # fmt: skip
    _drafts_kernel[(B,)](
        *rows, best, drafts, draft_lens, K, drafts.stride(0), splits,
        SPLITS_PAD=MAX_SPLITS, K_PAD=triton.next_power_of_2(max(K, 1)), num_warps=1,
    )  # fmt: skip

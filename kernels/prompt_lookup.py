"""Triton path of prompt-lookup drafting (kernels/ops.py: prompt_lookup, whose docstring is the rule):
each sequence's drafts are what followed the latest, longest earlier occurrence of its last tokens.

It runs inside the decode step's CUDA graph, so it reads every row's bounds from the device and
its grid is (B,): one program a row scans that row's end positions backwards, a block at a time,
and stops at the first block holding a match of max_ngram tokens (nothing earlier beats it), so a
sequence that repeats recent text costs a block or two even with a history of 1M tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # end positions a step of the scan compares
NUM_WARPS = 4
NGRAM_LIMIT = 8  # the longest n-gram the kernel compares (unrolled: one load of BLOCK tokens per token)
_KEY: tl.constexpr = tl.constexpr(1 << 40)  # a match is one int64 key, length * 2**40 + end


@triton.jit
def _prompt_lookup_kernel(
    History, Offsets, Lengths, Tokens, Want, Drafts, DraftLens, K, drafts_stride,
    MIN_NGRAM: tl.constexpr, MAX_NGRAM: tl.constexpr, NGRAM_PAD: tl.constexpr, K_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # Row b's sequence S (length L = P + 1) is history[o : o + P], then tokens[b]. An end e in
    # 1..P scores m(e): how many of S[e-1], S[e-2], ... equal S[L-1], S[L-2], ... in a row (at most
    # MAX_NGRAM); the best end has the largest (m, e) with m >= MIN_NGRAM.
    b = tl.program_id(0)
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
    hi = tl.where(w > 0, P, 0)  # the largest end not scanned yet; a row that wants none scans nothing
    while (hi >= 1) & (best < MAX_NGRAM * _KEY):
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
        hi -= BLOCK
    e = best % _KEY
    # the drafts copy on from S[e]; an occurrence that overlaps the end repeats its period L - e
    i = tl.arange(0, K_PAD)
    at = e + i % (P + 1 - e)  # [K_PAD] positions in S, <= P (P: tokens[b], not in history)
    n = tl.where(best > 0, w, 0)  # the drafts made (a scalar: the interpreter's vector & scalar is no mask)
    d = tl.load(row + at, mask=(i < n) & (at < P), other=0).to(tl.int64)
    tl.store(Drafts + b * drafts_stride + i, tl.where(at == P, tok, d), mask=i < n)
    tl.store(DraftLens + b, n)


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
    _prompt_lookup_kernel[(B,)](
        history, offsets, lengths, tokens, want, drafts, draft_lens, K, drafts.stride(0),
        MIN_NGRAM=min_ngram, MAX_NGRAM=max_ngram, NGRAM_PAD=triton.next_power_of_2(max_ngram),
        K_PAD=triton.next_power_of_2(max(K, 1)), BLOCK=BLOCK, num_warps=NUM_WARPS,
    )  # fmt: skip

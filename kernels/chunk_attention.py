"""A prompt chunk's attention after its past, bounded on the device: one CUDA graph of a mixed step
replays it for every chunk of its size (minidecode/mixed.py).

The chunk is C query rows at positions lo .. lo + count - 1 of a prompt whose region starts at
cache position `start`; query i attends to the region's positions 0 .. lo + i (its past and its
own rows, causally). Rows count .. C - 1 are padding.

- The G query heads that share a KV head are packed on the M axis of the dots (packed row
  r = query r // G, head r % G, as the lean decode kernel packs a group), so a K/V tile is read
  once for the whole group: a CTA is (block of BLOCK_M packed rows, KV head, split).
- A short chunk after a long past is a few row blocks a KV head, too few CTAs for the SMs, so each
  block's keys are cut into `splits` near-equal ranges (chunk_splits), one CTA each, which write
  their partial output and log-sum-exp; a second launch merges a row's partials by log-sum-exp.
- A block's keys below lo + (its first query) + 1 are seen by all its rows: those tiles run
  unmasked; only the tiles at its own diagonal and a range's ragged end are masked.

All bounds come from `where` on the device (no host value, no recompilation as the prefill
advances). Base-2 softmax in float32, as the lean kernel's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MAX_SPLITS = 16
HEAD_DIMS = (16, 32, 64, 128)  # powers of two (tl.arange), at least a dot's 16


@dataclass(frozen=True)
class ChunkConfig:
    """Launch parameters: packed query rows and key positions a tile, warps, pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Half dtypes on a GPU. 128 packed rows (32 queries of a 4-head group) by 64 keys, 8 warps: a
# [128, 128] bf16 q and three stages of 64-key K and V tiles fit one CTA's shared memory.
DEFAULT_CONFIG = ChunkConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
# float32 (tests, the interpreter): tiles of twice the bytes.
FP32_CONFIG = ChunkConfig(block_m=32, block_n=32, num_warps=4, num_stages=2)


def default_config(dtype: torch.dtype) -> ChunkConfig:
    return FP32_CONFIG if dtype == torch.float32 else DEFAULT_CONFIG


@functools.cache  # (asked once a mixed step, for a few chunk sizes)
def chunk_splits(rows: int, heads: int, kv_heads: int, sms: int, config: ChunkConfig = DEFAULT_CONFIG) -> int:
    """How many key ranges a chunk of `rows` queries cuts each row block's keys into: the count of
    1..MAX_SPLITS whose CTAs (row blocks x KV heads x splits, of about equal work) leave the least of
    their last wave idle, the fewest of those within 5% of the best (fewer partials to merge)."""
    blocks = -(-rows * (heads // kv_heads) // config.block_m) * kv_heads

    def busy(splits: int) -> float:  # the share of SM slots that the CTAs' waves keep working
        ctas = blocks * splits
        return ctas / (-(-ctas // sms) * sms)

    best = max(busy(s) for s in range(1, MAX_SPLITS + 1))
    return next(s for s in range(1, MAX_SPLITS + 1) if busy(s) >= 0.95 * best)


@triton.jit
def _tile(q, k_ptrs, v_ptrs, acc, m_i, l_i, qk_scale, key_ok, mask, MASKED: tl.constexpr):
    """One K/V tile (k_ptrs [D, BLOCK_N], v_ptrs [BLOCK_N, D]) into the running (acc, m_i, l_i) of
    the block's rows. MASKED: key_ok [BLOCK_N] says which keys exist, mask [BLOCK_M, BLOCK_N]
    which scores count."""
    if MASKED:
        k = tl.load(k_ptrs, mask=key_ok[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    qk = tl.dot(q, k) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
    if MASKED:
        qk = tl.where(mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
    p = tl.exp2(qk - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["SPLITS"])  # one kernel for every split count
def _chunk_partials_kernel(
    Q, K, V, Where, PartO, PartLse,
    stride_qc, stride_qh, stride_kh, stride_kn, stride_vh, stride_vn,
    qk_scale, M_PAD,
    SPLITS, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    # CTA (block, h, split): packed rows block * BLOCK_M .. of KV head h over its split's keys ->
    # PartO [SPLITS, Hkv, M_PAD, D] (o = acc / l) and PartLse [SPLITS, Hkv, M_PAD] (base 2; -inf:
    # no key in this range).
    block, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    lo = tl.load(Where).to(tl.int32)
    count = tl.load(Where + 1).to(tl.int32)
    start = tl.load(Where + 2)  # int64: a cache position
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    query = rows // G
    real = query < count
    first = (block * BLOCK_M) // G
    out_rows = (split * tl.num_programs(1) + h).to(tl.int64) * M_PAD + rows
    if first >= count:  # padding rows only: the merge writes their zeros
        return
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    q_ptrs = Q + query[:, None] * stride_qc + (h * G + rows % G)[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=real[:, None], other=0.0)
    # The block's keys 0 .. keys - 1 (region positions), cut into SPLITS ranges of whole tiles.
    last = tl.minimum((block * BLOCK_M + BLOCK_M - 1) // G, count - 1)
    keys = lo + last + 1
    per = tl.cdiv(tl.cdiv(keys, SPLITS), BLOCK_N) * BLOCK_N
    k0 = split * per
    k1 = tl.minimum(keys, k0 + per)
    # Tiles wholly below every row's causal limit (lo + first) run unmasked.
    full_end = tl.maximum(k0, k0 + (tl.minimum(k1, lo + first + 1) - k0) // BLOCK_N * BLOCK_N)
    k_base = K + h.to(tl.int64) * stride_kh + start * stride_kn
    v_base = V + h.to(tl.int64) * stride_vh + start * stride_vn
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n in range(k0, full_end, BLOCK_N):
        k_ptrs = k_base + (n + offs_n)[None, :] * stride_kn + offs_d[:, None]  # [D, BLOCK_N]
        v_ptrs = v_base + (n + offs_n)[:, None] * stride_vn + offs_d[None, :]  # [BLOCK_N, D]
        acc, m_i, l_i = _tile(q, k_ptrs, v_ptrs, acc, m_i, l_i, qk_scale, None, None, False)
    for n in range(full_end, k1, BLOCK_N):
        pos = n + offs_n
        key_ok = pos < k1
        mask = key_ok[None, :] & (pos[None, :] <= lo + query[:, None])
        k_ptrs = k_base + pos[None, :] * stride_kn + offs_d[:, None]
        v_ptrs = v_base + pos[:, None] * stride_vn + offs_d[None, :]
        acc, m_i, l_i = _tile(q, k_ptrs, v_ptrs, acc, m_i, l_i, qk_scale, key_ok, mask, True)
    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(PartO + out_rows[:, None] * HEAD_DIM + offs_d[None, :], o, mask=real[:, None])
    tl.store(PartLse + out_rows, lse, mask=real)


@triton.jit(do_not_specialize=["SPLITS"])
def _chunk_merge_kernel(
    PartO, PartLse, Out, Where, stride_oc, stride_oh, C, M_PAD,
    SPLITS, G: tl.constexpr, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    # CTA (block, h): packed rows block * BLOCK_R .. of KV head h, their SPLITS partials merged by
    # log-sum-exp -> Out [C, Hq, D] (zero for padding rows).
    block, h = tl.program_id(0), tl.program_id(1)
    kv_heads = tl.num_programs(1)
    count = tl.load(Where + 1).to(tl.int32)
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
    query = rows // G
    real = query < count
    offs_d = tl.arange(0, HEAD_DIM)
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    for s in range(SPLITS):
        at = (s * kv_heads + h).to(tl.int64) * M_PAD + rows
        m = tl.maximum(m, tl.load(PartLse + at, mask=real, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], dtype=tl.float32)
    for s in range(SPLITS):
        at = (s * kv_heads + h).to(tl.int64) * M_PAD + rows
        w = tl.exp2(tl.load(PartLse + at, mask=real, other=float("-inf")) - m)  # [BLOCK_R]: 0 if empty
        o_ptrs = PartO + at[:, None] * HEAD_DIM + offs_d[None, :]
        o = tl.load(o_ptrs, mask=(real & (w > 0))[:, None], other=0.0)
        acc += w[:, None] * o
        total += w
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    out_ptrs = Out + query[:, None] * stride_oc + (h * G + rows % G)[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=(query < C)[:, None])


def chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    where: torch.Tensor,
    splits: int,
    scale: float,
    config: ChunkConfig | None = None,
) -> torch.Tensor:
    """q [C, Hq, D]: the chunk's rotated queries, the first `count` real; k/v [Hkv, P, D]: the
    cache row (heads-major, positions contiguous a head); where [4] int64 on the device:
    (lo, count, start, _) -> [C, Hq, D] in q's dtype: query i over region positions 0 .. lo + i
    (cache positions start .. start + lo + i), rows >= count zero. splits: chunk_splits(C, ...),
    fixed for a graph. Two launches, no host read."""
    C, Hq, D = q.shape
    Hkv = k.shape[0]
    if Hq % Hkv or D not in HEAD_DIMS or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(
            f"chunk_attention takes Hq a multiple of Hkv and head_dim in {HEAD_DIMS}, got {Hq}/{Hkv}, {D}"
        )
    G = Hq // Hkv
    config = config or default_config(q.dtype)
    blocks = -(-C * G // config.block_m)
    m_pad = blocks * config.block_m
    part_o = torch.empty(splits, Hkv, m_pad, D, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(splits, Hkv, m_pad, dtype=torch.float32, device=q.device)
    _chunk_partials_kernel[(blocks, Hkv, splits)](
        q, k, v, where, part_o, part_lse,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        scale * LOG2E, m_pad,
        splits, G=G, BLOCK_M=config.block_m, BLOCK_N=config.block_n, HEAD_DIM=D,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    out = torch.empty_like(q)
    block_r = 64
    _chunk_merge_kernel[(-(-C * G // block_r), Hkv)](
        part_o, part_lse, out, where, out.stride(0), out.stride(1), C, m_pad,
        splits, G=G, BLOCK_R=block_r, HEAD_DIM=D, num_warps=4,
    )  # fmt: skip
    return out


"""Lean attention: one-launch, stream-K decode attention in Triton.

Decode attention for one (sequence b, KV head h) is a reduction over that sequence's context,
and online softmax makes it associative: two KV ranges with unnormalised output `acc`, running
max `m` and running sum `l` merge exactly. So the whole step is cut into equal work units and
dealt evenly to an SM-sized grid, like stream-K GEMM:

- a *tile* is one block of BLOCK_N positions of one (b, h); it computes all G = Hq / Hkv query
  heads that share KV head h (the group is packed into the M axis of the dots), so each K/V
  byte is read once per step;
- tiles are numbered (b, h, block) and CTA c takes a contiguous range of them; ranges differ in
  length by at most one tile and may cross head and sequence boundaries (where every (b, h)
  segment, defined below, has the same number of tiles and the grid is a multiple of the
  segment count, each segment is dealt to its own CTAs instead: ranges as long, none crossing
  a head);
- a CTA streams its whole range through one software-pipelined loop per sequence, so the
  next head's K/V loads are in flight while a head's result is stored;
- a (b, h) *segment* that one CTA covers wholly is finished in registers; a CTA that covers a
  segment only in part writes a partial (o = acc / l and lse = m + log2 l, per query head),
  and after its last tile draws a ticket from the segment's atomic counter (at most two
  partial segments a CTA: its first and its last). The CTA that draws the last ticket
  merges the segment's partials in CTA order (bitwise reproducible), writes the output and
  resets the counter to zero. Nobody ever waits for another CTA, so the scheme cannot
  deadlock however many CTAs are resident, and the counters are zero after every launch.

Verifying speculative drafts (q_lens): each sequence has up to Q_MAX new query positions, causal
among themselves over the whole cache. They join the group in a tile's rows (G * Q_MAX of them:
the same K/V bytes read once for all), each row's causal limit masks its scores, and the schedule
is the one above (positions, not queries, make the tiles). Their partials are G * Q_MAX rows, too
many for one CTA to merge from every contributor without holding up the step, so they merge up a
fixed tree instead of one ticket a segment: the CTA that finishes last among a node's children
(up to tree_fan) merges them and climbs, so the last CTA of a segment merges a few partials a
level, and the tree depends only on the contributors' count (still bitwise reproducible). Q_MAX =
1 compiles none of it; above 1, Q_MAX is a runtime value, so the steps whose rows pad to the same
tile (2 and 4 positions at G = 4: 16 rows) share one compile.

The schedule is computed inside the kernel from the device tensor of lengths: a growing context
needs no host sync and no recompilation, and a CUDA graph captured once replays for every later
step. The workspace (partials, counters) is allocated on the first eager call and cached.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import quant
from .device import INTERPRETER_CTAS, sm_count
from .e4m3 import split3_e4m3, split_e4m3
from .tiles import tile_rows

LOG2E = 1.4426950408889634
SUPPORTED_HEAD_DIMS = (64, 128)


@dataclass(frozen=True)
class LeanConfig:
    """Launch parameters: positions per tile, warps, pipeline depth of the tile loop, CTAs per SM,
    pipeline depth of the one-query merge loop (iterations in flight), whether a CTA draws the
    ticket of its first segment as soon as it leaves it (the loops of one head at a time: the FP8
    tensor-core path and several query positions; see FP8_CONFIG), how an FP8 cache is read (e4m3
    tensor-core dots, or each element decoded to fp16 for fp16 dots; see FP8_SHORT_CONFIG), how
    many partials a one-query merge iteration takes (_ticket_and_merge), whether the fp16 decode
    makes q's operand in every tile rather than once per segment (FP8_TINY_CONFIG), and, with
    several query positions a sequence, how many children a node of the merge tree has at most
    (_tree_merge)."""

    block_n: int
    num_warps: int
    num_stages: int
    ctas_per_sm: int
    merge_stages: int
    early_ticket: bool = False
    fp8_mma: bool = True
    merge_chunk: int = 1
    q_per_tile: bool = False
    tree_fan: int = 4


# Chosen by a sweep at head_dim 128 (bench/NOTES-attention.md). One CTA per SM keeps the splits
# per head, and so the merge, small; two 64 KiB tiles (K and V of 128 positions) in flight are
# enough to stream K/V at the memory's speed; 8 warps leave registers to spare (no spills); 4
# partials in flight in the merge hide their latency (_ticket_and_merge). head_dim 64 uses the
# same config (its tiles are half the bytes, within the same limits).
DEFAULT_CONFIG = LeanConfig(block_n=128, num_warps=8, num_stages=3, ctas_per_sm=1, merge_stages=4)


def default_config(
    head_dim: int, dtype: torch.dtype, fp8: bool = False, positions: int = 0, kv_heads: int = 1
) -> LeanConfig:
    """The tuned config for q's dtype and an FP8 (e4m3) or a q-dtype cache; fp32 K/V tiles are
    twice the bytes, so half the positions per tile and two stages keep them within shared
    memory (fp32 is for tests, not speed). An FP8 cache of `positions` (all its rows) and
    `kv_heads` takes FP8_TINY_CONFIG up to FP8_TINY_HEAD_POSITIONS positions times KV heads,
    FP8_SHORT_CONFIG below FP8_SHORT_POSITIONS positions and FP8_CONFIG from there: a shape, not
    the lengths, decides, so a CUDA graph captured for a cache replays one config however its
    context grows."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"lean_attention supports head_dim {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    if fp8:
        if positions * kv_heads <= FP8_TINY_HEAD_POSITIONS:
            return FP8_TINY_CONFIG
        return FP8_SHORT_CONFIG if positions < FP8_SHORT_POSITIONS else FP8_CONFIG
    if dtype == torch.float32:
        return dataclasses.replace(DEFAULT_CONFIG, block_n=DEFAULT_CONFIG.block_n // 2, num_stages=2)
    return DEFAULT_CONFIG


def config_sizes(head_dim: int, dtype: torch.dtype, fp8: bool = False, kv_heads: int = 1) -> list[int]:
    """The smallest cache (positions, all rows) of each config default_config picks for this
    cache, in increasing order: a cache grows through each, and each is a kernel of its own, so a
    warm-up that steps once at every size compiles every kernel the cache will launch."""
    candidates = sorted({1, FP8_TINY_HEAD_POSITIONS // kv_heads + 1, FP8_SHORT_POSITIONS}) if fp8 else [1]
    sizes, configs = [], []
    for positions in candidates:
        config = default_config(head_dim, dtype, fp8, positions, kv_heads)
        if config not in configs:
            sizes.append(positions)
            configs.append(config)
    return sizes


# Several query positions a sequence (q_lens) make a tile G * Q_MAX rows (padded to a power of
# two, G_PAD) instead of G: the score and output tiles, and the shared memory that the segment's
# stores stage through inside the tile loop, grow with them. The single-query configs hold up to
# 32 rows of a model-dtype cache; above, the configs of a sweep on an H200 (Triton 3.6, 32 / 8
# heads, 32k and 512k; bench/NOTES-attention.md): 64 rows in 64-position tiles over one warpgroup,
# two CTAs an SM (one warpgroup's MMA holds the 64 rows, so no reduction crosses warpgroups), 128
# in 32-position tiles over 8 warps. A multi-query segment's merge (_tree_merge) is most of what
# such a step costs over the plain one below 128k: nodes of up to 8 children for 64 rows (two CTAs
# an SM: ~33 contributors a segment), of 4 for 32 and 128 rows, whose passes of a node's rows would
# be twice as many with 8 (swept on an H100, bench/NOTES-attention.md). The CTA that holds two
# partial segments draws its first segment's ticket as it leaves it (early_ticket) but with 256
# rows (one stage: nothing to overlap). An FP8 cache takes the fp16 decode at every width: its
# conversions are per K/V element, shared by all of a tile's rows, where the e4m3 tensor-core tile
# runs three q terms and two p terms of dots for each row (the 64-row comparison is in
# bench/NOTES-attention.md). 32 rows through
# FP8_SHORT_CONFIG, 64 in 64-position tiles over one warpgroup at two CTAs an SM (the bf16
# 64-row shape), 128 and up in 128-position tiles with q made per tile.
# The sequence lengths a CTA's schedule reads at once (BLOCK_B) where a batch has several: a
# kernel is compiled for each BLOCK_B (~2 s on an H100, for every launch config and step size a
# load warms up), so batches of 2..16 share one. One sequence keeps its own: its schedule's
# reductions over 16 lanes cost a 1k step 11% (bench/NOTES-attention.md).
SCHEDULE_LANES = 16
MULTI_QUERY_MAX_ROWS = 256  # G * Q_MAX at most (a larger tile does not fit on an H200)
# G_PAD -> tile positions, warps, stages, CTAs an SM, early_ticket, tree_fan (model-dtype cache)
MULTI_QUERY_BF16 = {
    64: (64, 4, 3, 2, True, 8),
    128: (32, 8, 3, 1, True, 4),
    256: (64, 8, 1, 1, False, 4),
}
MULTI_QUERY_FP8_64 = LeanConfig(  # FP8 cache, 64 rows: the fp16 decode, 64 positions, 2 CTAs an SM
    block_n=64, num_warps=4, num_stages=3, ctas_per_sm=2, merge_stages=4, early_ticket=True, fp8_mma=False,
    tree_fan=8,
)
MULTI_QUERY_FP8_WIDE = LeanConfig(  # FP8 cache from 128 rows: the fp16 decode, q per tile
    block_n=128, num_warps=8, num_stages=2, ctas_per_sm=1, merge_stages=4, fp8_mma=False, q_per_tile=True
)


def multi_query_config(config: LeanConfig, g_pad: int, dtype: torch.dtype, fp8: bool) -> LeanConfig:
    """The launch config for tiles of g_pad rows (G * Q_MAX padded), from the single-query
    config `config` that default_config chose for the cache."""
    if g_pad <= 16:
        return config
    if fp8:
        if g_pad >= 128:
            return MULTI_QUERY_FP8_WIDE
        return MULTI_QUERY_FP8_64 if g_pad == 64 else FP8_SHORT_CONFIG
    if g_pad <= 32:  # the single-query tile, drawing its first segment's ticket early
        return dataclasses.replace(config, early_ticket=True)
    block_n, warps, stages, ctas, early, fan = MULTI_QUERY_BF16[min(g_pad, 256)]
    if dtype == torch.float32:  # tests only: fp32 tiles are twice the bytes
        block_n, stages = max(16, block_n // 2), max(1, stages - 1)
    return dataclasses.replace(
        config, block_n=block_n, num_warps=warps, num_stages=stages, ctas_per_sm=ctas, early_ticket=early,
        tree_fan=fan,
    )  # fmt: skip


# How the kernel reads an FP8 cache (kernel constexpr DEQUANT, from the config's fp8_mma;
# bench/NOTES-attention.md has the numbers). MMA decodes nothing: K and V enter e4m3 tensor-core
# dots as they are stored, q is split into three e4m3 terms (exact for bf16 / fp16) and p into two
# (bf16's precision; kernels/e4m3.py), so a long cache streams at the memory's speed. CVT decodes
# every K/V element to fp16 for fp16 dots: bounded by the conversions' rate, below the memory's,
# but its tile is a shorter chain of work, which is what a short cache's step waits for
# (FP8_SHORT_CONFIG). The interpreter has no float8 cast: there MMA rounds to e4m3 with integer
# ops, and BITS stands in for CVT (the same fp16 values times 2^-8).
DEQUANT_NONE = 0  # bf16 / fp16 / fp32 cache
DEQUANT_BITS = 1  # e4m3 bits moved into an fp16 bit pattern with integer ops (value * 2^-8)
DEQUANT_CVT = 2  # the hardware e4m3 -> fp16 conversion (value * 1)
DEQUANT_MMA = 3  # e4m3 tensor-core dots, no decode
DEQUANT_UNIT = {DEQUANT_BITS: 256.0, DEQUANT_CVT: 1.0}  # the decodes: e4m3 value / fp16 value

# FP8 cache: the e4m3 dots run as Hopper's warpgroup MMA (positions on M, the group's query heads
# on N = 16), 128 positions a tile, one warpgroup, 2 CTAs an SM: more independent tiles in flight
# than 256 positions over two warpgroups with one CTA an SM, which this config beats from 16k
# positions up with its merge taking 8 partials an iteration (bench/NOTES-attention.md).
# - early_ticket: a CTA that holds two partial segments finishes last (it pays a segment switch),
#   so at the end it would draw the last ticket of both and merge twice. Drawn as it leaves the
#   first segment, that ticket is almost never the last.
# - merge_chunk 8, 2 stages: a segment has tens of partials here (2 CTAs an SM); 8 an iteration,
#   their loads issued together, shorten the merge's chain of L2 round trips. The one-CTA-an-SM
#   configs, whose segments have a few partials, are faster with one an iteration.
FP8_CONFIG = LeanConfig(
    block_n=128, num_warps=4, num_stages=3, ctas_per_sm=2, merge_stages=2, early_ticket=True, merge_chunk=8
)
# Below FP8_SHORT_POSITIONS (above the tiny tier, FP8_TINY_CONFIG below), each element decoded to
# fp16 for fp16 dots, 256 positions a tile over 8 warps, one CTA an SM. A CTA holds one or two
# tiles there, so the step waits on a tile's chain of work more than on bandwidth, and the
# decode's two dots beat the tensor-core path's five and its q and p splits (over the range as a
# whole: bench/NOTES-attention.md).
FP8_SHORT_CONFIG = LeanConfig(
    block_n=256, num_warps=8, num_stages=3, ctas_per_sm=1, merge_stages=4, fp8_mma=False
)
FP8_SHORT_POSITIONS = 16384  # cache positions (all rows) below which an FP8 cache takes FP8_SHORT_CONFIG
# Up to 128 tiles of 128 positions (2048 positions of 8 KV heads: at most one tile a CTA on an
# H200), 4 warps, and q's operand made in every tile: its load then leaves with the first K/V
# loads, in the loop's pipeline, instead of being a round trip and a row maximum before them. At
# these sizes the kernel is that one tile's chain of work, which this shortens; where CTAs hold
# two tiles or more (3k positions of 8 heads, 1k of 32), FP8_SHORT_CONFIG is faster, and per-tile
# q would slow its 8 warps (bench/NOTES-attention.md). Two stages: with one tile a CTA there is
# nothing to prefetch, and a third stage only adds its prologue.
FP8_TINY_CONFIG = LeanConfig(
    block_n=128, num_warps=4, num_stages=2, ctas_per_sm=1, merge_stages=4, fp8_mma=False, q_per_tile=True
)
FP8_TINY_HEAD_POSITIONS = 16384  # cache positions (all rows) x KV heads up to which: FP8_TINY_CONFIG
# p * v_scale / (the tile's largest v_scale) is in [0, 1]; times P_RANGE it stays below e4m3's 448
# and in its normal range (>= 2^-6) down to p ~ 2^-14, before split_e4m3 takes it to two terms.
P_RANGE = tl.constexpr(256.0)

# The FP8 cache's V layout, "blocked_t" (K and a model-dtype V are [C, Hkv, S, D]): an e4m3 V
# cache stored per block of V_BLOCK positions with the positions contiguous,
# [C, Hkv, ceil(S / V_BLOCK), D, V_BLOCK] (to_v_blocked_t): the P.V dot's B operand then has its
# reduction axis (positions) contiguous, so it needs no transpose on its way from shared memory
# to the tensor cores (sm_90 has no 8-bit transposing ldmatrix: V in K's layout is read one byte
# an element there, bench/NOTES-attention.md). 64 positions: a block row is 64 bytes
# (two 32-byte sectors, four 16-byte vector loads), a head's blocks are adjacent, so a tile is
# still one contiguous run of D * BLOCK_N bytes; 64 divides every FP8 block_n (the layout must not
# change with the launch config), and the padding and the region-start granularity stay small.
# The kernel reads a sequence's last block whole (a mask along the contiguous axis would make byte
# loads, unpipelined): its bytes past the length get weight p = 0 exactly, so they only need to
# be finite, i.e. never an e4m3 NaN pattern (0x7F / 0xFF), which the quantizer never writes; a
# blocked cache is allocated zero-filled (to_v_blocked_t pads with zeros). Zeroing that tail in
# the kernel instead (tl.where on the bytes or on the fp16 operand, even only in the last tile)
# brings the shared-memory round trip back (offline sm_90 SASS, bench/NOTES-attention.md).
V_BLOCK = quant.V_BLOCK  # 64: the layout the FP8 cache stores (kernels/quant.py)
# q_lens: a tree node's merge takes its children's rows in passes of at most this many elements
# (children x rows x head_dim) a tensor: registers.
TREE_MERGE_ELEMENTS = 4096
TREE_COUNTER_STRIDE = tl.constexpr(8)  # int32s: a tree node's ticket counter on its own 32-byte sector


@triton.jit
def _e4m3_to_fp16(x, DEQUANT: tl.constexpr):
    """x: uint8 e4m3 bit patterns -> fp16, equal to the e4m3 value / DEQUANT_UNIT, exactly.
    DEQUANT 2 is the hardware conversion; DEQUANT 1 decodes with integer ops:

    The bit trick: e4m3 is s.eeee.mmm (bias 7), fp16 s.eeeee.mmmmmmmmmm (bias 15). Placing the
    sign at bit 15 and eeee.mmm at bits 13..7 gives an fp16 whose exponent is e (bias 15 instead
    of 7) and whose mantissa starts with mmm: the e4m3 value times 2^-8, subnormals included
    (e = 0 is an fp16 subnormal with the same mantissa). e4m3 NaN (0x7F) is never written."""
    if DEQUANT == 1:
        u = x.to(tl.uint16)
        return (((u & 0x80) << 8) | ((u & 0x7F) << 7)).to(tl.float16, bitcast=True)
    else:
        return x.to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def _fp8_query(q_b, q_offs, offs_d, row_ok, qk_scale, UNIT: tl.constexpr):
    """The tile's query rows (q_offs [G_PAD]: their element offsets from q_b, _row_offsets) as
    float32 q [G_PAD, D] times a power of two that takes each row's largest |q| into [128, 256)
    (exact; within fp16's and e4m3's range whatever q's dtype), and the [G_PAD] factor that undoes
    it (and the softmax scale, and UNIT) on the scores."""
    q = tl.load(q_b + q_offs[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    qf = q.to(tl.float32)
    q_exp = _pow2_exponent(tl.max(tl.abs(qf), 1))  # [G_PAD]
    return qf * _pow2(127 + 134 - q_exp)[:, None], qk_scale * UNIT * _pow2(q_exp - 7)


@triton.jit
def _fp16_query(q_b, q_offs, offs_d, row_ok, qk_scale, UNIT: tl.constexpr):
    """The fp16 decode's q operand [G_PAD, D] (_fp8_query's pre-scaled q, in fp16) and its factor."""
    q, row_scale = _fp8_query(q_b, q_offs, offs_d, row_ok, qk_scale, UNIT)
    return q.to(tl.float16), row_scale


@triton.jit
def _e4m3_query(q_b, q_offs, offs_d, row_ok, qk_scale, HW: tl.constexpr):
    """q.k's B operands for the e4m3 tensor-core dots: the pre-scaled q (_fp8_query) split into
    three e4m3 terms (split3_e4m3: exact for a bf16 or fp16 q), each [D, G_PAD]; and the [G_PAD]
    factor for the scores. Once per segment: the third term costs one more dot a tile, on tensor
    cores that are otherwise idle."""
    qs, row_scale = _fp8_query(q_b, q_offs, offs_d, row_ok, qk_scale, 1.0)
    q_hi, q_mid, q_lo = split3_e4m3(qs, HW)
    return tl.trans(q_hi), tl.trans(q_mid), tl.trans(q_lo), row_scale


@triton.jit
def _empty_state(G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, L_ROWS: tl.constexpr, MMA: tl.constexpr):
    """Online-softmax state of one segment: running max m [G_PAD] (log2 units), running sum l,
    unnormalised output acc. The e4m3 tensor-core tile (MMA) holds positions x query heads:
    acc [D, G_PAD], and l [L_ROWS, G_PAD]: per position (L_ROWS = BLOCK_N), summed over positions
    once at the segment's end (a sum over positions every tile is a reduction across warps); with
    several query positions (MULTI_Q: G_PAD up to 256 rows) one row (L_ROWS = 1), summed every
    tile, so that the state's registers stay within the warpgroup's."""
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    if MMA:
        l_sum = tl.zeros([L_ROWS, G_PAD], tl.float32)
        acc = tl.zeros([HEAD_DIM, G_PAD], tl.float32)
    else:
        l_sum = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, HEAD_DIM], tl.float32)
    return m, l_sum, acc


@triton.jit
def _e4m3_mma_tile(
    k, v, k_scale, v_scale, valid, seen, q_ops, row_scale, m_i, l_i, acc,
    HW: tl.constexpr, MULTI_Q: tl.constexpr,
):  # fmt: skip
    """One tile of the FP8 cache on e4m3 tensor cores, transposed (positions on the dots' M axis:
    Hopper's warpgroup MMA needs M >= 64, the group's G query heads fill only N = G_PAD).

    k [BLOCK_N, D] and v [D, BLOCK_N] (blocked V: positions contiguous, as the dot's K-major
    operand needs) are uint8 e4m3 as stored, never decoded; k_scale, v_scale [BLOCK_N] float32.
    Scores: k . (each of q's three terms, q_ops) with fp32 accumulation, times the K scales and
    q's factor. P.V: p times v_scale / (the tile's largest), times P_RANGE, split into two e4m3
    terms; the tile's largest v_scale / P_RANGE multiplies the fp32 result. fp32 softmax and fp32
    accumulation across tiles, as in the fp16 paths. MULTI_Q: seen [BLOCK_N, G_PAD] is the causal
    mask of the tile's query rows (_row_limits), and a row may see none of the tile."""
    k8 = k.to(tl.float8e4nv, bitcast=True)
    q_hi, q_mid, q_lo = q_ops
    # Hopper's e4m3 tensor cores accumulate with less than fp32 precision (about 14 bits kept),
    # so q's small terms go into their own accumulator and reach the large one in fp32: chained
    # into one, they are partly lost (most on heads with peaked scores, over long caches), for
    # one more fp32 add of a [BLOCK_N, G_PAD] tile. Chaining P.V's two terms costs no accuracy
    # (bench/NOTES-attention.md).
    qk = tl.dot(k8, q_hi) + tl.dot(k8, q_lo, acc=tl.dot(k8, q_mid))  # [BLOCK_N, G_PAD] fp32
    qk = qk * k_scale[:, None] * row_scale[None, :]
    if MULTI_Q:
        qk = tl.where(seen, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 0))  # -inf for a row that has seen nothing yet
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # such a row: alpha = p = 0, no NaN
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(qk - m_ref[None, :])  # [BLOCK_N, G_PAD]
        l_i = l_i * alpha[None, :] + tl.sum(p, 0)[None, :]  # [1, G_PAD]
    else:
        qk = tl.where(valid[:, None], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 0))  # finite: every tile holds a valid position
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[None, :])  # [BLOCK_N, G_PAD]
        l_i = l_i * alpha[None, :] + p
    v_top = tl.max(v_scale, 0)  # > 0: a tile holds a valid position, scales >= floor
    p_hi, p_lo = split_e4m3(p * (v_scale * (P_RANGE / v_top))[:, None], HW)
    v8 = v.to(tl.float8e4nv, bitcast=True)
    pv = tl.dot(v8, p_hi)
    pv = tl.dot(v8, p_lo, acc=pv)  # [D, G_PAD] fp32
    acc = acc * alpha[None, :] + pv * (v_top / P_RANGE)
    return m_new, l_i, acc


@triton.jit
def _decoded_tile(
    q, row_scale, k, v, k_scale, v_scale, seen, m_i, l_i, acc,
    DEQUANT: tl.constexpr, UNIT: tl.constexpr, DOT_PRECISION: tl.constexpr, MULTI_Q: tl.constexpr,
):  # fmt: skip
    """One tile's online-softmax update with the query heads on the dots' M axis: q [G_PAD, D] in
    the cache's dtype (DEQUANT 0; row_scale the softmax scale in log2 units) or the fp16 decode's
    pre-scaled operand (_fp16_query; row_scale [G_PAD] its factor), k [BLOCK_N, D] and v (in K's
    layout, or the FP8 cache's blocked [D, BLOCK_N]) as loaded, k_scale / v_scale [BLOCK_N] the FP8
    scales. seen [1 or G_PAD, BLOCK_N]: the positions each row sees (valid ones; MULTI_Q: the
    causal limits, under which a row may see none of the tile)."""
    if DEQUANT == 0:
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [G_PAD, BLOCK_N]
        qk = qk * row_scale
    else:
        # fp16 dot of the dequantized values (e4m3 / UNIT) with q's pre-scaled operand
        # (_fp8_query); its undoing factor and the per-position K scale multiply the
        # [G_PAD, BLOCK_N] score tile, not the K elements.
        qk = tl.dot(q, tl.trans(_e4m3_to_fp16(k, DEQUANT)))  # fp32 accumulation
        qk = qk * row_scale[:, None] * k_scale[None, :]
    qk = tl.where(seen, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if MULTI_Q:
        # A row may see none of this tile (the last one's draft positions past its limit): while
        # it has seen nothing, m = -inf and alpha = p = 0, with no NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        # Every block holds a valid position, so m_new is finite and alpha is 0 on a segment's
        # first block (m_i = -inf there).
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(qk - m_ref[:, None])  # [G_PAD, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, 1)
    if DEQUANT == 0:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    else:
        # The per-position V scale multiplies p, relative to the tile's largest scale so that p
        # stays in [0, 1] in fp16; that largest scale (and UNIT) multiplies the tile's fp32
        # result. fp32 accumulation across tiles, never fp16/fp8. V is blocked: the B operand
        # [BLOCK_N, HEAD_DIM] has its reduction axis contiguous.
        v_top = tl.max(v_scale, 0)  # > 0: a tile holds a valid position, scales >= floor
        p16 = (p * (v_scale / v_top)[None, :]).to(tl.float16)
        pv = tl.dot(p16, tl.trans(_e4m3_to_fp16(v, DEQUANT)))  # [G_PAD, HEAD_DIM] fp32
        acc = acc * alpha[:, None] + pv * (v_top * UNIT)
    return m_new, l_i, acc


@triton.jit
def _load_v_blocked(v_h, n0, offs_v, v_block_lo, length, stride_vn, V_BLOCK: tl.constexpr):
    """[HEAD_DIM, BLOCK_N] of a blocked V head; n0 is a multiple of BLOCK_N, so of V_BLOCK. Masked
    by whole blocks (see V_BLOCK): every block that begins before the length is in the cache."""
    return tl.load(
        v_h + (n0 // V_BLOCK) * stride_vn + offs_v, mask=(n0 + v_block_lo < length)[None, :], other=0.0
    )


@triton.jit
def _load_scales(KVScale, offs, valid):
    """The K and V scales [BLOCK_N] float32 of positions `offs` (0 where not valid). KVScale: the
    cache's kv_scale [..., 2] bfloat16 as int32 words, K's scale in the low 16 bits and V's in the
    high 16: one 4-byte load per position, which Triton pipelines as an asynchronous copy (two
    2-byte loads it cannot, and the tile loop would wait on them), and a bf16 pattern moved to the
    top of a float32 is that float32 exactly."""
    word = tl.load(KVScale + offs, mask=valid, other=0)
    return (word << 16).to(tl.float32, bitcast=True), (word & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _pow2_exponent(x):
    """Biased float32 exponent of x >= 0 (x = 2^(e - 127) * 1.f): integer ops, exact."""
    return (x.to(tl.int32, bitcast=True) >> 23) & 0xFF


@triton.jit
def _pow2(e):
    """2^(e - 127) as float32, for a biased exponent e (clamped to the normal range)."""
    return (tl.minimum(tl.maximum(e, 1), 254) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _row_offsets(rows, b, h, G, stride_b, stride_j, stride_h, MULTI_Q: tl.constexpr):
    """Element offsets [G_PAD] of a tile's rows `rows` (KV head h of sequence b) in a tensor with
    strides stride_b (sequence), stride_j (query position), stride_h (query head): q, out, lse.
    One query position: row r is query head h * G + r. MULTI_Q: row r is query position r // G of
    query head h * G + r % G (a tile holds the group's heads for each of the q_len positions)."""
    if MULTI_Q:
        return b * stride_b + (rows // G) * stride_j + (h * G + rows % G) * stride_h
    else:
        return b * stride_b + (h * G + rows) * stride_h


@triton.jit
def _row_limits(length, q_len, rows, G):
    """MULTI_Q: how many of the segment's positions each row [G_PAD] sees. The q_len new tokens are
    the segment's last positions, so query position j = rows // G sees the first
    length - q_len + j + 1 (causal among the new tokens); padding rows (j >= q_len) see them all."""
    return length - q_len + 1 + tl.minimum(rows // G, q_len - 1)


@triton.jit
def _range_start(cta, per, big, span_ctas, span_tiles):
    """First tile of CTA `cta`. Tiles are dealt in spans of span_tiles tiles to span_ctas CTAs each
    (the whole step, or one segment: _lean_decode_kernel's schedule); inside a span, its CTAs
    [0, big) take `per` tiles each, the others `per - 1`."""
    j = cta % span_ctas
    return (cta // span_ctas) * span_tiles + j * (per - 1) + tl.minimum(j, big)


@triton.jit
def _owner(tile, per, big, span_ctas, span_tiles):
    """The CTA whose range holds `tile` (inverse of _range_start)."""
    span = tile // tl.maximum(span_tiles, 1)
    t = tile - span * span_tiles
    split = big * per
    j = tl.where(t < split, t // tl.maximum(per, 1), big + (t - split) // tl.maximum(per - 1, 1))
    return span * span_ctas + j


@triton.jit
def _ticket_drawn_early(seg_lo, n_blk, range_lo, range_hi):
    """With EARLY_TICKET: whether a CTA with tiles [range_lo, range_hi) drew the ticket of segment
    [seg_lo, seg_lo + n_blk) as it left it, i.e. the segment is its first, began in an earlier
    CTA, and more of its range follows."""
    return (seg_lo < range_lo) & (seg_lo + n_blk < range_hi)


@triton.jit
def _locate(tile, offs_b, seq_len, seq_blocks, seq_end, Hkv):
    """The segment (b, h) that holds `tile`: returns b, h, its first tile, its tiles, its length."""
    b = tl.sum((seq_end <= tile).to(tl.int32), 0)
    is_b = offs_b == b
    n_blk = tl.sum(tl.where(is_b, seq_blocks, 0), 0)
    length = tl.sum(tl.where(is_b, seq_len, 0), 0)
    seq_lo = tl.sum(tl.where(is_b, seq_end, 0), 0) - n_blk * Hkv
    h = (tile - seq_lo) // n_blk
    return b, h, seq_lo + h * n_blk, n_blk, length


@triton.jit
def _merge_rows(
    first,  # the segment's contributing CTAs: first .. last
    last,
    first_slot,  # the partial slot of CTA `first` (the others': 2 * c)
    b,
    h,
    Out,
    Lse,
    PartO,
    PartLse,
    G,
    Hkv,
    stride_ob,
    stride_oh,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROWS: tl.constexpr,  # the group's G rows, padded to a power of two
    MERGE_STAGES: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    """Merge the partials of segment (b, h) in CTA order; write its output (one query position)."""
    cols = tl.arange(0, ROWS * HEAD_DIM)
    col_g = cols // HEAD_DIM  # query head of the partial of each column
    col_ok = col_g < G
    m = tl.full([ROWS * HEAD_DIM], float("-inf"), tl.float32)
    l_sum = tl.zeros([ROWS * HEAD_DIM], tl.float32)
    o = tl.zeros([ROWS * HEAD_DIM], tl.float32)
    # The group's rows are flattened with head_dim into ROWS * HEAD_DIM columns and each
    # partial's lse is stored once per column (_store_segment), so one contributor is two
    # vector loads and an element-wise update: nothing shared across threads. The merge is a
    # chain of dependent L2 reads unless they are issued ahead (bench/NOTES-attention.md):
    # MERGE_STAGES iterations are in flight (async copies), and an iteration takes one
    # contributor (MERGE_CHUNK 1, no reduction at all) or MERGE_CHUNK of them, whose loads
    # leave together and whose reduction over the chunk stays inside each thread. Plain
    # loads: the ticket's acquire already made every contributor's partial visible to this CTA.
    if MERGE_CHUNK == 1:
        for c in tl.range(first, last + 1, num_stages=MERGE_STAGES):
            slot = tl.where(c == first, first_slot, 2 * c)
            lse_c = tl.load(PartLse + slot * (G_PAD * HEAD_DIM) + cols, mask=col_ok, other=0.0)
            o_c = tl.load(PartO + slot * (G_PAD * HEAD_DIM) + cols, mask=col_ok, other=0.0)
            m_new = tl.maximum(m, lse_c)  # finite from the first contributor on (padding: 0)
            alpha = tl.exp2(m - m_new)
            w = tl.exp2(lse_c - m_new)
            o = o * alpha + o_c * w
            l_sum = l_sum * alpha + w
            m = m_new
    else:
        offs_c = tl.arange(0, MERGE_CHUNK)
        for c0 in tl.range(first, last + 1, MERGE_CHUNK, num_stages=MERGE_STAGES):
            c = c0 + offs_c  # [MERGE_CHUNK] contributors; past `last`: masked, weight 0
            slot = tl.where(c == first, first_slot, 2 * c)
            part = slot[:, None] * (G_PAD * HEAD_DIM) + cols[None, :]
            ok = (c <= last)[:, None] & col_ok[None, :]
            lse_c = tl.load(PartLse + part, mask=ok, other=float("-inf"))  # [MERGE_CHUNK, ROWS * D]
            o_c = tl.load(PartO + part, mask=ok, other=0.0)
            m_new = tl.maximum(m, tl.max(lse_c, 0))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding columns: no NaN
            alpha = tl.exp2(m - m_ref)
            w = tl.exp2(lse_c - m_ref[None, :])
            o = o * alpha + tl.sum(o_c * w, 0)
            l_sum = l_sum * alpha + tl.sum(w, 0)
            m = m_new
    o_ptrs = Out + _row_offsets(col_g, b, h, G, stride_ob, 0, stride_oh, False) + cols % HEAD_DIM
    tl.store(o_ptrs, (o / l_sum).to(Out.dtype.element_ty), mask=col_ok)
    if WRITE_LSE:  # natural log (x ln 2), once per query head: the column holding its d = 0
        lse_ptrs = Lse + _row_offsets(col_g, b, h, G, Hkv * G, 0, 1, False)
        tl.store(lse_ptrs, (m + tl.log2(l_sum)) * 0.6931471805599453, mask=col_ok & (cols % HEAD_DIM == 0))


@triton.jit
def _ticket_and_merge(
    b,
    h,
    seg_lo,
    seg_hi,
    per,
    big,
    span_ctas,
    span_tiles,
    Out,
    Lse,
    PartO,
    PartLse,
    Counters,
    G,
    Hkv,
    stride_ob,
    stride_oh,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    G_MERGE: tl.constexpr,
    MERGE_STAGES: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    COUNTER_STRIDE: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    """One query position: draw a ticket for segment (b, h); the CTA that draws the last one
    merges all its partials in CTA order (bitwise reproducible), writes the output and zeroes the
    counter."""
    counter = Counters + (b * Hkv + h) * COUNTER_STRIDE  # one cache line per counter
    # Acquire-release: our partial stores (ordered before this by the caller's barrier) are
    # visible to whoever draws the last ticket, and the last one sees everyone's.
    ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    first = _owner(seg_lo, per, big, span_ctas, span_tiles)
    last = _owner(seg_hi - 1, per, big, span_ctas, span_tiles)
    if ticket == last - first:
        # Slot 2c holds the partial of CTA c's first segment, 2c + 1 of its last. Only `first`
        # can have begun in an earlier segment (every later contributor's range starts inside
        # this one), so one _range_start serves the whole merge: none in its loop.
        first_slot = 2 * first + (_range_start(first, per, big, span_ctas, span_tiles) < seg_lo).to(tl.int32)
        # fmt: off
        _merge_rows(first, last, first_slot, b, h, Out, Lse, PartO, PartLse, G, Hkv, stride_ob, stride_oh,
                    G_PAD, HEAD_DIM, G_MERGE, MERGE_STAGES, MERGE_CHUNK, WRITE_LSE)
        # fmt: on
        tl.store(counter, 0)  # every contributor has drawn its ticket: ready for the next launch


@triton.jit
def _merge_node(
    row0,  # the first row merged here (of the segment's G * q_len)
    n_rows,  # the rows that are real: G * q_len
    first,  # the segment's first contributing CTA
    first_slot,  # its partial slot (the others': 2 * c)
    child0,  # the node's first leaf (contributor first + child0)
    span,  # leaves under each child
    kids,  # the node's children: leaves child0, child0 + span, ..
    root,  # the node covers every contributor: write the output, else the node's partial
    b, h, Out, Lse, PartO, PartLse, G, Hkv, stride_ob, stride_oj, stride_oh,
    q_max, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, TREE_FAN: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):  # fmt: skip
    """ROWS rows of one tree node: its children's partials (each in the slot of its first leaf's
    CTA, _store_segment's layout) merged at once, in child order, into the output or into the
    node's own partial, which takes its first child's slot."""
    cols = row0 * HEAD_DIM + tl.arange(0, ROWS * HEAD_DIM)
    col_g = cols // HEAD_DIM  # row of each column (query position, query head)
    col_ok = col_g < n_rows
    r = tl.arange(0, TREE_FAN)
    leaf = child0 + r * span  # [TREE_FAN] each child's first leaf
    slot = tl.where(leaf == 0, first_slot, 2 * (first + leaf))
    part = slot[:, None] * (G_PAD * HEAD_DIM) + cols[None, :]  # [TREE_FAN, ROWS * D]
    ok = (r < kids)[:, None] & col_ok[None, :]
    # .cg: from L2, where the children's CTAs wrote them (released by their tickets, acquired by ours)
    lse_c = tl.load(PartLse + part, mask=ok, other=float("-inf"), cache_modifier=".cg")
    o_c = tl.load(PartO + part, mask=ok, other=0.0, cache_modifier=".cg")
    m = tl.max(lse_c, 0)  # -inf for a row no child saw any position of (given limits)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse_c - m_ref[None, :])
    l_sum = tl.sum(w, 0)
    seen = l_sum > 0
    l_div = tl.where(seen, l_sum, 1.0)
    o = tl.sum(o_c * w, 0) / l_div  # 0 where nothing was seen (every weight 0)
    lse = tl.where(seen, m + tl.log2(l_div), float("-inf"))  # log2 units
    if root:
        o_ptrs = Out + _row_offsets(col_g, b, h, G, stride_ob, stride_oj, stride_oh, True) + cols % HEAD_DIM
        tl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=col_ok)
        if WRITE_LSE:  # natural log, once per row: the column holding its d = 0
            lse_ptrs = Lse + _row_offsets(col_g, b, h, G, q_max * Hkv * G, Hkv * G, 1, True)
            tl.store(lse_ptrs, lse * 0.6931471805599453, mask=col_ok & (cols % HEAD_DIM == 0))
    else:
        node = tl.where(child0 == 0, first_slot, 2 * (first + child0)) * (G_PAD * HEAD_DIM) + cols
        tl.store(PartO + node, o, mask=col_ok)
        tl.store(PartLse + node, lse, mask=col_ok)


@triton.jit
def _tree_merge(
    cta, b, h, seg_lo, seg_hi, per, big, span_ctas, span_tiles, Out, Lse, PartO, PartLse, TreeCounters,
    tree_levels, QLens, G, Hkv, stride_ob, stride_oj, stride_oh, q_max,
    G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, MERGE_ROWS: tl.constexpr, TREE_FAN: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):  # fmt: skip
    """Several query positions: our partial of segment (b, h) (written, its stores ordered before
    this by the caller's barrier) climbs a fixed tree over the segment's contributors. Leaf i is
    CTA first + i; a node of level L covers TREE_FAN^L consecutive leaves and has up to TREE_FAN
    children. At each node with two children or more, each child's CTA draws a ticket from the
    node's counter; the one that draws the last merges the children (_merge_node), zeroes the
    counter and goes on up with the node, the others are done; at a node of one child the CTA
    goes on up with nothing to do. The root's merge writes the output. So the last CTA to finish
    merges at most TREE_FAN partials a level, the merges of other nodes run in parallel on their
    own CTAs, nobody waits for another CTA, and the tree (so the rounding) depends only on the
    contributors' count: bitwise reproducible."""
    first = _owner(seg_lo, per, big, span_ctas, span_tiles)
    n = _owner(seg_hi - 1, per, big, span_ctas, span_tiles) - first + 1  # leaves, >= 2 (a partial)
    first_slot = 2 * first + (_range_start(first, per, big, span_ctas, span_tiles) < seg_lo).to(tl.int32)
    n_rows = G * tl.load(QLens + b)
    leaf = cta - first
    span = 1  # leaves under the node we hold
    level = 0
    going = True
    while going:
        child0 = (leaf // (span * TREE_FAN)) * (span * TREE_FAN)  # the parent's first leaf
        kids = tl.minimum(TREE_FAN, tl.cdiv(n - child0, span))
        root = span * TREE_FAN >= n
        if kids > 1:
            tl.debug_barrier()  # every thread's stores of our node precede the ticket (release)
            node_slot = tl.where(child0 == 0, first_slot, 2 * (first + child0))
            counter = TreeCounters + (node_slot * tree_levels + level) * TREE_COUNTER_STRIDE
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            won = ticket == kids - 1
            if won:
                tl.store(counter, 0)  # every child has drawn: ready for the next launch
                for row0 in range(0, n_rows, MERGE_ROWS):
                    # fmt: off
                    _merge_node(row0, n_rows, first, first_slot, child0, span, kids, root, b, h, Out, Lse,
                                PartO, PartLse, G, Hkv, stride_ob, stride_oj, stride_oh, q_max, G_PAD,
                                HEAD_DIM, MERGE_ROWS, TREE_FAN, WRITE_LSE)
                    # fmt: on
            going = won & (root == 0)
        else:
            going = root == 0
        span = span * TREE_FAN
        level += 1


@triton.jit
def _finish_partial(
    cta, b, h, seg_lo, seg_hi, per, big, span_ctas, span_tiles, Out, Lse, PartO, PartLse, Counters,
    TreeCounters, tree_levels, QLens, G, Hkv, stride_ob, stride_oj, stride_oh, q_max,
    G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, G_MERGE: tl.constexpr, MERGE_ROWS: tl.constexpr,
    MERGE_STAGES: tl.constexpr, MERGE_CHUNK: tl.constexpr, COUNTER_STRIDE: tl.constexpr,
    TREE_FAN: tl.constexpr, WRITE_LSE: tl.constexpr, MULTI_Q: tl.constexpr,
):  # fmt: skip
    """Our partial of segment (b, h) is written: its merge, one ticket a segment (one query
    position) or the tree (several)."""
    if MULTI_Q:
        # fmt: off
        _tree_merge(cta, b, h, seg_lo, seg_hi, per, big, span_ctas, span_tiles, Out, Lse, PartO, PartLse,
                    TreeCounters, tree_levels, QLens, G, Hkv, stride_ob, stride_oj, stride_oh, q_max, G_PAD,
                    HEAD_DIM, MERGE_ROWS, TREE_FAN, WRITE_LSE)
    else:
        _ticket_and_merge(b, h, seg_lo, seg_hi, per, big, span_ctas, span_tiles, Out, Lse, PartO, PartLse,
                          Counters, G, Hkv, stride_ob, stride_oh, G_PAD, HEAD_DIM, G_MERGE, MERGE_STAGES,
                          MERGE_CHUNK, COUNTER_STRIDE, WRITE_LSE)
        # fmt: on


@triton.jit
def _store_segment(
    o_seg,  # [G_PAD, HEAD_DIM] fp32, normalised: acc / l
    m_i,  # [G_PAD] running max (log2 units)
    l_row,  # [G_PAD] running sum
    whole,  # our tiles cover the whole segment: write the output, else a partial
    slot,  # our partial slot: 2 * cta (our first segment) or 2 * cta + 1 (our last)
    n_rows,  # the tile's rows that are real: G (MULTI_Q: G * q_len)
    o_offs,  # [G_PAD] element offsets of the rows in Out (_row_offsets)
    lse_offs,  # [G_PAD] element offsets of the rows in Lse
    Out,
    Lse,
    PartO,
    PartLse,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    MULTI_Q: tl.constexpr,
):
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_g < n_rows
    if MULTI_Q:
        # A row that saw none of our positions has m = -inf, l = 0 (the tiles' guard): o = 0 and
        # lse = -inf, weight 0 in a merge. In a partial: a segment's last tile, whose draft
        # positions are past the row's causal limit; in a whole segment, or every partial of one:
        # a limit of 0 (given limits, Limits: context parallelism's rank that holds none of the
        # positions before a query).
        o_seg = tl.where((l_row > 0)[:, None], o_seg, 0.0)
    if whole:  # no partials
        out_ptrs = Out + o_offs[:, None] + offs_d[None, :]
        tl.store(out_ptrs, o_seg.to(Out.dtype.element_ty), mask=row_ok[:, None])
        if WRITE_LSE:  # log2 units -> natural log
            lse_ptrs = Lse + lse_offs
            tl.store(lse_ptrs, (m_i + tl.log2(l_row)) * 0.6931471805599453, mask=row_ok)
    else:
        offs_part = offs_g[:, None] * HEAD_DIM + offs_d[None, :]  # [G_PAD, HEAD_DIM]
        tl.store(PartO + slot * (G_PAD * HEAD_DIM) + offs_part, o_seg, mask=row_ok[:, None])
        # each row's lse once per column, as the merge reads it (_ticket_and_merge)
        lse_row = tl.broadcast_to((m_i + tl.log2(l_row))[:, None], [G_PAD, HEAD_DIM])
        tl.store(PartLse + slot * (G_PAD * HEAD_DIM) + offs_part, lse_row, mask=row_ok[:, None])


# B and q_max are not specialized on (1, a multiple of 16): batches that share a BLOCK_B, and
# steps whose query rows share a tile (G_PAD), share a compile.
@triton.jit(do_not_specialize=["B", "q_max"])
def _lean_decode_kernel(
    Q,  # [B, Hq, D]; MULTI_Q: [B, q_max, Hq, D]
    K,  # [B, Hkv, S, D], last dim contiguous (FP8: the uint8 view of the e4m3 cache)
    V,  # [B, Hkv, S, D]; V_BLOCK > 0: [B, Hkv, S / V_BLOCK, D, V_BLOCK], positions contiguous
    KVScale,  # FP8: [B, Hkv, S] int32, last dim contiguous: the bf16 K (low half) and V scales
    Out,  # [B, Hq, D]; MULTI_Q: [B, q_max, Hq, D]
    Lse,  # [B, Hq] ([B, q_max, Hq]) float32, contiguous: log-sum-exp of the scaled scores, natural log
    Lengths,  # [B] int32
    Starts,  # [B] int64 with HAS_STARTS: sequence b's positions begin at Starts[b] of its cache row
    QLens,  # MULTI_Q: [B] int32, query positions of sequence b (1 <= QLens[b] <= min(q_max, length))
    Limits,  # HAS_LIMITS: [B, q_max] int32, contiguous: the positions query j of sequence b sees
    PartO,  # [2 * grid, G_PAD, D] fp32: a CTA's partials for its first and its last segment
    PartLse,  # [2 * grid, G_PAD, D] fp32: log2-sum-exp of each partial row, once per column
    Counters,  # [B * Hkv * COUNTER_STRIDE] int32 tickets, zero between launches
    TreeCounters,  # MULTI_Q: [2 * grid * tree_levels * TREE_COUNTER_STRIDE] int32, the tree's tickets
    tree_levels,  # MULTI_Q: the tree's levels (TREE_FAN^tree_levels >= grid)
    q_max,  # query positions a sequence (q's axis 1): 1 for the single-query decode step
    qk_scale,  # softmax scale * log2(e): scores live in log2 space, so exp2 is exact softmax
    B,
    Hkv,
    G,
    stride_qb,
    stride_qj,  # MULTI_Q: the stride of q's query positions
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,  # V_BLOCK > 0: the stride of V's blocks of positions
    stride_vd,  # V_BLOCK > 0: the stride of head_dim inside a block (positions have stride 1)
    stride_sb,
    stride_sh,
    stride_ob,
    stride_oj,
    stride_oh,
    BLOCK_B: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    G_MERGE: tl.constexpr,
    MERGE_ROWS: tl.constexpr,  # MULTI_Q: partial rows a tree node's merge takes a pass (of G * q_len)
    MERGE_STAGES: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    COUNTER_STRIDE: tl.constexpr,
    TREE_FAN: tl.constexpr,  # MULTI_Q: children a node of the merge tree has at most (_tree_merge)
    DEQUANT: tl.constexpr,
    UNIT: tl.constexpr,
    USE_PDL: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    HAS_LIMITS: tl.constexpr,  # MULTI_Q: each query position's causal limit given (Limits)
    V_BLOCK: tl.constexpr,  # 0: V in K's layout (model-dtype cache); > 0: FP8, "blocked_t"
    WRITE_LSE: tl.constexpr,
    E4M3_HW: tl.constexpr,  # DEQUANT 3: round to e4m3 with the hardware cast (else integer ops)
    EARLY_TICKET: tl.constexpr,  # PER_HEAD: draw a partial first segment's ticket on leaving it
    Q_PER_TILE: tl.constexpr,  # fp16 decode: q's operand made in every tile, not once a segment
    MULTI_Q: tl.constexpr,  # q_max > 1: several query positions a sequence (verifying drafts)
):
    cta = tl.program_id(0)
    n_ctas = tl.num_programs(0)

    # ---- the schedule, from the lengths on the device -------------------------------------
    offs_b = tl.arange(0, BLOCK_B)
    seq_len = tl.load(Lengths + offs_b, mask=offs_b < B, other=0)  # [BLOCK_B]
    seq_blocks = tl.cdiv(seq_len, BLOCK_N)  # [BLOCK_B] tiles per KV head of each sequence
    seq_end = tl.cumsum(seq_blocks * Hkv, 0)  # [BLOCK_B] one past the last tile of sequence b
    total = tl.max(seq_end, 0)
    # Where every segment has the same tiles and the grid is a multiple of the segments, each
    # segment is dealt to its own n_ctas / (B * Hkv) CTAs: the longest range is the same as
    # dealing the whole step (ceil(total / n_ctas) tiles), and no range crosses a head, whose
    # second segment costs the e4m3 path a pipeline refill, q's operands and a partial store
    # (bench/NOTES-attention.md). Otherwise the whole step is one span (stream-K).
    seg_max = tl.max(seq_blocks, 0)
    seg_min = tl.min(tl.where(offs_b < B, seq_blocks, seg_max), 0)
    aligned = (seg_min == seg_max) & (n_ctas % (B * Hkv) == 0)
    span_tiles = tl.where(aligned, seg_max, total)
    span_ctas = tl.where(aligned, n_ctas // (B * Hkv), n_ctas)
    per = tl.cdiv(span_tiles, span_ctas)  # a span's CTAs [0, big) take per tiles, the others per - 1
    big = span_tiles - (per - 1) * span_ctas
    range_lo = tl.minimum(_range_start(cta, per, big, span_ctas, span_tiles), total)
    range_hi = tl.minimum(_range_start(cta + 1, per, big, span_ctas, span_tiles), total)
    if USE_PDL:
        # Launched early (programmatic dependent launch): the schedule above only needs the
        # lengths, written before the step's first kernel; q and the new K/V row come from the
        # previous kernel, so wait for it before touching them.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    offs_g = tl.arange(0, G_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_g < G  # [G_PAD] rows past the group are padding for the dot's M >= 16
    # Several query positions a sequence (verification of drafts): a tile's rows are the group's
    # heads for each position (_row_offsets), all reading the tile's K/V once; each row's causal
    # limit masks its scores (_row_limits). The single-query step compiles none of it.
    # Loop-invariant int32 offsets inside one block; only the scalar block offset moves.
    offs_k = offs_n[:, None] * stride_kn + offs_d[None, :]  # [BLOCK_N, HEAD_DIM]
    if V_BLOCK == 0:
        offs_v = offs_n[:, None] * stride_vn + offs_d[None, :]  # [BLOCK_N, HEAD_DIM]
    else:
        # [HEAD_DIM, BLOCK_N], runs of V_BLOCK contiguous positions (a tile spans whole blocks)
        offs_v = (offs_n // V_BLOCK)[None, :] * stride_vn + (offs_n % V_BLOCK)[None, :]
        offs_v += offs_d[:, None] * stride_vd
        v_block_lo = (offs_n // V_BLOCK) * V_BLOCK  # [BLOCK_N] first position of each one's block

    # ---- our tiles ------------------------------------------------------------------------------
    # One query position a sequence (the decode step): the tiles of several heads run through one
    # software-pipelined loop (like a persistent GEMM's epilogue inside its K loop): the next
    # head's K/V loads are already in flight while a head's result is stored, so crossing a head
    # costs no pipeline drain and refill. Only a sequence boundary (found with reductions over the
    # batch, too slow to repeat per tile) restarts the loop. The e4m3 tensor-core path (MMA) and
    # several query positions (MULTI_Q) run one loop per head instead: q's operand is then
    # loop-invariant and stays in shared memory, where a head switch inside the loop makes Triton
    # copy it there every tile, a cost that grows with the tile's rows (bench/NOTES-attention.md).
    MMA: tl.constexpr = DEQUANT == 3  # e4m3 tensor-core tile (_e4m3_mma_tile)
    PER_HEAD: tl.constexpr = MMA or MULTI_Q
    if not PER_HEAD:
        m_i, l_i, acc = _empty_state(G_PAD, HEAD_DIM, BLOCK_N, MMA)
    tile = range_lo
    while tile < range_hi:
        b, h, seg_lo, n_blk, length = _locate(tile, offs_b, seq_len, seq_blocks, seq_end, Hkv)
        seq_lo = seg_lo - h * n_blk
        stop = tl.minimum(range_hi, seq_lo + Hkv * n_blk)
        q_b = Q + b * stride_qb
        # 64-bit: one layer's cache passes 2^31 elements. Batched regions: sequence b's positions
        # are a run of its cache row (stride 0 rows: one shared row) starting at Starts[b].
        start = tl.load(Starts + b) if HAS_STARTS else 0
        k_b = K + b.to(tl.int64) * stride_kb + start * stride_kn
        if V_BLOCK == 0:
            v_b = V + b.to(tl.int64) * stride_vb + start * stride_vn
        else:  # blocked: start is a multiple of V_BLOCK (the caller's contract)
            v_b = V + b.to(tl.int64) * stride_vb + (start // V_BLOCK) * stride_vn
        s_b = b.to(tl.int64) * stride_sb + start
        if MULTI_Q:  # this sequence's query positions: its rows and their causal limits
            q_len = tl.load(QLens + b)
            row_ok = offs_g < G * q_len
            if HAS_LIMITS:  # padding rows see every position, as _row_limits has them
                lim = tl.load(Limits + b * q_max + offs_g // G, mask=row_ok, other=length)  # [G_PAD]
            else:
                lim = _row_limits(length, q_len, offs_g, G)  # [G_PAD]
        if PER_HEAD:
            while tile < stop:  # our tiles of one head (segment) at a time
                h = (tile - seq_lo) // n_blk
                seg_lo = seq_lo + h * n_blk
                seg_stop = tl.minimum(stop, seg_lo + n_blk)
                q_offs = _row_offsets(offs_g, 0, h, G, 0, stride_qj, stride_qh, MULTI_Q)  # [G_PAD] rows' q
                if MMA:
                    q_hi, q_mid, q_lo, row_scale = _e4m3_query(q_b, q_offs, offs_d, row_ok, qk_scale, E4M3_HW)
                elif DEQUANT == 0:
                    q = tl.load(q_b + q_offs[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
                    row_scale = qk_scale
                elif not Q_PER_TILE:
                    q, row_scale = _fp16_query(q_b, q_offs, offs_d, row_ok, qk_scale, UNIT)
                k_h = k_b + h.to(tl.int64) * stride_kh  # 64-bit head offset, int32 within (host check)
                v_h = v_b + h.to(tl.int64) * stride_vh
                s_h = s_b + h * stride_sh
                m_i, l_i, acc = _empty_state(G_PAD, HEAD_DIM, 1 if MULTI_Q else BLOCK_N, MMA)
                for t in range(tile, seg_stop):
                    n0 = (t - seg_lo) * BLOCK_N
                    valid = n0 + offs_n < length  # [BLOCK_N] only a sequence's last block is ragged
                    k = tl.load(k_h + n0 * stride_kn + offs_k, mask=valid[:, None], other=0.0)
                    if DEQUANT != 0:
                        k_scale, v_scale = _load_scales(KVScale + s_h + n0, offs_n, valid)
                    else:
                        k_scale, v_scale = row_scale, row_scale  # unused
                    if V_BLOCK == 0:
                        v = tl.load(v_h + n0 * stride_vn + offs_v, mask=valid[:, None], other=0.0)
                    else:
                        v = _load_v_blocked(v_h, n0, offs_v, v_block_lo, length, stride_vn, V_BLOCK)
                    if MMA:
                        if MULTI_Q:
                            seen = (n0 + offs_n)[:, None] < lim[None, :]  # [BLOCK_N, G_PAD] causal
                        else:
                            seen = valid
                        # fmt: off
                        q_ops = (q_hi, q_mid, q_lo)
                        m_i, l_i, acc = _e4m3_mma_tile(k, v, k_scale, v_scale, valid, seen, q_ops, row_scale,
                                                       m_i, l_i, acc, E4M3_HW, MULTI_Q)
                        # fmt: on
                    else:
                        if Q_PER_TILE:  # its load is then pipelined with the tile's
                            q, row_scale = _fp16_query(q_b, q_offs, offs_d, row_ok, qk_scale, UNIT)
                        seen = (n0 + offs_n)[None, :] < lim[:, None]  # [G_PAD, BLOCK_N] causal
                        # fmt: off
                        m_i, l_i, acc = _decoded_tile(q, row_scale, k, v, k_scale, v_scale, seen, m_i, l_i,
                                                      acc, DEQUANT, UNIT, DOT_PRECISION, MULTI_Q)
                        # fmt: on
                if MMA:
                    l_row = tl.sum(l_i, 0)  # [G_PAD]
                    o_seg = tl.trans(acc / l_row[None, :])  # back to [G_PAD, HEAD_DIM]
                else:
                    l_row = l_i
                    o_seg = acc / l_i[:, None]
                whole = (seg_lo >= range_lo) & (seg_stop == seg_lo + n_blk)
                slot = 2 * cta + (range_lo < seg_lo).to(tl.int32)  # 0: our first segment, 1: our last
                o_offs = _row_offsets(offs_g, b, h, G, stride_ob, stride_oj, stride_oh, MULTI_Q)
                lse_offs = _row_offsets(offs_g, b, h, G, q_max * Hkv * G, Hkv * G, 1, MULTI_Q)
                # fmt: off
                _store_segment(o_seg, m_i, l_row, whole, slot, G * q_len if MULTI_Q else G, o_offs, lse_offs,
                               Out, Lse, PartO, PartLse, G_PAD, HEAD_DIM, WRITE_LSE, MULTI_Q)
                if EARLY_TICKET:
                    if _ticket_drawn_early(seg_lo, n_blk, range_lo, range_hi):
                        tl.debug_barrier()  # the partial's stores precede the ticket (release)
                        _finish_partial(cta, b, h, seg_lo, seg_lo + n_blk, per, big, span_ctas, span_tiles,
                                        Out, Lse, PartO, PartLse, Counters, TreeCounters, tree_levels, QLens,
                                        G, Hkv, stride_ob, stride_oj, stride_oh, q_max, G_PAD, HEAD_DIM,
                                        G_MERGE, MERGE_ROWS, MERGE_STAGES, MERGE_CHUNK, COUNTER_STRIDE,
                                        TREE_FAN, WRITE_LSE, MULTI_Q)
                # fmt: on
                tile = seg_stop
        else:
            if (DEQUANT != 0) and not Q_PER_TILE:
                # q's fp16 operand depends only on the head: made once per segment, not per tile
                h = (tile - seq_lo) // n_blk
                q_offs = _row_offsets(offs_g, 0, h, G, 0, stride_qj, stride_qh, MULTI_Q)
                q, row_scale = _fp16_query(q_b, q_offs, offs_d, row_ok, qk_scale, UNIT)
            for t in range(tile, stop):
                h = (t - seq_lo) // n_blk
                seg_lo = seq_lo + h * n_blk
                n0 = (t - seg_lo) * BLOCK_N
                q_offs = _row_offsets(offs_g, 0, h, G, 0, stride_qj, stride_qh, MULTI_Q)  # [G_PAD] rows' q
                if DEQUANT == 0:
                    q = tl.load(q_b + q_offs[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
                    row_scale = qk_scale
                elif Q_PER_TILE:  # its load is then pipelined with the tile's (FP8_TINY_CONFIG)
                    q, row_scale = _fp16_query(q_b, q_offs, offs_d, row_ok, qk_scale, UNIT)
                elif (t == seg_lo) & (t != tile):  # a new head starts inside our range
                    q, row_scale = _fp16_query(q_b, q_offs, offs_d, row_ok, qk_scale, UNIT)
                valid = n0 + offs_n < length  # [BLOCK_N] only a sequence's last block is ragged
                # 64-bit head offset; the offsets inside one head stay below 2^31 (checked on the host).
                k = tl.load(
                    k_b + h.to(tl.int64) * stride_kh + n0 * stride_kn + offs_k, mask=valid[:, None], other=0.0
                )
                if DEQUANT != 0:
                    k_scale, v_scale = _load_scales(KVScale + s_b + h * stride_sh + n0, offs_n, valid)
                else:
                    k_scale, v_scale = row_scale, row_scale  # unused
                if V_BLOCK == 0:
                    v = tl.load(
                        v_b + h.to(tl.int64) * stride_vh + n0 * stride_vn + offs_v,
                        mask=valid[:, None],
                        other=0.0,
                    )
                else:
                    v = _load_v_blocked(
                        v_b + h.to(tl.int64) * stride_vh, n0, offs_v, v_block_lo, length, stride_vn, V_BLOCK
                    )
                # fmt: off
                m_i, l_i, acc = _decoded_tile(q, row_scale, k, v, k_scale, v_scale, valid[None, :], m_i, l_i,
                                              acc, DEQUANT, UNIT, DOT_PRECISION, MULTI_Q)
                # fmt: on
                seg_hi = seg_lo + n_blk
                if (t == seg_hi - 1) | (t == range_hi - 1):  # our piece of this segment ends here
                    whole = (seg_lo >= range_lo) & (t == seg_hi - 1)
                    slot = 2 * cta + (range_lo < seg_lo).to(tl.int32)  # 0: our first segment, 1: our last
                    o_offs = _row_offsets(offs_g, b, h, G, stride_ob, stride_oj, stride_oh, MULTI_Q)
                    lse_offs = _row_offsets(offs_g, b, h, G, q_max * Hkv * G, Hkv * G, 1, MULTI_Q)
                    # fmt: off
                    _store_segment(acc / l_i[:, None], m_i, l_i, whole, slot, G, o_offs, lse_offs, Out, Lse,
                                   PartO, PartLse, G_PAD, HEAD_DIM, WRITE_LSE, MULTI_Q)
                    # fmt: on
                    m_i, l_i, acc = _empty_state(G_PAD, HEAD_DIM, BLOCK_N, MMA)
            tile = stop

    # ---- tickets for our (at most two) partial segments, after all our tiles -------------------
    # Deferred to the end so that no merge delays the rest of our range (EARLY_TICKET: the first
    # segment's was drawn as we left it, when more of our range followed).
    if range_lo < range_hi:
        tl.debug_barrier()  # every thread's partial stores precede the ticket (release)
        first_seg_lo = _locate(range_lo, offs_b, seq_len, seq_blocks, seq_end, Hkv)[2]
        for at_end in tl.static_range(2):  # the segment of our first tile, then of our last
            tile = range_lo + at_end * (range_hi - 1 - range_lo)
            b, h, seg_lo, n_blk, _ = _locate(tile, offs_b, seq_len, seq_blocks, seq_end, Hkv)
            in_part = (seg_lo < range_lo) | (seg_lo + n_blk > range_hi)
            if EARLY_TICKET and PER_HEAD and at_end == 0:
                in_part = in_part & (_ticket_drawn_early(seg_lo, n_blk, range_lo, range_hi) == 0)
            if in_part & ((at_end == 0) | (seg_lo != first_seg_lo)):
                # fmt: off
                _finish_partial(cta, b, h, seg_lo, seg_lo + n_blk, per, big, span_ctas, span_tiles, Out, Lse,
                                PartO, PartLse, Counters, TreeCounters, tree_levels, QLens, G, Hkv, stride_ob,
                                stride_oj, stride_oh, q_max, G_PAD, HEAD_DIM, G_MERGE, MERGE_ROWS,
                                MERGE_STAGES, MERGE_CHUNK, COUNTER_STRIDE, TREE_FAN, WRITE_LSE, MULTI_Q)
                # fmt: on


# ---- host side ------------------------------------------------------------------------------


class _Workspace(NamedTuple):
    part_o: torch.Tensor  # [2 * grid, G_PAD, D] fp32
    part_lse: torch.Tensor  # [2 * grid, G_PAD, D] fp32 (each row's lse repeated over D)
    # [B * Hkv * _COUNTER_STRIDE + 2 * grid * tree_levels * TREE_COUNTER_STRIDE] int32, zero between
    # launches: a segment's tickets, then the merge tree's (several query positions)
    counters: torch.Tensor


_WORKSPACES: dict[tuple, _Workspace] = {}
_COUNTER_STRIDE = 32  # int32s: each (b, h) ticket counter on its own 128-byte line


def _grid_size(device: torch.device, config: LeanConfig, num_ctas: int | None) -> int:
    if num_ctas is not None:
        if num_ctas < 1:
            raise ValueError(f"num_ctas must be >= 1, got {num_ctas}")
        return num_ctas
    if device.type != "cuda":
        return INTERPRETER_CTAS
    return sm_count(device) * config.ctas_per_sm


def _workspace(
    device: torch.device, grid: int, g_pad: int, head_dim: int, segments: int, tree_levels: int
) -> _Workspace:
    """Cached per (device, shape): a CUDA graph captured after one eager call allocates nothing."""
    key = (device, grid, g_pad, head_dim, segments, tree_levels)
    ws = _WORKSPACES.get(key)
    if ws is None:
        tickets = segments * _COUNTER_STRIDE + 2 * grid * tree_levels * TREE_COUNTER_STRIDE.value
        ws = _Workspace(
            torch.empty(2 * grid, g_pad, head_dim, dtype=torch.float32, device=device),
            torch.empty(2 * grid, g_pad, head_dim, dtype=torch.float32, device=device),
            torch.zeros(tickets, dtype=torch.int32, device=device),
        )
        _WORKSPACES[key] = ws
    return ws


def lean_attention(
    q: torch.Tensor,  # [B, Hq, D]; with q_lens: [B, Q_MAX, Hq, D]
    k_cache: torch.Tensor,  # [C, Hkv, S, D], C = B or 1 (one row shared), last dim contiguous
    v_cache: torch.Tensor,  # [C, Hkv, S, D]; FP8: [C, Hkv, ceil(S / V_BLOCK), D, V_BLOCK] (blocked_t)
    lengths: torch.Tensor,  # [B] int32 on q's device, 0 <= starts[b] + lengths[b] <= S
    scale: float,
    *,
    kv_scale: torch.Tensor | None = None,  # [C, Hkv, S, 2] bfloat16 (K, V), with a float8_e4m3fn cache
    starts: torch.Tensor | None = None,  # [B] int64: where sequence b's positions begin (default 0)
    num_ctas: int | None = None,
    config: LeanConfig | None = None,
    out: torch.Tensor | None = None,
    use_pdl: bool = False,
    lse: torch.Tensor | None = None,
    q_lens: torch.Tensor | None = None,  # [B] int32 on q's device: query positions of each sequence
    row_limits: torch.Tensor | None = None,  # [B, Q_MAX] int32 with q_lens: what each query position sees
) -> torch.Tensor:  # [B, Hq, D] ([B, Q_MAX, Hq, D] with q_lens) in q.dtype
    """softmax(q k^T * scale) v over each sequence's lengths[b] cached positions, which begin at
    position starts[b] (default 0) of its cache row: row b, or the one row when C = 1 (a batch
    whose sequences own contiguous regions of one shared position axis). A sequence of length 0
    costs nothing and its output row is left unwritten (an idle batch slot).

    K/V share q's dtype (fp16 / bf16 / fp32), or are float8_e4m3fn with per-(sequence, KV head,
    position) scales `kv_scale` (bfloat16, K's then V's; kernels/quant.py: row = e4m3 row * scale) and
    V in the blocked, transposed layout of to_v_blocked_t (see V_BLOCK). An FP8 cache is read by
    e4m3 tensor-core dots or decoded to fp16 in registers, as the config says (config.fp8_mma);
    softmax and accumulation stay in fp32 either way. The caller's contract for an FP8 cache:
    region starts are multiples of V_BLOCK (checked here for CPU tensors; on a GPU the check
    would cost a sync), and the bytes past a sequence's length up to the end of its last block
    are no e4m3 NaN pattern.

    One kernel launch, no host sync: safe to capture in a CUDA graph (after one eager call, which
    allocates the cached workspace) and replay as `lengths` grows in place. Calls that share a
    workspace must be ordered on one stream. `num_ctas` overrides the SM-derived grid (tests),
    `config` the tuned launch parameters; `out` ([B, Hq, D], q's dtype) receives the result.
    `use_pdl` launches with programmatic dependent launch (Hopper+), chained to the step's kernels.
    `lse` ([B, Hq] float32, contiguous) receives each query head's log-sum-exp of the scaled scores
    (natural log), written with the output (a sequence of length 0 writes neither).

    Several query positions a sequence (`q_lens`: verifying speculative drafts): q is
    [B, Q_MAX, Hq, D] and sequence b has q_lens[b] of them, 1 <= q_lens[b] <= Q_MAX and
    q_lens[b] <= lengths[b] where lengths[b] > 0. Their K/V are already cached as the last q_lens[b]
    of its lengths[b] positions, and query position j sees the first lengths[b] - q_lens[b] + j + 1
    (causal among the new tokens). `out` and the result are [B, Q_MAX, Hq, D], `lse`
    [B, Q_MAX, Hq]; rows j >= q_lens[b] are left unwritten. The tile's rows hold the group's query
    heads for each position (G * Q_MAX of them, padded to a power of two), so K/V are read once for
    all of them, and the schedule is the same as with one position. q_lens is a device tensor: a
    graph captured once replays for any q_lens up to Q_MAX. Q_MAX = 1 runs the single-query kernel.

    `row_limits` (with q_lens; context parallelism, where a rank holds only some of a step's new
    positions) gives each query position's causal limit instead: query j of sequence b sees the
    first row_limits[b, j] of its lengths[b] positions (0 <= row_limits[b, j] <= lengths[b]), and
    lengths[b] need not count q_lens[b]. A query that sees no position gets o = 0 and lse = -inf.
    """
    if q_lens is not None:
        if q.dim() != 4:
            raise ValueError(f"with q_lens, q must be [B, Q_MAX, Hq, D], got {tuple(q.shape)}")
        B, q_max = q.shape[:2]
        if q_lens.shape != (B,):
            raise ValueError(f"q_lens must be [B] = [{B}], got {tuple(q_lens.shape)}")
        if q_lens.device.type == "cpu" and bool(((q_lens < 1) | (q_lens > q_max)).any()):
            raise ValueError(f"every q_lens must be in [1, Q_MAX = {q_max}], got {q_lens.tolist()}")
        if row_limits is not None:
            if row_limits.shape != (B, q_max) or row_limits.dtype != torch.int32:
                raise ValueError(f"row_limits must be [B, Q_MAX] = [{B}, {q_max}] int32, got "
                                 f"{tuple(row_limits.shape)} {row_limits.dtype}")  # fmt: skip
            row_limits = row_limits.contiguous()
            if row_limits.device.type == "cpu" and bool(
                ((row_limits < 0) | (row_limits > lengths.cpu()[:, None])).any()
            ):
                raise ValueError("every row limit must be in [0, the sequence's length]")
        elif lengths.device.type == "cpu" and bool(((lengths > 0) & (lengths < q_lens.cpu())).any()):
            raise ValueError("a sequence's length must count its q_lens new positions")
        if q_max == 1:  # one position each: the single-query kernel, on [B, Hq, D] views
            if row_limits is not None:  # the one query's limit is the positions it reads
                lengths = row_limits[:, 0]
            return lean_attention(
                q[:, 0], k_cache, v_cache, lengths, scale, kv_scale=kv_scale, starts=starts,
                num_ctas=num_ctas, config=config, out=None if out is None else out[:, 0], use_pdl=use_pdl,
                lse=None if lse is None else lse[:, 0],
            ).unsqueeze(1)  # fmt: skip
        if q_lens.dtype != torch.int32:
            q_lens = q_lens.to(torch.int32)
        q3 = q[:, 0]  # [B, Hq, D]: the checks below are the single-query ones
    else:
        if row_limits is not None:
            raise ValueError("row_limits come with q_lens")
        q_max, q3 = 1, q
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if q3.dim() != 3 or k_cache.dim() != 4 or (v_cache.shape != k_cache.shape and not fp8):
        raise ValueError(f"expected q [B, Hq, D] and K/V [B, Hkv, S, D], got {q.shape}, {k_cache.shape}")
    B, Hq, D = q3.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape[0] not in (B, 1) or k_cache.shape[3] != D:
        raise ValueError(f"q {tuple(q.shape)} does not match K/V {tuple(k_cache.shape)}")
    if starts is not None and (starts.shape != (B,) or starts.dtype != torch.int64):
        raise ValueError(f"starts must be [B] = [{B}] int64, got {tuple(starts.shape)} {starts.dtype}")
    C = k_cache.shape[0]
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"lean_attention supports head_dim {SUPPORTED_HEAD_DIMS}, got {D}")
    if Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q must be fp16, bf16 or fp32, got {q.dtype}")
    if k_cache.dtype != v_cache.dtype or not (fp8 or k_cache.dtype == q.dtype):
        raise ValueError(
            f"K and V must share q's dtype or be float8_e4m3fn, got {k_cache.dtype}, {v_cache.dtype}"
        )
    if fp8:
        quant.check_kv_scale(kv_scale, (C, Hkv, S))
        want = [C, Hkv, -(-S // V_BLOCK), D, V_BLOCK]
        if list(v_cache.shape) != want:
            raise ValueError(
                f"an FP8 V cache must be blocked, [C, Hkv, ceil(S / {V_BLOCK}), D, {V_BLOCK}] = {want} "
                f"(to_v_blocked_t), got {list(v_cache.shape)}"
            )
        if starts is not None and starts.device.type == "cpu" and bool((starts % V_BLOCK).ne(0).any()):
            raise ValueError(f"with an FP8 cache every start must be a multiple of {V_BLOCK}")
    elif kv_scale is not None:
        raise ValueError(f"kv_scale is for a float8_e4m3fn cache, not {k_cache.dtype}")
    if lengths.shape != (B,):
        raise ValueError(f"lengths must be [B] = [{B}], got {tuple(lengths.shape)}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the head_dim axis of q, K and V must be contiguous")
    if max(k_cache.shape[2] * k_cache.stride(2), v_cache.shape[2] * v_cache.stride(2)) >= 2**31:
        raise ValueError("one KV head's positions must span fewer than 2^31 elements")
    if lengths.dtype != torch.int32:
        lengths = lengths.to(torch.int32)

    G = Hq // Hkv
    g_pad = tile_rows(G * q_max)
    if q_max > 1 and q.device.type == "cuda" and G * q_max > MULTI_QUERY_MAX_ROWS:
        raise ValueError(f"query heads a KV head x Q_MAX = {G * q_max} > {MULTI_QUERY_MAX_ROWS} rows a tile")
    if config is None:
        config = default_config(D, q.dtype, fp8, positions=C * S, kv_heads=Hkv)
        if q_max > 1:
            config = multi_query_config(config, g_pad, q.dtype, fp8)
    if fp8 and config.block_n % V_BLOCK != 0:
        raise ValueError(f"an FP8 cache needs block_n a multiple of {V_BLOCK}, got {config.block_n}")
    if config.merge_chunk < 1 or config.merge_chunk & (config.merge_chunk - 1):
        raise ValueError(f"merge_chunk must be a power of two, got {config.merge_chunk}")
    fan = config.tree_fan
    if fan < 2 or fan & (fan - 1):
        raise ValueError(f"tree_fan must be a power of two >= 2, got {fan}")
    grid = _grid_size(q.device, config, num_ctas)
    # Several query positions: a tree node's merge holds its children's rows x head_dim elements
    # a pass (TREE_MERGE_ELEMENTS), and the tree has the levels of a segment of every CTA.
    merge_rows = max(1, min(g_pad, TREE_MERGE_ELEMENTS // (fan * D)))
    tree_levels = 0
    while q_max > 1 and fan**tree_levels < grid:
        tree_levels += 1
    ws = _workspace(q.device, grid, g_pad, D, B * Hkv, tree_levels)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with a contiguous last dim")
    lse_shape = (B, Hq) if q_lens is None else (B, q_max, Hq)
    if lse is not None and (lse.shape != lse_shape or lse.dtype != torch.float32 or not lse.is_contiguous()):
        raise ValueError(f"lse must be a contiguous {list(lse_shape)} float32 tensor")
    if fp8:
        # uint8 views: the kernel decodes the e4m3 bits itself (the Triton interpreter has no
        # float8 tensors, and the integer decode needs no FP8 conversion hardware).
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        if config.fp8_mma:
            dequant = DEQUANT_MMA
        else:  # the interpreter has no float8 casts: the integer decode stands in for the hardware's
            dequant = DEQUANT_CVT if q.device.type == "cuda" else DEQUANT_BITS
        scale_words = quant.kv_scale_words(kv_scale)  # [C, Hkv, S] int32
    else:
        scale_words = k_cache  # an unused pointer
        dequant = DEQUANT_NONE
    _lean_decode_kernel[(grid,)](
        q,
        k_cache,
        v_cache,
        scale_words,
        out,
        out if lse is None else lse,  # unused pointer without lse
        lengths,
        lengths if starts is None else starts,  # unused pointer without starts
        lengths if q_lens is None else q_lens,  # unused pointer with one query position
        lengths if row_limits is None else row_limits,  # unused pointer without row limits
        ws.part_o,
        ws.part_lse,
        ws.counters,
        ws.counters[B * Hkv * _COUNTER_STRIDE :] if tree_levels else ws.counters,  # the tree's
        tree_levels,
        q_max,
        scale * LOG2E,
        B,
        Hkv,
        G,
        q.stride(0),
        q.stride(1) if q_lens is not None else 0,
        q.stride(-2),
        k_cache.stride(0) if C == B else 0,  # B > C = 1: every sequence reads the one row
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0) if C == B else 0,
        v_cache.stride(1),
        v_cache.stride(2),
        v_cache.stride(3) if fp8 else 0,
        (scale_words.stride(0) if C == B else 0) if fp8 else 0,
        scale_words.stride(1) if fp8 else 0,
        out.stride(0),
        out.stride(1) if q_lens is not None else 0,
        out.stride(-2),
        BLOCK_B=1 if B == 1 else max(SCHEDULE_LANES, triton.next_power_of_2(B)),
        G_PAD=g_pad,
        HEAD_DIM=D,
        BLOCK_N=config.block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        G_MERGE=triton.next_power_of_2(G),  # the single-query merge's rows
        MERGE_ROWS=merge_rows,
        MERGE_STAGES=config.merge_stages,
        MERGE_CHUNK=config.merge_chunk,
        COUNTER_STRIDE=_COUNTER_STRIDE,
        TREE_FAN=fan,
        DEQUANT=dequant,
        UNIT=DEQUANT_UNIT.get(dequant, 1.0),
        USE_PDL=use_pdl,
        HAS_STARTS=starts is not None,
        HAS_LIMITS=row_limits is not None,
        V_BLOCK=V_BLOCK if fp8 else 0,
        WRITE_LSE=lse is not None,
        E4M3_HW=q.device.type == "cuda",
        EARLY_TICKET=config.early_ticket,
        Q_PER_TILE=config.q_per_tile,
        MULTI_Q=q_max > 1,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return out


def to_v_blocked_t(v_cache: torch.Tensor) -> torch.Tensor:
    """A V cache [C, Hkv, S, D] in the "blocked_t" layout [C, Hkv, ceil(S / V_BLOCK), D, V_BLOCK]:
    element [c, h, p // V_BLOCK, d, p % V_BLOCK] = v_cache[c, h, p, d]; positions past S are zero.
    A new copy (moved as bytes: float8 tensors have few ops on the CPU)."""
    if v_cache.dim() != 4 or v_cache.element_size() != 1:
        raise ValueError(f"expected a 1-byte V cache [C, Hkv, S, D], got {v_cache.dtype} {[*v_cache.shape]}")
    C, Hkv, S, D = v_cache.shape
    n_blocks = -(-S // V_BLOCK)
    raw = v_cache.view(torch.uint8)
    padded = raw.new_zeros(C, Hkv, n_blocks * V_BLOCK, D)
    padded[:, :, :S] = raw
    blocks = padded.view(C, Hkv, n_blocks, V_BLOCK, D).transpose(-1, -2).contiguous()
    return blocks.view(v_cache.dtype)


# ---- the schedule, on the host, for reports and tests ---------------------------------------


@dataclass(frozen=True)
class LeanSchedule:
    grid: int  # CTAs launched
    block_n: int  # positions per tile
    total_tiles: int  # sum over (b, h) of ceil(lengths[b] / block_n)
    tiles_per_cta: int  # the most tiles a CTA takes; the others take one fewer (or none)
    max_splits_per_head: int  # the most CTAs that share one (b, h) segment
    partial_segments: int  # segments merged through partials (the rest finish in registers)
    aligned: bool  # each segment dealt to its own grid / segments CTAs (no range crosses a head)
    range_starts: tuple[int, ...]  # CTA c takes tiles [range_starts[c], range_starts[c + 1])


def lean_schedule(
    lengths: Sequence[int] | torch.Tensor,
    num_kv_heads: int,
    head_dim: int = 128,
    *,
    device: torch.device | str | None = None,
    num_ctas: int | None = None,
    config: LeanConfig | None = None,
) -> LeanSchedule:
    """The schedule the kernel computes on the device, recomputed on the host (it mirrors the
    kernel's arithmetic). `device` defaults to the current CUDA device, else the CPU grid."""
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.tolist()
    config = config or default_config(head_dim, torch.bfloat16)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    grid = _grid_size(torch.device(device), config, num_ctas)
    seq_tiles = [math.ceil(n / config.block_n) for n in lengths]
    seg_tiles = [n for n in seq_tiles for _ in range(num_kv_heads)]
    total = sum(seg_tiles)
    aligned = len(set(seq_tiles)) == 1 and grid % len(seg_tiles) == 0
    span_tiles, span_ctas = (seq_tiles[0], grid // len(seg_tiles)) if aligned else (total, grid)
    per = -(-span_tiles // span_ctas)
    big = span_tiles - (per - 1) * span_ctas

    def range_start(cta: int) -> int:
        span, j = divmod(cta, span_ctas)
        return min(span * span_tiles + j * (per - 1) + min(j, big), total)

    def owner(tile: int) -> int:
        span, t = divmod(tile, max(span_tiles, 1))
        split = big * per
        return span * span_ctas + (t // per if t < split else big + (t - split) // max(per - 1, 1))

    splits, lo = [], 0
    for n in seg_tiles:
        if n:
            splits.append(owner(lo + n - 1) - owner(lo) + 1)
        lo += n
    return LeanSchedule(
        grid=grid,
        block_n=config.block_n,
        total_tiles=total,
        tiles_per_cta=per,
        max_splits_per_head=max(splits, default=0),
        partial_segments=sum(s > 1 for s in splits),
        aligned=aligned,
        range_starts=tuple(range_start(c) for c in range(grid + 1)),
    )

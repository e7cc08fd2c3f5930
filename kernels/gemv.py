"""Decode GEMV in Triton: out = x @ W^T for the few rows of a decode step, optionally adding
into the residual stream in place.

A decode step multiplies one token's activations by every weight matrix: each weight byte is
read once for 2 FLOPs, so a GEMV runs at memory speed or not at all. What a 1-row GEMV loses is
around it, not in it: cuBLAS picks split-K kernels with a separate reduce launch for the 4096-wide
outputs, and every launch pays for its start (launch, first DRAM round trip) after the previous
kernel has fully drained. Here at most one CTA an SM streams its blocks of output features
(dealt round-robin) through the whole of K in one flat software-pipelined loop (tensor cores do
the arithmetic; default_config says which operand fills the dot's M axis), and the step's
kernels are chained with programmatic dependent launch (PDL): a kernel starts while its
predecessor finishes, issues its first weight tiles (weights never depend on an earlier kernel),
and only then waits for the predecessor's results (`gdc_wait`).

`residual` (o_proj and down_proj) adds the result into the residual stream in place, rounded as
transformers rounds `h + o_proj(...)`: the projection to the model dtype first, then the sum.
`gated` (the MLP's fused gate/up) pairs each output feature's gate and up rows in one tile and
writes silu(gate) * up from the epilogue, so the activation costs no launch of its own.
`split_k` (GemvConfig) splits K over CTAs, for o_proj and down at 17-32 rows, where a CTA's x tiles
would be as many bytes as its weight tiles.
`sum_after` (a tensor-parallel rank's o_proj and down): the same launch sums the result over the
group's ranks (kernels/collectives.py's protocol): each block's outputs are pushed to the peers as
they are stored, and the CTA that finishes last sums every rank's and writes the next RMSNorm, one
launch and one grid-completion wait fewer than a separate all-reduce (bench/NOTES-distributed.md).
FP8 weights (kernels/fp8_weights.py: e4m3 values, float32 scales per output channel or per block)
take e4m3 x rows (the layer's input rounded by kernels/fp8_activations.py): the tiles enter e4m3
tensor-core dots as stored, one byte a weight, and the scales multiply the float32 sums, in the
epilogue (per channel and per token) or per K chunk (block scales, or x scaled per group of
columns: a chunk then lies inside one scale block). Hopper's warpgroup e4m3 dots (weight rows on
M) accumulate with less than float32 precision (about 14 bits kept), so each chunk's dot starts
from zero and is added to the float32 accumulator (Triton does not fold that add into the dot for
e4m3 operands on sm_90): 512 products a promotion, where DeepSeek-V3 promotes every 128; the error
that adds stays well below a bf16 result's own rounding (bench/NOTES-fp8-weights.md). With x's
rows on M the e4m3 dots are mma.sync ones, whose float32 sums are exact to float32 rounding: they
accumulate across chunks in the dot.
The RMSNorm in front of qkv and gate/up stays a separate launch: folding it into the loop (x
scaled by the norm weight, x^2 summed alongside) makes those GEMVs several times slower, because
elementwise work on x in the loop stops its loads from being pipelined, and with the rms computed
first, normalising x tiles in the loop (or loading them an iteration ahead) still slows the step
(bench/NOTES-attention.md). Nor does the GEMV before it write the norm: its last CTA would take a
grid-wide ticket, then read the row back, which costs more than the separate launch under PDL
(bench/NOTES-fp8-weights.md); only a tensor-parallel sum carries it (`sum_after`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import collectives
from .device import INTERPRETER_CTAS, sm_count
from .fp8_weights import FP8Weight, QuantizedRows

# x's rows, padded to 16 or (from 17 rows) 32, are the dot's M or N axis; larger batches go to
# cuBLAS. Up to 32 rows this beats cuBLAS, with one CTA an SM (bench/NOTES-attention.md).
MAX_ROWS = 32
# Wider weights go to cuBLAS, except the fused gate/up (gated). lm_head (128,256 wide) would gain
# next to nothing through WIDE_CONFIG: the logits stay on cuBLAS.
MAX_OUTPUTS = 16384


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters: output features per block, reduction chunk, warps, pipeline depth."""

    # Output blocks are dealt round-robin to at most one CTA an SM: qkv's 6144 outputs are 192
    # blocks, 2 for each of 96 CTAs (one block a CTA would launch 192: two waves on 132 SMs, and
    # each CTA of the second fills a pipeline again). Blocks of 16 outputs, 3 for each of 128
    # CTAs, are slower (bench/NOTES-attention.md).
    block_n: int = 32
    block_k: int = 256  # a 16 KiB bf16 tile of W (and 8 KiB of x) per pipeline stage
    num_warps: int = 4
    # 6 stages keep 5 tiles in shared memory, 120 KiB: one CTA fits an SM. That is what matters
    # under PDL: a GEMV launched early is placed on whichever SMs its predecessor frees first, and
    # with room for two or three CTAs an SM they pile onto those SMs and stream from a few SMs
    # (bench/NOTES-attention.md).
    num_stages: int = 6
    # Weight tiles issued before the PDL wait, up to 16 rows (above, one: the padded x tiles cost
    # registers there). Two hide more of the predecessor's tail than one; four, or two at 32 rows,
    # are slower (bench/NOTES-attention.md).
    early_tiles: int = 2
    # The dot's operands: x [M_PAD, BLOCK_K] . W^T (x's padded rows on M: mma.sync, M = 16 or 32),
    # or W [BLOCK_N, BLOCK_K] . x^T (weight rows on M: Hopper's warpgroup MMA, which needs
    # M = block_n >= 64; a third of the registers, operands straight from shared memory).
    w_on_m: bool = False
    # K split into this many parts, each a work item dealt round-robin like blocks: a part's fp32
    # partial goes to a workspace, and after its loop each CTA draws its items' tickets; the last
    # part of a block sums the partials in part order (bitwise repeatable) and runs the
    # epilogue. Meant for one item a CTA: a CTA's later tickets wait for its whole loop (a batch's
    # gate/up split in four, 7 items a CTA, is much slower; bench/NOTES-attention.md).
    split_k: int = 1


DEFAULT_CONFIG = GemvConfig()
# Weight rows on M (warpgroup MMA), 32 KiB weight tiles, 4 stages (one CTA an SM: 162 KiB of
# shared memory at 16 rows, 194 KiB at 32).
WIDE_CONFIG = GemvConfig(block_n=64, block_k=256, num_stages=4, w_on_m=True)
# Gate/up of a batch: 64 features' gate and up rows a block, weight rows on M.
GATED_BATCH_CONFIG = GemvConfig(block_n=128, block_k=128, num_stages=4, w_on_m=True)
# o_proj / down of 17-32 rows: blocks of 64 weight rows on M, K split in two (as many CTAs as
# blocks of 32, half the x tiles per weight byte).
SPLIT_K_CONFIG = GemvConfig(block_n=64, block_k=256, num_stages=4, w_on_m=True, split_k=2)


# FP8 weights (bench/tune_gemv.py --fp8, bench/NOTES-fp8-weights.md): 512-column chunks, 32 KiB
# weight tiles of 64 rows, 4 stages (one CTA an SM at 16 and at 32 rows). Weight rows on M
# (warpgroup MMA, each chunk's sums promoted to float32), one item per block: qkv (96 blocks,
# whose 192 halves would take two rounds of CTAs). Faster than shorter chunks at more stages.
FP8_CONFIG = GemvConfig(block_n=64, block_k=512, num_stages=4, w_on_m=True)
# The same, K split in two: a weight of few 64-row blocks (o_proj, down), at most one item a CTA.
FP8_SPLIT_K_CONFIG = GemvConfig(block_n=64, block_k=512, num_stages=4, w_on_m=True, split_k=2)
# gate/up: x's rows on M (mma.sync e4m3, float32 sums across chunks), 64 weight rows (32 features)
# a block, no split: faster than the weight-rows-on-M split at one row.
FP8_GATED_CONFIG = GemvConfig(block_n=64, block_k=512, num_stages=4)
# Block scales cut a chunk to the scale block (128 columns on the hub's checkpoints): the stages
# grow to keep as many weight bytes in flight, up to this many.
FP8_MAX_STAGES = 13


def default_fp8_config(out_features: int, gated: bool, ctas: int) -> GemvConfig:
    """FP8 weights: gate/up FP8_GATED_CONFIG; else K split in two where that deals at most one item
    a CTA (a weight of few 64-row blocks: o_proj and down), one item per block otherwise (qkv)."""
    if gated:
        return FP8_GATED_CONFIG
    blocks = triton.cdiv(out_features, FP8_CONFIG.block_n)
    return FP8_SPLIT_K_CONFIG if FP8_SPLIT_K_CONFIG.split_k * blocks <= ctas else FP8_CONFIG


def default_config(rows: int, out_features: int, gated: bool, ctas: int) -> GemvConfig:
    """The config for `rows` of x and `out_features` outputs on `ctas` CTAs (H200 decode step,
    synthetic Llama-3-8B; bench/NOTES-attention.md):
    - weight rows on M wherever blocks of 64 keep as many CTAs as blocks of 32 dealt round-robin,
      i.e. where those would deal two or more a CTA: qkv (6144 outputs, 96 CTAs either way). The
      4096-wide o_proj and down would run on 64 CTAs instead of 128: they keep x's rows on M,
    - except from 17 rows, where x (padded to 32 rows) is as many bytes a tile as the weights:
      blocks of 64 weight rows on M with K split in two, one work item for each of 128 CTAs. At
      8 and 16 rows the split is slower than x's rows on M.
    - gate/up with silu * up, a batch (2-32 rows): weight rows on M, where x's rows on M lose to
      cuBLAS + silu_mul (and this beats that).
    - gate/up, one row: x's rows on M (weight rows on M are slower there)."""
    if gated:
        return DEFAULT_CONFIG if rows == 1 else GATED_BATCH_CONFIG
    if out_features > DEFAULT_CONFIG.block_n * ctas:
        return WIDE_CONFIG
    split_items = SPLIT_K_CONFIG.split_k * triton.cdiv(out_features, SPLIT_K_CONFIG.block_n)
    return SPLIT_K_CONFIG if rows > 16 and split_items <= ctas else DEFAULT_CONFIG


@triton.jit
def _tile_rows(block, offs_j, N, GATED: tl.constexpr, BLOCK_N: tl.constexpr):
    """A block's weight rows [BLOCK_N] and which exist. GATED: W is the fused [gate; up]
    projection (N = 2 I rows) and a block is BLOCK_N / 2 output features: tile row 2 c is feature
    c's gate row, 2 c + 1 its up row."""
    if GATED:
        feature = block * (BLOCK_N // 2) + offs_j // 2
        return feature + (offs_j % 2) * (N // 2), feature < N // 2
    rows = block * BLOCK_N + offs_j
    return rows, rows < N


@triton.jit
def _weight_rows(W, block, offs_j, stride_wn, N, GATED: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pointers to a block's weight rows [BLOCK_N, 1] (64-bit offsets for huge weights), and which
    exist [BLOCK_N, 1]."""
    rows, ok = _tile_rows(block, offs_j, N, GATED, BLOCK_N)
    return W + rows.to(tl.int64)[:, None] * stride_wn, ok[:, None]


@triton.jit
def _store_block(
    Out,
    Bias,
    acc,  # [M_PAD, BLOCK_N] fp32
    offs_m,
    block,
    offs_j,
    row_ok,
    N,
    stride_ob,
    Buffer,
    Peers,
    Calls,
    rank,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUM_SIZE: tl.constexpr,
):
    """The block's outputs: Out[:, block's features] = acc (+ bias), or += it with HAS_RESIDUAL;
    GATED: silu(gate) * up of the interleaved pairs, rounded as transformers rounds
    `F.silu(gate_proj(x)) * up_proj(x)` (each projection, then silu, then the product).
    SUM_SIZE (a sum over that many ranks after the GEMV): also pushed to the peers."""
    if GATED:
        if HAS_BIAS:
            rows, ok = _tile_rows(block, offs_j, N, GATED, BLOCK_N)
            acc += tl.load(Bias + rows, mask=ok, other=0.0).to(tl.float32)[None, :]
        pairs = tl.reshape(acc.to(Out.dtype.element_ty).to(tl.float32), [acc.shape[0], BLOCK_N // 2, 2])
        gate, up = tl.split(pairs)  # [M_PAD, BLOCK_N // 2] each
        act = (gate * tl.sigmoid(gate)).to(Out.dtype.element_ty).to(tl.float32)
        y = (act * up).to(Out.dtype.element_ty)
        offs_n = block * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        n_ok = offs_n < N // 2
    else:
        offs_n = block * BLOCK_N + offs_j
        n_ok = offs_n < N
        if HAS_BIAS:
            acc += tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y = acc.to(Out.dtype.element_ty)
    out_ptrs = Out + offs_m[:, None] * stride_ob + offs_n[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    if HAS_RESIDUAL:
        y = (tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32) + y.to(tl.float32)).to(
            Out.dtype.element_ty
        )
    tl.store(out_ptrs, y, mask=mask)
    if SUM_SIZE > 0:
        _push_block(y, offs_m, block, row_ok, N, Buffer, Peers, Calls, rank, BLOCK_N, SUM_SIZE)


@triton.jit
def _push_block(
    y, offs_m, block, row_ok, N, Buffer, Peers, Calls, rank, BLOCK_N: tl.constexpr, SUM_SIZE: tl.constexpr
):  # fmt: skip
    """A block's outputs y [M_PAD, BLOCK_N] as the sum's words (the result [B, N] is the message,
    contiguous; 16-bit values two a word, the lower column first) into every peer's buffer, with
    this call's tag (kernels/collectives.py)."""
    if y.dtype.primitive_bitwidth == 16:
        low, high = tl.split(tl.reshape(y, [y.shape[0], BLOCK_N // 2, 2]))  # [M_PAD, BLOCK_N // 2] each
        words = (low.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (
            high.to(tl.int16, bitcast=True).to(tl.int32) << 16
        )
        col = block * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        row_words = N // 2
    else:
        words = y.to(tl.int32, bitcast=True)
        col = block * BLOCK_N + tl.arange(0, BLOCK_N)
        row_words = N
    word = offs_m[:, None] * row_words + col[None, :]
    call = tl.load(Calls)  # the chunk's count: the whole message is CTA 0's chunk of one_shot
    ok = row_ok[:, None] & (col < row_words)[None, :]
    collectives._push(Buffer, Peers, word, words, ok, call + 1, call & 1, rank, SUM_SIZE)


@triton.jit
def _sum_after(
    Out, SumOut, Buffer, Calls, Ticket, NormW, Normed, n_ctas, B, N, rank, eps, SUM_SIZE: tl.constexpr,
    SUM_NORM: tl.constexpr,
):  # fmt: skip
    """After a CTA's last store: it draws the grid's ticket, and the last CTA sums Out [B, N] (this
    rank's result, every CTA's stores visible to it through the ticket) with every peer's pushed
    words, in rank order, into SumOut (and its RMSNorm into Normed), as collectives.one_shot's sum
    would, and advances the call count. Nobody waits for another CTA of this launch; the last one
    waits for the peers' words, which their GEMVs push without waiting for anyone."""
    half: tl.constexpr = Out.dtype.element_ty.primitive_bitwidth == 16
    tl.debug_barrier()  # all our threads' stores and pushes come before the ticket's release
    if tl.atomic_add(Ticket, 1, sem="acq_rel", scope="gpu") == n_ctas - 1:
        n_words = B * N // 2 if half else B * N
        word = tl.arange(0, collectives.WORDS)
        ok = word < n_words
        mine = tl.load(Out.to(tl.pointer_type(tl.int32), bitcast=True) + word, mask=ok, other=0)
        call = tl.load(Calls)
        acc = collectives._sum_words(
            Buffer, mine, word, ok, call + 1, call & 1, rank, SUM_SIZE, half, Out.dtype.element_ty
        )  # fmt: skip
        collectives._store_sum(SumOut, NormW, Normed, acc, 0, B * N, eps, SUM_NORM)
        tl.store(Calls, call + 1)
        tl.store(Ticket, 0)  # every CTA has drawn its ticket: ready for the next launch


@triton.jit
def _tile_dot(
    X, w, offs_m, k, row_ok, K, stride_xb, acc, scale, PRECISION: tl.constexpr, W_ON_M: tl.constexpr,
    FP8: tl.constexpr,
):  # fmt: skip
    """acc + one K chunk's products: x [M_PAD, BLOCK_K] . w^T -> [M_PAD, BLOCK_N], or with W_ON_M
    w . x^T -> [BLOCK_N, M_PAD] (acc None: the first chunk). FP8: w and x are e4m3 (or their
    bits: the bitcast is a no-op on e4m3 tensors), multiplied on e4m3 tensor cores; where the
    chunk has scales (`scale`, _chunk_scales, oriented as the result) or the dot is a warpgroup one
    (W_ON_M: short sums), the chunk's dot starts from zero and is added to acc in float32."""
    if W_ON_M:
        mask = row_ok[None, :] & (k < K)[:, None]
        a = w
        b = tl.load(X + offs_m[None, :] * stride_xb + k[:, None], mask=mask, other=0.0)  # [BLOCK_K, M_PAD]
    else:
        mask = row_ok[:, None] & (k < K)[None, :]
        a = tl.load(X + offs_m[:, None] * stride_xb + k[None, :], mask=mask, other=0.0)  # [M_PAD, BLOCK_K]
        b = tl.trans(w)
    if FP8:
        a, b = a.to(tl.float8e4nv, bitcast=True), b.to(tl.float8e4nv, bitcast=True)
    if FP8 and (W_ON_M or scale is not None):  # the chunk's sum on its own: promoted, or scaled
        part = tl.dot(a, b)
        if scale is not None:
            part = part * scale
        acc = part if acc is None else acc + part
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _chunk_scales(
    XScale, WScale, block, offs_j, offs_m, row_ok, k0, N, K, stride_xs, stride_ws, scale_rows, scale_cols,
    x_group, GATED: tl.constexpr, BLOCK_N: tl.constexpr, W_ON_M: tl.constexpr,
):  # fmt: skip
    """FP8 scales that vary along K: [BLOCK_N, M_PAD] (W_ON_M; else [M_PAD, BLOCK_N]), the tile's
    weight rows' scales times x's rows' scales for the chunk that starts at column k0 (inside one
    block of each). A chunk past K (a split's last part may run past it) reads the last column's
    scales, which exist, for its products of zeros."""
    rows, ok = _tile_rows(block, offs_j, N, GATED, BLOCK_N)
    k0 = tl.minimum(k0, K - 1)
    sw = tl.load(WScale + (rows // scale_rows) * stride_ws + k0 // scale_cols, mask=ok, other=0.0)
    sx = tl.load(XScale + offs_m * stride_xs + k0 // x_group, mask=row_ok, other=0.0)
    if W_ON_M:  # one return: Triton 3.6 compiles every return of a function, constexpr branches too
        scale = sw[:, None] * sx[None, :]
    else:
        scale = sx[:, None] * sw[None, :]
    return scale


@triton.jit
def _epilogue_scales(
    acc, XScale, WScale, block, offs_j, offs_m, row_ok, N, stride_xs, stride_ws, scale_rows,
    GATED: tl.constexpr, BLOCK_N: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """acc [M_PAD, BLOCK_N] times x's row scales and the weight rows' (per-channel) scales where
    SCALED (FP8 with scales constant along K); as it is otherwise."""
    if SCALED:
        rows, ok = _tile_rows(block, offs_j, N, GATED, BLOCK_N)
        sw = tl.load(WScale + (rows // scale_rows) * stride_ws, mask=ok, other=0.0)
        sx = tl.load(XScale + offs_m * stride_xs, mask=row_ok, other=0.0)
        acc = acc * sx[:, None] * sw[None, :]
    return acc


@triton.jit
def _rows_first(acc, W_ON_M: tl.constexpr):
    """The accumulator as [M_PAD, BLOCK_N]."""
    if W_ON_M:
        acc = tl.trans(acc)
    return acc


COUNTER_STRIDE: tl.constexpr = tl.constexpr(32)  # int32s: each block's ticket on its own 128-byte line


@triton.jit
def _finish_item(
    Out, Bias, Part, XScale, WScale, acc, offs_m, item, offs_j, row_ok, N, stride_ob, stride_xs, stride_ws,
    scale_rows, Buffer, Peers, Calls, rank, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    GATED: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, M_PAD: tl.constexpr,
    EPILOGUE_SCALES: tl.constexpr, SUM_SIZE: tl.constexpr,
):  # fmt: skip
    """acc [M_PAD, BLOCK_N] fp32 is work item `item`'s sum: the block's outputs, or with SPLIT_K
    its partial over one part of K, stored for _merge_parts (a plain store: the software
    pipeline runs on across it)."""
    if SPLIT_K == 1:
        acc = _epilogue_scales(
            acc, XScale, WScale, item, offs_j, offs_m, row_ok, N, stride_xs, stride_ws, scale_rows,
            GATED, BLOCK_N, EPILOGUE_SCALES,
        )  # fmt: skip
        _store_block(
            Out, Bias, acc, offs_m, item, offs_j, row_ok, N, stride_ob, Buffer, Peers, Calls, rank,
            HAS_BIAS, HAS_RESIDUAL, GATED, BLOCK_N, SUM_SIZE,
        )  # fmt: skip
    else:
        tile = offs_m[:, None] * BLOCK_N + offs_j[None, :]
        tl.store(Part + item * (M_PAD * BLOCK_N) + tile, acc, mask=row_ok[:, None])


@triton.jit
def _merge_parts(
    Out, Bias, Part, Counters, XScale, WScale, cta, n_ctas, n_items, offs_m, offs_j, row_ok, N, stride_ob,
    stride_xs, stride_ws, scale_rows, Buffer, Peers, Calls, rank, HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    M_PAD: tl.constexpr, EPILOGUE_SCALES: tl.constexpr, SUM_SIZE: tl.constexpr,
):  # fmt: skip
    """After the loop, for each of our items: draw its block's ticket; the part that draws the
    last one sums the block's partials in part order (bitwise repeatable whoever comes last),
    stores the block and zeroes the counter. Nobody waits for another CTA: no deadlock."""
    tl.debug_barrier()  # all our threads' partial stores come before the tickets' release
    tile = offs_m[:, None] * BLOCK_N + offs_j[None, :]  # [M_PAD, BLOCK_N]
    for item in range(cta, n_items, n_ctas):
        block = item // SPLIT_K
        counter = Counters + block * COUNTER_STRIDE
        # Acquire-release: every part's partial is visible to whoever draws the last ticket.
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            parts = Part + block * SPLIT_K * (M_PAD * BLOCK_N) + tile
            total = tl.load(parts, mask=row_ok[:, None], other=0.0)
            for s in tl.static_range(1, SPLIT_K):
                total += tl.load(parts + s * (M_PAD * BLOCK_N), mask=row_ok[:, None], other=0.0)
            total = _epilogue_scales(
                total, XScale, WScale, block, offs_j, offs_m, row_ok, N, stride_xs, stride_ws, scale_rows,
                GATED, BLOCK_N, EPILOGUE_SCALES,
            )  # fmt: skip
            _store_block(
                Out, Bias, total, offs_m, block, offs_j, row_ok, N, stride_ob, Buffer, Peers, Calls, rank,
                HAS_BIAS, HAS_RESIDUAL, GATED, BLOCK_N, SUM_SIZE,
            )  # fmt: skip
            tl.store(counter, 0)  # every part has drawn its ticket: ready for the next launch


@triton.jit
def _gemv_kernel(
    X,  # [B, K] (FP8: e4m3, or its bits as uint8 under the interpreter)
    W,  # [N, K], rows contiguous (FP8: e4m3, or its bits)
    Bias,  # [N] or a dummy
    Out,  # [B, N] ([B, N / 2] when GATED); with HAS_RESIDUAL the residual stream, updated in place
    Part,  # SPLIT_K > 1: [n_blocks, SPLIT_K, M_PAD, BLOCK_N] fp32 partials (else a dummy)
    Counters,  # SPLIT_K > 1: [n_blocks * COUNTER_STRIDE] int32 tickets, zero between launches
    XScale,  # FP8: [B, ceil(K / x_group)] float32 scales of x's rows (else a dummy)
    WScale,  # FP8: [ceil(N / scale_rows), ceil(K / scale_cols)] float32 weight scales (else a dummy)
    B,
    N,
    K,
    n_blocks,  # blocks of outputs: ceil(N / BLOCK_N), or of N / 2 features by BLOCK_N / 2 when GATED
    stride_xb,
    stride_wn,
    stride_ob,
    stride_xs,
    stride_ws,
    scale_rows,  # FP8: weight rows per scale (1: per channel)
    scale_cols,  # FP8: weight columns per scale (K: one scale along K)
    x_group,  # FP8: x's columns per scale (K: per row)
    # SUM_SIZE > 0: the result's sum over that many ranks after the product (collectives.SumAfter;
    # else dummies): into SumOut [B, N], its RMSNorm (SUM_NORM, weight NormW) into Normed
    SumOut,
    Buffer,  # this rank's one-shot buffer, int64 words
    Peers,  # [SUM_SIZE] int64: each rank's buffer minus ours, in 16-byte units
    Calls,  # int32 call counts (ours: [0])
    Ticket,  # [1] int32, zero between launches
    NormW,
    Normed,
    rank,
    eps,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    GATED: tl.constexpr,
    USE_PDL: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    EARLY_TILES: tl.constexpr,  # 1 or 2
    W_ON_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    FP8: tl.constexpr,
    K_SCALED: tl.constexpr,  # FP8 scales that vary along K: applied per chunk
    EPILOGUE_SCALES: tl.constexpr,  # FP8 scales constant along K: applied to the sums
    SUM_SIZE: tl.constexpr,
    SUM_NORM: tl.constexpr,
):
    # CTA c owns the work items c, c + grid, c + 2 grid, ... (item = block * SPLIT_K + part of K);
    # its (item, K chunk) pairs run as one flat loop, so the software pipeline streams on across an
    # item boundary instead of draining there.
    cta, n_ctas = tl.program_id(0), tl.num_programs(0)
    k_iters = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)  # K chunks of a part (the last may run past K)
    n_iters = tl.cdiv(n_blocks * SPLIT_K - cta, n_ctas) * k_iters
    offs_m = tl.arange(0, M_PAD)  # rows of x, padded
    offs_j = tl.arange(0, BLOCK_N)  # weight rows within a block's tile
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < B
    # The first EARLY_TILES weight tiles (K chunks of our first item; the host keeps EARLY_TILES
    # within its chunks) are loaded before waiting for the previous kernel: they overlap that
    # kernel's tail (weights are never written by the step, so there is nothing to wait for).
    block = cta // SPLIT_K
    w_rows, n_ok = _weight_rows(W, block, offs_j, stride_wn, N, GATED, BLOCK_N)  # [BLOCK_N, 1] each
    k0 = (cta % SPLIT_K) * k_iters * BLOCK_K
    k_first = k0 + offs_k
    k1 = BLOCK_K + k_first  # the second chunk
    w0 = tl.load(w_rows + k_first[None, :], mask=n_ok & (k_first < K)[None, :], other=0.0)
    if EARLY_TILES == 2:
        w1 = tl.load(w_rows + k1[None, :], mask=n_ok & (k1 < K)[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x (and the residual) are the previous kernels' results
        tl.extra.cuda.gdc_launch_dependents()
    scale = None
    if K_SCALED:
        scale = _chunk_scales(
            XScale, WScale, block, offs_j, offs_m, row_ok, k0, N, K, stride_xs, stride_ws, scale_rows,
            scale_cols, x_group, GATED, BLOCK_N, W_ON_M,
        )  # fmt: skip
    acc = _tile_dot(X, w0, offs_m, k_first, row_ok, K, stride_xb, None, scale, PRECISION, W_ON_M, FP8)
    if EARLY_TILES == 2:
        if K_SCALED:
            scale = _chunk_scales(
                XScale, WScale, block, offs_j, offs_m, row_ok, k0 + BLOCK_K, N, K, stride_xs, stride_ws,
                scale_rows, scale_cols, x_group, GATED, BLOCK_N, W_ON_M,
            )  # fmt: skip
        acc = _tile_dot(X, w1, offs_m, k1, row_ok, K, stride_xb, acc, scale, PRECISION, W_ON_M, FP8)
    for i in range(EARLY_TILES, n_iters):  # software-pipelined: num_stages tiles in flight
        item, chunk = cta + (i // k_iters) * n_ctas, i % k_iters
        if chunk == 0:  # a new item begins: the previous one is complete
            _finish_item(
                Out, Bias, Part, XScale, WScale, _rows_first(acc, W_ON_M), offs_m, item - n_ctas, offs_j,
                row_ok, N, stride_ob, stride_xs, stride_ws, scale_rows, Buffer, Peers, Calls, rank, HAS_BIAS,
                HAS_RESIDUAL, GATED, BLOCK_N, SPLIT_K, M_PAD, EPILOGUE_SCALES, SUM_SIZE,
            )  # fmt: skip
            acc = tl.zeros_like(acc)
        block = item // SPLIT_K
        k0 = ((item % SPLIT_K) * k_iters + chunk) * BLOCK_K
        k = k0 + offs_k
        w_rows, n_ok = _weight_rows(W, block, offs_j, stride_wn, N, GATED, BLOCK_N)
        w = tl.load(w_rows + k[None, :], mask=n_ok & (k < K)[None, :], other=0.0)
        if K_SCALED:
            scale = _chunk_scales(
                XScale, WScale, block, offs_j, offs_m, row_ok, k0, N, K, stride_xs, stride_ws, scale_rows,
                scale_cols, x_group, GATED, BLOCK_N, W_ON_M,
            )  # fmt: skip
        acc = _tile_dot(X, w, offs_m, k, row_ok, K, stride_xb, acc, scale, PRECISION, W_ON_M, FP8)
    last = cta + ((n_iters - 1) // k_iters) * n_ctas
    _finish_item(
        Out, Bias, Part, XScale, WScale, _rows_first(acc, W_ON_M), offs_m, last, offs_j, row_ok, N,
        stride_ob, stride_xs, stride_ws, scale_rows, Buffer, Peers, Calls, rank, HAS_BIAS, HAS_RESIDUAL,
        GATED, BLOCK_N, SPLIT_K, M_PAD, EPILOGUE_SCALES, SUM_SIZE,
    )  # fmt: skip
    if SPLIT_K > 1:
        _merge_parts(
            Out, Bias, Part, Counters, XScale, WScale, cta, n_ctas, n_blocks * SPLIT_K, offs_m, offs_j,
            row_ok, N, stride_ob, stride_xs, stride_ws, scale_rows, Buffer, Peers, Calls, rank, HAS_BIAS,
            HAS_RESIDUAL, GATED, BLOCK_N, SPLIT_K, M_PAD, EPILOGUE_SCALES, SUM_SIZE,
        )  # fmt: skip
    if SUM_SIZE > 0:
        _sum_after(
            Out, SumOut, Buffer, Calls, Ticket, NormW, Normed, n_ctas, B, N, rank, eps, SUM_SIZE, SUM_NORM
        )


def gemv(
    x: torch.Tensor | QuantizedRows,  # [B, K], B <= MAX_ROWS; FP8 weights: the rows rounded to e4m3
    weight: torch.Tensor | FP8Weight,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    *,
    residual: torch.Tensor | None = None,  # [B, N]: residual += result, in place, and returned
    gated: bool = False,  # weight is [gate; up] (N = 2 I): the result is silu(gate) * up [B, I]
    use_pdl: bool = False,
    config: GemvConfig | None = None,  # default: default_config(...) (FP8: default_fp8_config)
    max_ctas: int | None = None,  # default: the SM count (the interpreter: INTERPRETER_CTAS)
    sum_after: collectives.SumAfter | None = None,  # then the result's sum over a group's ranks
) -> torch.Tensor:  # [B, N] (gated: [B, N / 2]) in x's dtype (FP8: the dtype the rows were)
    """x @ weight^T + bias (added into residual in place, if given; gated: silu(gate) * up of the
    fused gate/up projection) in one Triton launch. FP8 weights (an FP8Weight) take x as
    QuantizedRows (kernels/fp8_activations.py) and compute W8A8 (kernels/fp8_weights.py). A
    split-K config uses a workspace cached per device and shape: calls that share one must be
    ordered on one stream (as the decode step's are). `sum_after`: the same launch then sums the
    result over the group's ranks (collectives.SumAfter; every rank makes the same call)."""
    fp8 = isinstance(weight, FP8Weight)
    if fp8 != isinstance(x, QuantizedRows):
        raise ValueError("gemv: FP8 weights take e4m3 rows (QuantizedRows), and only they do")
    xv, wv = (x.values, weight.values) if fp8 else (x, weight)
    B, K = xv.shape
    N = wv.shape[0]
    fits = wv.shape[1] == K and B <= MAX_ROWS and xv.stride(-1) == 1 and wv.stride(-1) == 1
    if not fits or (gated and (N % 2 or residual is not None)):
        raise ValueError(
            f"gemv: x {tuple(xv.shape)} and weight {tuple(wv.shape)} do not fit (contiguous K"
            + (", an even number of gate/up rows, no residual)" if gated else ")")
        )
    out_features = N // 2 if gated else N
    out = residual if residual is not None else torch.empty(B, out_features, dtype=x.dtype, device=xv.device)
    if max_ctas is None:
        max_ctas = sm_count(xv.device) if xv.is_cuda else INTERPRETER_CTAS
    if sum_after is not None:
        sum_args, norm_args = _sum_args(sum_after, out, gated)
    else:
        sum_args, norm_args = (out, out, out, out, out, out, out, 0, 0.0), (0, False)
    if fp8:
        config = config or default_fp8_config(out_features, gated, max_ctas)
        # K chunks inside one scale block of the weight and of x wherever the scales vary along K
        varying = [n for n in (weight.block_k, x.group) if n < K]
        block_k = min([config.block_k] + [n & -n for n in varying])  # largest power of two dividing each
        stages = max(config.num_stages, min(config.num_stages * config.block_k // block_k, FP8_MAX_STAGES))
        x_scale, w_scale = x.scale, weight.scale
        scale_args = (x_scale.stride(0), w_scale.stride(0), weight.block_n, min(weight.block_k, K), x.group)
        if not xv.is_cuda:  # the interpreter has no float8 tensors: their bits (the kernel bitcasts them)
            xv, wv = xv.view(torch.uint8), wv.view(torch.uint8)
    else:
        config = config or default_config(B, out_features, gated, max_ctas)
        block_k = config.block_k // 2 if xv.dtype == torch.float32 else config.block_k  # fp32: 2x the bytes
        stages = config.num_stages
        x_scale = w_scale = out  # unused
        scale_args, varying = (0, 0, 1, K, K), []
    # a gated block is block_n weight rows too: block_n / 2 features' gate and up rows
    n_blocks = triton.cdiv(out_features, config.block_n // 2 if gated else config.block_n)
    items = n_blocks * config.split_k
    grid = triton.cdiv(items, triton.cdiv(items, max_ctas))  # as few CTAs as the most items a CTA needs
    m_pad = 16 if B <= 16 else 32  # tl.dot needs M >= 16
    part_chunks = triton.cdiv(triton.cdiv(K, block_k), config.split_k)  # K chunks of a part
    if config.split_k > 1:
        part, counters = _workspace(xv.device, n_blocks, config.split_k, m_pad, config.block_n)
    else:
        part = counters = out  # unused
    _gemv_kernel[(grid,)](
        xv,
        wv,
        wv if bias is None else bias,
        out,
        part,
        counters,
        x_scale,
        w_scale,
        B,
        N,
        K,
        n_blocks,
        xv.stride(0),
        wv.stride(0),
        out.stride(0),
        *scale_args,
        *sum_args,
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None,
        GATED=gated,
        USE_PDL=use_pdl,
        M_PAD=m_pad,
        BLOCK_N=config.block_n,
        BLOCK_K=block_k,
        PRECISION="ieee" if xv.dtype == torch.float32 else "tf32",  # fp32 models: exact products
        EARLY_TILES=2 if config.early_tiles >= 2 and B <= 16 and part_chunks > 1 else 1,
        W_ON_M=config.w_on_m,
        SPLIT_K=config.split_k,
        FP8=fp8,
        K_SCALED=bool(varying),
        EPILOGUE_SCALES=fp8 and not varying,
        SUM_SIZE=norm_args[0],
        SUM_NORM=norm_args[1],
        num_warps=config.num_warps,
        num_stages=stages,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return out


def _sum_args(sum_after: collectives.SumAfter, out: torch.Tensor, gated: bool) -> tuple[tuple, tuple]:
    """The kernel's arguments for a sum after the GEMV, and (SUM_SIZE, SUM_NORM)."""
    ends, total = sum_after.ends, sum_after.out
    if gated or not collectives.fits_one_chunk(out) or not collectives.fits(out):
        raise ValueError(
            f"gemv: a sum after the GEMV takes one chunk of a plain result, not {tuple(out.shape)}"
        )
    assert total.shape == out.shape and total.dtype == out.dtype and total.is_contiguous()
    if sum_after.norm is not None:
        weight, eps, normed = sum_after.norm
        assert (
            out.shape[0] == 1 and weight.numel() == normed.numel() == out.numel() and normed.is_contiguous()
        )
    else:
        weight, eps, normed = out, 0.0, out  # unused
    buffer = ends.buffer.view(torch.int64)
    args = (total, buffer, ends.peers, ends.calls, ends.ticket, weight, normed, ends.rank, eps)
    return args, (ends.peers.numel(), sum_after.norm is not None)


_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, n_blocks: int, split_k: int, m_pad: int, block_n: int):
    """Split-K partials [n_blocks, split_k, m_pad, block_n] fp32 and ticket counters (zero between
    launches), cached per (device, shape): a CUDA graph captured after one eager call allocates
    nothing. Calls that share a workspace must be ordered on one stream (the engine's step is)."""
    key = (device, n_blocks, split_k, m_pad, block_n)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = (
            torch.empty(n_blocks, split_k, m_pad, block_n, dtype=torch.float32, device=device),
            torch.zeros(n_blocks * COUNTER_STRIDE.value, dtype=torch.int32, device=device),
        )
    return _WORKSPACES[key]

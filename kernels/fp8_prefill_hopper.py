"""FP8 causal flash attention for prefill on Hopper, warp-specialized (Gluon): the arithmetic of
fp8_prefill._fp8_attention_kernel, scheduled so that the tensor cores and the softmax overlap.

At head_dim 128 a tile's two e4m3 dots and its 8192 exponentials take about as long each (the
SM's 16 exp2 lanes against its FP8 tensor-core rate), so a warpgroup that runs them one after the
other leaves the tensor cores idle half the time, and two such CTAs on an SM drift into the same
phase. Here a CTA takes 2 x BLOCK_M query rows of one head in three partitions:

- a loader warp streams K and V tiles by TMA into a ring of STAGES slots (`ready` barriers), and
  refills a slot once both consumers have released it (`empty`, two arrivals);
- two consumer warpgroups, BLOCK_M rows each, run the online softmax: tile t's weights, then
  tile t's P.V and tile t + 1's Q.K^T issued back to back as asynchronous wgmmas;
- the consumers take turns issuing those wgmmas (`turn` barriers, FlashAttention-3's ping-pong):
  one's dots run while the other computes its exponentials.

The scores' accumulator layout gives a thread keys 2q, 2q + 1, 8 + 2q and 9 + 2q of every 16 (q
its index in its quad), where P.V's register operand wants keys 4q .. 4q + 3. Relabelling the keys
(a reshape and permute, free) and writing V^T with its keys in that order (quantize_kv's
permute_v) makes P's conversion to the operand four e4m3 roundings into one register per four
weights, with no data moving between threads.

Both consumers walk the CTA's whole range of tiles (the upper half's last tile is fully masked for
the lower half's rows: an exact change of units, powers of two), so their turns pair up. The
output equals fp8_prefill's Triton kernel bit for bit (tests/test_prefill_fp8.py on a GPU).
Gluon has no interpreter: this kernel runs on a GPU only; the CPU tests compile it for sm_90.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .fp8_prefill import _P_BITS, _P_SHIFT_MAX, LOG2E, QuantizedKV, _pow2, _scale_exponent

# Triton 3.6 names the TMA load async_copy_global_to_shared; later versions async_load.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

# Registers: the consumers hold a [64, D] accumulator, a [64, 128] score tile and a [64, D]
# P.V result in flight (~240 a thread); the loader needs few. 12 warps x 168 fill the SM's 64k.
MAX_REGISTERS = 168
_CONSUMER_REGISTERS, _LOADER_REGISTERS = gl.constexpr(240), gl.constexpr(24)


@gluon.jit
def _weights_operand(p, p_layout: gl.constexpr):
    """p [BM, BN] float32 in the scores' wgmma layout -> P.V's register operand in e4m3, with the
    keys of every 16 relabelled into the order each thread already holds them (module docstring):
    the layout change moves nothing, and each 4 weights round into one register."""
    BM: gl.constexpr = p.shape[0]
    BN: gl.constexpr = p.shape[1]
    p = p.reshape([BM, BN // 16, 2, 4, 2]).permute((0, 1, 3, 2, 4)).reshape([BM, BN])
    bits = gl.convert_layout(p, p_layout).to(gl.int32, bitcast=True)
    return gl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
        "=r,r,r,r,r", [bits], dtype=gl.float8e4nv, is_pure=True, pack=4,
    )  # fmt: skip


@gluon.jit
def _softmax(qk, n0, rows, keys, PAST, N, row_factor, k_scale, v_scale, v_prev, m_i, shift, l_i,
             p_layout: gl.constexpr, MASK: gl.constexpr):  # fmt: skip
    """One tile's online-softmax update (fp8_prefill._attend_tile's arithmetic): qk [BM, BN]
    float32 -> (P as the P.V operand, m, shift, l, the accumulator's rescale). MASK hides keys past
    a row's position or past N."""
    if MASK:
        key = gl.expand_dims(n0 + keys, 0)
        qk = gl.where((key <= gl.expand_dims(PAST + rows, 1)) & (key < N), qk, float("-inf"))
    factor = row_factor * k_scale  # [BM]: log2 units per unit of qk
    tile_max = gl.max(qk, axis=1) * factor
    m_new = gl.maximum(m_i, tile_max)
    shift_new = gl.minimum(gl.floor(m_new - tile_max), _P_SHIFT_MAX).to(gl.int32) + _P_BITS
    p = gl.exp2(qk * gl.expand_dims(factor, 1) - gl.expand_dims(m_new - shift_new.to(gl.float32), 1))
    rescale = gl.exp2(m_i - m_new) * _pow2(shift_new - shift)
    l_i = l_i * rescale + gl.sum(p, axis=1)
    return _weights_operand(p, p_layout), m_new, shift_new, l_i, rescale * (v_prev / v_scale)


@gluon.jit
def _tile(
    t, qk, q_smem, k_smem, v_smem, ready, empty, turn, n_turns, me, KS, VS, scales,
    rows, keys, PAST, N, row_factor, m_i, shift, l_i, v_prev, acc,
    MASK: gl.constexpr, LAST: gl.constexpr,
):  # fmt: skip
    """Tile t of a consumer: its weights from qk (tile t's scores, complete), then in its turn
    tile t's P.V and (unless LAST) tile t + 1's scores; returns tile t + 1's scores."""
    BLOCK_M: gl.constexpr = q_smem.type.shape[0]
    D: gl.constexpr = q_smem.type.shape[1]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    STAGES: gl.constexpr = k_smem.type.shape[0]
    s_layout: gl.constexpr = qk.type.layout
    o_layout: gl.constexpr = acc.type.layout
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    v_scale = gl.load(VS + scales + t)
    p_op, m_i, shift, l_i, rescale = _softmax(
        qk, t * BLOCK_N, rows, keys, PAST, N, row_factor, gl.load(KS + scales + t), v_scale, v_prev,
        m_i, shift, l_i, p_layout, MASK,
    )  # fmt: skip
    slot = t % STAGES
    mbarrier.wait(turn.index(me), (n_turns & 1) ^ (1 - me))
    pv = warpgroup_mma(
        p_op,
        v_smem.index(slot).permute((1, 0)),
        gl.zeros([BLOCK_M, D], gl.float32, o_layout),
        use_acc=False,
        is_async=True,
    )  # P.V from zero in every tile (fp8_prefill's docstring: the e4m3 MMA's ~14-bit accumulation)
    if LAST:
        mbarrier.arrive(turn.index(1 - me), count=1)
        pv = warpgroup_mma_wait(0, deps=[pv])
    else:
        slot_next = (t + 1) % STAGES
        mbarrier.wait(ready.index(slot_next), ((t + 1) // STAGES) & 1)
        k_tile = k_smem.index(slot_next).permute((1, 0))
        qk = warpgroup_mma(
            q_smem, k_tile, gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True
        )
        mbarrier.arrive(turn.index(1 - me), count=1)
        pv = warpgroup_mma_wait(1, deps=[pv])
    acc = acc * gl.expand_dims(gl.convert_layout(rescale, gl.SliceLayout(1, o_layout)), 1) + pv
    if not LAST:
        qk = warpgroup_mma_wait(0, deps=[qk])
    mbarrier.arrive(empty.index(slot), count=1)  # tile t's K and V are no longer read here
    return qk, m_i, shift, l_i, v_scale, acc, n_turns + 1


@gluon.jit
def _cta(smem, dims):
    """(b, h, the CTA's first row, its tile count, its KV head) from the program id."""
    q_smem, k_smem, v_smem, ready, empty, turn = smem
    T, PAST, N, N_PAD, NB, HQ, GROUP, HKV, Q_BLOCKS, BH = dims
    BLOCK_M: gl.constexpr = q_smem.type.shape[1]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    pid = gl.program_id(0)
    bh = pid % BH
    cta_i0 = (Q_BLOCKS - 1 - pid // BH) * 2 * BLOCK_M  # the longest query blocks first
    b = bh // HQ
    h = bh % HQ
    n_tiles = (gl.minimum(PAST + cta_i0 + 2 * BLOCK_M, N) + BLOCK_N - 1) // BLOCK_N
    return b, h, cta_i0, n_tiles, b * HKV + h // GROUP


@gluon.jit
def _consumer(args, me: gl.constexpr):
    """Consumer `me` (0 or 1): rows [cta_i0 + me BLOCK_M, + BLOCK_M) of the CTA's head."""
    io, smem, _, dims = args
    Q, Out, KS, VS, qk_scale, stride_qb, stride_qh, stride_qt, stride_ob, stride_oh, stride_ot = io
    q_smem_all, k_smem, v_smem, ready, empty, turn = smem
    T, PAST, N, N_PAD, NB, HQ, GROUP, HKV, Q_BLOCKS, BH = dims
    BLOCK_M: gl.constexpr = q_smem_all.type.shape[1]
    D: gl.constexpr = q_smem_all.type.shape[2]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    # wgmma layouts of one warpgroup: m64 in 16-row slices, n the tile's width, k 32 e4m3 values.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [4, 1], instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [4, 1], instr_shape=[16, D, 32])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_blocked: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    b, h, cta_i0, n_tiles, kv = _cta(smem, dims)
    i0 = cta_i0 + me * BLOCK_M
    scales = kv * NB

    # Q: loaded once, rounded to e4m3 with a power-of-two scale per row, into shared memory.
    rows_q = i0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_blocked))
    cols_q = gl.arange(0, D, layout=gl.SliceLayout(0, q_blocked))
    q_head = Q + b.to(gl.int64) * stride_qb + h.to(gl.int64) * stride_qh
    q_ptrs = q_head + gl.expand_dims(rows_q.to(gl.int64) * stride_qt, 1) + gl.expand_dims(cols_q, 0)
    q = gl.load(q_ptrs, mask=gl.expand_dims(rows_q < T, 1), other=0.0).to(gl.float32)
    q_exp = _scale_exponent(gl.max(gl.abs(q), axis=1))  # [BM]
    q_smem = q_smem_all.index(me)
    q_smem.store((q * gl.expand_dims(_pow2(-q_exp), 1)).to(gl.float8e4nv))
    fence_async_shared()
    row_factor = gl.convert_layout(qk_scale * _pow2(q_exp), row_s)  # softmax scale * log2 e / Q's scale

    rows = i0 + gl.arange(0, BLOCK_M, layout=row_s)
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    shift = gl.zeros([BLOCK_M], gl.int32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)

    # Tile 0's scores, in this consumer's first turn (consumer 0 goes first).
    mbarrier.wait(turn.index(me), 1 - me)
    mbarrier.wait(ready.index(0), 0)
    qk = warpgroup_mma(
        q_smem,
        k_smem.index(0).permute((1, 0)),
        gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout),
        use_acc=False,
        is_async=True,
    )
    mbarrier.arrive(turn.index(1 - me), count=1)
    qk = warpgroup_mma_wait(0, deps=[qk])
    n_turns = 1
    v_prev = gl.load(VS + scales)  # any positive value: the state is zero until the first tile

    # Tiles [0, n_full) are visible to every row of this consumer, the rest need the mask. Two
    # loops and a peeled last tile: no branch between a wgmma and its wait (ptxas would wait at
    # the join).
    n_full = gl.minimum((PAST + i0 + 1) // BLOCK_N, n_tiles - 1)
    for t in range(0, n_full):
        qk, m_i, shift, l_i, v_prev, acc, n_turns = _tile(
            t, qk, q_smem, k_smem, v_smem, ready, empty, turn, n_turns, me, KS, VS, scales,
            rows, keys, PAST, N, row_factor, m_i, shift, l_i, v_prev, acc, False, False,
        )  # fmt: skip
    for t in range(n_full, n_tiles - 1):
        qk, m_i, shift, l_i, v_prev, acc, n_turns = _tile(
            t, qk, q_smem, k_smem, v_smem, ready, empty, turn, n_turns, me, KS, VS, scales,
            rows, keys, PAST, N, row_factor, m_i, shift, l_i, v_prev, acc, True, False,
        )  # fmt: skip
    if (PAST + i0 + 1) // BLOCK_N >= n_tiles:
        qk, m_i, shift, l_i, v_prev, acc, n_turns = _tile(
            n_tiles - 1, qk, q_smem, k_smem, v_smem, ready, empty, turn, n_turns, me, KS, VS, scales,
            rows, keys, PAST, N, row_factor, m_i, shift, l_i, v_prev, acc, False, True,
        )  # fmt: skip
    else:
        qk, m_i, shift, l_i, v_prev, acc, n_turns = _tile(
            n_tiles - 1, qk, q_smem, k_smem, v_smem, ready, empty, turn, n_turns, me, KS, VS, scales,
            rows, keys, PAST, N, row_factor, m_i, shift, l_i, v_prev, acc, True, True,
        )  # fmt: skip

    out = acc * gl.expand_dims(gl.convert_layout(v_prev / l_i, row_o), 1)
    rows_o = i0 + gl.arange(0, BLOCK_M, layout=row_o)
    cols_o = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    o_head = Out + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
    o_ptrs = o_head + gl.expand_dims(rows_o.to(gl.int64) * stride_ot, 1) + gl.expand_dims(cols_o, 0)
    gl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=gl.expand_dims(rows_o < T, 1))


@gluon.jit
def _consumer_0(args):
    _consumer(args, 0)


@gluon.jit
def _consumer_1(args):
    _consumer(args, 1)


@gluon.jit
def _loader(args):
    """Streams the CTA's K and V tiles into the ring, a slot at a time as the consumers free it."""
    _, smem, descs, dims = args
    q_smem, k_smem, v_smem, ready, empty, turn = smem
    k_desc, v_desc = descs
    N_PAD = dims[3]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    D: gl.constexpr = k_smem.type.shape[2]
    STAGES: gl.constexpr = k_smem.type.shape[0]
    _, _, _, n_tiles, kv = _cta(smem, dims)
    for t in range(n_tiles):
        slot = t % STAGES
        mbarrier.wait(empty.index(slot), ((t // STAGES) & 1) ^ 1)  # (a fresh barrier's phase 1 is complete)
        mbarrier.expect(ready.index(slot), 2 * BLOCK_N * D)
        _tma_load(k_desc, [kv * N_PAD + t * BLOCK_N, 0], ready.index(slot), k_smem.index(slot))
        _tma_load(v_desc, [kv * D, t * BLOCK_N], ready.index(slot), v_smem.index(slot))


# The prompt's sizes and the call's head counts are not specialised on (a value of 1, multiples of
# 16): each new combination would compile the kernel anew (~3 s), which a long prompt's attention
# meets at its first call (it takes fewer KV heads a call than a short one). They are read once a
# CTA, outside the loops; the strides, always multiples of the head size, stay specialised.
@gluon.jit(do_not_specialize=["T", "PAST", "N", "NB", "HQ", "GROUP", "HKV", "Q_BLOCKS", "BH"])
def _fp8_attention_kernel(
    Q, k_desc, v_desc, KS, VS, Out,
    T, PAST, N, N_PAD, NB, HQ, GROUP, HKV, Q_BLOCKS, BH,
    stride_qb, stride_qh, stride_qt,
    stride_ob, stride_oh, stride_ot,
    qk_scale,
    BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """CTA: 2 x BLOCK_M queries of one (sequence, head), over the K/V of its KV head (K8 rows
    [kv N_PAD, + N_PAD), V8T rows [kv D, + D) with permuted keys) -> their attention output."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    D: gl.constexpr = k_desc.block_type.shape[1]
    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK_M, D], k_desc.layout)
    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, D, BLOCK_N], v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # both consumers release each tile
    for s in gl.static_range(2):
        mbarrier.init(turn.index(s), count=1)
    # (the worker partitions take no tensors: pointers, scalars, shared memory and descriptors)
    io = (Q, Out, KS, VS, qk_scale, stride_qb, stride_qh, stride_qt, stride_ob, stride_oh, stride_ot)
    smem = (q_smem, k_smem, v_smem, ready, empty, turn)
    args = (io, smem, (k_desc, v_desc), (T, PAST, N, N_PAD, NB, HQ, GROUP, HKV, Q_BLOCKS, BH))
    gl.warp_specialize(
        [(_consumer_0, (args,)), (_consumer_1, (args,)), (_loader, (args,))],
        [4, 1],
        [_CONSUMER_REGISTERS, _LOADER_REGISTERS],
    )


def kv_descriptors(kv: QuantizedKV) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of kv's K [B Hkv N_pad, D] and V^T [B Hkv D, N_pad], one tile each."""
    D, bn = kv.k.shape[-1], kv.block
    k2, v2 = kv.k.view(-1, D), kv.v.view(-1, kv.v.shape[-1])
    k_layout = gl.NVMMASharedLayout.get_default_for([bn, D], gl.float8e4nv)
    v_layout = gl.NVMMASharedLayout.get_default_for([D, bn], gl.float8e4nv)
    return (
        TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [bn, D], k_layout),
        TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [D, bn], v_layout),
    )


def launch(
    q: torch.Tensor, kv: QuantizedKV, scale: float, out: torch.Tensor, block_m: int, stages: int
) -> None:
    """q [B, Hq, T, D] against kv (quantize_kv(..., permute_v=True)) -> out [B, Hq, T, D]; a CTA
    takes block_m rows of one head, block_m / 2 per consumer (fp8_prefill.fp8_causal_attention
    checks the shapes)."""
    B, Hq, T, D = q.shape
    Hkv = kv.k.shape[0] // B
    k_desc, v_desc = kv_descriptors(kv)
    q_blocks = -(-T // block_m)
    _fp8_attention_kernel[(q_blocks * B * Hq,)](
        q, k_desc, v_desc, kv.k_scale, kv.v_scale, out,
        T, kv.length - T, kv.length, kv.k.shape[1], kv.k_scale.shape[1], Hq, Hq // Hkv, Hkv, q_blocks, B * Hq,
        q.stride(0), q.stride(1), q.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        scale * LOG2E,
        BLOCK_M=block_m // 2, STAGES=stages, num_warps=4, maxnreg=MAX_REGISTERS,
    )  # fmt: skip

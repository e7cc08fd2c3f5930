"""FP8 (e4m3) causal flash attention for prefill: Q.K^T and P.V on e4m3 tensor cores.

A long prompt's prefill is mostly attention (90% of a 512k prompt's FLOPs on Llama-3-8B), which
is compute-bound, and Hopper's e4m3 tensor cores run at twice the bf16 rate. This kernel rounds
Q, K and V to e4m3 with scales taken from the data as it goes (no calibration), multiplies on the
e4m3 tensor cores, and keeps the softmax and the accumulation in float32, as FlashAttention-3's
FP8 forward pass does:

- Q: one scale per (query, head), made when a CTA loads its queries (once per CTA).
- K, V: one scale per (block of BLOCK_N keys, KV head), made by a pre-pass (`quantize_kv`) that
  writes e4m3 K as [.., N_pad, D] and V transposed, [.., D, N_pad]: Hopper's e4m3 MMA takes its
  B operand only K-major, which for P.V means the keys contiguous. A key block is the kernel's
  tile, so its scale is one scalar a tile, folded into per-row factors (no per-element work).
- Every scale is a power of two, 2^e with e the smallest exponent that brings the largest |x|
  to at most 448 (e4m3's largest finite value; `scale_exponent`): applying it is exact, and e4m3
  keeps its three mantissa bits in every binade, so against amax / 448 it loses at most one
  binade of subnormal range, and the PyTorch twin reproduces the kernel's e4m3 operands bit for bit.
- P: a tile's softmax weights against the row's running maximum m, p = 2^(s - m) <= 1, are
  rounded to e4m3 times 2^(8 + e) per row of the tile, e = floor(m - the row's largest score in
  the tile), at most P_SHIFT_MAX: the row's largest weight in the tile lands in (128, 256], so a
  tile far below the running maximum keeps e4m3's relative precision instead of falling into its
  subnormals (128k weights of 2^-10 each outweigh the maximum 128 times, and would round to zero
  unscaled). The power of two costs nothing: it is part of the exponent's offset, and of the
  per-row factor that rescales the accumulator anyway.
- P.V starts from zero in every tile and its result joins the float32 accumulator on the CUDA
  cores: Hopper's e4m3 MMA keeps only about 14 bits while it accumulates
  (lean_attention._e4m3_mma_tile), so thousands of tiles chained into one accumulator would lose
  the small tiles' contributions.

On Hopper the same arithmetic runs in fp8_prefill_hopper's warp-specialized Gluon kernel (a TMA
loader and two consumer warpgroups that take turns on the tensor cores; bit for bit this kernel's
output, and faster: bench/NOTES-prefill.md). This module's kernel serves Ada, head_dim 32, and the CPU
tests (the Triton interpreter; Gluon has none).

Units of the running state (per query row; m in log2 units of the scaled scores): l holds
sum 2^(s - m) times 2^shift, acc holds sum 2^(s - m) v times 2^shift / v_unit, where shift is
the row's P exponent in the last tile and v_unit the last tile's V scale, so out = acc v_unit / l.

Causal, aligned bottom-right: the T queries are the last T of N = P + T positions (P: a cached
prefix), so query i sees keys 0..P+i. GQA: query head h reads KV head h // (Hq / Hkv), never a
copy. A CTA takes BLOCK_M queries of one head: the tiles of keys every one of its rows sees
without a mask, then the tiles on the diagonal with it; the longest rows go first (the grid runs
the query blocks from the last), and CTAs of neighbouring heads read the same K/V tiles at about
the same time (L2). Offsets of a whole head are int64 (a 1M-token, 32-head tensor has 2^32
elements); offsets inside one head's K/V stay int32 up to N_pad * D < 2^31 (16M keys).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .e4m3 import round_to_e4m3

# Scale exponents are clamped to [-32, 32]: a block whose largest |x| is below 448 * 2^-32 keeps
# 2^-32 (its values get e4m3's subnormals, far below anything that moves a sum), and the ratio of
# two V scales, which rescales the accumulator, stays within 2^64 (no float32 overflow: acc is
# at most 2^20 keys x 2^(P_BITS + P_SHIFT_MAX) x 448 x 2^64 < 2^127).
SCALE_EXP_MIN, SCALE_EXP_MAX = -32, 32
P_BITS = 8  # p * 2^8: a tile row's largest weight lands in (128, 256], below 448
P_SHIFT_MAX = 16  # weights below 2^-(16 + 1) of the running maximum's get no extra scale
LOG2E = 1.4426950408889634
_EXP_MIN, _EXP_MAX = tl.constexpr(SCALE_EXP_MIN), tl.constexpr(SCALE_EXP_MAX)
_P_BITS, _P_SHIFT_MAX = tl.constexpr(P_BITS), tl.constexpr(float(P_SHIFT_MAX))
SUPPORTED_HEAD_DIMS = (32, 64, 128)  # e4m3 MMA: a multiple of 32 (its K step); 256 would spill


@dataclass(frozen=True)
class Fp8PrefillConfig:
    block_m: int  # queries per CTA (one head)
    block_n: int  # keys per tile, and per K/V scale
    num_warps: int  # (warp-specialized: per consumer warpgroup)
    num_stages: int  # K and V tiles in flight (software pipelining, or the loader's ring)
    # Hopper only: fp8_prefill_hopper's Gluon kernel (a TMA loader warp and two consumer
    # warpgroups of block_m / 2 rows taking turns on the tensor cores) instead of this module's.
    warp_specialized: bool = False


# Hopper, head_dim 128 and 64: the warp-specialized kernel, 2 x 64 query rows a CTA against
# 128-key tiles, two K/V stages (82 KB of shared memory; its registers fill the SM: one CTA).
# The fastest of the sweep on one layer of Llama-3-8B (bench/results/prefill-attention-h100.md),
# ahead of HOPPER_TRITON_CONFIG (the same output) and of three stages.
HOPPER_CONFIG = Fp8PrefillConfig(block_m=128, block_n=128, num_warps=4, num_stages=2, warp_specialized=True)
# This module's kernel on Hopper: 64 x 128 tiles over one warpgroup, three stages (107 KB: two CTAs
# an SM); the fastest Triton config of that sweep.
HOPPER_TRITON_CONFIG = Fp8PrefillConfig(block_m=64, block_n=128, num_warps=4, num_stages=3)
# Hopper at head_dim 32 (not swept there): 128 x 128 tiles over two warpgroups (8 warps), each
# holding a [64, D] accumulator and a [64, 128] score tile; three stages of K and V tiles.
HOPPER_WIDE_CONFIG = Fp8PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)
# Ada (sm_89) has ~100 KiB of shared memory per SM: two stages.
ADA_CONFIG = Fp8PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=2)
# The interpreter (CPU tests): small tiles, so short sequences still span several tiles and blocks.
INTERPRETER_CONFIG = Fp8PrefillConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)
# What bench/prefill_attention.py times against each other on the GPU (the default first).
CANDIDATE_CONFIGS = (
    HOPPER_CONFIG,
    Fp8PrefillConfig(block_m=128, block_n=128, num_warps=4, num_stages=3, warp_specialized=True),
    HOPPER_TRITON_CONFIG,
    HOPPER_WIDE_CONFIG,
)
WARP_SPECIALIZED_HEAD_DIMS = (64, 128)


def default_config(head_dim: int, device: torch.device) -> Fp8PrefillConfig:
    """The config for a head size on a device: on Hopper HOPPER_CONFIG at head_dim 128 and 64 and
    HOPPER_WIDE_CONFIG at 32, ADA_CONFIG on compute capability 8.9, INTERPRETER_CONFIG on the CPU."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"FP8 prefill attention supports head_dim {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    if torch.cuda.get_device_capability(device)[0] < 9:
        return ADA_CONFIG
    return HOPPER_CONFIG if head_dim in WARP_SPECIALIZED_HEAD_DIMS else HOPPER_WIDE_CONFIG


# ---- the kernels ---------------------------------------------------------------------------


@triton.jit
def _pow2(e):
    """2^e as float32 for int32 e in [-126, 127], exactly (the exponent bits built directly)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _scale_exponent(amax):
    """amax float32 >= 0 -> int32 e, the smallest with amax * 2^-e <= 448, clamped to
    [SCALE_EXP_MIN, SCALE_EXP_MAX]. With amax = 1.m * 2^E: 448 = 1.75 * 2^8, so e = E - 8, or
    E - 7 where the mantissa 1.m exceeds 1.75 (its fraction bits above 0x600000)."""
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return tl.minimum(tl.maximum(e, _EXP_MIN), _EXP_MAX)


@triton.jit
def _e4m3_bits(x, HW: tl.constexpr):
    """x float32 with |x| <= 448 -> uint8 e4m3 bit patterns, rounded to nearest even: the
    hardware conversion (HW) or round_to_e4m3's integer ops (the interpreter; the same bits)."""
    if HW:
        return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        return round_to_e4m3(x)


@triton.jit
def _to_e4m3(x, HW: tl.constexpr):
    """x float32 with |x| <= 448 -> float8e4nv, rounded to nearest even."""
    if HW:
        return x.to(tl.float8e4nv)
    else:
        return round_to_e4m3(x).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _quantize_block(src, dst_rows, offs_n, offs_d, valid, stride_n, HW: tl.constexpr):
    """One [BLOCK_N, D] block of K or V (rows past the length read as 0) -> its e4m3 bits at
    dst_rows (a [BLOCK_N, D] pointer block) and its scale, 2^scale_exponent(the block's max |x|)."""
    x = tl.load(src + offs_n[:, None].to(tl.int64) * stride_n + offs_d[None, :], mask=valid, other=0.0)
    x = x.to(tl.float32)
    e = _scale_exponent(tl.max(tl.max(tl.abs(x), 1), 0))
    tl.store(dst_rows, _e4m3_bits(x * _pow2(-e), HW))
    return _pow2(e)


@triton.jit
def _quantize_kv_kernel(
    K, V, K8, V8T, KS, VS,
    N, N_PAD, NB, HKV,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    D: tl.constexpr, BLOCK_N: tl.constexpr, HW: tl.constexpr, PERMUTE_V: tl.constexpr,
):  # fmt: skip
    """CTA (key block j, sequence b x KV head h): keys [j BLOCK_N, (j + 1) BLOCK_N) of K and V
    -> K8 [b Hkv + h, rows, :] e4m3, V8T [b Hkv + h, :, rows] e4m3 (transposed: keys contiguous),
    KS / VS [b Hkv + h, j] their float32 power-of-two scales. Rows past N are written as zeros.
    PERMUTE_V: key 16c + 8h + 2q + e goes to V8T's column 16c + 4q + 2h + e (fp8_prefill_hopper)."""
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // HKV, bh % HKV
    offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    valid = (offs_n < N)[:, None]
    head = bh.to(tl.int64) * N_PAD * D  # the [N_PAD, D] (or [D, N_PAD]) region of this head
    k_src = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    k_dst = K8 + head + offs_n[:, None] * D + offs_d[None, :]
    tl.store(KS + bh * NB + blk, _quantize_block(k_src, k_dst, offs_n, offs_d, valid, stride_kn, HW))
    v_src = V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
    cols = offs_n
    if PERMUTE_V:
        cols = (offs_n & ~15) | (((offs_n >> 1) & 3) << 2) | (((offs_n >> 3) & 1) << 1) | (offs_n & 1)
    v_dst = V8T + head + offs_d[None, :] * N_PAD + cols[:, None]
    tl.store(VS + bh * NB + blk, _quantize_block(v_src, v_dst, offs_n, offs_d, valid, stride_vn, HW))


@triton.jit
def _attend_tile(
    q8, row_factor, k_tile, v_tile, k_scale, v_scale, keys, rows, past, N,
    m_i, shift, l_i, acc, v_unit,
    MASK: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """One tile of BLOCK_N keys for the CTA's BLOCK_M query rows: the online-softmax update.

    q8 [BM, D] e4m3; row_factor [BM] = softmax scale * log2(e) * the rows' Q scales; k_tile
    [BN, D] and v_tile [D, BN] e4m3 with their scalar scales; keys [BN] and rows [BM] the
    positions (query row i is position past + i); MASK hides keys past a row's position or past
    N (the diagonal tiles; the masked scores are -inf, everything else the same arithmetic as the
    unmasked tiles, so a row's result does not depend on which of the two loops took a tile)."""
    qk = tl.dot(q8, tl.trans(k_tile))  # [BM, BN] float32: e4m3 products
    if MASK:
        visible = (keys[None, :] <= past + rows[:, None]) & (keys < N)[None, :]
        qk = tl.where(visible, qk, float("-inf"))
    factor = row_factor * k_scale  # [BM]: log2 units per unit of qk (exact: powers of two)
    tile_max = tl.max(qk, 1) * factor
    m_new = tl.maximum(m_i, tile_max)  # finite: every row sees key 0 in its first tile
    # The tile's P exponent per row (an integer): floor(m - tile max) up to P_SHIFT_MAX, + P_BITS
    # (a row with no visible key here: inf -> P_SHIFT_MAX, and all its weights are 0).
    shift_new = tl.minimum(tl.floor(m_new - tile_max), _P_SHIFT_MAX).to(tl.int32) + _P_BITS
    p = tl.exp2(qk * factor[:, None] - (m_new - shift_new.to(tl.float32))[:, None])  # <= 256
    rescale = tl.exp2(m_i - m_new) * _pow2(shift_new - shift)  # [BM]: the old state's new units
    l_i = l_i * rescale + tl.sum(p, 1)
    pv = tl.dot(_to_e4m3(p, HW), tl.trans(v_tile))  # [BM, D] float32, from zero (see the docstring)
    acc = acc * (rescale * (v_unit / v_scale))[:, None] + pv
    return m_new, shift_new, l_i, acc, v_scale


@triton.jit
def _fp8_attention_kernel(
    Q, K8, V8T, KS, VS, Out,
    T, PAST, N, N_PAD, NB, HQ, GROUP, HKV, Q_BLOCKS, BH,
    stride_qb, stride_qh, stride_qt,
    stride_ob, stride_oh, stride_ot,
    qk_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """CTA: BLOCK_M queries of one (sequence, head) -> their attention output (see the module
    docstring). CTAs run query block Q_BLOCKS - 1 first, over all B x Hq heads, then the next."""
    pid = tl.program_id(0)
    bh = pid % BH
    q_block = Q_BLOCKS - 1 - pid // BH
    b, h = bh // HQ, bh % HQ
    kv = b * HKV + h // GROUP  # this head's KV head, as a row of the [B * Hkv] quantized K/V
    i0 = q_block * BLOCK_M
    rows = i0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    row_ok = rows < T

    # Q: loaded once, rounded to e4m3 with a power-of-two scale per row.
    q_head = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    q_rows = q_head + rows.to(tl.int64)[:, None] * stride_qt + offs_d[None, :]
    q = tl.load(q_rows, mask=row_ok[:, None], other=0.0).to(tl.float32)
    q_exp = _scale_exponent(tl.max(tl.abs(q), 1))  # [BM]
    q8 = _to_e4m3(q * _pow2(-q_exp)[:, None], HW)
    row_factor = qk_scale * _pow2(q_exp)  # [BM]

    head = kv.to(tl.int64) * N_PAD * D
    k_tiles = K8 + head + offs_n[:, None] * D + offs_d[None, :]  # [BN, D] at key 0
    v_tiles = V8T + head + offs_d[:, None] * N_PAD + offs_n[None, :]  # [D, BN] at key 0
    scales = kv * NB
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    shift = tl.zeros([BLOCK_M], tl.int32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    v_unit = tl.load(VS + scales)  # any positive value: the state is zero until the first tile

    # Keys [0, full_end) are visible to every row of the block (its first row, position
    # PAST + i0, sees keys up to PAST + i0); [full_end, hi) are the diagonal tiles.
    full_end = (PAST + i0 + 1) // BLOCK_N * BLOCK_N
    hi = tl.minimum(PAST + i0 + BLOCK_M, N)
    for n0 in range(0, full_end, BLOCK_N):
        k, v = tl.load(k_tiles + n0 * D), tl.load(v_tiles + n0)
        k_scale, v_scale = tl.load(KS + scales + n0 // BLOCK_N), tl.load(VS + scales + n0 // BLOCK_N)
        m_i, shift, l_i, acc, v_unit = _attend_tile(
            q8, row_factor, k, v, k_scale, v_scale, n0 + offs_n, rows, PAST, N,
            m_i, shift, l_i, acc, v_unit, False, HW,
        )  # fmt: skip
    for n0 in range(full_end, hi, BLOCK_N):
        k, v = tl.load(k_tiles + n0 * D), tl.load(v_tiles + n0)
        k_scale, v_scale = tl.load(KS + scales + n0 // BLOCK_N), tl.load(VS + scales + n0 // BLOCK_N)
        m_i, shift, l_i, acc, v_unit = _attend_tile(
            q8, row_factor, k, v, k_scale, v_scale, n0 + offs_n, rows, PAST, N,
            m_i, shift, l_i, acc, v_unit, True, HW,
        )  # fmt: skip

    out = acc * (v_unit / l_i)[:, None]
    o_head = Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    o_rows = o_head + rows.to(tl.int64)[:, None] * stride_ot + offs_d[None, :]
    tl.store(o_rows, out.to(Out.dtype.element_ty), mask=row_ok[:, None])


# ---- host entry points ---------------------------------------------------------------------


@dataclass
class QuantizedKV:
    """K and V of B x Hkv heads in e4m3 (float8_e4m3fn) with per-block power-of-two scales:
    k [B * Hkv, N_pad, D], v transposed [B * Hkv, D, N_pad] (keys contiguous), k_scale and
    v_scale [B * Hkv, N_pad / block] float32. Rows past the length are zeros."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    length: int
    block: int


def quantize_kv(k: torch.Tensor, v: torch.Tensor, block: int, permute_v: bool = False) -> QuantizedKV:
    """k, v [B, Hkv, N, D] (any float dtype, the last dim contiguous) -> QuantizedKV in blocks of
    `block` keys: one Triton pass (the interpreter on CPU tensors). permute_v: V^T's keys in the
    order of fp8_prefill_hopper's P operand (in each 16, key 8h + 2q + e at column 4q + 2h + e)."""
    B, Hkv, N, D = k.shape
    blocks = triton.cdiv(N, block)
    n_pad = blocks * block
    k8 = torch.empty(B * Hkv, n_pad, D, dtype=torch.float8_e4m3fn, device=k.device)
    v8t = torch.empty(B * Hkv, D, n_pad, dtype=torch.float8_e4m3fn, device=k.device)
    k_scale = torch.empty(B * Hkv, blocks, dtype=torch.float32, device=k.device)
    v_scale = torch.empty_like(k_scale)
    # The writer stores bit patterns (uint8 views): the interpreter has no float8 cast.
    _quantize_kv_kernel[(blocks, B * Hkv)](
        k, v, k8.view(torch.uint8), v8t.view(torch.uint8), k_scale, v_scale,
        N, n_pad, blocks, Hkv,
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        D=D, BLOCK_N=block, HW=k.is_cuda, PERMUTE_V=permute_v, num_warps=8,
    )  # fmt: skip
    return QuantizedKV(k8, v8t, k_scale, v_scale, N, block)


def fp8_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    config: Fp8PrefillConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, T, D], k/v [B, Hkv, P + T, D] -> causal attention [B, Hq, T, D] in q's dtype.

    The queries are the last T of the P + T positions (P: a cached prefix): query i sees keys
    0..P+i. Hq a multiple of Hkv (GQA: query head h reads KV head h // (Hq / Hkv)). Any strides
    with a contiguous last dim (views of the cache are read in place by the pre-pass). out: where
    the result goes, [B, Hq, T, D] in q's dtype with a contiguous last dim; it may be q itself
    (a CTA reads its queries before it writes their rows, and no other CTA reads them). On CPU
    tensors it runs under the Triton interpreter (tests)."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        shapes = f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        raise ValueError(f"expected q [B, Hq, T, D] and k, v [B, Hkv, N, D], got {shapes}")
    B, Hq, T, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    if k.shape[0] != B or k.shape[3] != D or Hq % Hkv != 0 or not 1 <= T <= N:
        raise ValueError(f"q {tuple(q.shape)} does not fit k/v {tuple(k.shape)} (Hq % Hkv == 0, T <= N)")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k and v need a contiguous last dim")
    if not scale > 0:
        raise ValueError(f"the softmax scale must be positive, got {scale}")
    config = config or default_config(D, q.device)
    ws = config.warp_specialized
    if ws and not (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9):
        raise ValueError("the warp-specialized FP8 prefill kernel runs on Hopper (compute capability 9.x)")
    if ws and D not in WARP_SPECIALIZED_HEAD_DIMS:
        dims = ", ".join(map(str, WARP_SPECIALIZED_HEAD_DIMS))
        raise ValueError(f"the warp-specialized FP8 prefill kernel takes head_dim {dims}, not {D}")
    kv = quantize_kv(k, v, config.block_n, permute_v=ws)
    if out is None:
        out = torch.empty(B, Hq, T, D, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with a contiguous last dim")
    if ws:
        from .fp8_prefill_hopper import launch  # (Gluon: imported on a Hopper GPU only)

        launch(q, kv, scale, out, config.block_m, config.num_stages)
        return out
    q_blocks = triton.cdiv(T, config.block_m)
    _fp8_attention_kernel[(q_blocks * B * Hq,)](
        q, kv.k, kv.v, kv.k_scale, kv.v_scale, out,
        T, N - T, N, kv.k.shape[1], kv.k_scale.shape[1], Hq, Hq // Hkv, Hkv, q_blocks, B * Hq,
        q.stride(0), q.stride(1), q.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        scale * LOG2E,
        D=D, BLOCK_M=config.block_m, BLOCK_N=config.block_n, HW=q.is_cuda,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


# ---- the PyTorch twin ----------------------------------------------------------------------


def scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """amax float32 >= 0 -> int32 e, the smallest with amax * 2^-e <= 448, in [-32, 32]
    (the kernels' _scale_exponent, bit for bit)."""
    bits = amax.float().contiguous().view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    return e.clamp(SCALE_EXP_MIN, SCALE_EXP_MAX)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as float32 for int32 e (exact: torch.ldexp of 1)."""
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (e4m3 [..., D], float32 power-of-two scale [...]) per row: the kernel's Q."""
    xf = x.float()
    scale = pow2(scale_exponent(xf.abs().amax(-1)))
    return (xf / scale[..., None]).to(torch.float8_e4m3fn), scale


def quantize_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, H, N, D] -> (e4m3 [B, H, N_pad, D], zeros past N; float32 scales [B, H, N_pad / block])
    per block of `block` rows: quantize_kv's values (K; V is the same, not transposed)."""
    B, H, N, D = x.shape
    blocks = -(-N // block)
    xf = torch.zeros(B, H, blocks * block, D, dtype=torch.float32, device=x.device)
    xf[:, :, :N] = x.float()
    xf = xf.view(B, H, blocks, block, D)
    scale = pow2(scale_exponent(xf.abs().amax((-1, -2))))  # [B, H, blocks]
    x8 = (xf / scale[..., None, None]).to(torch.float8_e4m3fn)
    return x8.view(B, H, blocks * block, D), scale


def dequantized_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The e4m3 values the kernel multiplies, times their scales, in float64: q, k, v as the
    kernel sees them (the reference for its own error, apart from the inputs' rounding)."""
    N = k.shape[2]
    q8, qs = quantize_rows(q)
    k8, ks = quantize_blocks(k, block_n)
    v8, vs = quantize_blocks(v, block_n)

    def per_key(s: torch.Tensor) -> torch.Tensor:  # [B, H, blocks] -> [B, H, N, 1]
        return s.double().repeat_interleave(block_n, -1)[..., :N, None]

    q64 = q8.double() * qs.double()[..., None]
    return q64, k8[:, :, :N].double() * per_key(ks), v8[:, :, :N].double() * per_key(vs)


def fp8_attention_twin(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    config: Fp8PrefillConfig,
    round_p: bool = True,
) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch (float32 state, exact e4m3 operands): the same Q, K, V
    rounding and scales, the same tiles (keys in blocks of block_n from 0, each query row through
    the tiles up to its block's diagonal), the same per-row P exponent and rounding to e4m3 per
    tile. The dots are exact sums rounded once to float32 (the tensor cores accumulate with less
    precision), and the exponentials are torch's, not the GPU's approximate exp2: so P may round
    differently where a weight sits on an e4m3 rounding boundary (rare; a few ulps of p).
    round_p=False keeps P in float32: then the twin is exact attention over the e4m3 operands (up
    to float32), which checks its tiling, masks and online softmax against float64."""
    B, Hq, T, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G, past, bn = Hq // Hkv, N - T, config.block_n
    q8, q_scale = quantize_rows(q)
    k8, k_scale = quantize_blocks(k, bn)
    v8, v_scale = quantize_blocks(v, bn)
    k8, v8 = k8.double().repeat_interleave(G, 1), v8.double().repeat_interleave(G, 1)  # [B, Hq, N_pad, D]
    k_scale, v_scale = k_scale.repeat_interleave(G, 1), v_scale.repeat_interleave(G, 1)  # [B, Hq, nb]
    qd = q8.double()
    row_factor = torch.tensor(scale * LOG2E, dtype=torch.float32, device=q.device) * q_scale  # [B, Hq, T]
    rows = torch.arange(T, device=q.device)
    # A row's tiles end with its block's diagonal: keys [0, min(P + i0 + BLOCK_M, N)).
    row_end = torch.clamp(past + (rows // config.block_m + 1) * config.block_m, max=N)  # [T]
    m = torch.full((B, Hq, T), float("-inf"), device=q.device)
    shift = torch.zeros(B, Hq, T, dtype=torch.int32, device=q.device)
    l_sum = torch.zeros(B, Hq, T, device=q.device)
    acc = torch.zeros(B, Hq, T, D, device=q.device)
    v_unit = v_scale[:, :, :1].expand(B, Hq, T).clone()
    for j in range(k_scale.shape[-1]):
        n0 = j * bn
        active = (n0 < row_end)[None, None, :]  # [1, 1, T]
        keys = torch.arange(n0, n0 + bn, device=q.device)
        qk = (qd @ k8[:, :, n0 : n0 + bn].transpose(-1, -2)).float()  # [B, Hq, T, bn]
        visible = (keys[None, :] <= past + rows[:, None]) & (keys < N)[None, :]
        qk = qk.masked_fill(~visible, float("-inf"))
        factor = row_factor * k_scale[:, :, j, None]  # [B, Hq, T]
        tile_max = qk.amax(-1) * factor
        m_new = torch.maximum(m, tile_max)
        shift_new = torch.floor(m_new - tile_max).clamp(max=P_SHIFT_MAX).to(torch.int32) + P_BITS
        p = torch.exp2(qk * factor[..., None] - (m_new - shift_new.float())[..., None])
        rescale = torch.exp2(m - m_new) * pow2(shift_new - shift)
        l_new = l_sum * rescale + p.sum(-1)
        p_op = p.to(torch.float8_e4m3fn) if round_p else p
        pv = (p_op.double() @ v8[:, :, n0 : n0 + bn]).float()  # [B, Hq, T, D]
        unit = v_scale[:, :, j, None]
        acc_new = acc * (rescale * (v_unit / unit))[..., None] + pv
        m, shift = torch.where(active, m_new, m), torch.where(active, shift_new, shift)
        l_sum, acc = torch.where(active, l_new, l_sum), torch.where(active[..., None], acc_new, acc)
        v_unit = torch.where(active, unit.expand(B, Hq, T), v_unit)
    return (acc * (v_unit / l_sum)[..., None]).to(q.dtype)


def causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 causal attention of the last T of N positions (query i sees keys 0..N-T+i), the
    KV heads broadcast to their query heads: [B, Hq, T, D] float64. Memory O(T N) per head."""
    Hq, T, N = q.shape[1], q.shape[2], k.shape[2]
    G = Hq // k.shape[1]
    kd, vd = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    scores = (q.double() @ kd.transpose(-1, -2)) * scale  # [B, Hq, T, N]
    hidden = torch.ones(T, N, dtype=torch.bool, device=q.device).triu(N - T + 1)
    return torch.softmax(scores.masked_fill(hidden, float("-inf")), -1) @ vd


def flops(batch: int, heads: int, t: int, n: int, head_dim: int) -> float:
    """FLOPs of causal attention of t queries after n - t cached keys: 4 D per visible
    (query, key) pair (Q.K^T and P.V), sum over the rows of (n - t + i + 1) keys."""
    pairs = t * (n - t) + t * (t + 1) / 2
    return 4.0 * batch * heads * head_dim * pairs

"""Triton implementations of kernels/fused.py (see there for the contracts)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .e4m3 import round_to_e4m3
from .quant import (
    FP8_DTYPE,
    SCALE_FLOOR,
    V_BLOCK,
    check_kv_scale,
    kv_scale_words,
    v_blocks,
)


@triton.jit
def _rms_norm_kernel(X, W, Out, N, eps, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # One program per row: out = w * (x / rms(x)), normalised in float32 and rounded before w.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    if USE_PDL:
        # Let the next kernel (a GEMV) launch before waiting here: it issues its first weight tiles
        # while this norm waits for x (bench/NOTES-attention.md). RoPE / cache write and SiLU * up
        # do the same; the GEMVs and the attention kernel trigger after their wait (triggering
        # first gains them nothing).
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
    xf = tl.load(X + row * N + offs, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    y = (xf * inv_rms).to(Out.dtype.element_ty).to(tl.float32) * w
    tl.store(Out + row * N + offs, y.to(Out.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, use_pdl: bool = False) -> torch.Tensor:
    N = x.shape[-1]
    rows = x.reshape(-1, N)  # [R, N] contiguous (a copy only for strided views)
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    block = triton.next_power_of_2(N)
    _rms_norm_kernel[(rows.shape[0],)](
        rows,
        weight,
        out,
        N,
        eps,
        BLOCK=block,
        USE_PDL=use_pdl,
        num_warps=min(16, max(1, block // 512)),
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return out.view(x.shape)


@triton.jit
def _head(Row, head, offs, partner, W, eps, D: tl.constexpr, HAS_NORM: tl.constexpr):
    """Load head `head` of a fused qkv row as float32, and the rotate-half partner of each lane,
    RMS-normalised per head when HAS_NORM (rounded like the PyTorch twin)."""
    x = tl.load(Row + head * D + offs)
    xp = tl.load(Row + head * D + partner)
    if HAS_NORM:
        xf = x.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
        x = ((xf * inv_rms).to(x.dtype).to(tl.float32) * tl.load(W + offs).to(tl.float32)).to(x.dtype)
        xp = (
            (xp.to(tl.float32) * inv_rms).to(x.dtype).to(tl.float32) * tl.load(W + partner).to(tl.float32)
        ).to(x.dtype)
    return x.to(tl.float32), xp.to(tl.float32)


@triton.jit
def _quantize_e4m3(x, SCALE_FLOOR: tl.constexpr, static_scale, STATIC: tl.constexpr):
    """x [D] float32 -> (uint8 e4m3 bit patterns [D], the scale's bfloat16 bits in the top half of
    an int32), as kernels/quant.py's quantize_fp8: scale = bf16_ceil(max(amax / 448, floor)) (or
    bf16_ceil(static_scale) when STATIC), e4m3(x / scale) rounded to nearest even.

    Rounded by e4m3.round_to_e4m3 (float32 and integer ops): the interpreter and any GPU compute
    the same bits."""
    if STATIC:
        scale = static_scale
    else:
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 0), 448.0), SCALE_FLOOR)
    # bf16_ceil: float32 bits rounded up to their top 16 (the cache stores the scale in bfloat16)
    scale = ((scale.to(tl.int32, bitcast=True) + 0xFFFF) & -65536).to(tl.float32, bitcast=True)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
    return round_to_e4m3(y), scale.to(tl.int32, bitcast=True)


@triton.jit
def _rope_cache_kernel(
    QKV,
    Cos,
    Sin,
    Pos,
    Q,
    KC,
    VC,
    KVS,
    QW,
    KW,
    eps,
    k_static,
    v_static,
    HQ,
    HKV,
    cache_stride_b,
    cache_stride_h,
    scale_stride_b,
    scale_stride_h,
    v_stride_b,
    v_stride_h,
    v_stride_blk,
    D: tl.constexpr,
    HAS_NORM: tl.constexpr,
    FP8: tl.constexpr,
    STATIC: tl.constexpr,
    SCALE_FLOOR: tl.constexpr,
    V_BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Program (b, h): h < HQ rotates query head h into Q [B, HQ, D]; otherwise KV head h - HQ is
    # rotated (k) and copied (v) into the caches [B, HKV, S, D] at position Pos[b]. FP8: the caches
    # are uint8 views of e4m3, V blocked [B, HKV, S / V_BLOCK, D, V_BLOCK] (v_stride_*), and the
    # K and V rows' bf16 scales go to KVS [B, HKV, S] int32 (K's in the low half, V's in the high).
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, D)
    half = D // 2
    partner = (offs + half) % D
    sign = tl.where(offs < half, -1.0, 1.0)  # rotate_half: (-x2, x1)
    cos = tl.load(Cos + b * D + offs)  # cos, sin, positions: written before the step's first kernel
    sin = tl.load(Sin + b * D + offs)
    pos = tl.load(Pos + b).to(tl.int64)
    if USE_PDL:  # the next kernel may launch at once (as in _rms_norm_kernel)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # qkv is the previous kernel's output
    row = QKV + b * (HQ + 2 * HKV) * D
    if h < HQ:
        x, xp = _head(row, h, offs, partner, QW, eps, D, HAS_NORM)
        tl.store(Q + (b * HQ + h) * D + offs, (x * cos + sign * xp * sin).to(Q.dtype.element_ty))
    else:
        j = h - HQ
        dst = b * cache_stride_b + j * cache_stride_h + pos * D + offs
        k, kp = _head(row, HQ + j, offs, partner, KW, eps, D, HAS_NORM)
        k = k * cos + sign * kp * sin
        v = tl.load(row + (HQ + HKV + j) * D + offs)
        if FP8:
            # quantize the rows the model-dtype cache would hold (k rounded to qkv's dtype first)
            k8, k_bits = _quantize_e4m3(k.to(v.dtype).to(tl.float32), SCALE_FLOOR, k_static, STATIC)
            v8, v_bits = _quantize_e4m3(v.to(tl.float32), SCALE_FLOOR, v_static, STATIC)
            tl.store(KC + dst, k8)
            # block pos // V_BLOCK, slot pos % V_BLOCK of each head_dim element (stride V_BLOCK)
            v_blk = (pos // V_BLOCK) * v_stride_blk + offs * V_BLOCK + pos % V_BLOCK
            tl.store(VC + b * v_stride_b + j * v_stride_h + v_blk, v8)
            s_dst = b * scale_stride_b + j * scale_stride_h + pos
            tl.store(KVS + s_dst, ((k_bits >> 16) & 0xFFFF) | v_bits)  # kv_scale[b, j, pos] = (K, V)
        else:
            tl.store(KC + dst, k.to(KC.dtype.element_ty))
            tl.store(VC + dst, v)


def rope_and_cache(
    qkv,
    cos,
    sin,
    positions,
    k_cache,
    v_cache,
    num_heads,
    q_norm,
    k_norm,
    eps,
    use_pdl,
    kv_scale=None,
    static_scales=None,
):
    """Caches [C, Hkv, S, D] with C = B (a row per sequence) or 1 (every sequence writes into the
    one row, at its own `positions`). FP8: k_cache / v_cache float8_e4m3fn, v_cache blocked
    [C, Hkv, ceil(S / V_BLOCK), D, V_BLOCK], and kv_scale [C, Hkv, S, 2] bfloat16 (kernels/quant.py's
    scheme, computed here per written row, or the checkpoint's `static_scales` (k, v) floats)."""
    B = qkv.shape[0]
    C, Hkv, S, D = k_cache.shape
    if C not in (B, 1):
        raise ValueError(f"the cache has {C} rows for a batch of {B}: expected {B} or 1")
    assert k_cache.stride(3) == 1 and k_cache.stride(2) == D
    fp8 = k_cache.dtype == FP8_DTYPE
    if fp8:
        want = (C, Hkv, v_blocks(S), D, V_BLOCK)
        if v_cache.shape != want or v_cache.stride()[3:] != (V_BLOCK, 1):
            raise ValueError(
                f"an FP8 V cache must be blocked [C, Hkv, ceil(S / {V_BLOCK}), D, {V_BLOCK}] = {list(want)} "
                f"(each block contiguous), got {list(v_cache.shape)}"
            )
        check_kv_scale(kv_scale, (C, Hkv, S))
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        scale_words = kv_scale_words(kv_scale)  # [C, Hkv, S] int32
    else:
        assert k_cache.stride() == v_cache.stride()
        scale_words = k_cache  # an unused pointer
    q = torch.empty(B, num_heads, D, dtype=qkv.dtype, device=qkv.device)
    has_norm = q_norm is not None
    _rope_cache_kernel[(B, num_heads + Hkv)](
        qkv,
        cos.contiguous(),
        sin.contiguous(),
        positions,
        q,
        k_cache,
        v_cache,
        scale_words,
        q_norm if has_norm else qkv,
        k_norm if has_norm else qkv,
        eps,
        *(static_scales or (1.0, 1.0)),  # read only when STATIC
        num_heads,
        Hkv,
        k_cache.stride(0) if C == B else 0,  # one shared row: every sequence writes row 0
        k_cache.stride(1),
        (scale_words.stride(0) if C == B else 0) if fp8 else 0,
        scale_words.stride(1) if fp8 else 0,
        v_cache.stride(0) if C == B else 0,
        v_cache.stride(1),
        v_cache.stride(2),  # FP8: the stride of V's blocks
        D=D,
        HAS_NORM=has_norm,
        FP8=fp8,
        STATIC=static_scales is not None,
        SCALE_FLOOR=SCALE_FLOOR,
        V_BLOCK=V_BLOCK,
        USE_PDL=use_pdl,
        num_warps=1,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return q


@triton.jit
def _rope_rows_kernel(
    QKV, Cos, Sin, Q, K, V, QW, KW, eps, T, HQ, HKV,
    stride_xb, stride_xt, stride_cb, stride_ct,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    D: tl.constexpr, BLOCK_T: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    # Program (rows, b, h): BLOCK_T rows of head h of a prefill chunk's fused projection
    # QKV [B, T, (HQ + 2 HKV) D]. h < HQ: query head h, rotated into Q [B, HQ, T, D]; then KV head
    # h - HQ, rotated into K [B, HKV, T, D]; then KV head h - HQ - HKV, copied into V (any strides:
    # views of prefill's query buffer and of the cache). Launched without FMA contraction, so the
    # rotation rounds as ops.rotate's PyTorch math does, bit for bit.
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    offs = tl.arange(0, D)
    ok = (t < T)[:, None]  # [BLOCK_T, 1]
    t = t.to(tl.int64)[:, None]
    head = QKV + b * stride_xb + t * stride_xt + h * D  # [BLOCK_T, 1]
    if h < HQ + HKV:
        partner = (offs + D // 2) % D
        x = tl.load(head + offs[None, :], mask=ok, other=0.0)  # [BLOCK_T, D]
        xp = tl.load(head + partner[None, :], mask=ok, other=0.0)  # each lane's rotate-half partner
        if HAS_NORM:  # per-head RMSNorm first (Qwen3), rounded as _rms_norm_kernel rounds
            w_ptr = QW if h < HQ else KW
            xf = x.to(tl.float32)
            inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)[:, None]
            w, wp = tl.load(w_ptr + offs).to(tl.float32), tl.load(w_ptr + partner).to(tl.float32)
            x = ((xf * inv_rms).to(x.dtype).to(tl.float32) * w[None, :]).to(x.dtype)
            xp = ((xp.to(tl.float32) * inv_rms).to(x.dtype).to(tl.float32) * wp[None, :]).to(x.dtype)
        angle = b * stride_cb + t * stride_ct + offs[None, :]
        cos = tl.load(Cos + angle, mask=ok, other=0.0)
        sin = tl.load(Sin + angle, mask=ok, other=0.0)
        sign = tl.where(offs < D // 2, -1.0, 1.0)[None, :]  # rotate_half: (-x2, x1)
        y = x.to(tl.float32) * cos + sign * xp.to(tl.float32) * sin
        if h < HQ:
            dst = Q + b * stride_qb + h * stride_qh + t * stride_qt + offs[None, :]
            tl.store(dst, y.to(Q.dtype.element_ty), mask=ok)
        else:
            dst = K + b * stride_kb + (h - HQ) * stride_kh + t * stride_kt + offs[None, :]
            tl.store(dst, y.to(K.dtype.element_ty), mask=ok)
    else:
        j = h - HQ - HKV
        v = tl.load(head + offs[None, :], mask=ok, other=0.0)
        tl.store(V + b * stride_vb + j * stride_vh + t * stride_vt + offs[None, :], v, mask=ok)


ROPE_ROWS = 32  # rows of one head a program of _rope_rows_kernel


def rope_into(qkv, cos, sin, q_out, k_out, v_out, q_norm, k_norm, eps) -> None:
    """ops.rope_into's Triton path: one launch for a chunk's q, k and v."""
    B, T = qkv.shape[:2]
    Hq, Hkv, D = q_out.shape[1], k_out.shape[1], q_out.shape[3]
    assert qkv.stride(2) == 1 and cos.stride(2) == 1 and sin.stride() == cos.stride()
    assert q_out.stride(3) == 1 and k_out.stride(3) == 1 and v_out.stride(3) == 1
    has_norm = q_norm is not None
    _rope_rows_kernel[(triton.cdiv(T, ROPE_ROWS), B, Hq + 2 * Hkv)](
        qkv, cos, sin, q_out, k_out, v_out,
        q_norm if has_norm else qkv, k_norm if has_norm else qkv, eps, T, Hq, Hkv,
        qkv.stride(0), qkv.stride(1), cos.stride(0), cos.stride(1),
        *q_out.stride()[:3], *k_out.stride()[:3], *v_out.stride()[:3],
        D=D, BLOCK_T=ROPE_ROWS, HAS_NORM=has_norm, num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip


@triton.jit
def _silu_mul_kernel(GU, Out, INTER, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # gate_up row [2 * INTER] -> silu(gate) * up, rounding silu to the model dtype first.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    if USE_PDL:  # the next kernel may launch at once (as in _rms_norm_kernel)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # gate_up is the previous kernel's output
    g = tl.load(GU + row * 2 * INTER + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * 2 * INTER + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * INTER + offs, (act * u).to(Out.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, use_pdl: bool = False) -> torch.Tensor:
    *lead, two_inter = gate_up.shape  # [..., 2I]: one decode row or a prefill chunk
    inter = two_inter // 2
    gate_up = gate_up.reshape(-1, two_inter)
    B = gate_up.shape[0]
    out = torch.empty(*lead, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(B, triton.cdiv(inter, block))](
        gate_up,
        out,
        inter,
        BLOCK=block,
        USE_PDL=use_pdl,
        num_warps=4,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return out

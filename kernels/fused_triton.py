"""Triton implementations of kernels/fused.py (see there for the contracts)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(X, W, Out, N, eps, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # One program per row: out = w * (x / rms(x)), normalised in float32 and rounded before w.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
        tl.extra.cuda.gdc_launch_dependents()
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
def _rope_cache_kernel(
    QKV,
    Cos,
    Sin,
    Pos,
    Q,
    KC,
    VC,
    QW,
    KW,
    eps,
    HQ,
    HKV,
    cache_stride_b,
    cache_stride_h,
    D: tl.constexpr,
    HAS_NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Program (b, h): h < HQ rotates query head h into Q [B, HQ, D]; otherwise KV head h - HQ is
    # rotated (k) and copied (v) into the caches [B, HKV, S, D] at position Pos[b].
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, D)
    half = D // 2
    partner = (offs + half) % D
    sign = tl.where(offs < half, -1.0, 1.0)  # rotate_half: (-x2, x1)
    cos = tl.load(Cos + b * D + offs)  # cos, sin, positions: written before the step's first kernel
    sin = tl.load(Sin + b * D + offs)
    pos = tl.load(Pos + b).to(tl.int64)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # qkv is the previous kernel's output
        tl.extra.cuda.gdc_launch_dependents()
    row = QKV + b * (HQ + 2 * HKV) * D
    if h < HQ:
        x, xp = _head(row, h, offs, partner, QW, eps, D, HAS_NORM)
        tl.store(Q + (b * HQ + h) * D + offs, (x * cos + sign * xp * sin).to(Q.dtype.element_ty))
    else:
        j = h - HQ
        dst = b * cache_stride_b + j * cache_stride_h + pos * D + offs
        k, kp = _head(row, HQ + j, offs, partner, KW, eps, D, HAS_NORM)
        tl.store(KC + dst, (k * cos + sign * kp * sin).to(KC.dtype.element_ty))
        tl.store(VC + dst, tl.load(row + (HQ + HKV + j) * D + offs))


def rope_and_cache(qkv, cos, sin, positions, k_cache, v_cache, num_heads, q_norm, k_norm, eps, use_pdl):
    B = qkv.shape[0]
    Hkv, D = k_cache.shape[1], k_cache.shape[3]
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and k_cache.stride(2) == D
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
        q_norm if has_norm else qkv,
        k_norm if has_norm else qkv,
        eps,
        num_heads,
        Hkv,
        k_cache.stride(0),
        k_cache.stride(1),
        D=D,
        HAS_NORM=has_norm,
        USE_PDL=use_pdl,
        num_warps=1,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return q


@triton.jit
def _silu_mul_kernel(GU, Out, INTER, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # gate_up row [2 * INTER] -> silu(gate) * up, rounding silu to the model dtype first.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # gate_up is the previous kernel's output
        tl.extra.cuda.gdc_launch_dependents()
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

"""FP8 (e4m3) KV cache: quantize and dequantize in PyTorch, the reference of the Triton kernels.

Scheme: one scale per (token, KV head), computed when the row is written, held in bfloat16:

    scale = bf16_ceil(max(amax(|x| over head_dim) / 448, SCALE_FLOOR)),   x_fp8 = e4m3(x / scale)

- Per token and head because a row is written once and never rewritten: its scale needs no
  calibration data, no running statistics and no re-quantization of older rows, and one outlier
  token or head spends e4m3's 3 mantissa bits only on itself.
- 448 is the largest finite e4m3 (float8_e4m3fn) value: the row's largest |x| maps onto it, so
  no element can overflow (an unscaled e4m3 cache saturates at 448; a silent scale of 1.0 would
  clip every larger K/V value).
- bfloat16, rounded up (bf16_ceil): float32's range in 2 bytes. Rounding the scale up by less
  than 2^-7 costs nothing measurable (the row's largest |x| / scale lands in [444.5, 448] and still
  rounds to 448; e4m3 keeps the same 3 mantissa bits in every binade), and it never divides a
  value past 448.
- SCALE_FLOOR keeps an all-zero row (and rows below ~1e-28) from dividing by zero: they
  quantize to zeros (or e4m3 subnormals) of a tiny scale.
- K's and V's scales of a (token, head) sit side by side, `kv_scale [..., 2]` (K, then V): one
  32-bit word that the decode kernel loads with one asynchronous copy (lean_attention: a
  2-byte load per element cannot be one, and stalls the tile loop). 4 bytes per (token, head),
  1.5% of a head_dim-128 pair of e4m3 rows (float32 scales would be 3%, bytes that every decode
  step reads; bench/NOTES-attention.md).

A checkpoint may ship a static per-layer scale instead (`k_scale` / `v_scale` scalars, e.g. a
compressed-tensors `kv_cache_scheme`): pass it as `static_scale`. Every row then uses that scale,
rounded up to bfloat16 (bf16_ceil: at most 2^-7 larger), and elements beyond 448 times it are
clamped to +-448 (saturated), as the checkpoint's calibration assumed.

Layout: the cache stores K as `[..., S, D]` and V blocked, `[..., ceil(S / V_BLOCK), D, V_BLOCK]`
(element [..., p // V_BLOCK, d, p % V_BLOCK] is V[..., p, d]), the lean decode kernel's
"blocked_t" layout (kernels/lean_attention.py, V_BLOCK): positions contiguous inside a block make
the P.V dot's operand need no transpose. write_v_rows / read_v_rows move runs of positions in and
out of it for every host-side reader and writer (prefill, cache files, the PyTorch twins).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_DTYPE = torch.bfloat16  # the scales' storage (bf16_ceil of each row's float32 scale)
SCALE_FLOOR = 1e-30  # smallest scale: an all-zero row divides by this, not by zero
V_BLOCK = 64  # positions per block of the blocked V layout (kernels/lean_attention.py imports it)


def bf16_ceil(x: torch.Tensor) -> torch.Tensor:
    """x float32 >= 0 (finite) -> the smallest bfloat16 >= x: float32's bits rounded up to their
    top 16 (the Triton writer rounds the same way, fused_triton._quantize_e4m3)."""
    bits = (x.float().contiguous().view(torch.int32) + 0xFFFF) & -65536  # no overflow below inf
    return (bits >> 16).to(torch.int16).view(SCALE_DTYPE)


def quantize_fp8(x: torch.Tensor, static_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (x_fp8 [..., D] float8_e4m3fn, scale [...] bfloat16).

    x ~= x_fp8.float() * scale.float()[..., None]. With `static_scale` every row uses that scale
    (rounded up to bfloat16) and values beyond 448 times it saturate at +-448."""
    xf = x.float()
    if static_scale is None:
        scale = bf16_ceil((xf.abs().amax(dim=-1) / FP8_MAX).clamp_min(SCALE_FLOOR))
    else:
        if not static_scale > 0:
            raise ValueError(f"a static FP8 scale must be positive, got {static_scale}")
        scale = bf16_ceil(torch.tensor(static_scale)).expand(xf.shape[:-1]).to(x.device)
    # The division is IEEE (as the Triton writer's div_rn); the cast rounds to nearest even; the
    # clamp only acts on a static scale (or one float32 ulp past 448, from the division's rounding).
    x_fp8 = (xf / scale.float()[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_fp8, scale


def dequantize_fp8(
    x_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(x_fp8 [..., D] float8_e4m3fn, scale [...]) -> x_fp8 * scale in `dtype`
    (the product is formed in float32, then rounded once)."""
    if x_fp8.dtype != FP8_DTYPE:
        raise ValueError(f"expected a float8_e4m3fn tensor, got {x_fp8.dtype}")
    if scale.shape != x_fp8.shape[:-1]:
        raise ValueError(f"scale must be {tuple(x_fp8.shape[:-1])}, got {tuple(scale.shape)}")
    return (x_fp8.float() * scale.float()[..., None]).to(dtype)


def check_kv_scale(kv_scale: torch.Tensor | None, positions: tuple[int, int, int]) -> None:
    """An FP8 cache needs its scales, [C, Hkv, S, 2] bfloat16 (`positions` = (C, Hkv, S)), each
    (K, V) pair adjacent and the positions contiguous: the kernels read a pair as one int32 word."""
    want = [*positions, 2]
    if kv_scale is None:
        raise ValueError(f"an FP8 (float8_e4m3fn) cache needs kv_scale ({want} bfloat16)")
    if list(kv_scale.shape) != want or kv_scale.dtype != SCALE_DTYPE or kv_scale.stride()[-2:] != (2, 1):
        raise ValueError(
            f"kv_scale must be {want} bfloat16 with contiguous (K, V) pairs along the positions, "
            f"got {list(kv_scale.shape)} {kv_scale.dtype} strides {kv_scale.stride()}"
        )


def kv_scale_words(kv_scale: torch.Tensor) -> torch.Tensor:
    """kv_scale [..., S, 2] bfloat16 as [..., S] int32: K's scale in the low 16 bits (little-endian),
    V's in the high 16 (lean_attention._load_scales)."""
    return kv_scale.view(torch.int32).squeeze(-1)


def v_blocks(positions: int) -> int:
    """Blocks of the blocked V layout that hold `positions` positions: ceil(positions / V_BLOCK)."""
    return -(-positions // V_BLOCK)


def write_v_rows(v_blocked: torch.Tensor, start: int, rows: torch.Tensor) -> None:
    """Write rows [..., T, D] at positions start..start+T-1 of a blocked V [..., nb, D, V_BLOCK]
    (1-byte dtype, moved as bytes: float8 has few CPU ops); other positions are left as they are.

    `v_blocked.transpose(-1, -2)` is a [..., nb, V_BLOCK, D] view whose (block, slot) index is the
    position; its blocks cannot merge into one position axis (a block's stride is D * V_BLOCK,
    not V_BLOCK), so a run is written as a head up to a block boundary, whole blocks, and a tail."""
    by_pos = v_blocked.view(torch.uint8).transpose(-1, -2)  # [..., nb, V_BLOCK, D]
    rows = rows.view(torch.uint8)
    T = rows.shape[-2]
    head = min(-start % V_BLOCK, T)  # positions before the first block boundary
    if head:
        slot = start % V_BLOCK
        by_pos[..., start // V_BLOCK, slot : slot + head, :] = rows[..., :head, :]
    whole = (T - head) // V_BLOCK
    first = (start + head) // V_BLOCK  # the first whole block
    if whole:
        body = rows[..., head : head + whole * V_BLOCK, :].unflatten(-2, (whole, V_BLOCK))
        by_pos[..., first : first + whole, :, :] = body  # [..., whole, V_BLOCK, D]
    tail = T - head - whole * V_BLOCK  # positions in a last, partial block
    if tail:
        by_pos[..., first + whole, :tail, :] = rows[..., T - tail :, :]


def read_v_rows(v_blocked: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Positions start..end-1 of a blocked V [..., nb, D, V_BLOCK] as [..., end - start, D]
    (a copy, in v_blocked's dtype)."""
    first, stop = start // V_BLOCK, v_blocks(end)
    by_pos = v_blocked.view(torch.uint8)[..., first:stop, :, :].transpose(-1, -2)  # [..., n, V_BLOCK, D]
    rows = by_pos.flatten(-3, -2)  # [..., n * V_BLOCK, D]: a copy (see write_v_rows)
    return rows[..., start - first * V_BLOCK : end - first * V_BLOCK, :].view(v_blocked.dtype)

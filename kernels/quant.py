"""FP8 (e4m3) KV cache: quantize and dequantize in PyTorch, the reference of the Triton kernels.

Scheme: one float32 scale per (token, KV head), computed when the row is written:

    scale = max(amax(|x| over head_dim) / 448, SCALE_FLOOR),   x_fp8 = e4m3(x / scale)

- Per token and head because a row is written once and never rewritten: its scale needs no
  calibration data, no running statistics and no re-quantization of older rows, and one outlier
  token or head spends e4m3's 3 mantissa bits only on itself.
- 448 is the largest finite e4m3 (float8_e4m3fn) value: the row's largest |x| maps onto it, so
  no element can overflow (an unscaled e4m3 cache saturates at 448; a silent scale of 1.0 would
  clip every larger K/V value).
- SCALE_FLOOR keeps an all-zero row (and rows below ~1e-28) from dividing by zero: they
  quantize to zeros (or e4m3 subnormals) of a tiny scale.
- The scales cost 4 bytes per (token, head): 3% of a head_dim-128 e4m3 row.

A checkpoint may ship a static per-layer scale instead (`k_scale` / `v_scale` scalars, e.g. a
compressed-tensors `kv_cache_scheme`): pass it as `static_scale`. The scale tensor is then filled
with that value, and elements beyond 448 * static_scale are clamped to +-448 (saturated), as the
checkpoint's calibration assumed.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_FLOOR = 1e-30  # smallest scale: an all-zero row divides by this, not by zero


def quantize_fp8(x: torch.Tensor, static_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (x_fp8 [..., D] float8_e4m3fn, scale [...] float32).

    x ~= x_fp8.float() * scale[..., None]. With `static_scale` every row uses that scale and
    values beyond 448 * static_scale saturate at +-448."""
    xf = x.float()
    if static_scale is None:
        scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp_min(SCALE_FLOOR)
    else:
        if not static_scale > 0:
            raise ValueError(f"a static FP8 scale must be positive, got {static_scale}")
        scale = torch.full(xf.shape[:-1], static_scale, dtype=torch.float32, device=x.device)
    # The division is IEEE (as the Triton writer's div_rn); the cast rounds to nearest even.
    x_fp8 = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_fp8, scale


def dequantize_fp8(
    x_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(x_fp8 [..., D] float8_e4m3fn, scale [...] float32) -> x_fp8 * scale in `dtype`
    (the product is formed in float32, then rounded once)."""
    if x_fp8.dtype != FP8_DTYPE:
        raise ValueError(f"expected a float8_e4m3fn tensor, got {x_fp8.dtype}")
    if scale.shape != x_fp8.shape[:-1]:
        raise ValueError(f"scale must be {tuple(x_fp8.shape[:-1])}, got {tuple(scale.shape)}")
    return (x_fp8.float() * scale.float()[..., None]).to(dtype)

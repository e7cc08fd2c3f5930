"""e4m3 (float8_e4m3fn) rounding inside Triton kernels, shared by the FP8 cache writer
(fused_triton.rope_and_cache) and the decode kernel's tensor-core path (lean_attention).

`round_to_e4m3` uses float32 and integer ops only, so the interpreter (which has no correct float8
cast) and every GPU produce the bits torch's `.to(float8_e4m3fn)` does. On a GPU with FP8
conversion the hardware cast (`cvt.rn.satfinite.e4m3x2.f32`, round to nearest even) gives the
same values in one instruction per pair: `to_e4m3(x, HW=True)`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to_e4m3(y):
    """y float32 in [-448, 448] -> uint8 e4m3 bit patterns, rounded to nearest even.

    |y| is rounded to the e4m3 grid of its binade by adding and subtracting 1.5 * 2^23 * step
    (the sum's ulp is the step; 2^-9 below 2^-6, e4m3's subnormals), then re-encoded through fp16,
    which holds every e4m3 value times 2^-8 exactly: the fp16 bits >> 7 are e4m3's exponent and
    mantissa (lean_attention._e4m3_to_fp16 is the inverse)."""
    y_abs = tl.abs(y)
    binade = tl.maximum((y_abs.to(tl.int32, bitcast=True) >> 23) & 0xFF, 121)  # 2^-6: subnormal step
    magic = (((binade + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)  # 1.5 * 2^23 * step
    r = (y_abs + magic) - magic
    h = (r * 0.00390625).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)  # r * 2^-8, exact
    sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80
    return (sign | ((h >> 7) & 0x7F)).to(tl.uint8)


@triton.jit
def to_e4m3(x, HW: tl.constexpr):
    """x float32 with |x| <= 448 -> float8e4nv, rounded to nearest even: the hardware cast (HW)
    or round_to_e4m3 (the interpreter; the same values)."""
    if HW:
        return x.to(tl.float8e4nv)
    else:
        return round_to_e4m3(x).to(tl.float8e4nv, bitcast=True)


@triton.jit
def cut_e4m3(x):
    """x float32 -> (x cut to e4m3's 3 mantissa bits, the remainder): clearing float32's low 20
    mantissa bits, so the cut is exact in e4m3 for |x| in [2^-6, 448] and |remainder| < 2^-3 |x|."""
    cut = (x.to(tl.int32, bitcast=True) & -1048576).to(tl.float32, bitcast=True)  # 0xFFF00000
    return cut, x - cut


@triton.jit
def split_e4m3(x, HW: tl.constexpr):
    """x float32 with |x| < 448 -> (hi, lo) float8e4nv with hi + lo = x to about 2^-8 of |x|
    (bf16's precision) while |x| >= 2^-6 (e4m3's normals; below, hi alone, rounded): hi is the
    exact cut (cut_e4m3), lo the remainder rounded to e4m3. Two e4m3 dots on (hi, lo) give a
    product with bf16-level error from e4m3 tensor cores."""
    hi, rest = cut_e4m3(x)
    return to_e4m3(hi, HW), to_e4m3(rest, HW)


@triton.jit
def split3_e4m3(x, HW: tl.constexpr):
    """As split_e4m3 in three terms (hi + mid + lo = x to about 2^-12 of |x|): exact for fp16 and
    bf16 values in e4m3's normal range, whose 11 or 8 significant bits fit three 4-bit terms."""
    hi, rest = cut_e4m3(x)
    mid, rest = cut_e4m3(rest)
    return to_e4m3(hi, HW), to_e4m3(mid, HW), to_e4m3(rest, HW)

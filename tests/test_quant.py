"""FP8 (e4m3) KV-cache quantization: the PyTorch reference against float64 math, the Triton
cache writer (rope_and_cache with an FP8 cache) against the reference, and the blocked V layout's
row writer / reader against to_v_blocked_t of a standard-layout cache."""

import pytest
import torch

from minidecode.kernels.fused_triton import rope_and_cache
from minidecode.kernels.lean_attention import to_v_blocked_t
from minidecode.kernels.quant import (
    FP8_MAX,
    SCALE_FLOOR,
    V_BLOCK,
    bf16_ceil,
    dequantize_fp8,
    quantize_fp8,
    read_v_rows,
    v_blocks,
    write_v_rows,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def e4m3_grid() -> torch.Tensor:
    """Every finite float8_e4m3fn value, ascending, as float64."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    return values[values.isfinite()].unique()


def test_quantize_per_token_and_head():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 64, generator=gen) * torch.logspace(-3, 3, 5)[:, None]  # rows of any size
    x8, scale = quantize_fp8(x)
    assert x8.dtype == torch.float8_e4m3fn and scale.shape == (2, 3, 5) and scale.dtype == torch.bfloat16
    # the scale is amax / 448 rounded up to bfloat16 (float64 math): nothing saturates, and the
    # largest |x| of each row, within 2^-7 below 448, still rounds to 448: the full range is used
    exact = x.double().abs().amax(-1) / FP8_MAX
    assert (scale.double() >= exact).all() and (scale.double() < exact * (1 + 2**-7)).all()
    torch.testing.assert_close(x8.float().abs().amax(-1), torch.full(scale.shape, FP8_MAX))
    # each element is the e4m3 value nearest x / scale (float64 search over the whole grid)
    grid = e4m3_grid()
    y = (x.double() / scale.double()[..., None]).flatten()
    nearest_gap = (grid[None, :] - y[:, None]).abs().min(1).values
    assert torch.allclose((x8.double().flatten() - y).abs(), nearest_gap, rtol=0, atol=1e-12)
    # round trip: e4m3 keeps 3 mantissa bits, a relative error of at most 2^-4 per normal element
    back = dequantize_fp8(x8, scale, torch.float64)
    big = x.abs() > scale[..., None] * 2**-6  # normal e4m3 range
    assert ((back - x.double()).abs() <= x.double().abs() * 2**-4)[big].all()


def test_zero_rows_and_floor():
    x = torch.zeros(4, 128)
    x[1, 3] = 1e-35
    x8, scale = quantize_fp8(x)
    assert torch.equal(scale[[0, 2, 3]], bf16_ceil(torch.full((3,), SCALE_FLOOR)))
    assert x8.float().isfinite().all() and dequantize_fp8(x8, scale).isfinite().all()
    assert x8[0].float().eq(0).all()


def test_static_scale_saturates():
    x = torch.tensor([[0.5, -1.0, 10.0, -1000.0]])
    x8, scale = quantize_fp8(x, static_scale=0.5)
    assert torch.equal(scale.float(), torch.tensor([0.5]))
    # 10 / 0.5 = 20 is on the grid; -1000 / 0.5 = -2000 is beyond 448 and clamps
    assert x8.float().tolist() == [[1.0, -2.0, 20.0, -FP8_MAX]]
    # a scale between bfloat16 values is rounded up (at most 2^-7 larger): never more saturation
    _, scale = quantize_fp8(x, static_scale=0.03)
    assert scale.dtype == torch.bfloat16 and 0.03 <= scale.item() < 0.03 * (1 + 2**-7)
    with pytest.raises(ValueError, match="positive"):
        quantize_fp8(x, static_scale=0.0)


def test_bf16_ceil_is_the_smallest_bfloat16_not_below():
    """bf16_ceil against float64 math over every bfloat16 neighbourhood it can land in: the result
    is a bfloat16 >= x, and the next bfloat16 below it is < x."""
    gen = torch.Generator().manual_seed(3)
    x = torch.cat((torch.rand(5000, generator=gen) * torch.logspace(-30, 30, 5000), torch.tensor([0.0, 1.0])))
    x = torch.cat((x, bf16_ceil(x[:100]).float()))  # values that are bfloat16 already stay
    up = bf16_ceil(x)
    below = (up.view(torch.int16) - 1).view(torch.bfloat16)  # the next smaller bfloat16 (x > 0)
    assert up.dtype == torch.bfloat16 and (up.double() >= x.double()).all()
    assert ((below.double() < x.double()) | (x == 0)).all()
    assert torch.equal(bf16_ceil(x[-100:]).float(), x[-100:])


def test_dequantize_rejects_bad_input():
    x8, scale = quantize_fp8(torch.randn(3, 16))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_fp8(x8.float(), scale)
    with pytest.raises(ValueError, match="scale must be"):
        dequantize_fp8(x8, scale[:2])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rope_and_cache_writes_fp8(dtype):
    """The Triton writer's e4m3 rows and scales equal quantize_fp8 of the rows it writes into a
    model-dtype cache (same kernel, same rotation); V lands in its block (the bytes of
    to_v_blocked_t of a standard-layout cache); other positions stay untouched."""
    gen = torch.Generator().manual_seed(2)
    B, Hq, Hkv, D, S = 2, 4, 2, 64, V_BLOCK + 9
    qkv = (torch.randn(B, (Hq + 2 * Hkv) * D, generator=gen) * 30).to(dtype).to(DEVICE)
    qkv[0, (Hq + Hkv) * D : (Hq + Hkv + 1) * D] = 0  # a zero V row: the scale floor
    qkv[1, Hq * D] = 1e-3  # tiny values beside large ones: e4m3 subnormals
    angles = torch.rand(B, D // 2, generator=gen, dtype=torch.float64) * 6
    angles = torch.cat((angles, angles), -1)
    cos, sin = angles.cos().float().to(DEVICE), angles.sin().float().to(DEVICE)
    positions = torch.tensor([3, V_BLOCK + 8], device=DEVICE)  # the second in block 1

    kc = torch.zeros(B, Hkv, S, D, dtype=dtype, device=DEVICE)
    vc = torch.zeros_like(kc)
    q_ref = rope_and_cache(qkv, cos, sin, positions, kc, vc, Hq, None, None, 1e-6, False)
    k8 = torch.zeros(B, Hkv, S, D, dtype=torch.float8_e4m3fn, device=DEVICE)
    v8 = torch.zeros(B, Hkv, v_blocks(S), D, V_BLOCK, dtype=torch.float8_e4m3fn, device=DEVICE)
    kv_scale = torch.full((B, Hkv, S, 2), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    q = rope_and_cache(qkv, cos, sin, positions, k8, v8, Hq, None, None, 1e-6, False, kv_scale=kv_scale)
    assert torch.equal(q, q_ref)
    v_standard = torch.zeros_like(k8)  # what V would hold in K's layout
    ks, vs = kv_scale[..., 0], kv_scale[..., 1]
    for got8, got_scale, written in ((k8, ks, kc), (v_standard, vs, vc)):
        for b, pos in enumerate(positions.tolist()):
            ref8, ref_scale = quantize_fp8(written[b, :, pos])
            assert torch.equal(got_scale[b, :, pos], ref_scale)
            if got8 is v_standard:
                v_standard[b, :, pos] = ref8
            else:
                assert torch.equal(got8[b, :, pos].float(), ref8.float())  # +0 and -0 compare equal
        untouched = torch.ones(B, S, dtype=torch.bool)
        untouched[0, 3] = untouched[1, V_BLOCK + 8] = False
        assert got_scale.isnan().permute(0, 2, 1)[untouched].all()
    assert k8.float().eq(0).permute(0, 2, 1, 3)[untouched].all()
    assert torch.equal(v8.float(), to_v_blocked_t(v_standard.cpu()).to(DEVICE).float())  # every byte
    assert vs[0, 0, 3] == bf16_ceil(torch.tensor(SCALE_FLOOR))


def test_rope_and_cache_fp8_needs_scales_and_a_blocked_v():
    qkv = torch.randn(1, 4 * 64, device=DEVICE, dtype=torch.float16)
    cos = sin = torch.ones(1, 64, device=DEVICE)
    position = torch.tensor([0], device=DEVICE)
    k8 = torch.zeros(1, 1, 4, 64, dtype=torch.float8_e4m3fn, device=DEVICE)
    v8 = torch.zeros(1, 1, 1, 64, V_BLOCK, dtype=torch.float8_e4m3fn, device=DEVICE)
    with pytest.raises(ValueError, match="needs kv_scale"):
        rope_and_cache(qkv, cos, sin, position, k8, v8, 2, None, None, 1e-6, False)
    scales = torch.zeros(1, 1, 4, 2, dtype=torch.bfloat16, device=DEVICE)
    for bad in (scales[:, :, :3], scales.float(), scales.transpose(-1, -2).contiguous().transpose(-1, -2)):
        with pytest.raises(ValueError, match=r"kv_scale must be \[1, 1, 4, 2\] bfloat16"):
            rope_and_cache(qkv, cos, sin, position, k8, v8, 2, None, None, 1e-6, False, bad)
    with pytest.raises(ValueError, match=r"an FP8 V cache must be blocked \[C, Hkv, ceil\(S / 64\), D, 64\]"):
        rope_and_cache(qkv, cos, sin, position, k8, k8.clone(), 2, None, None, 1e-6, False, scales)


# ---- the blocked V layout ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "start, length",
    [(0, 1), (5, 20), (V_BLOCK - 3, 3), (V_BLOCK - 3, 4), (7, 2 * V_BLOCK + 11), (2 * V_BLOCK, V_BLOCK)]
    + [(0, 0)],
)
def test_v_rows_round_trip_against_to_v_blocked_t(start, length):
    """write_v_rows of positions start..start+length-1 (unaligned heads and tails, whole blocks)
    writes exactly the bytes to_v_blocked_t puts there for a standard-layout cache holding those
    rows, leaves every other byte as it was, and read_v_rows gives the rows back."""
    gen = torch.Generator().manual_seed(start + length)
    B, Hkv, S, D = 2, 3, 3 * V_BLOCK + 5, 8
    old = torch.randint(0, 0x7F, (B, Hkv, S, D), generator=gen, dtype=torch.uint8)  # earlier contents
    rows = torch.randint(0, 0x7F, (B, Hkv, length, D), generator=gen, dtype=torch.uint8)
    fp8 = torch.float8_e4m3fn
    blocked = to_v_blocked_t(old.view(fp8))
    write_v_rows(blocked, start, rows.view(fp8))
    want = old.clone()
    want[:, :, start : start + length] = rows
    assert torch.equal(blocked.view(torch.uint8), to_v_blocked_t(want.view(fp8)).view(torch.uint8))
    for lo, hi in ((start, start + length), (0, S), (start // 2, min(S, start + length + 70))):
        got = read_v_rows(blocked, lo, hi)
        assert got.dtype == fp8 and torch.equal(got.view(torch.uint8), want[:, :, lo:hi])

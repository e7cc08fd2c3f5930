"""FP8 (e4m3) KV-cache quantization: the PyTorch reference against float64 math, and the Triton
cache writer (rope_and_cache with an FP8 cache) against the reference."""

import pytest
import torch

from minidecode.kernels.fused_triton import rope_and_cache
from minidecode.kernels.quant import FP8_MAX, SCALE_FLOOR, dequantize_fp8, quantize_fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def e4m3_grid() -> torch.Tensor:
    """Every finite float8_e4m3fn value, ascending, as float64."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    return values[values.isfinite()].unique()


def test_quantize_per_token_and_head():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 64, generator=gen) * torch.logspace(-3, 3, 5)[:, None]  # rows of any size
    x8, scale = quantize_fp8(x)
    assert x8.dtype == torch.float8_e4m3fn and scale.shape == (2, 3, 5) and scale.dtype == torch.float32
    # the largest |x| of each row lands on 448: nothing saturates, the full range is used
    torch.testing.assert_close(x8.float().abs().amax(-1), torch.full_like(scale, FP8_MAX))
    torch.testing.assert_close(scale.double(), x.double().abs().amax(-1) / FP8_MAX, rtol=1e-6, atol=0)
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
    assert torch.equal(scale[[0, 2, 3]], torch.full((3,), SCALE_FLOOR))
    assert x8.float().isfinite().all() and dequantize_fp8(x8, scale).isfinite().all()
    assert x8[0].float().eq(0).all()


def test_static_scale_saturates():
    x = torch.tensor([[0.5, -1.0, 10.0, -1000.0]])
    x8, scale = quantize_fp8(x, static_scale=0.5)
    assert torch.equal(scale, torch.tensor([0.5]))
    # 10 / 0.5 = 20 is on the grid; -1000 / 0.5 = -2000 is beyond 448 and clamps
    assert x8.float().tolist() == [[1.0, -2.0, 20.0, -FP8_MAX]]
    with pytest.raises(ValueError, match="positive"):
        quantize_fp8(x, static_scale=0.0)


def test_dequantize_rejects_bad_input():
    x8, scale = quantize_fp8(torch.randn(3, 16))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_fp8(x8.float(), scale)
    with pytest.raises(ValueError, match="scale must be"):
        dequantize_fp8(x8, scale[:2])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rope_and_cache_writes_fp8(dtype):
    """The Triton writer's e4m3 rows and scales equal quantize_fp8 of the rows it writes into a
    model-dtype cache (same kernel, same rotation); other positions stay untouched."""
    gen = torch.Generator().manual_seed(2)
    B, Hq, Hkv, D, S = 2, 4, 2, 64, 9
    qkv = (torch.randn(B, (Hq + 2 * Hkv) * D, generator=gen) * 30).to(dtype).to(DEVICE)
    qkv[0, (Hq + Hkv) * D : (Hq + Hkv + 1) * D] = 0  # a zero V row: the scale floor
    qkv[1, Hq * D] = 1e-3  # tiny values beside large ones: e4m3 subnormals
    angles = torch.rand(B, D // 2, generator=gen, dtype=torch.float64) * 6
    angles = torch.cat((angles, angles), -1)
    cos, sin = angles.cos().float().to(DEVICE), angles.sin().float().to(DEVICE)
    positions = torch.tensor([3, 8], device=DEVICE)

    kc = torch.zeros(B, Hkv, S, D, dtype=dtype, device=DEVICE)
    vc = torch.zeros_like(kc)
    q_ref = rope_and_cache(qkv, cos, sin, positions, kc, vc, Hq, None, None, 1e-6, False)
    k8 = torch.zeros(B, Hkv, S, D, dtype=torch.float8_e4m3fn, device=DEVICE)
    v8 = torch.zeros_like(k8)
    ks = torch.full((B, Hkv, S), float("nan"), device=DEVICE)
    vs = torch.full_like(ks, float("nan"))
    q = rope_and_cache(qkv, cos, sin, positions, k8, v8, Hq, None, None, 1e-6, False, k_scale=ks, v_scale=vs)
    assert torch.equal(q, q_ref)
    for got8, got_scale, written in ((k8, ks, kc), (v8, vs, vc)):
        for b, pos in enumerate(positions.tolist()):
            ref8, ref_scale = quantize_fp8(written[b, :, pos])
            assert torch.equal(got_scale[b, :, pos], ref_scale)
            assert torch.equal(got8[b, :, pos].float(), ref8.float())  # +0 and -0 compare equal
        untouched = torch.ones(B, S, dtype=torch.bool)
        untouched[0, 3] = untouched[1, 8] = False
        assert got_scale.isnan().permute(0, 2, 1)[untouched].all()
        assert got8.float().eq(0).permute(0, 2, 1, 3)[untouched].all()
    assert vs[0, 0, 3] == SCALE_FLOOR


def test_rope_and_cache_fp8_needs_scales():
    qkv = torch.randn(1, 4 * 64, device=DEVICE, dtype=torch.float16)
    cos = sin = torch.ones(1, 64, device=DEVICE)
    k8 = torch.zeros(1, 1, 4, 64, dtype=torch.float8_e4m3fn, device=DEVICE)
    with pytest.raises(ValueError, match="k_scale"):
        rope_and_cache(
            qkv, cos, sin, torch.tensor([0], device=DEVICE), k8, k8.clone(), 2, None, None, 1e-6, False
        )
    bad = torch.zeros(1, 1, 3, device=DEVICE)
    with pytest.raises(ValueError, match="k_scale must be"):
        rope_and_cache(
            qkv,
            cos,
            sin,
            torch.tensor([0], device=DEVICE),
            k8,
            k8.clone(),
            2,
            None,
            None,
            1e-6,
            False,
            bad,
            bad,
        )

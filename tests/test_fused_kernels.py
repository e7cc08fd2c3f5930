"""The decode step's fused Triton kernels against their PyTorch twins (CPU: Triton interpreter)."""

import pytest
import torch

from minidecode.kernels.fused import add_rms_norm, rope_and_cache, silu_mul

# bf16 is checked on the GPU only: the interpreter's bf16 conversions do not round to nearest.
CUDA = torch.cuda.is_available()
DTYPES = [torch.float32, torch.float16] + [pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
DEVICE = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm(dtype, with_delta):
    torch.manual_seed(0)
    x = torch.randn(3, 200, dtype=dtype, device=DEVICE)
    delta = torch.randn(3, 200, dtype=dtype, device=DEVICE) if with_delta else None
    w = torch.randn(200, dtype=dtype, device=DEVICE)
    x_ref, x_tri = x.clone(), x.clone()
    ref = add_rms_norm(x_ref, delta, w, 1e-5, triton=False)
    out = add_rms_norm(x_tri, delta, w, 1e-5, triton=True)
    torch.testing.assert_close(x_tri, x_ref, rtol=0, atol=0)  # the residual add is exact
    torch.testing.assert_close(out, ref, rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-2)
    # and against float64 math
    xf = x.double() + (delta.double() if with_delta else 0)
    exact = w.double() * xf / xf.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()
    assert (out.double() - exact).norm() / exact.norm() < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_and_cache(dtype, qk_norm):
    torch.manual_seed(1)
    B, Hq, Hkv, D, S = 2, 4, 2, 16, 10
    qkv = torch.randn(B, (Hq + 2 * Hkv) * D, dtype=dtype, device=DEVICE)
    angles = torch.rand(B, D // 2, dtype=torch.float64, device=DEVICE) * 6
    angles = torch.cat((angles, angles), -1)
    cos, sin = angles.cos().float(), angles.sin().float()
    positions = torch.tensor([3, 9], device=DEVICE)
    norms = (
        (torch.randn(D, dtype=dtype, device=DEVICE), torch.randn(D, dtype=dtype, device=DEVICE))
        if qk_norm
        else (None, None)
    )
    caches = []
    outs = []
    for use in (False, True):
        kc = torch.full((B, Hkv, S, D), float("nan"), dtype=dtype, device=DEVICE)
        vc = torch.full((B, Hkv, S, D), float("nan"), dtype=dtype, device=DEVICE)
        outs.append(rope_and_cache(qkv, cos, sin, positions, kc, vc, Hq, *norms, 1e-6, triton=use))
        caches.append((kc, vc))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(outs[1], outs[0], **tol)
    for ref, got in zip(caches[0], caches[1], strict=True):
        torch.testing.assert_close(got, ref, equal_nan=True, **tol)  # same positions written, rest untouched
    assert not torch.isnan(caches[1][0][0, :, 3]).any() and torch.isnan(caches[1][0][0, :, 4]).all()
    # rotation against complex-number math in float64 (no norm): q head 0 of sequence 0
    if not qk_norm and dtype == torch.float32:
        q0 = qkv[0, :D].double()
        z = torch.complex(q0[: D // 2], q0[D // 2 :]) * torch.exp(1j * angles[0, : D // 2])
        exact = torch.cat((z.real, z.imag))
        torch.testing.assert_close(outs[1][0, 0].double(), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    torch.manual_seed(2)
    gate_up = torch.randn(2, 2 * 1500, dtype=dtype, device=DEVICE) * 3
    ref = silu_mul(gate_up, triton=False)
    out = silu_mul(gate_up, triton=True)
    torch.testing.assert_close(out, ref, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
    g, u = gate_up.double().chunk(2, -1)
    exact = g * torch.sigmoid(g) * u
    assert (out.double() - exact).norm() / exact.norm() < (1e-6 if dtype == torch.float32 else 2e-2)

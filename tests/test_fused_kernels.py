"""The decode step's ops (kernels/ops.py): Triton paths against their PyTorch twins and float64
(CPU: the Triton interpreter)."""

import pytest
import torch
from helpers import rel_err

from minidecode.kernels.gemv import (
    DEFAULT_CONFIG,
    GATED_BATCH_CONFIG,
    SPLIT_K_CONFIG,
    WIDE_CONFIG,
    GemvConfig,
    default_config,
    gemv,
)
from minidecode.kernels.ops import (
    gate_up_silu,
    linear,
    linear_residual,
    rms_norm,
    rope_and_cache,
    rope_into,
    silu_mul,
)

# bf16 is checked on the GPU only: the interpreter's bf16 conversions do not round to nearest.
CUDA = torch.cuda.is_available()
DTYPES = [torch.float32, torch.float16] + [pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
DEVICE = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 200, dtype=dtype, device=DEVICE)[:, 1:4]  # a strided view, as prefill passes
    w = torch.randn(200, dtype=dtype, device=DEVICE)
    ref = rms_norm(x, w, 1e-5, triton=False)
    out = rms_norm(x, w, 1e-5, triton=True)
    assert out.shape == x.shape
    torch.testing.assert_close(out, ref, rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-2)
    xf = x.double()
    exact = w.double() * xf / xf.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()
    assert rel_err(out, exact) < (1e-5 if dtype == torch.float32 else 1e-2)


# Shapes off every block multiple: N not a multiple of BLOCK_N, K of BLOCK_K (or below it). N 200
# is wider than 32 outputs for each of the interpreter's 4 CTAs: weight rows on M (WIDE_CONFIG).
GEMV_SHAPES = [
    (1, 40, 1100),
    (3, 24, 96),
    (16, 48, 520),
    (17, 40, 300),
    (32, 24, 520),
    (1, 200, 1100),
    (20, 200, 300),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, N, K", GEMV_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear(dtype, B, N, K, bias):
    torch.manual_seed(3)
    x = torch.randn(B, K, dtype=dtype, device=DEVICE)
    w = torch.randn(N, K, dtype=dtype, device=DEVICE) / K**0.5
    b = torch.randn(N, dtype=dtype, device=DEVICE) if bias else None
    out = linear(x, w, b, triton=True)
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    assert out.shape == (B, N) and rel_err(out, exact) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, N, K", GEMV_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_residual(dtype, B, N, K, bias):
    torch.manual_seed(4)
    x = torch.randn(B, K, dtype=dtype, device=DEVICE)
    w = torch.randn(N, K, dtype=dtype, device=DEVICE) / K**0.5
    b = torch.randn(N, dtype=dtype, device=DEVICE) if bias else None
    residual = torch.randn(B, N, dtype=dtype, device=DEVICE) * 8
    ref, out = residual.clone(), residual.clone()
    linear_residual(x, w, b, ref, triton=False)
    linear_residual(x, w, b, out, triton=True)
    exact = residual.double() + x.double() @ w.double().T + (b.double() if bias else 0)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(out, exact) < tol and rel_err(ref, exact) < tol
    # both round the projection to the model dtype, then the sum: one rounding step apart at most
    proj = (x.double() @ w.double().T + (b.double() if bias else 0)).to(dtype)
    bound = 2 * ref.double().abs().max() * torch.finfo(dtype).eps
    assert (out.double() - (residual.double() + proj.double())).abs().max() <= bound


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("triton", [False, True])
def test_linear_residual_rounds_like_transformers(dtype, triton):
    """transformers computes `h + proj(x)`: the projection is rounded to the model dtype, then the
    sum is (two roundings). One fp32 add rounded once differs in many elements."""
    torch.manual_seed(5)
    B, N, K = 3, 48, 520
    x = torch.randn(B, K, dtype=dtype, device=DEVICE)
    w = torch.randn(N, K, dtype=dtype, device=DEVICE) / K**0.5
    residual = torch.randn(B, N, dtype=dtype, device=DEVICE) * 8
    proj = linear(x, w, None, triton=triton)  # [B, N], rounded to dtype
    out = residual.clone()
    linear_residual(x, w, None, out, triton=triton)
    assert torch.equal(out, residual + proj)


# (B, inter, K): inter not a multiple of a block's features (16 for one row, 64 for a batch), K
# off BLOCK_K; one row's inter 100 is 7 blocks, dealt to the interpreter's 4 CTAs; 17 rows pad x
# to 32.
GATED_SHAPES = [(1, 40, 1100), (3, 24, 96), (16, 100, 520), (17, 40, 300)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, inter, K", GATED_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_gate_up_silu(dtype, B, inter, K, bias):
    torch.manual_seed(6)
    x = torch.randn(B, K, dtype=dtype, device=DEVICE)
    w = torch.randn(2 * inter, K, dtype=dtype, device=DEVICE) * (3 / K**0.5)  # gates of a few units
    b = torch.randn(2 * inter, dtype=dtype, device=DEVICE) if bias else None
    out = gemv(x, w, b, gated=True)
    assert torch.equal(gate_up_silu(x, w, b, triton=True), out)  # the op takes this kernel
    gate, up = (x.double() @ w.double().T + (b.double() if bias else 0)).chunk(2, -1)
    exact = gate * torch.sigmoid(gate) * up
    assert out.shape == (B, inter) and rel_err(out, exact) < (1e-5 if dtype == torch.float32 else 2e-2)
    # The twin (F.linear, then silu * up) rounds at the same points: a half-precision result equals
    # it but where the dots' summation order tips a projection's rounding (one element, or 2%).
    # Not with a bias: on the GPU cuBLAS may round the product before adding it.
    ref = gate_up_silu(x, w, b, triton=False)
    if dtype != torch.float32 and not bias:
        assert (out != ref).sum() <= max(1, 0.02 * out.numel())


# A split of K in three with x's rows on M: parts end mid-chunk (K 1100 is 9 chunks of 128 for
# fp16, 18 of 64 for fp32, so 3 or 6 a part, the last part past K).
SPLIT3_CONFIG = GemvConfig(block_n=32, block_k=128, split_k=3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "config",
    [DEFAULT_CONFIG, WIDE_CONFIG, GATED_BATCH_CONFIG, SPLIT_K_CONFIG, SPLIT3_CONFIG],
    ids=["x_on_m", "wide", "gated_batch", "split_k", "split3"],
)
@pytest.mark.parametrize("B, N, K", [(1, 200, 1100), (17, 136, 300), (32, 72, 520)])
@pytest.mark.parametrize("mode", ["plain", "residual", "gated"])
def test_gemv_both_dot_orientations(dtype, config, B, N, K, mode):
    """x's rows or the weight's rows on the dot's M axis, K whole or split over CTAs, every mode,
    two CTAs dealt several work items each (an item boundary inside the pipelined loop; several
    tickets a CTA), against float64."""
    torch.manual_seed(7)
    x = torch.randn(B, K, dtype=dtype, device=DEVICE)
    w = torch.randn(N, K, dtype=dtype, device=DEVICE) * (3 / K**0.5)
    residual = torch.randn(B, N, dtype=dtype, device=DEVICE) if mode == "residual" else None
    exact = x.double() @ w.double().T
    if mode == "gated":
        gate, up = exact.chunk(2, -1)
        exact = gate * torch.sigmoid(gate) * up
    elif mode == "residual":
        exact = exact + residual.double()
    out = gemv(x, w, residual=residual, gated=mode == "gated", config=config, max_ctas=2)
    assert out.shape == exact.shape and rel_err(out, exact) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_gemv_default_config():
    """Weight rows on M where blocks of 32 outputs would be dealt two or more a CTA (qkv of an 8B
    model on 132 SMs), and for a batch's gate/up; x's rows on M for o_proj / down and one row's
    gate/up; from 17 rows o_proj / down split K, while its items fit one a CTA."""
    assert default_config(1, 6144, False, 132) is WIDE_CONFIG
    assert default_config(16, 4096, False, 132) is DEFAULT_CONFIG
    assert default_config(17, 4096, False, 132) is SPLIT_K_CONFIG
    assert default_config(32, 4064, False, 127) is DEFAULT_CONFIG  # 2 x 64 items > 127 CTAs
    assert default_config(1, 14336, True, 132) is DEFAULT_CONFIG
    assert default_config(2, 14336, True, 132) is GATED_BATCH_CONFIG


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [SPLIT_K_CONFIG, SPLIT3_CONFIG], ids=["split_k", "split3"])
def test_gemv_split_k_repeats_and_resets(dtype, config):
    """Split K: the partials are summed in part order whichever part comes last, so a result
    repeats bitwise (on the GPU the parts race), and the tickets are zero again after each launch
    (a graph replays the same counters)."""
    from minidecode.kernels.gemv import _WORKSPACES

    torch.manual_seed(8)
    x = torch.randn(24, 1100, dtype=dtype, device=DEVICE)
    w = torch.randn(200, 1100, dtype=dtype, device=DEVICE) * (3 / 1100**0.5)
    residual = torch.randn(24, 200, dtype=dtype, device=DEVICE)
    ctas = 3 if DEVICE == "cpu" else None  # CPU: several items a CTA; GPU: one each
    outs = [gemv(x, w, residual=residual.clone(), config=config, max_ctas=ctas) for _ in range(3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    exact = x.double() @ w.double().T + residual.double()
    assert rel_err(outs[0], exact) < (1e-5 if dtype == torch.float32 else 2e-2)
    counters = [ws[1] for key, ws in _WORKSPACES.items() if key[0] == x.device]
    assert counters and all(int(c.abs().sum()) == 0 for c in counters)


def test_gemv_rejects_too_many_rows_and_falls_back():
    x = torch.randn(33, 32, device=DEVICE)
    w = torch.randn(16, 32, device=DEVICE)
    residual = torch.zeros(33, 16, device=DEVICE)
    linear_residual(x, w, None, residual, triton=True)  # 33 > MAX_ROWS: the cuBLAS path
    torch.testing.assert_close(residual, x @ w.T)
    with pytest.raises(ValueError, match="do not fit"):
        gemv(x, w)
    with pytest.raises(ValueError, match="even number of gate/up rows"):
        gemv(x[:4], w[:15], gated=True)


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


@pytest.mark.parametrize("triton", [False, True])
def test_rope_and_cache_into_one_shared_row(triton):
    """A batch whose sequences own regions of one cache row [1, Hkv, S, D]: each sequence's K/V
    land at its own (region) position of that row, exactly the rows a per-sequence cache gets."""
    torch.manual_seed(2)
    B, Hq, Hkv, D, S = 3, 4, 2, 16, 30
    qkv = torch.randn(B, (Hq + 2 * Hkv) * D, device=DEVICE)
    cos, sin = torch.randn(B, D, device=DEVICE), torch.randn(B, D, device=DEVICE)
    per_row = [torch.zeros(B, Hkv, S, D, device=DEVICE) for _ in "kv"]
    shared = [torch.zeros(1, Hkv, S, D, device=DEVICE) for _ in "kv"]
    positions, written = torch.tensor([1, 4, 0], device=DEVICE), torch.tensor([1, 14, 25], device=DEVICE)
    q_ref = rope_and_cache(qkv, cos, sin, positions, *per_row, Hq, triton=triton)
    q = rope_and_cache(qkv, cos, sin, written, *shared, Hq, triton=triton)
    torch.testing.assert_close(q, q_ref, rtol=0, atol=0)
    for ref, got in zip(per_row, shared, strict=True):
        for b in range(B):
            assert torch.equal(got[0, :, written[b]], ref[b, :, positions[b]])
        assert int((got != 0).any(-1).sum()) == B * Hkv  # nothing else written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_into(dtype, qk_norm):
    """Prefill's chunk: q, k rotated and v copied into heads-major views (a query buffer's columns,
    cache positions 7..) with 37 rows (a partial block of 32); nothing else written. Without the
    per-head norm the kernel rounds as the PyTorch twin does, bit for bit."""
    torch.manual_seed(3)
    B, T, Hq, Hkv, D, S = 2, 37, 4, 2, 16, 50
    qkv = torch.randn(B, T, (Hq + 2 * Hkv) * D, dtype=dtype, device=DEVICE)
    angles = torch.rand(B, T, D // 2, dtype=torch.float64, device=DEVICE) * 6
    angles = torch.cat((angles, angles), -1)
    cos, sin = angles.cos().float(), angles.sin().float()
    norms = (torch.randn(D, dtype=dtype, device=DEVICE), torch.randn(D, dtype=dtype, device=DEVICE))
    results = []
    for use in (False, True):
        q_buf = torch.full((B, Hq, T + 5, D), float("nan"), dtype=dtype, device=DEVICE)
        kc, vc = (torch.full((B, Hkv, S, D), float("nan"), dtype=dtype, device=DEVICE) for _ in "kv")
        at = slice(7, 7 + T)
        q_norm, k_norm = norms if qk_norm else (None, None)
        rope_into(
            qkv, cos, sin, q_buf[:, :, 2 : 2 + T], kc[:, :, at], vc[:, :, at], q_norm, k_norm, triton=use
        )
        results.append((q_buf, kc, vc))
    exact = not qk_norm and (dtype == torch.float32 or CUDA)
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-2, atol=1e-2)
    for ref, got in zip(*results, strict=True):
        torch.testing.assert_close(got, ref, equal_nan=True, **tol)
    q_buf, kc, vc = results[1]
    assert torch.isnan(q_buf[:, :, :2]).all() and not torch.isnan(q_buf[:, :, 2 : 2 + T]).any()
    assert torch.isnan(kc[:, :, :7]).all() and torch.isnan(vc[:, :, 7 + T :]).all()
    assert torch.equal(vc[:, :, 7 : 7 + T], qkv.view(B, T, -1, D)[:, :, Hq + Hkv :].transpose(1, 2))
    if not qk_norm and dtype == torch.float32:  # against complex-number math in float64
        k = qkv.view(B, T, -1, D)[:, :, Hq].double()  # KV head 0 of every row
        z = torch.complex(k[..., : D // 2], k[..., D // 2 :]) * torch.exp(1j * angles[..., : D // 2])
        torch.testing.assert_close(
            kc[:, 0, 7 : 7 + T].double(), torch.cat((z.real, z.imag), -1), rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    torch.manual_seed(2)
    gate_up = torch.randn(2, 2 * 1500, dtype=dtype, device=DEVICE) * 3
    ref = silu_mul(gate_up, triton=False)
    out = silu_mul(gate_up, triton=True)
    torch.testing.assert_close(out, ref, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
    g, u = gate_up.double().chunk(2, -1)
    exact = g * torch.sigmoid(g) * u
    assert rel_err(out, exact) < (1e-6 if dtype == torch.float32 else 2e-2)

"""FP8 prefill attention (kernels/fp8_prefill.py) against its PyTorch twin (the same e4m3 operands
and per-tile P rounding) and float64 references: on the CPU under the Triton interpreter, whose
e4m3 dots are exact float32 sums (small tiles, so short sequences span several tiles and query
blocks), and on a GPU (marked gpu) at every candidate config.

Error levels. Against the twin: the same arithmetic, so ~1e-6 on the CPU; on the GPU the tensor
cores' reduced-precision accumulation and the approximate exp2 move a few weights across an e4m3
rounding boundary. Against float64 attention over the kernel's own e4m3 operands: P's rounding to
e4m3 (3 mantissa bits) per tile, ~2% on random inputs. Against the unquantized inputs: Q, K and V's
rounding too, ~5%. A wrong scale, mask or tile bound is far outside these.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from helpers import kernel_devices, max_rel_err, rel_err

from minidecode.kernels import fp8_prefill as fp
from minidecode.kernels import prefill
from minidecode.kernels.fp8_prefill import (
    Fp8PrefillConfig,
    causal_reference,
    dequantized_inputs,
    fp8_attention_twin,
    fp8_causal_attention,
    quantize_blocks,
    quantize_kv,
    scale_exponent,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
import stdlib_corpus  # noqa: E402

INTERPRETED, DEVICES = kernel_devices(fp._fp8_attention_kernel)
DTYPE = {"cpu": torch.float16, "cuda": torch.bfloat16}  # the interpreter's bf16 dot is broken
TWIN_TOL = {"cpu": 1e-4, "cuda": 2e-2}
OWN_TOL = 5e-2  # against float64 over the kernel's e4m3 operands: P's rounding
UNQUANTIZED_TOL = 0.1  # against float64 over the unquantized inputs: Q, K, V and P's rounding


def config_for(device: str, head_dim: int) -> Fp8PrefillConfig:
    return fp.INTERPRETER_CONFIG if device == "cpu" else fp.default_config(head_dim, torch.device(device))


def make_inputs(device, B, Hq, Hkv, T, past, D, dtype, seed=0, slack=5, k_spread=True):
    """Random q [B, Hq, T, D] and k, v [B, Hkv, past + T, D] as views of a cache [B, Hkv, S, D]
    (S = past + T + slack, the positions past the length NaN: reading them shows). K's heads get
    different sizes (0.3x-3x: peaked and flat scores side by side)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    N = past + T
    q = torch.randn(B, Hq, T, D, generator=gen, device=device).to(dtype)
    cache_k = torch.randn(B, Hkv, N + slack, D, generator=gen, device=device)
    cache_v = torch.randn(B, Hkv, N + slack, D, generator=gen, device=device)
    if k_spread:
        cache_k = cache_k * torch.logspace(-0.5, 0.5, Hkv, device=device)[:, None, None]
    cache_k, cache_v = cache_k.to(dtype), cache_v.to(dtype)
    cache_k[:, :, N:], cache_v[:, :, N:] = float("nan"), float("nan")
    return q, cache_k[:, :, :N], cache_v[:, :, :N]


# (B, Hq, Hkv, T, past, D): a whole prompt over several tiles and blocks with a partial last one;
# a chunk after a cached prefix that is not a multiple of the tile (so diagonal tiles straddle);
# a prefix that is; GQA 4:1, 2:1 and MHA; one query alone and after a prefix; T shorter than a
# block after a long prefix; head_dim 32, 64 and 128.
CASES = [
    (1, 4, 1, 100, 0, 64),
    (2, 4, 2, 70, 45, 64),
    (1, 2, 2, 40, 64, 32),
    (1, 2, 1, 1, 0, 64),
    (1, 4, 2, 1, 77, 128),
    (1, 2, 1, 9, 150, 32),
    (1, 2, 1, 64, 0, 128),
]


def case_id(case):
    B, Hq, Hkv, T, past, D = case
    return f"B{B}-{Hq}q{Hkv}kv-T{T}-past{past}-d{D}"


# ---- scales -------------------------------------------------------------------------------


def test_scale_exponent_is_the_smallest_power_of_two_that_fits_448():
    """amax * 2^-e <= 448 and amax * 2^-(e-1) > 448, for values on every side of the mantissa
    threshold 1.75 (448 = 1.75 x 2^8) and of powers of two; zero and tiny values take the floor."""
    base = torch.tensor([1.0, 1.5, 1.75, 1.7500001, 1.9999999, 448.0, 448.00003, 449.0, 3.0e-3, 7.0e4])
    values = torch.cat([base * 2.0**k for k in range(-15, 16, 5)])  # inside the clamp
    e = scale_exponent(values)
    fits = values * torch.exp2(-e.double()) <= 448
    tight = values * torch.exp2(-(e.double() - 1)) > 448
    assert fits.all() and tight.all()
    edges = torch.tensor([448.0, 449.0, 1.0, 0.0, 1e-38, 1e30])
    assert scale_exponent(edges).tolist() == [0, 1, -8, -32, -32, 32]


@triton.jit
def _exponent_kernel(X, E):
    offs = tl.arange(0, 64)
    tl.store(E + offs, fp._scale_exponent(tl.load(X + offs)))


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_scale_exponent_equals_the_twin(device):
    gen = torch.Generator().manual_seed(0)
    x = (torch.rand(64, generator=gen) * 2.0 ** torch.randint(-40, 40, (64,), generator=gen)).float()
    x[:4] = torch.tensor([0.0, 448.0, 448.00003, 1.75])
    got = torch.empty(64, dtype=torch.int32, device=device)
    _exponent_kernel[(1,)](x.to(device), got)
    assert torch.equal(got.cpu(), scale_exponent(x))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N, block", [(100, 32), (64, 32), (130, 64)])
def test_quantize_kv_writes_the_twins_bits(device, N, block):
    """The pre-pass on strided views of a cache (NaN past the length): K's and V's e4m3 bits equal
    the twin's, V transposed (keys contiguous), power-of-two scales, zeros past the length."""
    q, k, v = make_inputs(device, 2, 2, 2, N, 0, 64, DTYPE[device])
    kv = quantize_kv(k, v, block)
    k8, ks = quantize_blocks(k, block)
    v8, vs = quantize_blocks(v, block)
    n_pad = kv.k.shape[1]
    assert n_pad == -(-N // block) * block and kv.v.shape == (4, 64, n_pad)
    assert torch.equal(kv.k.view(torch.uint8).cpu(), k8.flatten(0, 1).view(torch.uint8).cpu())
    assert torch.equal(kv.v.view(torch.uint8).cpu(), v8.flatten(0, 1).transpose(1, 2).view(torch.uint8).cpu())
    assert torch.equal(kv.k_scale.cpu(), ks.flatten(0, 1).cpu())
    assert torch.equal(kv.v_scale.cpu(), vs.flatten(0, 1).cpu())
    assert (kv.k.view(torch.uint8)[:, N:] == 0).all() and (kv.v.view(torch.uint8)[:, :, N:] == 0).all()
    assert torch.equal(torch.exp2(torch.log2(kv.k_scale).round()), kv.k_scale)
    # each block's largest |value| lands in (224, 448], so in [224, 448] once rounded to e4m3
    top = k8.float().abs().view(2, 2, -1, block * 64).amax(-1)
    assert ((top >= 224) & (top <= 448)).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N, block", [(100, 32), (130, 64)])
def test_quantize_kv_permutes_v_for_the_hopper_kernel(device, N, block):
    """permute_v writes V^T's keys in the order of the Hopper kernel's P operand: in every 16, key
    8h + 2q + e at column 4q + 2h + e (a permutation); K, the scales and the bits are unchanged."""
    q, k, v = make_inputs(device, 1, 2, 2, N, 0, 64, DTYPE[device])
    plain, permuted = quantize_kv(k, v, block), quantize_kv(k, v, block, permute_v=True)
    key = torch.arange(plain.v.shape[-1])
    column = key // 16 * 16 + (key // 2) % 4 * 4 + (key // 8) % 2 * 2 + key % 2
    assert sorted(column.tolist()) == key.tolist() and column[8].item() == 2 and column[2].item() == 4
    as_keys = permuted.v.view(torch.uint8).cpu()[:, :, column]
    assert torch.equal(as_keys, plain.v.view(torch.uint8).cpu())
    assert not torch.equal(permuted.v.view(torch.uint8).cpu(), plain.v.view(torch.uint8).cpu())
    for name in ("k", "k_scale", "v_scale"):
        a, b = getattr(permuted, name).cpu(), getattr(plain, name).cpu()
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_hopper_kernel_compiles_for_sm90():
    """The warp-specialized Gluon kernel (fp8_prefill_hopper; Gluon has no interpreter, so the GPU
    tests below run it) compiles for sm_90 on this machine at head_dim 64 and 128: a register
    budget per partition (setmaxnreg), e4m3 wgmmas as wide as the tiles, TMA loads, no local memory."""
    import json
    import os
    import subprocess

    pytest.importorskip("triton.experimental.gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("sm90_compile.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for line, head_dim in zip(done.stdout.splitlines(), fp.WARP_SPECIALIZED_HEAD_DIMS, strict=True):
        got = json.loads(line)
        assert got["head_dim"] == head_dim
        assert {"24", "240"} <= set(got["setmaxnreg"])
        assert got["wgmma"] == sorted({"m64n128k32", f"m64n{head_dim}k32"})
        assert got["tma_loads"] == 2 and not got["local_memory"]


def test_warp_specialized_config_needs_hopper():
    q, k, v = make_inputs("cpu", 1, 2, 1, 10, 0, 64, torch.float32)
    with pytest.raises(ValueError, match="runs on Hopper"):
        fp8_causal_attention(q, k, v, 0.125, fp.HOPPER_CONFIG)


# ---- the kernel -----------------------------------------------------------------------------


def check_kernel(device, case, config, seed=0):
    B, Hq, Hkv, T, past, D = case
    q, k, v = make_inputs(device, B, Hq, Hkv, T, past, D, DTYPE[device], seed=seed)
    scale = D**-0.5
    out = fp8_causal_attention(q, k, v, scale, config)
    assert out.shape == q.shape and out.dtype == q.dtype and torch.isfinite(out).all()
    twin = fp8_attention_twin(q, k, v, scale, config)
    own = causal_reference(*dequantized_inputs(q, k, v, config.block_n), scale)
    exact = causal_reference(q, k, v, scale)
    errors = rel_err(out, twin), rel_err(out, own), rel_err(out, exact)
    assert errors[0] < TWIN_TOL[device], f"{errors[0]:.2e} against the twin"
    assert errors[1] < OWN_TOL, f"{errors[1]:.2e} against float64 on the e4m3 operands"
    assert errors[2] < UNQUANTIZED_TOL, f"{errors[2]:.2e} against float64 on the unquantized inputs"
    return out


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("device", DEVICES)
def test_kernel_against_twin_and_float64(device, case):
    check_kernel(device, case, config_for(device, case[-1]))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_twin_without_p_rounding_is_exact_attention_over_the_e4m3_operands(case):
    """The twin's tiles, masks and online softmax on their own: with P kept in float32 it is
    float64 attention over the e4m3 operands, up to float32 rounding."""
    B, Hq, Hkv, T, past, D = case
    q, k, v = make_inputs("cpu", B, Hq, Hkv, T, past, D, torch.float32)
    config = fp.INTERPRETER_CONFIG
    twin = fp8_attention_twin(q, k, v, D**-0.5, config, round_p=False)
    assert rel_err(twin, causal_reference(*dequantized_inputs(q, k, v, config.block_n), D**-0.5)) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_weights_far_below_the_maximum_keep_their_precision(device):
    """A sink: key 0 scores 20 (log2 units) above the keys of the later tiles, whose weights ~2^-20
    would be e4m3 zeros even times 2^8 (the rest of the sink's tile scores 40 below it: nothing).
    The sink's value is 0 and the others' 2^10, so a row's output is exactly their share, ~2^-10
    per key. The per-tile P exponent scales each later tile's weights up to e4m3's normal range."""
    D = 64
    bn = config_for(device, D).block_n
    T = 4 * bn
    q = torch.zeros(1, 2, T, D)
    k, v = torch.zeros(1, 1, T, D), torch.full((1, 1, T, D), 1024.0)
    q[..., 0] = 1.0
    k[0, 0, 0, 0] = 20 / fp.LOG2E / D**-0.5  # the sink's score: 20 in log2 units, for every query
    k[0, 0, 1:bn, 0] = -20 / fp.LOG2E / D**-0.5  # the rest of its tile: 2^-40 of the sink
    # the later keys score 0 to 0.7 (log2 units): weights of 2^-20 to 2^-19.3 of the sink's, of
    # varied sizes, so their rounding errors average out as in real attention
    k[0, 0, bn:, 0] = (
        torch.rand(T - bn, generator=torch.Generator().manual_seed(0)) * 0.7 / fp.LOG2E / D**-0.5
    )
    v[0, 0, 0] = 0.0
    q, k, v = (x.to(device, DTYPE[device]) for x in (q, k, v))
    out = fp8_causal_attention(q, k, v, D**-0.5, config_for(device, D))
    own = causal_reference(*dequantized_inputs(q, k, v, bn), D**-0.5)  # (K's e4m3 moves the sink)
    assert rel_err(out[:, :, bn:], own[:, :, bn:]) < 0.02


@pytest.mark.parametrize("device", DEVICES)
def test_causal_attention_fp8_backend_runs_the_kernel(device):
    """prefill.causal_attention(..., "fp8") on a call with enough query blocks and keys (on a GPU
    at least FP8_MIN_KEYS) is the kernel's result (on the CPU every call takes the kernel)."""
    T = prefill.FP8_MIN_KEYS if device == "cuda" else 60
    q, k, v = make_inputs(device, 1, 4, 1, T, 20, 64, DTYPE[device])
    out = prefill.causal_attention(q, k, v, 0.125, "fp8")
    assert torch.equal(out, fp8_causal_attention(q, k, v, 0.125))


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_writes_in_place_over_q(device):
    """out=q: each CTA reads its queries before it writes their rows, so the result is the same."""
    q, k, v = make_inputs(device, 1, 4, 2, 70, 30, 64, DTYPE[device])
    want = fp8_causal_attention(q, k, v, 0.125)
    assert fp8_causal_attention(q, k, v, 0.125, out=q) is q
    assert torch.equal(q, want)


# ---- the user's choice ----------------------------------------------------------------------


def test_check_prefill_attention_names_and_devices(monkeypatch):
    cpu = torch.device("cpu")
    assert prefill.check_prefill_attention("auto", cpu, 128) == "auto"
    with pytest.raises(ValueError, match="unknown prefill attention 'fp16'; use one of auto, fp8"):
        prefill.check_prefill_attention("fp16", cpu, 128)
    with pytest.raises(ValueError, match="not on the cpu"):
        prefill.check_prefill_attention("fp8", cpu, 128)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"compute capability 8.9 or newer\); NVIDIA A100-SXM4-80GB has 8.0"):
        prefill.check_prefill_attention("fp8", cuda, 128)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert prefill.check_prefill_attention("fp8", cuda, 128) == "fp8"
    with pytest.raises(ValueError, match="head_dim 32, 64, 128, not 80"):
        prefill.check_prefill_attention("fp8", cuda, 80)


# ---- the model ------------------------------------------------------------------------------


@pytest.mark.skipif(not INTERPRETED, reason="kernel compiled for the GPU in this process")
def test_shipped_model_prefill_with_fp8_attention_keeps_its_predictions():
    """The shipped model (head_dim 32) prefilling 160 held-out tokens with backend "fp8" (every
    layer's attention through the kernel) against its default prefill: the next-token
    distributions of every position stay close (KL) and mostly keep their top token."""
    from minidecode import LLM
    from minidecode.models.cache import KVCache

    llm = LLM(device="cpu", dtype="float32")
    cfg = llm.config
    _, texts = stdlib_corpus.load_split("heldout", max_chars=4000)
    ids = torch.tensor([llm.tokenizer.encode("\n".join(texts))[:160]])
    logits = {}
    for backend in (None, "fp8"):
        cache = KVCache(cfg.num_layers, 1, cfg.num_kv_heads, 160, cfg.head_dim, torch.float32, "cpu")
        with torch.inference_mode():
            hidden = llm.model.prefill(ids, cache, 2048, backend, last_only=False)
        logits[backend] = llm.model.logits(hidden[0]).log_softmax(-1)
    ref, fp8 = logits[None], logits["fp8"]
    kl = (ref.exp() * (ref - fp8)).sum(-1)
    top1 = (ref.argmax(-1) == fp8.argmax(-1)).float().mean().item()
    print(f"fp8 prefill on the shipped model: KL mean {kl.mean():.2e} max {kl.max():.2e}, top-1 {top1:.3f}")
    assert kl.mean() < 1e-2 and top1 > 0.9
    assert max_rel_err(fp8, ref) > 0  # the kernel ran (float32 attention would match exactly)


# ---- GPU: every config, repeatability, chunks, long offsets, routing ---------------------------

NEEDS_CUDA = pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs a CUDA device")
# (B, Hq, Hkv, T, past): a whole prompt of several blocks with a partial last one, a chunk after
# an unaligned prefix, one query after a prefix.
GPU_CASES = [(1, 8, 2, 1000, 0), (2, 4, 1, 700, 333), (1, 4, 1, 1, 500)]


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(
    "config", fp.CANDIDATE_CONFIGS, ids=lambda c: f"m{c.block_m}n{c.block_n}w{c.num_warps}s{c.num_stages}"
)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"B{c[0]}-{c[1]}q{c[2]}kv-T{c[3]}-past{c[4]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_config_against_float64_on_gpu(config, case, head_dim, dtype):
    if dtype == torch.float16 and (config != fp.HOPPER_CONFIG or head_dim != 128):
        pytest.skip("fp16 q at the default config only")
    if config.warp_specialized and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialized kernel is Hopper's")
    B, Hq, Hkv, T, past = case
    q, k, v = make_inputs("cuda", B, Hq, Hkv, T, past, head_dim, dtype, seed=T + past)
    scale = head_dim**-0.5
    out = fp8_causal_attention(q, k, v, scale, config)
    own = causal_reference(*dequantized_inputs(q, k, v, config.block_n), scale)
    assert torch.isfinite(out).all()
    assert rel_err(out, fp8_attention_twin(q, k, v, scale, config)) < TWIN_TOL["cuda"]
    assert rel_err(out, own) < OWN_TOL
    assert rel_err(out, causal_reference(q, k, v, scale)) < UNQUANTIZED_TOL
    assert torch.equal(out, fp8_causal_attention(q, k, v, scale, config))  # bitwise repeatable


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("head_dim", fp.WARP_SPECIALIZED_HEAD_DIMS)
@pytest.mark.parametrize(
    "case", GPU_CASES + [(1, 32, 8, 4096, 0)], ids=lambda c: f"B{c[0]}-{c[1]}q{c[2]}kv-T{c[3]}-past{c[4]}"
)
def test_warp_specialized_kernel_equals_the_triton_kernel_on_hopper(case, head_dim):
    """The same arithmetic in another schedule: bit for bit the Triton kernel's output (the key
    relabelling stays within a wgmma's 32-key step; a fully masked tile changes units by powers of two)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialized kernel is Hopper's")
    B, Hq, Hkv, T, past = case
    q, k, v = make_inputs("cuda", B, Hq, Hkv, T, past, head_dim, torch.bfloat16, seed=T + past + head_dim)
    ws = fp8_causal_attention(q, k, v, head_dim**-0.5, fp.HOPPER_CONFIG)
    assert torch.equal(ws, fp8_causal_attention(q, k, v, head_dim**-0.5, fp.HOPPER_TRITON_CONFIG))


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("split", [1024, 1000])
def test_chunked_prefill_equals_whole_on_gpu(split):
    """The prompt's attention in two calls (rows [0, split) over keys [0, split), then rows
    [split, N) after that cached prefix) against one call: bitwise where the split is a multiple of
    the tiles (the same K/V blocks and scales, the same query blocks), within the kernel's error
    otherwise (the first call's last K/V block holds fewer keys, so its scales differ)."""
    config = fp.HOPPER_CONFIG
    q, k, v = make_inputs("cuda", 1, 8, 2, 3000, 0, 128, torch.bfloat16, seed=7)
    whole = fp8_causal_attention(q, k, v, 128**-0.5, config)
    first = fp8_causal_attention(q[:, :, :split], k[:, :, :split], v[:, :, :split], 128**-0.5, config)
    second = fp8_causal_attention(q[:, :, split:], k, v, 128**-0.5, config)
    chunked = torch.cat([first, second], 2)
    if split % config.block_m == 0 and split % config.block_n == 0:
        assert torch.equal(chunked, whole)
    else:
        assert rel_err(chunked, whole) < OWN_TOL
        # The second call reads the same K/V blocks; its rows only pass through other query blocks.
        print(
            f"split {split}: rows after it equal the whole call's: {torch.equal(second, whole[:, :, split:])}"
        )
        assert rel_err(second, whole[:, :, split:]) < 1e-3


@pytest.mark.gpu
@NEEDS_CUDA
def test_head_offsets_past_2_to_the_31_on_gpu():
    """q, k, v and the output as views whose head stride puts a head's rows past element 2^31
    (the kernels' int64 offsets): a few rows of each head against float64."""
    D, T, rows = 128, 300, 2**24  # a head's stride: 2^24 x 128 = 2^31 elements
    free, _ = torch.cuda.mem_get_info()
    if free < 28 * 2**30:
        pytest.skip("needs 24 GiB of free GPU memory")
    q_store = torch.empty(1, 2, rows, D, dtype=torch.bfloat16, device="cuda")
    kv_store = torch.empty(2, 1, 2, rows, D, dtype=torch.bfloat16, device="cuda")
    try:
        gen = torch.Generator(device="cuda").manual_seed(3)
        q, k, v = q_store[:, :, :T], kv_store[0, :, :, :T], kv_store[1, :, :, :T]
        for x in (q, k, v):
            x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
        out = fp8_causal_attention(q, k, v, D**-0.5)
        own = causal_reference(*dequantized_inputs(q, k, v, fp.HOPPER_CONFIG.block_n), D**-0.5)
        assert rel_err(out, own) < OWN_TOL
    finally:
        del q_store, kv_store


@pytest.mark.gpu
@NEEDS_CUDA
def test_fp8_backend_takes_sdpa_where_the_kernel_does_not_pay():
    """A whole layer's call over 16k keys (32 heads x 128 query blocks = 4096 CTAs of 128 rows on
    Hopper) goes through the kernel; the same layer's first 1000 rows (fewer keys than
    FP8_MIN_KEYS) through SDPA's measured backend, exactly, per KV head as SDPA's fallback takes
    them; and 100 queries after a 16k prefix (32 CTAs: the SMs not filled) through SDPA too."""
    assert prefill.FP8_MIN_KEYS == 16384
    q, k, v = make_inputs("cuda", 1, 32, 8, 16384, 0, 128, torch.bfloat16, seed=1)
    sdpa = prefill.choose_backend(q.device, 128, 4, q.dtype)
    assert torch.equal(prefill.causal_attention(q, k, v, 0.1, "fp8"), fp8_causal_attention(q, k, v, 0.1))
    head = (q[:, :, :1000], k[:, :, :1000], v[:, :, :1000])
    expected = prefill.causal_attention(*head, 0.1, sdpa)
    assert torch.equal(prefill.causal_attention(*head, 0.1, "fp8"), expected)
    short = (q[:, :, -100:], k, v)
    per_head = [
        prefill.causal_attention(short[0][:, 4 * h : 4 * h + 4], k[:, h : h + 1], v[:, h : h + 1], 0.1, sdpa)
        for h in range(8)
    ]
    assert torch.equal(prefill.causal_attention(*short, 0.1, "fp8"), torch.cat(per_head, 1))

"""Transformer.prefill's attention over several KV heads a call, and its RoPE angles made once for
every layer: the result of one attention call per KV head with the angles made per layer, bit for
bit on the CPU (a whole prompt in one or more chunks, a suffix after a cached prefix), and a
float64 forward pass's within rounding; the calls a prompt makes; and the memory rule that picks
the KV heads per call."""

from __future__ import annotations

import pytest
import torch
from helpers import rel_err

from minidecode.loading import build_model
from minidecode.memory import activation_bytes
from minidecode.models import llama
from minidecode.models.cache import KVCache
from minidecode.models.config import ModelConfig
from minidecode.models.presets import preset_config
from minidecode.models.temporaries import chunk_row_elements, prefill_attention_kv_heads, rope_bytes

# 3 KV heads of 2 query heads each: a call of 2 KV heads leaves a group of 1 (uneven groups).
CFG = ModelConfig(
    model_type="llama",
    vocab_size=128,
    hidden_size=48,
    intermediate_size=96,
    num_layers=2,
    num_heads=6,
    num_kv_heads=3,
    head_dim=16,
    max_position_embeddings=4096,
)


@pytest.fixture(scope="module")
def model() -> llama.Transformer:
    model = build_model(CFG, None, torch.device("cpu"), torch.float32)
    for layer in model.model.layers:  # weights of std 0.02 give near-uniform attention: sharper scores
        layer.self_attn.qkv_weight.mul_(8)
    return model


def tokens(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (1, n), generator=gen)


def new_cache(positions: int) -> KVCache:
    return KVCache(CFG.num_layers, 1, CFG.num_kv_heads, positions, CFG.head_dim, torch.float32, "cpu")


def prefill(model, ids: torch.Tensor, cache: KVCache, chunk: int, **kw) -> tuple[torch.Tensor, list]:
    """-> (hidden [1, T, hidden] of every position, the FLOPs prefill_units yields after each unit)."""
    pauses: list = kw.pop("pauses", [])
    with torch.inference_mode():
        units = model.prefill_units(ids, cache, chunk, last_only=False, **kw)
        while True:
            try:
                pauses.append(next(units))
            except StopIteration as done:
                hidden = done.value
                break
    return hidden, pauses


def per_kv_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference form: one attention call per KV head, the RoPE angles made for every layer."""
    monkeypatch.setattr(llama, "prefill_attention_kv_heads", lambda *args: 1)
    monkeypatch.setattr(llama, "rope_bytes", lambda *args: 0)


def float64_forward(model, ids: torch.Tensor) -> torch.Tensor:
    """The model written out in float64 from its weights (default RoPE, causal GQA attention as
    full matrices): final-normed hidden [1, T, hidden], independent of the prefill's code."""
    T, D, G, eps = ids.shape[1], CFG.head_dim, CFG.group_size, CFG.rms_norm_eps

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()

    def heads(x: torch.Tensor, linear) -> torch.Tensor:  # [T, hidden] -> [H, T, D]
        return (x @ linear.weight.double().T).view(T, -1, D).transpose(0, 1)

    inv_freq = 1.0 / CFG.rope.theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq  # [T, D/2]
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()  # [T, D]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat((-x2, x1), -1) * sin

    hidden = torch.ones(T, T, dtype=torch.bool).triu(1)
    x = model.model.embed_tokens.weight.double()[ids[0]]  # [T, hidden]
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        h = norm(x, layer.input_layernorm.weight)
        q, k, v = rotate(heads(h, attn.q_proj)), rotate(heads(h, attn.k_proj)), heads(h, attn.v_proj)
        k, v = k.repeat_interleave(G, 0), v.repeat_interleave(G, 0)  # [Hq, T, D]
        scores = (q @ k.transpose(-1, -2) * attn.scale).masked_fill(hidden, float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, -1)  # [T, Hq * D]
        x = x + out @ attn.o_proj.weight.double().T
        h = norm(x, layer.post_attention_layernorm.weight)
        gate, up = h @ mlp.gate_proj.weight.double().T, h @ mlp.up_proj.weight.double().T
        x = x + (torch.nn.functional.silu(gate) * up) @ mlp.down_proj.weight.double().T
    return norm(x, model.model.norm.weight)[None]


def counted(monkeypatch: pytest.MonkeyPatch, model, events: list | None = None) -> dict[str, int]:
    """Counts of the prefill's causal_attention and cos_sin calls from here on; each attention
    call also appends "attention" to `events`."""
    calls = {"attention": 0, "angles": 0}
    attention, cos_sin = llama.causal_attention, model.rope.cos_sin

    def attention_counted(*args, **kw):
        calls["attention"] += 1
        if events is not None:
            events.append("attention")
        return attention(*args, **kw)

    def cos_sin_counted(*args):
        calls["angles"] += 1
        return cos_sin(*args)

    monkeypatch.setattr(llama, "causal_attention", attention_counted)
    monkeypatch.setattr(model.rope, "cos_sin", cos_sin_counted)
    return calls


@pytest.mark.parametrize(
    "prefix, T, chunk",
    [
        (0, 90, 2048),  # one chunk: a whole layer a call, angles once
        (0, 75, 40),  # two chunks: angles still made once
        (0, 90, 40),  # three chunks: angles per layer
        (100, 40, 32),  # a suffix after a cached prefix
        (100, 300, 2048),
    ],
)
def test_several_kv_heads_a_call_equal_one_call_per_kv_head(model, monkeypatch, prefix, T, chunk):
    ids = tokens(prefix + T, seed=T)
    results = []
    for reference in (False, True):
        with monkeypatch.context() as patch:
            if reference:
                per_kv_head(patch)
            cache = new_cache(prefix + T)
            if prefix:
                prefill(model, ids[:, :prefix], cache, chunk)
            hidden, pauses = prefill(model, ids[:, prefix:], cache, chunk, start=prefix)
        results.append((hidden, cache.k.clone(), cache.v.clone(), sum(pauses)))
    (hidden, k, v, flops), (ref_hidden, ref_k, ref_v, ref_flops) = results
    assert torch.equal(hidden, ref_hidden)
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)
    assert flops == pytest.approx(ref_flops)  # the same attention FLOPs, however grouped


@pytest.mark.parametrize("prefix, T, chunk", [(0, 90, 2048), (0, 75, 40), (100, 300, 2048), (100, 30, 16)])
def test_prefill_against_float64(model, prefix, T, chunk):
    """A whole layer a call, angles once (one chunk, two chunks), a suffix after a cached prefix:
    every position against the float64 forward pass."""
    ids = tokens(prefix + T, seed=4)
    cache = new_cache(prefix + T)
    if prefix:
        prefill(model, ids[:, :prefix], cache, chunk)
    hidden, _ = prefill(model, ids[:, prefix:], cache, chunk, start=prefix)
    ref = float64_forward(model, ids)[:, prefix:]
    assert rel_err(hidden, ref) < 1e-5


@pytest.mark.parametrize("T, chunk, chunks, angles", [(40, 2048, 1, 1), (75, 40, 2, 2), (90, 40, 3, 2 * 3)])
def test_the_calls_a_prompt_makes(model, monkeypatch, T, chunk, chunks, angles):
    """One attention call a layer; the RoPE angles once per chunk where all chunks' take no more than
    the one chunk's float64 angles the plan counts (up to two chunks), else per chunk and layer. The
    reference form (the other tests') makes one call per KV head and the angles per layer."""
    ids = tokens(T, seed=1)
    calls = counted(monkeypatch, model)
    hidden, _ = prefill(model, ids, new_cache(T), chunk)
    assert calls == {"attention": CFG.num_layers, "angles": angles}
    calls.update(attention=0, angles=0)
    per_kv_head(monkeypatch)
    ref, _ = prefill(model, ids, new_cache(T), chunk)
    assert calls == {"attention": CFG.num_layers * CFG.num_kv_heads, "angles": CFG.num_layers * chunks}
    assert torch.equal(hidden, ref)


def test_kv_heads_a_call_stay_within_the_chunk_temporaries_the_plan_counts():
    """Llama-3-8B in bf16 with the GPU's 8192-row chunks: a whole layer a call up to ~140k rows;
    fewer beyond, with small chunks, or with the FP8 kernel's K/V after a long cached prefix; and
    what a call makes never exceeds one chunk's temporaries, which activation_bytes counts."""
    cfg, bf16 = preset_config("llama-3-8b"), torch.bfloat16
    K = 1024

    def heads(rows: int, chunk: int = 8192, keys: int | None = None, fp8: bool = False) -> int:
        return prefill_attention_kv_heads(cfg, 1, rows, keys or rows, chunk, bf16, fp8)

    assert [heads(n) for n in (1, K, 32 * K, 128 * K)] == [8] * 4
    assert heads(256 * K) == 4 and heads(32 * K, chunk=256) == 1
    assert heads(K, keys=K, fp8=True) == 8 and heads(K, keys=1024 * K, fp8=True) == 1
    for rows, chunk in ((K, 8192), (64 * K, 8192), (256 * K, 8192), (32 * K, 1024)):
        made = heads(rows, chunk) * cfg.group_size * rows * (cfg.head_dim * bf16.itemsize + 4)
        assert heads(rows, chunk) == 1 or made <= min(chunk, rows) * chunk_row_elements(cfg) * bf16.itemsize
    # ... which is activation_bytes's own chunk term: a chunk one row longer adds a row of it.
    cuda = torch.device("cuda")
    grown = activation_bytes(cfg, 64 * K, 8193, bf16, cuda) - activation_bytes(cfg, 64 * K, 8192, bf16, cuda)
    assert grown == chunk_row_elements(cfg) * bf16.itemsize + rope_bytes(cfg, 1)

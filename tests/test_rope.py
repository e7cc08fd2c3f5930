"""RoPE: inverse frequencies and attention scaling against transformers' own init functions for
every type, and rotation angles formed in float64 (checked against exact float64 math)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from minidecode.models.config import ModelConfig
from minidecode.models.rope import RotaryEmbedding


def phi3_factors(n: int, top: float) -> list[float]:
    return [1.0 + (top - 1.0) * (i / (n - 1)) ** 2 for i in range(n)]


# name -> (head_dim, max_position_embeddings, rope_parameters): tiny ones and real models' values.
CASES: dict[str, tuple[int, int, dict]] = {
    "default": (64, 2048, {"rope_type": "default", "rope_theta": 10000.0}),
    "default-llama3-8b": (128, 8192, {"rope_type": "default", "rope_theta": 500000.0}),
    "default-head-dim-24": (24, 2048, {"rope_type": "default", "rope_theta": 10000.0}),
    "linear": (64, 8192, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "linear-2.5": (128, 32768, {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.5}),
    "dynamic": (64, 2048, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
    "dynamic-128": (128, 4096, {"rope_type": "dynamic", "rope_theta": 500000.0, "factor": 8.0}),
    "yarn-qwen2.5": (
        128,
        131072,
        {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768},
    ),
    "yarn-mscale": (
        64,
        163840,
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    ),
    "yarn-no-truncate": (
        128,
        65536,
        {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 16,
            "beta_slow": 2,
            "attention_factor": 1.2,
            "truncate": False,
        },
    ),
    "yarn-implicit-factor": (
        64,
        8192,
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0},  # original = max positions
    ),
    "llama3.1-8b": (
        128,
        131072,
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "llama3.2-1b": (
        64,
        131072,
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "longrope-phi3": (
        96,
        131072,
        {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 4096,
            "short_factor": phi3_factors(48, 1.2),
            "long_factor": phi3_factors(48, 40.0),
        },
    ),
    "longrope-explicit": (
        16,
        2048,
        {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "factor": 6.0,
            "attention_factor": 1.1,
            "original_max_position_embeddings": 256,
            "short_factor": [1.0 + 0.05 * i for i in range(8)],
            "long_factor": [1.0 + 0.5 * i for i in range(8)],
        },
    ),
}


def configs(name: str) -> tuple[LlamaConfig, ModelConfig]:
    head_dim, max_pos, params = CASES[name]
    hf_config = LlamaConfig(
        vocab_size=32,
        hidden_size=head_dim * 4,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=dict(params),
    )
    # Ours reads the config.json transformers would save.
    return hf_config, ModelConfig.from_dict(hf_config.to_dict())


def hf_init(hf_config: LlamaConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    rope_type = hf_config.rope_parameters["rope_type"]
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config)
    # The models call it with seq_len as a 0-d tensor (max position + 1): do the same.
    seq = None if seq_len is None else torch.tensor(seq_len)
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", seq_len=seq)


def test_every_rope_type_is_covered():
    from minidecode.models.config import ROPE_TYPES

    assert {CASES[name][2]["rope_type"] for name in CASES} == set(ROPE_TYPES)


@pytest.mark.parametrize(
    "name", [n for n in CASES if CASES[n][2]["rope_type"] not in ("dynamic", "longrope")]
)
def test_static_inv_freq_matches_transformers(name):
    hf_config, cfg = configs(name)
    ref_inv_freq, ref_scaling = hf_init(hf_config)
    ours = RotaryEmbedding(cfg)
    assert ours.inv_freq.dtype == torch.float32
    torch.testing.assert_close(ours.inv_freq, ref_inv_freq, rtol=1e-7, atol=0)
    assert ours.attention_scaling == pytest.approx(ref_scaling, rel=1e-12)
    for seq_len in (1, cfg.max_position_embeddings, 4 * cfg.max_position_embeddings):  # independent of length
        torch.testing.assert_close(ours.inv_freq_for(torch.tensor(seq_len)), ref_inv_freq, rtol=1e-7, atol=0)


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][2]["rope_type"] == "dynamic"])
def test_dynamic_ntk_inv_freq_matches_transformers(name):
    hf_config, cfg = configs(name)
    ours = RotaryEmbedding(cfg)
    max_pos = cfg.max_position_embeddings
    base_inv_freq, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config)
    for seq_len in (1, max_pos - 1, max_pos, max_pos + 1, 3 * max_pos + 17, 1_000_000):
        ref, ref_scaling = hf_init(hf_config, seq_len)
        got = ours.inv_freq_for(torch.tensor(seq_len))
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=0, msg=f"seq_len {seq_len}")
        assert ours.attention_scaling == ref_scaling
        if seq_len <= max_pos:  # no scaling within the trained length
            torch.testing.assert_close(got, base_inv_freq, rtol=1e-6, atol=0)
        elif seq_len > 2 * max_pos:  # the lowest frequency really moves
            assert got[-1] < base_inv_freq[-1] * 0.9


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][2]["rope_type"] == "longrope"])
def test_longrope_inv_freq_matches_transformers(name):
    hf_config, cfg = configs(name)
    ours = RotaryEmbedding(cfg)
    original = cfg.rope.original_max_position_embeddings
    short, _ = hf_init(hf_config, original)
    long, _ = hf_init(hf_config, original + 1)
    assert not torch.equal(short, long)
    for seq_len, ref in ((1, short), (original, short), (original + 1, long), (10 * original, long)):
        got = ours.inv_freq_for(torch.tensor(seq_len))
        torch.testing.assert_close(got, ref, rtol=1e-7, atol=0, msg=f"seq_len {seq_len}")
    _, ref_scaling = hf_init(hf_config)
    assert ours.attention_scaling == pytest.approx(ref_scaling, rel=1e-12)


@pytest.mark.parametrize("name", list(CASES))
def test_cos_sin_match_transformers_rotary_embedding(name):
    """Layout (rotate-half, cat of two halves) and attention scaling, at positions where
    transformers' float32 angles are still accurate; seq_len = last position + 1 as in a forward."""
    hf_config, cfg = configs(name)
    positions = torch.arange(0, 600)[None]  # [1, T]
    if cfg.rope.rope_type in ("dynamic", "longrope"):  # beyond the threshold too
        positions = positions + (cfg.rope.original_max_position_embeddings or cfg.max_position_embeddings)
    ref_cos, ref_sin = LlamaRotaryEmbedding(hf_config)(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = RotaryEmbedding(cfg).cos_sin(positions, positions.max() + 1)
    assert cos.shape == ref_cos.shape and cos.dtype == torch.float32
    # float32 angles near position 5,000 carry ~3e-4 rad of rounding: that is the reference's error.
    tol = 1e-6 + 8e-8 * positions.max().item()
    torch.testing.assert_close(cos, ref_cos, rtol=0, atol=tol)
    torch.testing.assert_close(sin, ref_sin, rtol=0, atol=tol)


class CaptureCosInputs(TorchFunctionMode):
    """Records every tensor whose cosine is taken: the rotation angles."""

    def __init__(self):
        super().__init__()
        self.inputs: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.cos, torch.Tensor.cos):
            self.inputs.append(args[0].detach().clone())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["default", "llama3.1-8b"])
def test_angles_are_float64_at_position_one_million(name):
    _, cfg = configs(name)
    rope = RotaryEmbedding(cfg)
    half = cfg.head_dim // 2
    pos = list(range(1_000_000, 1_000_016)) + [2**20 - 1]
    positions = torch.tensor([pos])
    inv_freq = [float(f) for f in rope.inv_freq.tolist()]  # float32 values, exactly as doubles
    # position * inv_freq is exact in float64 (20-bit integer times a 24-bit mantissa): the truth.
    exact = [[p * f for f in inv_freq] for p in pos]

    with CaptureCosInputs() as capture:
        cos, sin = rope.cos_sin(positions, torch.tensor(pos[-1] + 1))
    angles = [a for a in capture.inputs if a.shape[-2:] in ((len(pos), half), (len(pos), cfg.head_dim))]
    assert angles, "no cosine of a [T, D] angle tensor was taken"
    got = angles[0].reshape(len(pos), -1)[:, :half]
    assert got.dtype == torch.float64
    err = (got - torch.tensor(exact, dtype=torch.float64)).abs().max().item()
    assert err <= 1e-9

    # float32 angles are visibly wrong here: the float64 path is what makes the difference.
    f32 = (positions[0].float()[:, None] * rope.inv_freq.float()[None]).double()
    assert (f32 - torch.tensor(exact, dtype=torch.float64)).abs().max().item() > 1e-3

    # cos / sin are the float32 roundings of the exact values (1 ulp).
    scale = rope.attention_scaling
    ref_cos = torch.tensor([[math.cos(a) * scale for a in row] for row in exact]).float()
    ref_sin = torch.tensor([[math.sin(a) * scale for a in row] for row in exact]).float()
    ulp = 2 * torch.finfo(torch.float32).eps * scale
    torch.testing.assert_close(cos.reshape(len(pos), -1)[:, :half], ref_cos, rtol=0, atol=ulp)
    torch.testing.assert_close(sin.reshape(len(pos), -1)[:, :half], ref_sin, rtol=0, atol=ulp)
    torch.testing.assert_close(cos.reshape(len(pos), -1)[:, half:], ref_cos, rtol=0, atol=ulp)

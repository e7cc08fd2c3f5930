"""Synthetic models: the presets have the published shapes, and a synthetic model runs end to end."""

import pytest
from typer.testing import CliRunner

import minidecode
from minidecode.models import presets
from minidecode.models.config import RopeConfig
from minidecode_cli.cli import app

# Parameter counts of the published checkpoints (their model cards / safetensors indexes).
PUBLISHED = {
    "llama-3-8b": 8_030_261_248,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3-70b": 70_553_706_496,
    "qwen2.5-7b": 7_615_616_512,
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_preset_matches_published_parameter_count(name):
    assert presets.preset_config(name).num_parameters() == PUBLISHED[name]


def test_llama_3_8b_kv_cache_is_128_kib_per_token():
    assert presets.preset_config("llama-3-8b").kv_bytes_per_token(2) == 128 * 1024


@pytest.fixture
def tiny_preset(monkeypatch):
    shape = dict(
        model_type="llama",
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        rope=RopeConfig(),
    )
    monkeypatch.setitem(presets.PRESETS, "tiny-test", shape)
    return "synthetic:tiny-test"


def test_synthetic_model_generates_exactly_the_requested_tokens(tiny_preset):
    llm = minidecode.LLM(tiny_preset, device="cpu")
    assert llm.synthetic and llm.model.model.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.2)
    # random weights: no eos, and no position limit (its speed is all it is for)
    result = llm.generate(token_ids=llm.random_prompt(100), max_new_tokens=20, temperature=0)
    assert result.stats.new_tokens == 20 and result.finish_reason == "length"
    assert result.stats.prompt_tokens == 100


def test_cli_synthetic_prompt_tokens(tiny_preset):
    run = CliRunner().invoke(
        app, ["generate", tiny_preset, "--prompt-tokens", "50", "-n", "5", "--device", "cpu", "--json"]
    )
    assert run.exit_code == 0, run.output
    assert '"prompt_tokens": 50' in run.output and "RANDOM weights" in run.output


def test_unknown_preset_is_refused():
    with pytest.raises(minidecode.UserError, match="unknown synthetic model 'nope'; known: llama-3-8b"):
        minidecode.LLM("synthetic:nope", device="cpu")

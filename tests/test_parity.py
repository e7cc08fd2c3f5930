"""Parity with transformers on tiny random checkpoints of every family and RoPE type (float32, CPU).

Checkpoints are saved with max_position_embeddings=512 (original 256 for yarn / llama3 / longrope)
and the prompts are longer than that, so dynamic NTK and LongRoPE really scale, and every prompt
goes through several prefill chunks of a ragged size.
"""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import FAMILIES, ROPES
from helpers import max_rel_err

from minidecode import LLM
from minidecode.models.config import ModelConfig

PROMPT = 1040  # >= 1,000 tokens: four chunks of CHUNK, the last one partial
CHUNK = 300
NEW = 32
MAX_POS = 512
TOL = 1e-4

FAMILY_NAMES = list(FAMILIES)
ROPE_NAMES = list(ROPES)


def load(model_dir, **kw) -> LLM:
    return LLM(model_dir, device="cpu", dtype="float32", **kw)


@pytest.mark.parametrize("rope", ROPE_NAMES)
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_logits_match_transformers(checkpoint_factory, hf, prompt_ids, family, rope):
    model_dir = checkpoint_factory(family, rope, max_positions=MAX_POS)
    ids = prompt_ids(PROMPT, seed=1)
    ref = hf.logits(model_dir, ids)  # [T, V]

    llm = load(model_dir, prefill_chunk=CHUNK)
    ours = llm.logits(ids)
    assert ours.shape == ref.shape
    assert max_rel_err(ours, ref) <= TOL

    assert_engine_prefill_matches(llm, ids, ref[-1])


def assert_engine_prefill_matches(llm: LLM, ids: list[int], ref_last: torch.Tensor) -> None:
    """The generation path's prefill (chunked, through the KV cache): its first token is
    transformers' argmax at the last position, with transformers' log-probability."""
    kw = dict(max_new_tokens=1, temperature=0, logprobs=True, allow_extrapolation=True)
    out = llm.generate(token_ids=ids, ignore_eos=True, **kw)  # a first token equal to eos is still returned
    token = int(ref_last.argmax())
    assert out.token_ids == [token]
    assert abs(out.logprobs[0] - ref_last.double().log_softmax(-1)[token].item()) <= TOL


def test_prompt_one_past_a_chunk_boundary(checkpoint_factory, hf, prompt_ids):
    """A last prefill chunk of a single token is computed, not dropped."""
    model_dir = checkpoint_factory("llama", "default", max_positions=MAX_POS)
    ids = prompt_ids(2 * CHUNK + 1, seed=4)
    ref = hf.logits(model_dir, ids)
    llm = load(model_dir, prefill_chunk=CHUNK)
    ours = llm.logits(ids)
    assert ours.shape == ref.shape and max_rel_err(ours, ref) <= TOL
    assert_engine_prefill_matches(llm, ids, ref[-1])


@pytest.mark.parametrize("rope", ROPE_NAMES)
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_greedy_matches_transformers_generate(checkpoint_factory, hf, prompt_ids, family, rope):
    model_dir = checkpoint_factory(family, rope, max_positions=MAX_POS)
    ids = prompt_ids(PROMPT, seed=2)
    ref = hf.greedy(model_dir, ids, NEW)  # eos off: all NEW tokens are compared
    assert len(ref) == NEW

    llm = load(model_dir, prefill_chunk=CHUNK)
    kw = dict(max_new_tokens=NEW, temperature=0, allow_extrapolation=True)
    out = llm.generate(token_ids=ids, ignore_eos=True, **kw)  # like transformers above: run to max_new_tokens
    assert out.token_ids == ref
    assert out.finish_reason == "length"


@pytest.mark.parametrize("rope", [r for r in ROPE_NAMES if r != "default"])
def test_legacy_rope_keys_load_and_match(checkpoint_factory, hf, prompt_ids, rope):
    """Old checkpoints carry `rope_theta` + `rope_scaling` instead of `rope_parameters`."""
    legacy = checkpoint_factory("llama", rope, max_positions=MAX_POS, legacy_rope_keys=True)
    config = json.loads((legacy / "config.json").read_text())
    assert "rope_parameters" not in config and "rope_scaling" in config and "rope_theta" in config

    modern = checkpoint_factory("llama", rope, max_positions=MAX_POS)
    ours_cfg = ModelConfig.from_file(legacy / "config.json")
    assert ours_cfg.rope == ModelConfig.from_file(modern / "config.json").rope

    ids = prompt_ids(PROMPT, seed=3)
    ref = hf.logits(legacy, ids)
    llm = load(legacy, prefill_chunk=CHUNK)
    assert max_rel_err(llm.logits(ids), ref) <= TOL
    assert_engine_prefill_matches(llm, ids, ref[-1])


def test_legacy_type_key(checkpoint_factory, hf, prompt_ids, tmp_path):
    """The oldest spelling: rope_scaling {"type": "linear", "factor": ...}."""
    import shutil

    src = checkpoint_factory("llama", "linear", max_positions=MAX_POS, legacy_rope_keys=True)
    model_dir = tmp_path / "ckpt"
    shutil.copytree(src, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_scaling"] = {"type": "linear", "factor": 4.0}
    (model_dir / "config.json").write_text(json.dumps(config))
    assert ModelConfig.from_file(model_dir / "config.json").rope.rope_type == "linear"

    ids = prompt_ids(300, seed=4)
    assert max_rel_err(load(model_dir).logits(ids), hf.logits(model_dir, ids)) <= TOL

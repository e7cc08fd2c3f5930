"""The FP8 KV cache on CUDA (skipped without a GPU): CUDA-graph decoding equals eager decoding
over 256 greedy steps, and FP8 greedy agrees with the bf16 cache's up to the first near-tie.
(The Triton FP8 cache writer against its twin in bf16: tests/test_fp8_cache.py, marked gpu.)"""

from __future__ import annotations

import pytest
import torch
from test_fp8_cache import NEAR_TIE, decode_logits, first_divergence

from minidecode import LLM
from minidecode.models.cache import FP8

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir(checkpoint_factory):
    return checkpoint_factory("gpu-llama-hd64", "default", max_positions=4096)  # head_dim 64


def test_cuda_graph_equals_eager_with_fp8_cache(model_dir, prompt_ids):
    ids = prompt_ids(1500, seed=3)
    runs = {}
    for graph in (True, False):
        llm = LLM(model_dir, device="cuda", dtype="bfloat16", kv_cache_dtype="fp8", cuda_graph=graph)
        result = llm.generate(token_ids=ids, max_new_tokens=256, temperature=0, ignore_eos=True)
        assert len(result.token_ids) == 256 and result.stats.kv_cache_dtype == "fp8_e4m3"
        runs[graph] = result.token_ids
    assert runs[True] == runs[False]


def test_fp8_greedy_agrees_with_bf16_up_to_the_first_near_tie(model_dir, prompt_ids):
    llm = LLM(model_dir, device="cuda", dtype="bfloat16")
    ids = prompt_ids(1500, seed=4)
    steps = 256
    ref_logits, ref_tokens = decode_logits(llm, ids, len(ids), torch.bfloat16, steps, greedy=True)
    _, tokens = decode_logits(llm, ids, len(ids), FP8, steps, greedy=True)
    step, gap, tie = first_divergence(ref_logits, ref_tokens, tokens)
    print(f"bf16 vs FP8 cache, {steps} greedy steps: diverge at {step} (top-2 gap {gap:.4f}); "
          f"first near-tie (< {NEAR_TIE}) at {tie}")  # fmt: skip
    assert step >= tie

"""Parity with transformers on CUDA in bfloat16 (the GPU twin of test_parity.py), and CUDA-graph
decoding against eager decoding. Skipped without a GPU.

Tiny random checkpoints with head_dim 64 (the lean decode kernel takes head_dim 64 or 128), a
prompt of a few thousand tokens and 64+ new tokens. bf16 rounding differs between any two
implementations, so logits are compared loosely and greedy tokens must agree except where
transformers' own top two logits are within bf16 rounding of each other.
"""

from __future__ import annotations

import checkpoints
import pytest
import torch
from helpers import max_rel_err

from minidecode import LLM

pytestmark = pytest.mark.gpu

MAX_POS = 2048
PROMPT = 3000  # beyond MAX_POS: dynamic NTK scales (generation opts in to extrapolation)
NEW = 64
CASES = [
    ("gpu-llama-hd64", "default"),
    ("gpu-llama-hd64", "llama3"),
    ("gpu-llama-hd64", "dynamic"),
    ("gpu-qwen2-hd64", "yarn"),
    ("gpu-qwen3-hd64", "linear"),
]


@pytest.fixture(scope="module")
def gpu_checkpoint(checkpoint_factory):
    def make(family: str, rope: str):  # a head_dim-64 family of checkpoints.GPU_FAMILIES
        return checkpoint_factory(family, rope, max_positions=MAX_POS)

    return make


def hf_bf16(model_dir):
    return checkpoints.hf_model(model_dir).to("cuda", torch.bfloat16)


@torch.no_grad()
def hf_greedy(model_dir, ids: list[int], new: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' bf16 greedy generate: new tokens and the raw logits [V] of each step."""
    model = hf_bf16(model_dir)  # fresh: dynamic RoPE keeps state
    model.generation_config.eos_token_id = None
    prompt = torch.tensor([ids], device="cuda")
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, len(ids) :].tolist(), [step[0].float() for step in out.logits]


@pytest.mark.parametrize("family,rope", CASES)
def test_bf16_logits_close_to_transformers(gpu_checkpoint, prompt_ids, family, rope):
    model_dir = gpu_checkpoint(family, rope)
    ids = prompt_ids(PROMPT, seed=1)
    with torch.no_grad():
        ref_bf16 = hf_bf16(model_dir)(torch.tensor([ids], device="cuda")).logits[0].float()
        ref_fp32 = checkpoints.hf_model(model_dir).cuda()(torch.tensor([ids], device="cuda")).logits[0]
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", prefill_chunk=1024)
    ours = llm.logits(ids)
    assert max_rel_err(ours, ref_fp32) < 3e-2
    # transformers' own bf16 run is the noisier one where it rounds cos/sin to bf16 after YaRN's
    # attention scaling (~6e-2 from float32 here): allow its own distance from float32.
    assert max_rel_err(ours, ref_bf16) < max(3e-2, 1.5 * max_rel_err(ref_bf16, ref_fp32))


@pytest.mark.parametrize("family,rope", CASES)
def test_fp32_on_cuda_matches_transformers(gpu_checkpoint, prompt_ids, family, rope):
    """float32 on the GPU (SDPA prefill, the lean decode kernel, fused kernels): as tight as the CPU."""
    model_dir = gpu_checkpoint(family, rope)
    ids = prompt_ids(PROMPT, seed=4)
    model = checkpoints.hf_model(model_dir).cuda()
    with torch.no_grad():
        ref = model(torch.tensor([ids], device="cuda")).logits[0]
    llm = LLM(model_dir, device="cuda", dtype="float32", prefill_chunk=1024)
    assert max_rel_err(llm.logits(ids), ref) <= 1e-4
    kw = dict(max_new_tokens=NEW, temperature=0, allow_extrapolation=True)
    ours = llm.generate(token_ids=ids, ignore_eos=True, **kw)
    model = checkpoints.hf_model(model_dir).cuda()  # fresh: dynamic RoPE keeps state
    model.generation_config.eos_token_id = None
    prompt = torch.tensor([ids], device="cuda")
    ref_tokens = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False, pad_token_id=0
    )[0, len(ids) :].tolist()
    assert ours.token_ids == ref_tokens


@pytest.mark.parametrize("family,rope", CASES)
def test_bf16_greedy_matches_transformers_up_to_ties(gpu_checkpoint, prompt_ids, family, rope):
    model_dir = gpu_checkpoint(family, rope)
    ids = prompt_ids(PROMPT, seed=2)
    ref, ref_logits = hf_greedy(model_dir, ids, NEW)
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", prefill_chunk=1024)
    kw = dict(max_new_tokens=NEW, temperature=0, allow_extrapolation=True)
    ours = llm.generate(token_ids=ids, ignore_eos=True, **kw).token_ids
    assert len(ours) == len(ref) == NEW
    diverge = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b), None)
    if diverge is None:
        return
    # At the first divergence transformers' own choice must have been a near tie in bf16.
    logits = ref_logits[diverge]
    top2 = logits.topk(2)
    gap = (top2.values[0] - top2.values[1]).item()
    assert gap < 0.05 * logits.abs().max().item(), (
        f"diverged at step {diverge} ({ours[diverge]} vs {ref[diverge]}) with a clear top-1 margin {gap:.4f}"
    )
    assert ours[diverge] in top2.indices.tolist()


GRAPH_CASES = [("gpu-llama-hd64", "default"), ("gpu-qwen2-hd64", "dynamic")]


def graph_and_eager_runs(gpu_checkpoint, prompt_ids, family, rope, **sampling) -> dict[bool, list[list[int]]]:
    """Two 256-token generations per mode on one LLM each: CUDA graph replay and eager steps."""
    model_dir = gpu_checkpoint(family, rope)
    ids = prompt_ids(PROMPT, seed=3)
    runs = {}
    for graph in (True, False):
        llm = LLM(model_dir, device="cuda", dtype="bfloat16", cuda_graph=graph)
        kw = dict(max_new_tokens=256, allow_extrapolation=True, ignore_eos=True)
        runs[graph] = [llm.generate(token_ids=ids, **kw, **sampling).token_ids for _ in range(2)]
        assert all(len(r) == 256 for r in runs[graph])
    return runs


@pytest.mark.parametrize("family,rope", GRAPH_CASES)
def test_cuda_graph_equals_eager_greedy(gpu_checkpoint, prompt_ids, family, rope):
    runs = graph_and_eager_runs(gpu_checkpoint, prompt_ids, family, rope, temperature=0)
    assert runs[True][0] == runs[True][1]  # a reused cache and captured graph change nothing
    assert runs[True][0] == runs[False][0] == runs[False][1]


@pytest.mark.parametrize("family,rope", GRAPH_CASES)
def test_cuda_graph_equals_eager_seeded_sampling(gpu_checkpoint, prompt_ids, family, rope):
    runs = graph_and_eager_runs(gpu_checkpoint, prompt_ids, family, rope, temperature=1.0, top_p=0.9, seed=5)
    assert runs[False][0] == runs[False][1]  # eager: same seed, same tokens
    assert runs[True][0] == runs[True][1]
    assert runs[True][0] == runs[False][0]

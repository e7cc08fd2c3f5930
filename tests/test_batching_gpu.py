"""Batched generation on CUDA: the graph-replayed batch step against the eager one on a ragged
batch, a batch against each request alone, and many short requests without a memory leak.
Skipped without a GPU."""

from __future__ import annotations

import gc

import pytest
import torch

from minidecode import LLM, Request

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir(checkpoint_factory):
    return checkpoint_factory("gpu-llama-hd64", "default", max_positions=4096)


def ragged(prompt_ids) -> list[Request]:
    lengths, news = [700, 33, 2500, 1, 300], [40, 64, 7, 20, 1]
    return [
        Request(token_ids=prompt_ids(n, seed=i), max_new_tokens=m)
        for i, (n, m) in enumerate(zip(lengths, news, strict=True))
    ]


def test_graph_batch_equals_eager_batch_and_each_alone(model_dir, prompt_ids):
    """fp32 on CUDA: the batch through CUDA graphs (buckets 8, 4, 2, 1 as requests finish) gives the
    eager batch's tokens, and each request's tokens alone (fp32: no rounding ties)."""
    items = ragged(prompt_ids)
    graph = LLM(model_dir, device="cuda", dtype="float32")
    eager = LLM(model_dir, device="cuda", dtype="float32", cuda_graph=False)
    kw = dict(temperature=0, ignore_eos=True)
    a = [r.token_ids for r in graph.generate(items, **kw)]
    b = [r.token_ids for r in eager.generate(items, **kw)]
    alone = [graph.generate(x, reuse_prefix=False, **kw).token_ids for x in items]
    assert a == b == alone
    sampled = dict(kw, temperature=1.0, top_p=0.9, seed=3)
    c, d = (llm.generate(items, **sampled) for llm in (graph, eager))
    assert [r.token_ids for r in c] == [r.token_ids for r in d]


def test_a_batch_of_more_than_16_equals_each_alone(model_dir, prompt_ids):
    """fp32 on CUDA, 20 ragged requests: the 32-row bucket, whose o_proj and down split K over the
    GEMV's CTAs (kernels/gemv.py), gives through graphs what the eager batch and each request
    alone give, and then again in a second run (the split's tickets are reset every launch)."""
    items = [
        Request(token_ids=prompt_ids(3 + 37 * i % 400, seed=50 + i), max_new_tokens=2 + i % 9)
        for i in range(20)
    ]
    kw = dict(temperature=0, ignore_eos=True)
    graph = LLM(model_dir, device="cuda", dtype="float32")
    eager = LLM(model_dir, device="cuda", dtype="float32", cuda_graph=False)
    a = [r.token_ids for r in graph.generate(items, **kw)]
    b = [r.token_ids for r in eager.generate(items, **kw)]
    alone = [graph.generate(x, reuse_prefix=False, **kw).token_ids for x in items]
    assert a == b == alone
    assert [r.token_ids for r in graph.generate(items, **kw)] == a


def test_bf16_fp8_batch_runs_and_stays_close(model_dir, prompt_ids):
    """bf16 with an FP8 cache: a ragged batch completes, every result is full length."""
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", kv_cache_dtype="fp8")
    results = llm.generate(ragged(prompt_ids), temperature=0, ignore_eos=True)
    assert [len(r.token_ids) for r in results] == [40, 64, 7, 20, 1]


def test_fp8_graph_batch_equals_eager_batch_and_each_alone(model_dir, prompt_ids):
    """fp32 with an FP8 cache (V blocked, regions on multiples of 64, idle slots on the spare
    block): the graph-replayed batch, the eager batch and each request alone give the same tokens."""
    items = ragged(prompt_ids)
    kw = dict(temperature=0, ignore_eos=True)
    graph = LLM(model_dir, device="cuda", dtype="float32", kv_cache_dtype="fp8")
    eager = LLM(model_dir, device="cuda", dtype="float32", kv_cache_dtype="fp8", cuda_graph=False)
    a = [r.token_ids for r in graph.generate(items, **kw)]
    b = [r.token_ids for r in eager.generate(items, **kw)]
    alone = [graph.generate(x, reuse_prefix=False, **kw).token_ids for x in items]
    assert a == b == alone


def test_a_thousand_short_requests_leave_no_leak(model_dir, prompt_ids):
    """Two runs of 1,000 short requests through 16 rows: the second allocates nothing that stays
    (every finished row, region and cached prefix is reused or given back)."""
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", max_batch=16)
    items = [Request(token_ids=prompt_ids(5 + i % 50, seed=i), max_new_tokens=1 + i % 7) for i in range(1000)]
    llm.generate(items, temperature=0, ignore_eos=True)  # compiles, captures and sizes the cache
    gc.collect()  # garbage of earlier tests in this process must not be freed inside the measurement
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    results = llm.generate(items, temperature=0, ignore_eos=True)
    torch.cuda.synchronize()
    assert all(r.error is None for r in results)
    assert [len(r.token_ids) for r in results] == [x.max_new_tokens for x in items]
    assert torch.cuda.memory_allocated() == before

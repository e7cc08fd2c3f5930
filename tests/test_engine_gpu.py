"""The engine's newer steps on CUDA, where they run through CUDA graphs and the compiled kernels:
the step with drafts (prompt-lookup speculation) and the mixed step (a prompt prefilling in chunks
beside running streams). fp32, so no rounding tie can flip a greedy token: each must give exactly
the plain run's tokens. Skipped without a GPU."""

from __future__ import annotations

import time

import pytest
from conftest import random_ids
from test_speculation_engine import CLASS, CODE, REPEATS

from minidecode import LLM, Request
from minidecode.engine import Engine

pytestmark = pytest.mark.gpu

GREEDY = dict(temperature=0, ignore_eos=True, reuse_prefix=False)


@pytest.fixture(scope="module")
def model_dir(checkpoint_factory):
    return checkpoint_factory("gpu-llama-hd64", "default", max_positions=4096)


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_speculation_on_cuda_gives_the_plain_tokens(kv):
    """The shipped model: drafts of up to 1, 4, 8 and 16 tokens through the draft step's graphs
    (and eagerly), alone and in a batch mixing them with plain rows: the plain run's tokens, with
    drafts accepted; a seeded sampled request draws the same tokens twice, and alone as in a batch."""
    graph = LLM(device="cuda", dtype="float32", kv_cache_dtype=kv)  # the shipped model: it copies
    eager = LLM(device="cuda", dtype="float32", kv_cache_dtype=kv, cuda_graph=False)
    prompts = [graph.tokenizer.encode(text) for text in (REPEATS, CODE, CLASS, CODE + REPEATS)]
    plain = [graph.generate(token_ids=p, max_new_tokens=96, **GREEDY).token_ids for p in prompts]
    for llm in (graph, eager):
        for k in (1, 4, 8, 16):
            run = llm.generate(token_ids=prompts[0], max_new_tokens=96, speculate=k, **GREEDY)
            assert run.token_ids == plain[0], (k, llm is graph)
            assert run.stats.accepted_tokens > 0 and run.stats.decode_steps < 95, k
    batch = [
        Request(token_ids=p, max_new_tokens=96, speculate=k)
        for p, k in zip(prompts, (0, 4, 8, 16), strict=True)
    ]
    assert [r.token_ids for r in graph.generate(batch, **GREEDY)] == plain
    sampled = dict(temperature=1.0, top_p=0.9, seed=7, ignore_eos=True, reuse_prefix=False)
    first, again = (
        graph.generate(token_ids=prompts[1], max_new_tokens=64, speculate=8, **sampled) for _ in "ab"
    )
    assert first.token_ids == again.token_ids
    mixed = [
        Request(token_ids=prompts[1], max_new_tokens=64, speculate=8),
        Request(token_ids=prompts[2], max_new_tokens=9),
    ]
    assert graph.generate(mixed, **sampled)[0].token_ids == first.token_ids


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_mixed_steps_on_cuda_give_each_request_its_tokens_alone(model_dir, kv, monkeypatch):
    """Three streams decoding while a 2,500-token prompt arrives: it prefills in mixed steps of at
    most 64 rows (each chunk with the streams' rows in one forward), and every request's tokens are
    its tokens alone."""
    llm = LLM(model_dir, device="cuda", dtype="float32", kv_cache_dtype=kv, step_tokens=64)
    streams = [random_ids(n, seed=10 + n) for n in (40, 300, 900)]
    long = random_ids(2500, seed=3)
    alone = [llm.generate(token_ids=p, max_new_tokens=200, **GREEDY).token_ids for p in streams]
    long_alone = llm.generate(token_ids=long, max_new_tokens=20, **GREEDY).token_ids
    chunks: list[tuple[int, int]] = []
    real = Engine.run

    def run(self, plan, on_progress=None):
        if plan.prefill is not None and plan.prefill.chunk is not None and plan.decode is not None:
            chunks.append(plan.prefill.chunk)
        return real(self, plan, on_progress)

    monkeypatch.setattr(Engine, "run", run)
    results: dict[int, list] = {}
    started: set[int] = set()

    def sink(i):
        def on_event(event) -> None:  # (the loop's thread)
            if event.token is not None:
                started.add(i)
            if event.result is not None:
                results[i] = event.result.token_ids

        return on_event

    def wait(condition, what: str) -> None:
        deadline = time.monotonic() + 60
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.005)

    for i, p in enumerate(streams):
        llm.submit(Request(token_ids=p, max_new_tokens=200, **GREEDY).check(), sink(i))
    wait(lambda: len(started) == 3, "every stream decoding")
    llm.submit(Request(token_ids=long, max_new_tokens=20, **GREEDY).check(), sink(3))
    wait(lambda: len(results) == 4, "the results")
    assert [results[i] for i in range(3)] == alone and results[3] == long_alone
    assert len(chunks) >= 2500 // 64 and chunks[-1][1] == 2500, chunks[-3:]

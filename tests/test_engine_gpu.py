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
def test_the_load_warms_the_steps_of_the_speculate_default(kv):
    """LLM(speculate=8): a request of the default, alone and in a batch, captures its step graphs
    with no warm-up run (every one warmed at load, so no kernel compiles before its prefill) and
    gives the plain tokens; a request speculating further warms the steps it adds."""
    llm = LLM(device="cuda", dtype="float32", kv_cache_dtype=kv, speculate=8)
    loaded = set(llm.engine.graphs.warmed)
    prompts = [llm.tokenizer.encode(text) for text in (REPEATS, CODE, CLASS)]
    plain = llm.generate(token_ids=prompts[0], max_new_tokens=64, speculate=0, **GREEDY)
    spec = llm.generate(token_ids=prompts[0], max_new_tokens=64, **GREEDY)
    llm.generate([Request(token_ids=p, max_new_tokens=48) for p in prompts], **GREEDY)
    assert spec.token_ids == plain.token_ids and spec.stats.accepted_tokens > 0
    assert llm.engine.graphs.warmed == loaded
    llm.generate(token_ids=prompts[0], max_new_tokens=64, speculate=16, **GREEDY)
    largest = 1 + llm.engine.draft_sizes[-1]  # the query rows of the largest draft size (8 runs up to 7)
    added = llm.engine.graphs.warmed - loaded  # keys (bucket, mode, ..., queries, ...)
    assert any(key[5] == largest for key in added)


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


def test_a_mixed_step_graph_is_the_eager_step(model_dir):
    """bf16, where mixed steps run as CUDA graphs: two running rows beside a prompt prefilled up to
    position 40; its chunks 40..57 and 57..82 (both in the graph of 32 chunk rows: the second a
    replay with new bounds) and 82..130 (the 64-row graph, captured with no warm-up of its own)
    through the graphs, against the same steps eagerly: the logits within bf16 rounding, and the
    same K/V."""
    import torch

    from minidecode.engine import Prefilling
    from minidecode.sampling import SamplingParams

    engine = LLM(model_dir, device="cuda", dtype="bfloat16").engine
    assert engine.mixed.graphed
    size = -(-512 // engine.granule) * engine.granule
    engine.resize(3 * size)
    for t in engine.cache.tensors().values():
        t.zero_()
    prompts, greedy = [random_ids(n, seed=n) for n in (23, 31, 300)], SamplingParams(temperature=0)
    runs = []
    with torch.inference_mode():
        for row, ids in enumerate(prompts[:2]):
            engine.sample_first(row, engine.prefill(ids, row * size, size, 0), greedy, False)
            engine.start_row(row, row * size, len(ids), greedy)
        engine.prefill(prompts[2][:40], 2 * size, size, 0)
        before = {name: t.clone() for name, t in engine.cache.tensors().items()}
        for graphed in (True, False):
            for name, t in engine.cache.tensors().items():
                t.copy_(before[name])
            engine.mixed.graphed = graphed
            work = Prefilling(prompts[2], 2 * size, size, 40)
            chunks = ((40, 57), (57, 82), (82, 130))
            logits = [engine._mixed_logits(work, chunk, 2).clone() for chunk in chunks]
            runs.append((logits, {name: t.clone() for name, t in engine.cache.tensors().items()}))
    (graph_logits, graph_cache), (eager_logits, eager_cache) = runs
    assert {(32, 2), (64, 2)} <= set(engine.mixed._graphs)
    for got, want in zip(graph_logits, eager_logits, strict=True):
        assert (got - want).abs().max() < 0.05 * want.abs().max(), (got - want).abs().max()
    for name, t in eager_cache.items():
        real = slice(0, engine.spare_start)
        torch.testing.assert_close(graph_cache[name][:, :, :, real], t[:, :, :, real], rtol=2e-2, atol=2e-2)


def test_mixed_step_graphs_are_captured_again_after_the_cache_grows(model_dir):
    """A mixed-step graph captured, the cache grown (its graphs dropped), then a chunk of a new size
    captured and replayed: the capture into the graphs' memory pool must not fail (the dropped
    graphs' pool is not reused), and the step's logits are the eager step's."""
    import torch

    from minidecode.engine import Prefilling
    from minidecode.sampling import SamplingParams

    engine = LLM(model_dir, device="cuda", dtype="bfloat16").engine
    size = -(-512 // engine.granule) * engine.granule
    engine.resize(3 * size)
    greedy = SamplingParams(temperature=0)
    prompts = [random_ids(n, seed=n) for n in (23, 300)]
    with torch.inference_mode():
        engine.sample_first(0, engine.prefill(prompts[0], 0, size, 0), greedy, False)
        engine.start_row(0, 0, len(prompts[0]), greedy)
        engine.prefill(prompts[1][:40], size, size, 0)
        engine._mixed_logits(Prefilling(prompts[1], size, size, 40), (40, 57), 1)  # the 32-row graph
        assert engine.mixed._graphs
        engine.resize(4 * size, keep=3 * size)  # grown in place: every graph dropped
        assert not engine.mixed._graphs
        work = Prefilling(prompts[1], size, size, 57)
        graphed = engine._mixed_logits(work, (57, 120), 1).clone()  # the 64-row graph, a new capture
        assert (64, 1) in engine.mixed._graphs
        engine.mixed.graphed = False
        eager = engine._mixed_logits(work, (57, 120), 1)
    assert (graphed - eager).abs().max() < 0.05 * eager.abs().max(), (graphed - eager).abs().max()

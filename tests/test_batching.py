"""Batched generation on the CPU against transformers (fp32): a ragged batch yields, per request,
exactly the tokens the request yields alone; the order and company of a batch do not matter;
continuous batching refills rows and regions; refused requests do not stop the others; the cache
is sized within the memory it may take."""

from __future__ import annotations

import pytest
import torch

from minidecode import LLM, Request
from minidecode import engine as engine_module
from minidecode.cache import Regions
from minidecode.kernels.quant import V_BLOCK
from minidecode.models.llama import Attention

MAX_POS = 512


def load(model_dir, **kw) -> LLM:
    return LLM(model_dir, device="cpu", dtype="float32", **kw)


@pytest.fixture(scope="module")
def llama(checkpoint_factory):
    return checkpoint_factory("llama", "default", max_positions=MAX_POS)


@pytest.fixture(scope="module")
def ragged(prompt_ids):
    """Prompts of different lengths, each with its own max_new_tokens."""
    lengths, news = [37, 5, 120, 64, 9], [12, 20, 3, 16, 1]
    return [(prompt_ids(n, seed=10 + i), m) for i, (n, m) in enumerate(zip(lengths, news, strict=True))]


def test_ragged_batch_equals_transformers_alone(llama, hf, ragged):
    """Each request of a ragged batch (lengths 5-120, max_new_tokens 1-20, eos honoured) gets
    transformers' greedy tokens for it alone."""
    llm = load(llama)
    items = [Request(token_ids=ids, max_new_tokens=m) for ids, m in ragged]
    results = llm.generate(items, temperature=0)
    for (ids, m), result in zip(ragged, results, strict=True):
        assert result.token_ids == hf.greedy(llama, ids, m, eos=True)
        assert result.finish_reason in ("eos", "length") and result.error is None
        assert result.prompt_token_ids == ids and result.stats.prompt_tokens == len(ids)


@pytest.mark.parametrize("max_batch", [1, 2, 32])
def test_order_and_batch_size_do_not_matter(llama, ragged, max_batch):
    """Reversed order, and 1 / 2 rows (so finished rows are refilled from the queue: continuous
    batching): every request's tokens equal its tokens alone."""
    llm = load(llama)
    alone = [
        llm.generate(token_ids=ids, max_new_tokens=m, temperature=0, ignore_eos=True).token_ids
        for ids, m in ragged
    ]
    items = [Request(token_ids=ids, max_new_tokens=m) for ids, m in ragged][::-1]
    results = load(llama, max_batch=max_batch).generate(items, temperature=0, ignore_eos=True)
    assert [r.token_ids for r in results][::-1] == alone


def test_seeded_sampling_does_not_depend_on_the_batch(llama, ragged):
    """A seeded request draws the same tokens alone, in a batch, and in a batch of other company
    (the randomness is a hash of its seed and positions, not a shared generator)."""
    llm = load(llama)
    ids = ragged[0][0]
    kw = dict(temperature=1.0, top_k=50, top_p=0.9, max_new_tokens=16, ignore_eos=True)
    alone = llm.generate(token_ids=ids, seed=7, **kw).token_ids
    target = Request(token_ids=ids, seed=7)
    others = [Request(token_ids=o, seed=i) for i, (o, _) in enumerate(ragged[1:])]
    first = llm.generate([target, *others], **kw)[0].token_ids
    last = llm.generate([*others[:2], Request(token_ids=ids, temperature=0), target], **kw)[-1].token_ids
    assert alone == first == last
    assert llm.generate(token_ids=ids, seed=8, **kw).token_ids != alone  # another seed, other tokens


def test_per_request_settings_stop_strings_and_streaming(llama):
    """Per-request stop strings and limits; the stream yields (index, piece) pairs that add up to
    each result's text; a greedy request inside a sampling batch stays greedy."""
    llm = load(llama)
    text = llm.generate("Hello", max_new_tokens=24, temperature=0, ignore_eos=True).text
    stop = text[6:9]
    assert stop and stop not in text[:6]
    items = [
        Request(prompt="Hello", stop=[stop], max_new_tokens=24),
        Request(prompt="Hello", max_new_tokens=5),
        Request(prompt="Hello", temperature=1.0, seed=3, max_new_tokens=8),
    ]
    pieces: dict[int, str] = {}
    finished = []
    with llm.stream_batch(
        items, temperature=0, ignore_eos=True, on_result=lambda i, r: finished.append(i)
    ) as stream:
        for i, piece in stream:
            pieces[i] = pieces.get(i, "") + piece
    results = stream.results
    assert results[0].finish_reason == "stop" and results[0].text == text[: text.index(stop)]
    assert results[1].finish_reason == "length" and len(results[1].token_ids) == 5
    assert results[1].text == llm.generate("Hello", max_new_tokens=5, temperature=0, ignore_eos=True).text
    assert [pieces.get(i, "") for i in range(3)] == [r.text for r in results]
    assert sorted(finished) == [0, 1, 2]


def test_refused_requests_get_error_results_and_the_others_run(llama, ragged, monkeypatch):
    """An empty prompt, a bad setting, a context beyond the model and one larger than the memory
    allows: each gets an error result naming why; the rest get their tokens."""
    llm = load(llama)
    ids, m = ragged[0]
    alone = llm.generate(token_ids=ids, max_new_tokens=m, temperature=0, ignore_eos=True).token_ids
    engine = llm.engine
    reserved = engine.planner.activations(len(ids))
    llm.release_cache()
    # Memory for 300 positions beside the activations: a 400-token request cannot fit.
    budget = reserved + 300 * engine.planner.kv_bytes_per_token
    monkeypatch.setattr(engine_module, "free_memory", lambda device: budget - engine.cache_bytes)
    items = [
        Request(token_ids=ids, max_new_tokens=m),
        Request(prompt=""),
        Request(prompt="x", temperature=-1.0),
        Request(prompt="x", max_new_tokens=MAX_POS + 10),
        Request(token_ids=ids, max_new_tokens=400 - len(ids)),
        {"prompt": "x", "colour": "red"},
    ]
    results = llm.generate(items, temperature=0, ignore_eos=True)
    assert results[0].token_ids == alone and results[0].error is None
    errors = [r.error for r in results[1:]]
    assert all(r.finish_reason == "error" for r in results[1:])
    assert "empty" in errors[0] and "temperature" in errors[1] and "trained for" in errors[2]
    assert "KV cache" in errors[3] and "colour" in errors[4]


def test_fp8_cache_batch_equals_fp8_alone(llama, ragged):
    llm = load(llama, kv_cache_dtype="fp8")
    alone = [
        llm.generate(token_ids=ids, max_new_tokens=m, temperature=0, ignore_eos=True).token_ids
        for ids, m in ragged
    ]
    results = llm.generate(
        [Request(token_ids=ids, max_new_tokens=m) for ids, m in ragged], temperature=0, ignore_eos=True
    )
    assert [r.token_ids for r in results] == alone
    assert all(r.stats.kv_cache_dtype == "fp8_e4m3" for r in results)


def test_fp8_batch_regions_start_on_v_blocks(llama, ragged, monkeypatch):
    """With an FP8 cache every region is sized up to whole V blocks, so each sequence's start (what
    the decode kernel finds its V blocks from) is a multiple of V_BLOCK, also when finished
    regions are reused (max_batch 2)."""
    seen, attend = [], Attention.attend

    def recording_attend(q, k_cache, v_cache, lengths, scale, **kwargs):
        seen.append(kwargs["starts"].clone())
        return attend(q, k_cache, v_cache, lengths, scale, **kwargs)

    monkeypatch.setattr(Attention, "attend", staticmethod(recording_attend))
    items = [Request(token_ids=ids, max_new_tokens=m) for ids, m in ragged]
    results = load(llama, kv_cache_dtype="fp8", max_batch=2).generate(items, temperature=0, ignore_eos=True)
    assert all(r.error is None for r in results)
    starts = torch.cat(seen)
    assert len(set(starts.tolist())) >= 3 and bool((starts % V_BLOCK == 0).all()), starts.unique()


def test_fp8_cache_rounds_to_v_blocks_within_its_memory(llama, monkeypatch):
    """Memory for 300 positions: a request needing more (263 positions -> 320 in whole V blocks)
    is refused, the other runs in a cache of whole V blocks (its 128 positions, then the idle
    rows' spare block) whose bytes, V's padding included, stay within that memory."""
    llm = load(llama, kv_cache_dtype="fp8")
    engine = llm.engine
    planner = engine.planner
    budget = 300 * planner.kv_bytes_per_token
    reserved = planner.activations(3)
    monkeypatch.setattr(engine_module, "free_memory", lambda device: reserved + budget - engine.cache_bytes)
    requests = [
        Request(token_ids=[1, 2, 3], max_new_tokens=120),
        Request(token_ids=[1, 2, 3], max_new_tokens=260),
    ]
    results = llm.generate(requests, temperature=0, ignore_eos=True)
    assert results[0].error is None and len(results[0].token_ids) == 120
    assert "263 tokens" in results[1].error and "KV cache" in results[1].error
    assert engine.capacity == 128 and engine.cache.max_len == 192  # the spare granule after the regions
    assert engine.cache.v.shape[3] == 3 and engine.cache.nbytes <= budget
    assert engine.state.starts.eq(128).all()  # idle rows write the spare granule, a block start


def test_single_requests_reuse_what_a_batch_left(llama, prompt_ids):
    """A batch's finished sequences stay in the cache as prefixes: a single request that starts
    like one of them reuses it and gets the tokens of a fresh run."""
    llm = load(llama)
    ids = prompt_ids(30, seed=3)
    fresh = load(llama).generate(token_ids=ids, max_new_tokens=6, temperature=0, ignore_eos=True).token_ids
    llm.generate([ids, prompt_ids(10, seed=4)], max_new_tokens=4)
    after = llm.generate(token_ids=ids, max_new_tokens=6, temperature=0, ignore_eos=True)
    assert after.token_ids == fresh and after.stats.reused_tokens == len(ids) - 1


def test_regions_first_fit_and_merge():
    regions = Regions(100)
    a, b, c = regions.take(30), regions.take(30), regions.take(30)
    assert (a, b, c) == (0, 30, 60) and regions.take(20) is None
    regions.give(b, 30)
    assert regions.take(40) is None and regions.take(25) == 30
    regions.give(30, 25)
    regions.give(a, 30)
    assert regions.take(60) == 0  # freed neighbours merged into one range
    regions.give(0, 60)
    regions.give(c, 30)
    assert regions.free == [(0, 100)]


def test_batch_api_rejects_bad_calls(llama):
    from minidecode import UserError

    llm = load(llama)
    with pytest.raises(UserError, match="non-empty list"):
        llm.generate([])
    with pytest.raises(UserError, match="unknown batch setting .colour."):
        llm.generate(["a"], colour="red")
    with pytest.raises(UserError, match="temperature"):
        llm.generate(["a"], temperature=-2)
    assert torch.is_inference_mode_enabled() is False


def test_readme_batch_example_runs_as_written(capsys):
    """The README's "Many prompts at once" block, exactly as written (the shipped model)."""
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = readme.split("**Many prompts at once.**", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    exec(compile(block, "README.md", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("length 32 ") and lines[1].split()[0] in ("stop", "length")
    assert {line.split()[0] for line in lines[2:]} == {"0", "1"}  # pieces of both prompts

"""Batched generation on the CPU against transformers (fp32): a ragged batch yields, per request,
exactly the tokens the request yields alone; the order and company of a batch do not matter;
continuous batching refills rows and regions; refused requests do not stop the others."""

from __future__ import annotations

import pytest
import torch

from minidecode import LLM, PromptRequest
from minidecode import batching as batching_module
from minidecode.batching import Regions
from minidecode.engine import Request, activation_bytes
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
    items = [PromptRequest(token_ids=ids, max_new_tokens=m) for ids, m in ragged]
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
    items = [PromptRequest(token_ids=ids, max_new_tokens=m) for ids, m in ragged][::-1]
    results = llm.generate(items, temperature=0, ignore_eos=True, max_batch=max_batch)
    assert [r.token_ids for r in results][::-1] == alone


def test_seeded_sampling_does_not_depend_on_the_batch(llama, ragged):
    """A seeded request draws the same tokens alone, in a batch, and in a batch of other company
    (the randomness is a hash of its seed and positions, not a shared generator)."""
    llm = load(llama)
    ids = ragged[0][0]
    kw = dict(temperature=1.0, top_k=50, top_p=0.9, max_new_tokens=16, ignore_eos=True)
    alone = llm.generate(token_ids=ids, seed=7, **kw).token_ids
    target = PromptRequest(token_ids=ids, seed=7)
    others = [PromptRequest(token_ids=o, seed=i) for i, (o, _) in enumerate(ragged[1:])]
    first = llm.generate([target, *others], **kw)[0].token_ids
    last = llm.generate([*others[:2], PromptRequest(token_ids=ids, temperature=0), target], **kw)[
        -1
    ].token_ids
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
        PromptRequest(prompt="Hello", stop=[stop], max_new_tokens=24),
        PromptRequest(prompt="Hello", max_new_tokens=5),
        PromptRequest(prompt="Hello", temperature=1.0, seed=3, max_new_tokens=8),
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
    reserved = activation_bytes(
        llm.config, len(ids), engine.prefill_chunk, llm.dtype, llm.device, llm.kv_dtype
    )
    reserved += batching_module.DEFAULT_MAX_BATCH * llm.config.vocab_size * 32
    real_free = batching_module.free_memory
    # Memory for 300 positions beside the activations: a 400-token request cannot fit.
    monkeypatch.setattr(
        batching_module, "free_memory", lambda device: reserved + 300 * engine.kv_bytes_per_token
    )
    items = [
        PromptRequest(token_ids=ids, max_new_tokens=m),
        PromptRequest(prompt=""),
        PromptRequest(prompt="x", temperature=-1.0),
        PromptRequest(prompt="x", max_new_tokens=MAX_POS + 10),
        PromptRequest(token_ids=ids, max_new_tokens=400 - len(ids)),
        {"prompt": "x", "colour": "red"},
    ]
    results = llm.generate(items, temperature=0, ignore_eos=True)
    monkeypatch.setattr(batching_module, "free_memory", real_free)
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
        [PromptRequest(token_ids=ids, max_new_tokens=m) for ids, m in ragged], temperature=0, ignore_eos=True
    )
    assert [r.token_ids for r in results] == alone
    assert all(r.stats.kv_cache_dtype == "fp8_e4m3" for r in results)


def test_fp8_batch_regions_start_on_v_blocks(llama, ragged, monkeypatch):
    """With an FP8 cache every region is sized up to whole V blocks, so each sequence's start (what
    the decode kernel finds its V blocks from) is a multiple of V_BLOCK, also when finished
    regions are reused (max_batch 2)."""
    llm = load(llama, kv_cache_dtype="fp8")
    seen, attend = [], Attention.attend

    def recording_attend(q, k_cache, v_cache, lengths, scale, **kwargs):
        seen.append(kwargs["starts"].clone())
        return attend(q, k_cache, v_cache, lengths, scale, **kwargs)

    monkeypatch.setattr(Attention, "attend", staticmethod(recording_attend))
    items = [PromptRequest(token_ids=ids, max_new_tokens=m) for ids, m in ragged]
    results = llm.generate(items, temperature=0, ignore_eos=True, max_batch=2)
    assert all(r.error is None for r in results)
    starts = torch.cat(seen)
    assert len(set(starts.tolist())) >= 3 and bool((starts % V_BLOCK == 0).all()), starts.unique()


def test_fp8_batch_cache_rounds_to_v_blocks_within_its_memory(llama, monkeypatch):
    """Memory for 300 positions: the FP8 batch cache holds regions up to 256 positions (whole V
    blocks) plus the idle slots' spare position on a block of its own, and its bytes, V's padding
    included, stay within that memory; a request needing more than 256 is refused."""
    llm = load(llama, kv_cache_dtype="fp8")
    engine, cfg = llm.engine, llm.config
    requests = [Request([1, 2, 3], max_new_tokens=120), Request([1, 2, 3], max_new_tokens=260)]
    budget = 300 * engine.kv_bytes_per_token
    reserved = activation_bytes(cfg, 3, engine.prefill_chunk, llm.dtype, llm.device, llm.kv_dtype)
    reserved += 2 * cfg.vocab_size * 32
    monkeypatch.setattr(batching_module, "free_memory", lambda device: reserved + budget)
    batch = batching_module.Batch(engine, requests, max_batch=2)
    assert list(batch._refusals()) == []
    (refused,) = list(batch._allocate())
    assert refused.index == 1 and "only 256 tokens" in refused.error
    assert batch.spare == 256 and batch._cache.max_len == 257
    assert batch._cache.v.shape[3] == 5 and batch._cache.nbytes <= budget
    assert batch._state.starts.eq(256).all()  # idle slots write the spare position, a block start


def test_single_requests_work_after_a_batch(llama, prompt_ids):
    """The batch frees its cache; the next single request allocates its own (and prefix reuse
    starts afresh)."""
    llm = load(llama)
    ids = prompt_ids(30, seed=3)
    before = llm.generate(token_ids=ids, max_new_tokens=6, temperature=0, ignore_eos=True).token_ids
    llm.generate([ids, prompt_ids(10, seed=4)], max_new_tokens=4)
    after = llm.generate(token_ids=ids, max_new_tokens=6, temperature=0, ignore_eos=True)
    assert after.token_ids == before and after.stats.reused_tokens == 0


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
    with pytest.raises(UserError, match="unknown batch settings"):
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

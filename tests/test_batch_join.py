"""Calls from several threads on one LLM join the batch that runs: one batch and one cache for
all of them, each caller's own results equal to transformers' greedy tokens of its prompts alone.

Overlaps are made certain, not timed: the first caller's batch holds a request that ends after
one token, and its on_result (which runs on that caller's thread, so the caller stops reading)
waits until the joiners have been added. Its region (max_context) leaves room for the joiners.
Every wait has a timeout, so a deadlock fails the test instead of hanging it."""

from __future__ import annotations

import threading

import pytest

from minidecode import LLM, GenerationResult, PromptRequest, UserError
from minidecode import batching as batching_module
from minidecode.batching import Batch
from minidecode.engine import Request

MAX_POS = 512
WAIT = 30  # seconds before a wait counts as a deadlock


def load(model_dir) -> LLM:
    return LLM(model_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def llama(checkpoint_factory):
    return checkpoint_factory("llama", "default", max_positions=MAX_POS)


@pytest.fixture(scope="module")
def greedy(llama, hf):
    """transformers' greedy new tokens of (prompt ids, max_new_tokens), run to the length."""
    made: dict = {}

    def tokens(ids: list[int], new: int) -> list[int]:
        if (tuple(ids), new) not in made:
            made[tuple(ids), new] = hf.greedy(llama, ids, new)
        return made[tuple(ids), new]

    return tokens


class Watch:
    """Counts the batches and cache allocations made, and records each non-empty Batch.add:
    (the batch, what it returned); `added(n)` is set once n of them took their requests."""

    def __init__(self, monkeypatch):
        self.batches: list[Batch] = []
        self.caches = 0
        self.adds: list[tuple[Batch, list[int] | None]] = []
        self.taken = threading.Condition()
        real_init, real_add, real_cache = Batch.__init__, Batch.add, batching_module.KVCache
        watch = self

        def init(self, *args, **kwargs):
            watch.batches.append(self)
            real_init(self, *args, **kwargs)

        def add(self, requests):
            indices = real_add(self, requests)
            if requests:
                with watch.taken:
                    watch.adds.append((self, indices))
                    watch.taken.notify_all()
            return indices

        class CountedCache(real_cache):  # the batch's KVCache, counting allocations
            def __init__(self, *args, **kwargs):
                watch.caches += 1
                super().__init__(*args, **kwargs)

        monkeypatch.setattr(Batch, "__init__", init)
        monkeypatch.setattr(Batch, "add", add)
        monkeypatch.setattr(batching_module, "KVCache", CountedCache)

    def wait_adds(self, n: int, refused: bool = False) -> bool:
        """Wait until n adds took their requests (or, refused: until one was turned away)."""

        def seen() -> bool:
            if refused:
                return any(indices is None for _, indices in self.adds)
            return sum(indices is not None for _, indices in self.adds) >= n

        with self.taken:
            return self.taken.wait_for(seen, timeout=WAIT)


def gated(ids: list[int], room: int) -> PromptRequest:
    """The first caller's request that ends after one token, freeing a region of `room` positions."""
    return PromptRequest(token_ids=ids, max_new_tokens=1, max_context=room)


def first_call(llm: LLM, gate_ids: list[int], prompts: list[tuple[list[int], int]], on_result):
    """The first caller's greedy batch: a gated request (room for joiners), then (ids, max_new) prompts."""
    items = [gated(gate_ids, 130)] + [PromptRequest(token_ids=ids, max_new_tokens=m) for ids, m in prompts]
    return llm.generate(items, temperature=0, ignore_eos=True, on_result=on_result)


def start(target, *args) -> tuple[threading.Thread, dict]:
    """Run target(*args) on a thread; its return value or exception lands in the dict."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = target(*args)
        except BaseException as e:  # noqa: BLE001 (the test looks at it)
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def finish(*threads: threading.Thread) -> None:
    for thread in threads:
        thread.join(timeout=WAIT)
    assert not any(thread.is_alive() for thread in threads), "deadlock: a caller never finished"


def test_three_threads_join_one_batch(llama, greedy, prompt_ids, monkeypatch):
    """A runs a batch; while it runs, B's generate([...]) and C's single generate(...) join it:
    one batch, one cache allocation, and every caller's results (in its own order, C's a
    GenerationResult) are transformers' greedy tokens of its prompts alone."""
    llm = load(llama)
    watch = Watch(monkeypatch)
    a_prompts = [(prompt_ids(20, seed=1), 16), (prompt_ids(33, seed=2), 12)]
    b_prompts = [(prompt_ids(17, seed=3), 14), (prompt_ids(9, seed=4), 10)]
    c_ids, c_new = prompt_ids(25, seed=5), 12
    a_ended: list[int] = []

    def on_result(i: int, result: GenerationResult) -> None:
        a_ended.append(i)
        if i == 0:  # A stops reading until B and C are in its batch
            assert watch.wait_adds(3), "B and C never joined"

    def caller_a():
        return first_call(llm, prompt_ids(8, seed=0), a_prompts, on_result)

    def caller_b():
        assert watch.wait_adds(1)
        items = [PromptRequest(token_ids=ids, max_new_tokens=m) for ids, m in b_prompts]
        return llm.generate(items, temperature=0, ignore_eos=True)

    def caller_c():
        assert watch.wait_adds(2)
        return llm.generate(token_ids=c_ids, max_new_tokens=c_new, temperature=0, ignore_eos=True)

    threads, outs = zip(*(start(f) for f in (caller_a, caller_b, caller_c)), strict=True)
    finish(*threads)
    assert [out.get("error") for out in outs] == [None] * 3
    a, b, c = (out["value"] for out in outs)
    assert len(watch.batches) == 1 and watch.caches == 1
    assert [batch for batch, _ in watch.adds] == [watch.batches[0]] * 3
    assert [r.token_ids for r in a[1:]] == [greedy(ids, m) for ids, m in a_prompts]
    assert [r.token_ids for r in b] == [greedy(ids, m) for ids, m in b_prompts]
    assert isinstance(c, GenerationResult) and c.token_ids == greedy(c_ids, c_new)
    assert c.finish_reason == "length" and c.prompt_token_ids == c_ids and c.error is None
    assert sorted(a_ended) == [0, 1, 2]  # A's on_result saw its own requests only


def test_a_joiner_that_closes_early_ends_only_its_own_requests(llama, greedy, prompt_ids, monkeypatch):
    """B joins with two long requests, reads one piece and closes: its requests end (the batch
    hands out few of their tokens), A's requests finish with their greedy tokens."""
    llm = load(llama)
    watch = Watch(monkeypatch)
    a_prompts = [(prompt_ids(21, seed=11), 40), (prompt_ids(30, seed=12), 36)]
    b_closed = threading.Event()

    def on_result(i: int, result: GenerationResult) -> None:
        if i == 0:
            assert b_closed.wait(WAIT), "B never closed"

    def caller_a():
        return first_call(llm, prompt_ids(8, seed=10), a_prompts, on_result)

    def caller_b():
        assert watch.wait_adds(1)
        items = [prompt_ids(12, seed=13), prompt_ids(15, seed=14)]
        with llm.stream_batch(items, max_new_tokens=60, temperature=0, ignore_eos=True) as stream:
            for _ in stream:
                break  # closes the stream
        b_closed.set()
        return stream.results

    (a_thread, a_out), (b_thread, b_out) = start(caller_a), start(caller_b)
    finish(a_thread, b_thread)
    assert a_out.get("error") is None and b_out.get("error") is None
    assert len(watch.batches) == 1 and len(watch.adds) == 2
    assert [r.token_ids for r in a_out["value"][1:]] == [greedy(ids, m) for ids, m in a_prompts]
    a_tokens = 1 + sum(m for _, m in a_prompts)
    b_tokens = watch.batches[0].progress.new_tokens - a_tokens
    assert 1 <= b_tokens <= 8  # of the 120 B asked for: its requests stopped when it left
    assert None in b_out["value"]  # closed before its requests ended
    assert llm.engine.busy is False


def test_the_joiner_goes_on_after_the_first_caller_has_finished(llama, greedy, prompt_ids, monkeypatch):
    """A's requests end (and A returns) while B's still run: B's thread keeps the batch going to
    the end, with its greedy tokens; then the model takes new calls."""
    llm = load(llama)
    watch = Watch(monkeypatch)
    a_ids, b_prompts = prompt_ids(20, seed=21), [(prompt_ids(14, seed=22), 30), (prompt_ids(6, seed=23), 24)]
    a_done = threading.Event()

    def on_result(i: int, result: GenerationResult) -> None:
        if i == 0:
            assert watch.wait_adds(2), "B never joined"

    def caller_a():
        items = [gated(prompt_ids(8, seed=20), 120), PromptRequest(token_ids=a_ids, max_new_tokens=4)]
        results = llm.generate(items, temperature=0, ignore_eos=True, on_result=on_result)
        a_done.set()
        return results

    def caller_b():
        assert watch.wait_adds(1)
        items = [PromptRequest(token_ids=ids, max_new_tokens=m) for ids, m in b_prompts]
        with llm.stream_batch(items, temperature=0, ignore_eos=True) as stream:
            for n, _ in enumerate(stream):
                if n == 0:  # B stops reading: A alone drives until it has all it asked for
                    assert a_done.wait(WAIT), "A never finished"
                    assert None in stream.results  # B's requests outlive A
        return stream.results

    (a_thread, a_out), (b_thread, b_out) = start(caller_a), start(caller_b)
    finish(a_thread, b_thread)
    assert a_out.get("error") is None and b_out.get("error") is None
    assert len(watch.batches) == 1 and a_out["value"][1].token_ids == greedy(a_ids, 4)
    assert [r.token_ids for r in b_out["value"]] == [greedy(ids, m) for ids, m in b_prompts]
    assert llm.generate(
        token_ids=a_ids, max_new_tokens=4, temperature=0, ignore_eos=True
    ).token_ids == greedy(a_ids, 4)


def test_a_call_too_large_for_the_running_cache_waits_for_its_own_batch(
    llama, greedy, prompt_ids, monkeypatch
):
    """B's request needs more positions than A's whole cache: it is not taken (no error result),
    B waits for A's batch to end and runs in a batch (and cache) of its own."""
    llm = load(llama)
    watch = Watch(monkeypatch)
    a_ids, b_ids = prompt_ids(12, seed=31), prompt_ids(40, seed=32)

    def on_result(i: int, result: GenerationResult) -> None:
        if i == 0:
            assert watch.wait_adds(0, refused=True), "B never tried to join"

    def caller_a():
        items = [gated(prompt_ids(8, seed=30), 40), PromptRequest(token_ids=a_ids, max_new_tokens=6)]
        return llm.generate(items, temperature=0, ignore_eos=True, on_result=on_result)

    def caller_b():
        assert watch.wait_adds(1)
        return llm.generate(
            [PromptRequest(token_ids=b_ids, max_new_tokens=200)], temperature=0, ignore_eos=True
        )

    (a_thread, a_out), (b_thread, b_out) = start(caller_a), start(caller_b)
    finish(a_thread, b_thread)
    assert a_out.get("error") is None and b_out.get("error") is None
    assert len(watch.batches) == 2 and watch.caches == 2
    assert a_out["value"][1].token_ids == greedy(a_ids, 6)
    (b,) = b_out["value"]
    assert b.error is None and b.token_ids == greedy(b_ids, 200)


@pytest.mark.parametrize("failure", [RuntimeError("boom"), KeyboardInterrupt()])
def test_an_error_in_the_loop_reaches_every_caller(llama, greedy, prompt_ids, monkeypatch, failure):
    """A decode step fails (a device error; an interrupt) after B joined: A and B both get an
    error naming it, and the model works afterwards (single requests and batches)."""
    llm = load(llama)
    watch = Watch(monkeypatch)
    real_step = Batch._step
    steps_after_join = []

    def step(self, n):
        if watch.wait_adds(2) and len(steps_after_join) == 2:
            raise failure
        if len(watch.adds) >= 2:
            steps_after_join.append(n)
        real_step(self, n)

    def caller_a():
        items = [PromptRequest(token_ids=prompt_ids(20, seed=40), max_new_tokens=30)] * 2
        return llm.generate(items, temperature=0, ignore_eos=True)

    def caller_b():
        assert watch.wait_adds(1)
        return llm.generate(
            token_ids=prompt_ids(10, seed=41), max_new_tokens=30, temperature=0, ignore_eos=True
        )

    monkeypatch.setattr(Batch, "_step", step)
    (a_thread, a_out), (b_thread, b_out) = start(caller_a), start(caller_b)
    finish(a_thread, b_thread)
    monkeypatch.setattr(Batch, "_step", real_step)
    errors = [a_out.get("error"), b_out.get("error")]
    assert all(e is not None for e in errors), errors
    assert sum(e is failure for e in errors) == 1  # the thread that ran the step gets it as it is
    (other,) = [e for e in errors if e is not failure]
    assert isinstance(other, RuntimeError) and repr(failure) in str(other) and other.__cause__ is failure
    assert llm.engine.busy is False
    ids = prompt_ids(15, seed=42)
    assert llm.generate(token_ids=ids, max_new_tokens=8, temperature=0, ignore_eos=True).token_ids == greedy(
        ids, 8
    )
    assert llm.generate([ids], max_new_tokens=8, temperature=0, ignore_eos=True)[0].token_ids == greedy(
        ids, 8
    )


def test_a_thread_with_an_open_stream_that_calls_again_is_refused(llama, greedy, prompt_ids):
    """A thread holding an open batch stream (or single stream) that calls again, batch or single,
    gets the clear error instead of waiting for itself; its stream is left intact."""
    llm = load(llama)
    ids = prompt_ids(18, seed=50)
    refused = []

    def calls_again() -> list[int]:  # on a thread of its own: waiting for itself fails the test
        with llm.stream_batch([ids], max_new_tokens=12, temperature=0, ignore_eos=True) as stream:
            pieces = iter(stream)
            next(pieces)
            for call in (
                lambda: llm.generate(token_ids=ids),
                lambda: llm.generate([ids]),
                lambda: llm.logits(ids),
            ):
                with pytest.raises(UserError, match="still generating.*close the previous stream"):
                    call()
                refused.append(call)
            for _ in pieces:
                pass
        with llm.stream(token_ids=ids, max_new_tokens=12, temperature=0, ignore_eos=True) as single:
            single_pieces = iter(single)
            next(single_pieces)
            with pytest.raises(UserError, match="still generating.*close the previous stream"):
                llm.generate([ids])
            refused.append(single)
        return stream.results[0].token_ids

    thread, out = start(calls_again)
    finish(thread)
    assert out.get("error") is None and len(refused) == 4
    assert out["value"] == greedy(ids, 12)
    assert llm.generate([ids], max_new_tokens=12, temperature=0, ignore_eos=True)[0].token_ids == greedy(
        ids, 12
    )


def test_batch_add_while_running(llama, greedy, prompt_ids):
    """Batch.add during the loop: the request is queued and runs with its greedy tokens; one ended
    by finish() while it waits never runs; one larger than the cache, and any once the batch has
    ended, is not taken (None)."""
    llm = load(llama)
    ids, late = prompt_ids(16, seed=60), prompt_ids(11, seed=61)
    params = llm.sampling_params(0, None, None, None)

    def request(prompt: list[int], new: int, context: int | None = None) -> Request:
        return Request(prompt, params, new, max_context=context, ignore_eos=True)

    batch = Batch(llm.engine, [request(ids, 1, context=60), request(ids, 12)])
    tokens: dict[int, list[int]] = {}
    ends = {}
    added = None
    for event in batch.events():
        if added is None:
            assert batch.add([request(late, 2, context=batch.capacity)]) is None  # no room ever
            added = batch.add([request(late, 10), request(ids, 5)])
            batch.finish(added[1])
        if event.token is not None:
            tokens.setdefault(event.index, []).append(event.token)
        if event.done:
            ends[event.index] = event.generation
    assert added == [2, 3] and tokens[2] == greedy(late, 10) and tokens[1] == greedy(ids, 12)
    assert 3 not in tokens and ends[3].stats.prompt_tokens == 0  # never prefilled
    assert batch.add([request(late, 10)]) is None and batch.progress.done == 4

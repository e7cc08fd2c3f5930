"""The engine loop on the CPU: one worker owns the model; callers on several threads decode in one
batch and each gets exactly its tokens alone (transformers' greedy ones); a closed stream frees
its row at the next step; an error in one request ends only that request; a dying loop reaches
every waiting caller and the next call starts a new one; a long prefill lets running streams
decode beside its chunks. Overlaps are made certain by gates, not by timing; every wait has a
timeout, so a deadlock fails instead of hanging."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time

import pytest
from conftest import greedy_reference

from minidecode import LLM, Request, UserError
from minidecode.engine import Engine
from minidecode.loop import EngineLoop
from minidecode.scheduler import common_prefix

MAX_POS = 2048
WAIT = 60  # seconds before a wait counts as a deadlock


def load(model_dir, **kw) -> LLM:
    return LLM(model_dir, device="cpu", dtype="float32", **kw)


@pytest.fixture(scope="module")
def llama(checkpoint_factory):
    return checkpoint_factory("llama", "default", max_positions=MAX_POS)


@pytest.fixture(scope="module")
def greedy(llama, hf):
    """transformers' greedy new tokens of (prompt ids, max_new_tokens), run to the length."""
    return greedy_reference(hf, llama)


def run_threads(*targets) -> list[dict]:
    """Run each target on its own thread; -> each one's {"value"} or {"error"}."""
    outs = [{} for _ in targets]

    def wrap(target, out):
        try:
            out["value"] = target()
        except BaseException as e:  # noqa: BLE001 (the test looks at it)
            out["error"] = e

    threads = [
        threading.Thread(target=wrap, args=(t, o), daemon=True) for t, o in zip(targets, outs, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=WAIT)
    assert not any(thread.is_alive() for thread in threads), "deadlock: a caller never finished"
    return outs


def record_steps(monkeypatch) -> list[int]:
    """The running rows of every decode step."""
    rows, real = [], Engine.step

    def step(self, n, mode, logprobs, *flags):
        rows.append(n)
        real(self, n, mode, logprobs, *flags)

    monkeypatch.setattr(Engine, "step", step)
    return rows


def test_threads_decode_in_one_batch_each_with_its_own_tokens(llama, greedy, prompt_ids, monkeypatch):
    """Four threads (single requests, a stream, a prompt list) on one LLM: they decode together
    (steps of several rows) and each result equals transformers' greedy tokens of its prompt."""
    llm = load(llama)
    rows = record_steps(monkeypatch)
    gate = threading.Barrier(4, timeout=WAIT)
    prompts = [prompt_ids(20 + 9 * i, seed=60 + i) for i in range(5)]

    def single(i):
        gate.wait()
        return [
            llm.generate(token_ids=prompts[i], max_new_tokens=24, temperature=0, ignore_eos=True).token_ids
        ]

    def streamed():
        gate.wait()
        with llm.stream(token_ids=prompts[2], max_new_tokens=24, temperature=0, ignore_eos=True) as stream:
            for _ in stream:
                pass
        return [stream.result.token_ids]

    def batch():
        gate.wait()
        results = llm.generate([prompts[3], prompts[4]], max_new_tokens=24, temperature=0, ignore_eos=True)
        return [r.token_ids for r in results]

    outs = run_threads(lambda: single(0), lambda: single(1), streamed, batch)
    assert all("error" not in out for out in outs), outs
    got = [t for out in outs for t in out["value"]]
    assert got == [greedy(p, 24) for p in prompts]
    assert max(rows) >= 3  # they shared decode steps


def test_a_stop_string_ends_its_own_request_only(llama, prompt_ids):
    """A stop string of a request from another thread ends that request, not a row of the batch it
    decodes with (the others run to their length and equal their runs alone)."""
    llm = load(llama)
    ids = [prompt_ids(30 + 5 * i, seed=70 + i) for i in range(3)]
    alone = [llm.generate(token_ids=p, max_new_tokens=30, temperature=0, ignore_eos=True) for p in ids]
    stop = alone[1].text[8:12]
    assert stop and stop not in alone[1].text[:8]
    gate = threading.Barrier(2, timeout=WAIT)

    def batch():
        gate.wait()
        return llm.generate([ids[0], ids[2]], max_new_tokens=30, temperature=0, ignore_eos=True)

    def stopped():
        gate.wait()
        return llm.generate(token_ids=ids[1], max_new_tokens=30, temperature=0, ignore_eos=True, stop=stop)

    a, b = run_threads(batch, stopped)
    assert [r.token_ids for r in a["value"]] == [alone[0].token_ids, alone[2].token_ids]
    assert (
        b["value"].finish_reason == "stop" and b["value"].text == alone[1].text[: alone[1].text.index(stop)]
    )


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_closed_stream_frees_its_row_and_a_waiting_one_never_runs(llama, greedy, prompt_ids):
    """Closing a stream mid-way ends it at the next step (no row left running; its region holds
    only the tokens it was fed); closing one that waits for a row ends it without a prefill."""
    llm = load(llama, max_batch=1)
    ids = prompt_ids(40, seed=80)
    a = llm.stream(token_ids=ids, max_new_tokens=400, temperature=0, ignore_eos=True)
    events = a.events()
    for _ in range(3):
        next(events)
    b = llm.stream(token_ids=prompt_ids(12, seed=81), max_new_tokens=5, temperature=0)
    b.close()  # waiting behind a (one row): never runs
    a.close()
    wait_for(lambda: llm.loop.counts() == (0, 0), "the rows to empty")
    (prefix,) = llm.loop.scheduler.prefixes
    assert prefix.ids[:40] == ids and 40 + 3 <= len(prefix.ids) < 40 + 400
    assert prefix.ids[40:] == greedy(ids, len(prefix.ids) - 40)
    c = llm.generate(token_ids=ids, max_new_tokens=10, temperature=0, ignore_eos=True)
    assert c.token_ids == greedy(ids, 10) and c.stats.reused_tokens == 39


def test_an_error_in_one_request_ends_only_that_request(llama, greedy, prompt_ids, monkeypatch):
    """A request whose prefill fails (NaN logits: a UserError) gets its error; the requests beside
    it run on."""
    llm = load(llama)
    real = Engine.prefill_units
    bad = prompt_ids(17, seed=90)

    def prefill_units(self, prompt_ids, *args, **kwargs):
        if prompt_ids == bad:
            raise UserError("the model produced NaN/inf logits (planted)")
        return real(self, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(Engine, "prefill_units", prefill_units)
    good = [prompt_ids(25, seed=91), prompt_ids(9, seed=92)]
    results = llm.generate([good[0], bad, good[1]], max_new_tokens=12, temperature=0, ignore_eos=True)
    assert results[1].finish_reason == "error" and "planted" in results[1].error
    assert [results[0].token_ids, results[2].token_ids] == [greedy(g, 12) for g in good]
    with pytest.raises(UserError, match="planted"):
        llm.generate(token_ids=bad, max_new_tokens=3)


def test_a_dying_loop_reaches_every_caller_and_the_next_call_restarts(llama, greedy, prompt_ids, monkeypatch):
    """A decode step fails (a device error): every caller with a request in the loop gets it as a
    RuntimeError naming it, /health says so at once (while the dying thread still ends), and the
    next call starts a new loop."""
    llm = load(llama)
    rows = record_steps(monkeypatch)
    real = Engine.step
    gate = threading.Barrier(2, timeout=WAIT)

    def step(self, n, mode, logprobs, *flags):
        if n >= 3:  # both callers' requests run: fail
            raise RuntimeError("boom: an illegal memory access (planted)")
        real(self, n, mode, logprobs, *flags)

    monkeypatch.setattr(Engine, "step", step)
    real_die = EngineLoop._die

    def slow_die(self, error):  # the dying thread lingers after the callers heard: no race window hides
        real_die(self, error)
        time.sleep(0.5)

    monkeypatch.setattr(EngineLoop, "_die", slow_die)

    def caller_a():
        gate.wait()
        return llm.generate([prompt_ids(20, seed=93)] * 2, max_new_tokens=40, temperature=0, ignore_eos=True)

    def caller_b():
        gate.wait()
        return llm.generate(
            token_ids=prompt_ids(10, seed=94), max_new_tokens=40, temperature=0, ignore_eos=True
        )

    a, b = run_threads(caller_a, caller_b)
    errors = [a.get("error"), b.get("error")]
    assert all(isinstance(e, RuntimeError) and "boom" in str(e) for e in errors), (a, b, rows)
    assert not llm.loop.healthy
    monkeypatch.setattr(Engine, "step", real)
    ids = prompt_ids(15, seed=95)
    assert llm.generate(token_ids=ids, max_new_tokens=8, temperature=0, ignore_eos=True).token_ids == greedy(
        ids, 8
    )
    assert llm.loop.healthy
    batch = llm.generate([ids, ids], max_new_tokens=8, temperature=0, ignore_eos=True)
    assert [r.token_ids for r in batch] == [greedy(ids, 8)] * 2


def test_a_long_prefill_lets_running_streams_decode(llama, greedy, prompt_ids):
    """While a long prompt prefills (in mixed steps of 32 rows here), the running stream keeps
    getting tokens; both results equal transformers'."""
    llm = load(llama, step_tokens=32)
    short, long = prompt_ids(10, seed=96), prompt_ids(1500, seed=97)
    events: queue.SimpleQueue = queue.SimpleQueue()
    a = llm.submit(
        Request(token_ids=short, max_new_tokens=200, temperature=0, ignore_eos=True).check(), events.put
    )
    first = events.get(timeout=WAIT)
    assert first.token is not None
    b_events: queue.SimpleQueue = queue.SimpleQueue()
    llm.submit(
        Request(token_ids=long, max_new_tokens=5, temperature=0, ignore_eos=True).check(), b_events.put
    )
    b_first = b_events.get(timeout=WAIT)  # the long prompt's first token: its prefill is done
    during = 0
    while not events.empty():
        event = events.get()
        during += event.token is not None and event.index == a.index
        if event.result is not None:
            a_result = event.result
    assert during >= 10, during  # tokens of the running stream handed out during that prefill
    while b_first.result is None:
        b_first = b_events.get(timeout=WAIT)
    assert b_first.result.token_ids == greedy(long, 5)
    while "a_result" not in locals():
        event = events.get(timeout=WAIT)
        if event.result is not None:
            a_result = event.result
    assert a_result.token_ids == greedy(short, 200)


def test_prefix_differing_at_the_first_token_reuses_nothing(llama, greedy, prompt_ids):
    llm = load(llama)
    ids = prompt_ids(30, seed=98)
    llm.generate(token_ids=ids, max_new_tokens=4, temperature=0)
    other = [(ids[0] + 1) % 200 + 3] + ids[1:]
    out = llm.generate(token_ids=other, max_new_tokens=6, temperature=0, ignore_eos=True)
    assert out.stats.reused_tokens == 0 and out.token_ids == greedy(other, 6)
    assert common_prefix([5, 1, 2], [6, 1, 2], 3) == 0 and common_prefix([1, 2, 3], [1, 2, 4], 3) == 2


def test_many_requests_in_little_memory_reuse_freed_regions(llama, greedy, prompt_ids, monkeypatch):
    """60 requests through a cache of about three regions and two rows: every region is given back
    (a region never freed would leave the queue waiting for ever: the per-test timeout fails it)."""
    from minidecode import engine as engine_module

    llm = load(llama, max_batch=2)
    planner, engine = llm.engine.planner, llm.engine
    budget = planner.activations(40) + 3 * 60 * planner.kv_bytes_per_token
    monkeypatch.setattr(engine_module, "free_memory", lambda device: budget - engine.cache_bytes)
    prompts = [prompt_ids(20 + i % 20, seed=200 + i % 7) for i in range(60)]
    results = llm.generate(prompts, max_new_tokens=6, temperature=0, ignore_eos=True)
    assert all(r.error is None for r in results)
    assert [r.token_ids for r in results[:7]] == [greedy(p, 6) for p in prompts[:7]]
    assert engine.capacity <= 3 * 60


def test_an_abandoned_stream_at_exit_prints_nothing(tmp_path):
    """A stream still referenced when the interpreter exits: no 'Exception ignored' noise."""
    script = (
        "from minidecode import LLM\n"
        "llm = LLM(device='cpu')\n"
        "stream = llm.stream('def f(x):', max_new_tokens=50)\n"
        "next(iter(stream))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr.strip() == "", done.stderr


def test_dropping_an_llm_stops_its_loop_and_frees_the_model(llama):
    """The loop's thread holds the model, not the LLM: once the LLM is dropped, the thread stops
    and the weights can be freed."""
    import gc
    import weakref

    llm = load(llama)
    llm.generate(token_ids=[5, 6, 7], max_new_tokens=2)
    model, thread = weakref.ref(llm.model), llm.loop._thread
    del llm
    gc.collect()
    thread.join(timeout=WAIT)
    assert not thread.is_alive()
    gc.collect()
    assert model() is None

"""Mixed steps on the CPU: a prompt that prefills beside running streams goes chunk by chunk, each
chunk in one forward with the streams' decode rows. One mixed step equals a decode step plus the
chunk prefilled on its own (the decode rows' next tokens, every K/V written, the first token); whole
runs give transformers' greedy tokens, and the separate steps' tokens and log-probs (a batch with
reused prefixes, logits processors and log-probs rows, the FP8 cache); a stream gets a token every
step of a long prefill; a prefill whose streams end goes on as a whole prefill; a request that fails
inside a mixed step ends alone."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch
from conftest import greedy_reference, random_ids
from ranks import as_torchrun_rank

from minidecode import LLM, Request, UserError
from minidecode.engine import Engine
from minidecode.mixed import CHUNK_MULTIPLE, MIN_CHUNK, chunk_bucket, chunk_end
from minidecode.models.llama import Transformer
from minidecode.plan import Decode, DecodeKind, Prefill, RowStart, StepPlan
from minidecode.sampling import SamplingParams

WAIT = 60  # seconds before a wait counts as a deadlock
BUDGET = 24  # step_tokens: a 400-token prompt spans about 20 mixed steps


@pytest.fixture(scope="module")
def llama(checkpoint_factory):
    return checkpoint_factory("llama", "default", max_positions=1024)


@pytest.fixture(scope="module")
def greedy(llama, hf):
    """transformers' greedy new tokens of (prompt ids, max_new_tokens)."""
    return greedy_reference(hf, llama)


def load(model_dir, **kw) -> LLM:
    return LLM(model_dir, device="cpu", dtype="float32", step_tokens=BUDGET, **kw)


def record_plans(monkeypatch, log: list) -> None:
    """Append each plan the engine runs to `log` (the loop's thread: in order with the events)."""
    real = Engine.run

    def run(self, plan, on_progress=None):
        if plan.decode is not None or plan.prefill is not None:
            log.append(plan)
        return real(self, plan, on_progress)

    monkeypatch.setattr(Engine, "run", run)


def separate_steps(monkeypatch) -> None:
    """The engine's mixed step as the two steps it replaces: the decode rows' own decode step, then
    the chunk prefilled on its own (a suffix after the positions before it, Engine.prefill)."""

    def mixed_step(self, decode, p, out, on_progress):
        if decode is not None:
            self._decode(decode)
        work, (lo, hi) = self._prefilling, p.chunk
        logits = self.prefill(work.prompt[:hi], work.start, work.size, lo)
        work.done = hi
        if hi == len(work.prompt):
            self._end_prefill(p, logits, out)

    monkeypatch.setattr(Engine, "_mixed_step", mixed_step)


class Submitted:
    """A request in the loop and its own events (appended by the loop's thread)."""

    def __init__(self, llm: LLM, **fields):
        self.events: list = []
        self.seq = llm.submit(Request(temperature=0, ignore_eos=True, **fields).check(), self.events.append)

    def started(self) -> bool:
        return any(e.token is not None for e in self.events)

    @property
    def result(self):
        return next((e.result for e in self.events if e.result is not None), None)


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def results_of(handles: list[Submitted]) -> list:
    wait_for(lambda: all(h.result is not None for h in handles), "the results")
    return [h.result for h in handles]


def test_chunk_end_is_the_most_rows_within_the_budget():
    """Against counting the work row by row: the chunk is the longest whose rows (1 each, plus
    key_rows per key read) fit the room, past CHUNK_MULTIPLE rows down to a multiple of it, at
    least MIN_CHUNK, never past the prompt's end."""
    cases = [
        (0, 5000, 384, 0.0),
        (0, 5000, 384, 1e-3),
        (3000, 9000, 200, 3e-3),
        (124032, 140000, 568, 5.3e-5),
        (131072, 140000, 376, 3.3e-5),
    ]
    for lo, end, room, key_rows in [*cases, (10, 20, 384, 0.0), (0, 5000, 5, 0.0), (0, 5000, 30, 0.0)]:
        work = [1 + key_rows * (lo + j + 1) for j in range(end - lo)]
        fits = next((c for c in range(end - lo) if sum(work[: c + 1]) > room + 1e-9), end - lo)
        if fits > CHUNK_MULTIPLE:
            fits = fits // CHUNK_MULTIPLE * CHUNK_MULTIPLE
        assert chunk_end(lo, end, room, key_rows) == min(end, lo + max(MIN_CHUNK, fits)), (lo, room, key_rows)
    assert chunk_end(0, 5000, -3, 1e-3) == MIN_CHUNK  # more decode rows than the budget: still moves
    assert chunk_end(124032, 140000, 568, 5.3e-5) - 124032 == 64  # not the 66 rows that fit


@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("last", [False, True])
def test_one_mixed_step_equals_a_decode_step_and_the_chunk_alone(llama, kv, last):
    """Two running rows and a prefill in progress at position 40 of 70: one mixed step of the chunk
    40..56 (or 40..70, the prompt's last) against the decode step and Engine.prefill of the chunk
    after its past: the same next tokens, the same K/V of the decode rows' positions and of the
    chunk's, nothing else written; the last chunk's first token and its logits."""
    llm = LLM(llama, device="cpu", dtype="float32", kv_cache_dtype=kv)
    engine = llm.engine
    size = -(-96 // engine.granule) * engine.granule
    engine.resize(3 * size)
    for t in engine.cache.tensors().values():  # (compared whole below: no uninitialised NaN)
        t.zero_()
    prompts = [random_ids(n, seed=n) for n in (23, 31, 70)]
    greedy = SamplingParams(temperature=0)
    with torch.inference_mode():
        for row, ids in enumerate(prompts[:2]):
            logits = engine.prefill(ids, row * size, size, 0)
            engine.start_row(row, row * size, len(ids), greedy)
            engine.sample_first(row, logits, greedy, False)
        engine.step(2, DecodeKind(greedy.mode))
        engine.prefill(prompts[2][:40], 2 * size, size, 0)  # the chunks before this one
        before = {name: t.clone() for name, t in engine.cache.tensors().items()}
        saved = (engine.state.tokens.clone(), engine.state.positions.clone())
        hi = 70 if last else 56
        decode = Decode(2, DecodeKind(greedy.mode))
        row = RowStart(2, 2 * size, 70, greedy)
        prefill = Prefill(7, 2 * size, size, 40, row, chunk=(40, hi), begin=prompts[2])
        out = engine.run(StepPlan(decode=decode, prefill=prefill))
        mixed = {name: t.clone() for name, t in engine.cache.tensors().items()}
        tokens, positions = engine.state.tokens[:3].tolist(), engine.state.positions[:3].tolist()
        for name, t in engine.cache.tensors().items():  # the same step as the two it replaces
            t.copy_(before[name])
        engine.state.tokens.copy_(saved[0])
        engine.state.positions.copy_(saved[1])
        engine.clear_row(2)
        engine.run(StepPlan(decode=decode))
        alone = engine.prefill(prompts[2][:hi], 2 * size, size, 40)
        separate = engine.cache.tensors()
        steps = engine.state
        assert steps.tokens[:2].tolist() == tokens[:2] and steps.positions[:2].tolist() == positions[:2]
        for name, t in separate.items():
            changed = (mixed[name] != before[name]) | (t != before[name])
            assert changed.any(), name
            # the same positions written, the same values (FP8: a value a last float32 bit apart
            # may round to the neighbouring e4m3 step, so compare what decode reads)
            assert torch.equal(mixed[name] != before[name], t != before[name]) or kv == "fp8", name
        if kv == "auto":
            for name, t in separate.items():
                torch.testing.assert_close(mixed[name], t, rtol=1e-5, atol=1e-6)
        else:
            written = (engine.state.starts[:2] + saved[1][:2]).tolist()  # the decode rows' K/V
            for pos in [*range(2 * size + 40, 2 * size + hi), *written]:
                for got, want in zip(read(engine, mixed, pos), read(engine, separate, pos), strict=True):
                    torch.testing.assert_close(got, want, rtol=0.07, atol=1e-3)  # within an e4m3 step
        if last:
            assert out.first is not None and out.first[0] == int(alone.argmax())
            assert tokens[2] == out.first[0] and positions[2] == 70
        else:
            assert out.first is None


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_a_padded_chunk_beside_idle_rows_is_the_same_step(llama, kv):
    """The form a mixed step's CUDA graph takes (eagerly here): the chunk's 17 rows padded to 32
    and a bucket of 4 decode rows of which one runs. Against the step of exactly 17 and 1 rows:
    the same logits of the chunk's last row and the running row, the same K/V at every position
    but the spare granule's (where the padding and idle rows write), the spare's changed."""
    from minidecode.models.llama import PromptChunk

    llm = LLM(llama, device="cpu", dtype="float32", kv_cache_dtype=kv)
    engine, model = llm.engine, llm.model
    size = -(-96 // engine.granule) * engine.granule
    engine.resize(2 * size)
    for t in engine.cache.tensors().values():
        t.zero_()
    stream, prompt = random_ids(23, seed=23), random_ids(60, seed=60)
    greedy = SamplingParams(temperature=0)
    spare = slice(engine.spare_start, engine.spare_start + engine.granule)
    with torch.inference_mode():
        engine.sample_first(0, engine.prefill(stream, 0, size, 0), greedy, False)
        engine.start_row(0, 0, len(stream), greedy)
        engine.prefill(prompt[:40], size, size, 0)  # the chunk's past
        before = {name: t.clone() for name, t in engine.cache.tensors().items()}
        region = engine.region(size, size)
        staging = model.chunk_staging(region, len(prompt))
        runs = []
        # exact, padded, and (a model-dtype cache) padded with nothing on the host: the graph's
        # chunk attention kernel (the interpreter here) bounded by `where` alone
        forms = ((17, 1, True), (32, 4, True)) + (((32, 4, False),) if kv == "auto" else ())
        for rows, batch, eager in forms:
            for name, t in engine.cache.tensors().items():
                t.copy_(before[name])
            ids = torch.tensor(prompt[40:57] + [5] * (rows - 17))
            host = (40, 17, size, len(prompt))
            chunk = PromptChunk(
                ids, torch.tensor(host), engine.spare_start, host, region, None, engine.prefill_chunk, staging
            ) if eager else PromptChunk(ids, torch.tensor(host), engine.spare_start, splits=3)
            state = engine.state.rows(batch)
            decode_rows = (state.tokens, state.positions, state.starts, state.active)
            hidden = model.mixed(chunk, *decode_rows, engine.cache)
            runs.append((model.logits(hidden), {n: t.clone() for n, t in engine.cache.tensors().items()}))
    (exact, exact_cache), *padded_runs = runs
    for padded, padded_cache in padded_runs:
        torch.testing.assert_close(padded[:2], exact, rtol=1e-5, atol=1e-5)
        for name, t in exact_cache.items():
            outside = [t[:, :, :, : spare.start], padded_cache[name][:, :, :, : spare.start]]
            if kv == "auto" or name == "kv_scale":
                torch.testing.assert_close(*outside, rtol=1e-5, atol=1e-6)
            else:  # e4m3 bytes: a value a last float32 bit apart may round to the next step
                assert (outside[0] != outside[1]).float().mean() < 0.01, name
            if name == "k":
                assert not torch.equal(padded_cache[name][:, :, :, spare], before[name][:, :, :, spare])


def read(engine: Engine, tensors: dict, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's K and V [layers, Hkv, D] at a cache position of an FP8 cache's tensors,
    dequantized."""
    from minidecode.kernels.quant import V_BLOCK

    k = tensors["k"][:, 0, :, position].float() * tensors["kv_scale"][:, 0, :, position, :1].float()
    v = tensors["v"][:, 0, :, position // V_BLOCK, :, position % V_BLOCK].float()
    return k, v * tensors["kv_scale"][:, 0, :, position, 1:].float()


def long_prompt_beside_a_stream(llm: LLM, greedy, plans: list) -> list:
    """A 400-token prompt submitted once a 150-token stream has its first token; both checked
    against transformers' greedy -> the plans of the long prompt's prefill (record_plans' log)."""
    short, long = random_ids(12, seed=1), random_ids(400, seed=2)
    a = Submitted(llm, token_ids=short, max_new_tokens=150)
    wait_for(a.started, "the stream's first token")
    b = Submitted(llm, token_ids=long, max_new_tokens=5)
    result_a, result_b = results_of([a, b])
    assert result_b.token_ids == greedy(long, 5) and result_a.token_ids == greedy(short, 150)
    return [p for p in plans if p.prefill is not None and p.prefill.seq == b.seq.id]


def test_a_stream_gets_a_token_every_step_of_a_long_prefill(llama, greedy, monkeypatch):
    """A 400-token prompt beside a running stream: every plan of its prefill is one mixed step of a
    chunk within the budget (the chunks follow one another from position 0 to its end) and the
    stream's row, and after each the stream gets one token; both equal transformers' greedy."""
    llm, plans = load(llama), []
    record_plans(monkeypatch, plans)
    prefill = long_prompt_beside_a_stream(llm, greedy, plans)
    mixed = [p for p in prefill if p.prefill.chunk is not None]
    ends = [p.prefill.chunk[1] for p in mixed]
    assert [p.prefill.chunk for p in mixed] == list(zip([0, *ends[:-1]], ends, strict=True))
    assert mixed[-1].prefill.chunk[1] == 400 and len(mixed) >= 400 // BUDGET
    assert all(p.decode.rows == 1 and p.decode.queries == 1 for p in mixed)
    assert all(hi - lo <= max(MIN_CHUNK, BUDGET - 1) for lo, hi in (p.prefill.chunk for p in mixed))
    assert mixed == prefill  # every plan of its prefill, none of a whole prefill's units


def test_a_prefill_beside_a_stream_prepares_its_decode_graph_in_a_step_that_captures_nothing(
    llama, greedy, monkeypatch
):
    """The decode graph the long prompt will join the stream in (2 rows) is not prepared with its
    admission (whose mixed step captures its own graph after the cache grew) but once, in a later
    plan of its prefill whose step has the shape of the one before (its graphs exist), before the
    prompt's first decode step."""
    llm, plans = load(llama), []
    record_plans(monkeypatch, plans)
    prefill = long_prompt_beside_a_stream(llm, greedy, plans)
    assert prefill[0].admit is not None and prefill[0].prepare == []

    def shape(plan: StepPlan) -> tuple:
        lo, hi = plan.prefill.chunk
        return chunk_bucket(hi - lo), plan.decode.rows, plan.decode.queries

    prepared = [(i, entry) for i, plan in enumerate(prefill) for entry in plan.prepare]
    assert [(rows, queries) for _, (rows, _, queries) in prepared] == [(2, 1)]
    i = prepared[0][0]
    assert 0 < i < len(prefill) - 1 and shape(prefill[i]) == shape(prefill[i - 1])


def test_without_mixed_steps_a_prefill_goes_a_unit_a_step_beside_the_stream(llama, greedy, monkeypatch):
    """An engine that runs no mixed steps (context parallelism's: Engine.context_parallel): a
    prompt arriving while a stream decodes is planned as the stream's decode step plus one unit of
    its whole prefill, plan after plan, never a chunk; both equal transformers' greedy."""
    llm, plans = load(llama), []
    llm.engine.context_parallel = True
    record_plans(monkeypatch, plans)
    prefill = long_prompt_beside_a_stream(llm, greedy, plans)
    assert all(p.prefill.chunk is None and p.prefill.units == 1 for p in prefill)
    assert all(p.decode is not None and p.decode.rows == 1 for p in prefill)  # the stream steps each plan
    assert len(prefill) >= 3 * llm.config.num_layers  # a layer's units: projections, attention, MLP


def test_a_token_after_every_mixed_step(llama, monkeypatch):
    """The loop's order of plans and handed-out tokens: each mixed step is followed by exactly one
    token of the running stream before the next plan (no step without one, none stalled)."""
    llm, order = load(llama), []
    real_run = Engine.run

    def run(self, plan, on_progress=None):
        if plan.prefill is not None and plan.prefill.chunk is not None:
            order.append("mixed")
        return real_run(self, plan, on_progress)

    monkeypatch.setattr(Engine, "run", run)
    events: list = []

    def sink(event) -> None:  # (the loop's thread, between its plans)
        if event.token is not None:
            order.append("token")
        events.append(event)

    request = Request(token_ids=random_ids(12, seed=1), max_new_tokens=150, temperature=0, ignore_eos=True)
    llm.submit(request.check(), sink)
    wait_for(lambda: "token" in order, "the stream's first token")
    llm.generate(token_ids=random_ids(300, seed=3), max_new_tokens=2, temperature=0, ignore_eos=True)
    wait_for(lambda: any(e.result is not None for e in events), "the stream's end")
    first, last = order.index("mixed"), len(order) - 1 - order[::-1].index("mixed")
    steps = order[first : last + 2]  # each mixed step, then what came before the next plan
    assert steps.count("mixed") >= 300 // BUDGET
    assert steps == ["mixed", "token"] * steps.count("mixed"), steps


def test_a_prefill_whose_streams_end_goes_on_as_a_whole_prefill(llama, greedy, monkeypatch):
    """The running stream ends (aborted from the loop's thread after the third mixed step) a few
    steps into a long prefill: the rest of the prompt runs as one whole prefill's units (layer by
    layer), and its tokens are still transformers'."""
    llm, plans = load(llama), []
    real = Engine.run

    def run(self, plan, on_progress=None):  # (the loop's thread: in step with the plans)
        plans.append(plan)
        if sum(p.prefill is not None and p.prefill.chunk is not None for p in plans) == 3:
            llm.loop.abort([a.seq])  # the stream ends at the next plan
        return real(self, plan, on_progress)

    monkeypatch.setattr(Engine, "run", run)
    short, long = random_ids(12, seed=4), random_ids(400, seed=5)
    a = Submitted(llm, token_ids=short, max_new_tokens=500)
    wait_for(a.started, "the stream's first token")
    b = Submitted(llm, token_ids=long, max_new_tokens=5)
    result_a, result_b = results_of([a, b])
    assert result_b.token_ids == greedy(long, 5)
    assert 3 <= len(result_a.token_ids) < 500 and result_a.token_ids == greedy(short, len(result_a.token_ids))
    prefill = [p.prefill for p in plans if p.prefill is not None and p.prefill.seq == b.seq.id]
    chunked = [p for p in prefill if p.chunk is not None]
    assert chunked and chunked[-1].chunk[1] < 400  # it began in mixed steps ...
    rest = prefill[len(chunked) :]
    assert rest and all(p.chunk is None for p in rest)  # ... and went on as a whole prefill


def scenario(llm: LLM, monkeypatch) -> tuple[list, list]:
    """Two streams (one with log-probs and top log-probs, one with a repetition penalty and a logit
    bias: the logits processors) running, then a batch of two questions on one document: the
    second reuses the first's document positions (copied from its running region) and prefills
    only its question, both in mixed steps; -> (results, the plans)."""
    plans = []
    record_plans(monkeypatch, plans)
    doc = random_ids(200, seed=6)
    streams = [
        Submitted(llm, token_ids=random_ids(14, seed=7), max_new_tokens=100, logprobs=True, top_logprobs=3),
        Submitted(llm, token_ids=random_ids(9, seed=8), max_new_tokens=100, repetition_penalty=1.3,
                  logit_bias={"5": 4.0, "17": -2.0}),
    ]  # fmt: skip
    wait_for(lambda: all(s.started() for s in streams), "the streams' first tokens")
    questions = [
        Submitted(llm, token_ids=doc + random_ids(30, seed=9), max_new_tokens=6, logprobs=True),
        Submitted(llm, token_ids=doc + random_ids(25, seed=10), max_new_tokens=6),
    ]
    return results_of(streams + questions), plans


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_mixed_steps_give_the_separate_steps_tokens(llama, greedy, kv, monkeypatch):
    """The scenario in mixed steps and in the separate steps they replace (a decode step, then the
    chunk prefilled alone): the same tokens, log-probs and top log-probs; in the model dtype also
    transformers' greedy tokens for the requests with no processor, and the same tokens as each
    request alone."""
    mixed, plans = scenario(load(llama, kv_cache_dtype=kv), monkeypatch)
    riding = [p for p in plans if p.prefill is not None and p.prefill.chunk is not None and p.decode]
    assert len(riding) >= 200 // BUDGET and {p.decode.kind.adjust for p in riding} == {True}
    assert mixed[3].stats.reused_tokens == 200 and any(p.prefill.chunk[0] == 200 for p in riding)
    with monkeypatch.context() as patch:
        separate_steps(patch)
        separate, _ = scenario(load(llama, kv_cache_dtype=kv), patch)
    for got, want in zip(mixed, separate, strict=True):
        assert got.error is None and got.token_ids == want.token_ids
        if want.logprobs is not None:
            logprobs = [torch.tensor(r.logprobs) for r in (got, want)]
            torch.testing.assert_close(*logprobs, rtol=1e-4, atol=1e-4)
        if want.top_logprobs is not None:
            top = [[[t for t, _ in row] for row in r.top_logprobs] for r in (got, want)]
            assert top[0] == top[1]
    if kv == "auto":
        for i in (0, 2, 3):
            prompt = mixed[i].prompt_token_ids
            assert mixed[i].token_ids == greedy(prompt, len(mixed[i].token_ids)), i
        alone = load(llama).generate(
            token_ids=mixed[1].prompt_token_ids, max_new_tokens=100, temperature=0, ignore_eos=True,
            repetition_penalty=1.3, logit_bias={"5": 4.0, "17": -2.0},
        )  # fmt: skip
        assert mixed[1].token_ids == alone.token_ids


@pytest.mark.parametrize("failure", ["nan", "user error", "out of memory"])
def test_a_request_that_fails_in_a_mixed_step_ends_alone(llama, greedy, failure, monkeypatch):
    """A prompt whose prefill fails inside a mixed step (NaN logits from a token of its own, in the
    same forward as the stream's row; a UserError or out of memory in its chunk) gets its error;
    the running stream goes on with transformers' tokens, and the next request runs."""
    llm = load(llama)
    short = random_ids(12, seed=11)
    want = greedy(short, 80)
    bad_token = next(t for t in range(3, 384) if t not in short and t not in want)
    long = random_ids(300, seed=12)
    long[150] = bad_token
    if failure == "nan":
        llm.model.model.embed_tokens.weight[bad_token] = float("nan")
    else:
        real = Transformer.mixed
        error = UserError("planted") if failure == "user error" else torch.OutOfMemoryError("planted")

        def mixed(self, chunk, *args):
            lo, count = chunk.host[:2]
            if lo >= 100 and lo + count > 150:
                raise error
            return real(self, chunk, *args)

        monkeypatch.setattr(Transformer, "mixed", mixed)
    a = Submitted(llm, token_ids=short, max_new_tokens=80)
    wait_for(a.started, "the stream's first token")
    b = Submitted(llm, token_ids=long, max_new_tokens=5)
    result_a, result_b = results_of([a, b])
    assert result_b.finish_reason == "error" and result_a.error is None
    message = {"nan": "NaN/inf logits", "user error": "planted", "out of memory": "out of memory"}[failure]
    assert message in result_b.error
    assert result_a.token_ids == want
    again = random_ids(20, seed=13)
    after = llm.generate(token_ids=again, max_new_tokens=4, temperature=0, ignore_eos=True)
    assert after.token_ids == greedy(again, 4)


def test_step_tokens_is_checked():
    with pytest.raises(UserError, match="step_tokens must be >= 1"):
        LLM(device="cpu", step_tokens=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_and_long_prompt(llm: LLM) -> dict:
    """A running stream, then a 300-token prompt beside it (mixed steps) -> their tokens and the
    mixed steps run."""
    mixed = []
    real = Engine.run

    def run(self, plan, on_progress=None):
        mixed.append(plan.prefill is not None and plan.prefill.chunk is not None and plan.decode is not None)
        return real(self, plan, on_progress)

    Engine.run = run
    try:
        a = Submitted(llm, token_ids=random_ids(12, seed=14), max_new_tokens=150)
        wait_for(a.started, "the stream's first token")
        b = Submitted(llm, token_ids=random_ids(300, seed=15), max_new_tokens=5)
        results = results_of([a, b])
    finally:
        Engine.run = real
    return {"tokens": [r.token_ids for r in results], "mixed": sum(mixed)}


def _tp_rank(rank: int, world: int, port: int, model: str, out: str) -> None:
    """One tensor-parallel rank: rank 0 runs the stream and the prompt, the other its plans."""
    as_torchrun_rank(rank, world, port)
    llm = LLM(model, device="cpu", dtype="float32", tp=world, step_tokens=BUDGET)
    if llm.rank != 0:  # every plan of rank 0's, its tokens checked against rank 0's each step
        torch.save({"plans": llm.serve_plans()}, Path(out) / f"{rank}.pt")
        return
    result = stream_and_long_prompt(llm)
    llm.loop.close()
    torch.save(result, Path(out) / f"{rank}.pt")


def test_mixed_steps_under_tensor_parallel(llama, tmp_path):
    """Under tp 2 both ranks run rank 0's mixed steps (the chunk and the decode rows plain data in
    the plan): the stream's and the prompt's tokens are one process's."""
    from ranks import run_ranks

    run_ranks(_tp_rank, (2, _free_port(), str(llama), str(tmp_path)), 2)
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    alone = stream_and_long_prompt(load(llama))
    assert ranks[0]["tokens"] == alone["tokens"] and ranks[0]["mixed"] >= 300 // BUDGET
    assert ranks[1]["plans"] > ranks[0]["mixed"]


def test_a_speculating_stream_beside_a_prefill(monkeypatch):
    """A stream that speculates (the shipped model copies its prompt: drafts match) beside a long
    prefill: a step that verifies drafts runs as its own step and the chunk alone after it; the
    stream's tokens are its tokens without speculation, and the prompt's are its tokens alone."""
    llm, plans = LLM(device="cpu", dtype="float32", step_tokens=BUDGET), []
    repeats = llm.tokenizer.encode("def add(a, b):\n    return a + b\n\n\n" * 3 + "def add(a, b):\n")
    long = random_ids(300, seed=16)
    settings = dict(temperature=0, ignore_eos=True, reuse_prefix=False)
    plain = llm.generate(token_ids=repeats, max_new_tokens=200, **settings)
    alone = llm.generate(token_ids=long, max_new_tokens=5, **settings)
    record_plans(monkeypatch, plans)
    a = Submitted(llm, token_ids=repeats, max_new_tokens=200, speculate=8, reuse_prefix=False)
    wait_for(a.started, "the stream's first token")
    b = Submitted(llm, token_ids=long, max_new_tokens=5, reuse_prefix=False)
    spec, result = results_of([a, b])
    assert spec.token_ids == plain.token_ids and result.token_ids == alone.token_ids
    beside = [p.decode.queries for p in plans if p.prefill is not None and p.prefill.chunk and p.decode]
    assert max(beside) > 1 and spec.stats.accepted_tokens > 0  # drafts verified beside the prefill


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_the_warm_up_mixed_step_writes_its_chunk_and_the_spare_granule(llama, kv):
    """warm_up_mixed (run on a GPU before the first request) after the warm-up's prefill
    of ids 1..16: the K/V of positions 16..31 are a whole prefill's of ids 1..32, and nothing is
    written but them and the spare granule (its decode row's)."""
    from minidecode.warm_up import warm_up_mixed

    engine = LLM(llama, device="cpu", dtype="float32", kv_cache_dtype=kv).engine
    capacity = -(-64 // engine.granule) * engine.granule
    engine.resize(capacity)
    for t in engine.cache.tensors().values():
        t.zero_()
    with torch.inference_mode():
        engine.prefill(list(range(1, 17)), 0, capacity, 0)
        before = {name: t.clone() for name, t in engine.cache.tensors().items()}
        warm_up_mixed(engine)
        mixed = {name: t.clone() for name, t in engine.cache.tensors().items()}
        engine.prefill(list(range(1, 33)), 0, capacity, 0)
    k = mixed["k"] != before["k"]  # [layers, 1, Hkv, positions, D]
    written = k.any(-1).any(0).any(0).any(0).nonzero()[:, 0].tolist()
    spare = list(range(engine.spare_start, engine.spare_start + engine.granule))
    assert set(range(16, 32)) <= set(written) <= set(range(16, 32)) | set(spare)
    if kv == "auto":
        torch.testing.assert_close(
            mixed["k"][:, :, :, 16:32], engine.cache.k[:, :, :, 16:32], rtol=1e-5, atol=1e-6
        )
        torch.testing.assert_close(
            mixed["v"][:, :, :, 16:32], engine.cache.v[:, :, :, 16:32], rtol=1e-5, atol=1e-6
        )


def test_the_warm_up_runs_the_projections_at_every_row_count_of_a_mixed_step_graph(llama):
    """A mixed-step graph's matmuls take its chunk's padded rows plus its decode bucket's rows, at
    every chunk size the budget allows beside every number of running rows: each is among the row
    counts warm_up_mixed runs the projections at (mixed_rows)."""
    from minidecode.decode import bucket
    from minidecode.warm_up import mixed_rows

    engine = LLM(llama, device="cpu", dtype="float32", max_batch=12, step_tokens=200).engine
    warmed = set(mixed_rows(engine))
    for count in range(1, 201):
        for running in range(13):
            rows = chunk_bucket(count) + (min(bucket(running), 12) if running else 0)
            assert rows in warmed, (count, running)


def test_a_length_dependent_rope_prompt_in_mixed_steps(checkpoint_factory, hf, monkeypatch):
    """Dynamic NTK (angles rescaled past 64 positions): a 120-token prompt prefilled chunk by chunk
    beside a stream rotates every chunk by the whole prompt's length, as transformers' one pass
    does: its tokens and the stream's are transformers', its first token's log p that of
    transformers' pass over the prompt."""
    model_dir = checkpoint_factory("llama", "dynamic", max_positions=64)
    llm, plans = load(model_dir), []
    record_plans(monkeypatch, plans)
    short, long = random_ids(12, seed=17), random_ids(120, seed=18)
    a = Submitted(llm, token_ids=short, max_new_tokens=40)
    wait_for(a.started, "the stream's first token")
    b = Submitted(llm, token_ids=long, max_new_tokens=4, allow_extrapolation=True, logprobs=True)
    result_a, result_b = results_of([a, b])
    chunks = [p.prefill.chunk for p in plans if p.prefill is not None and p.prefill.seq == b.seq.id]
    assert len(chunks) >= 4 and None not in chunks and chunks[0][1] < 64
    assert result_b.token_ids == hf.greedy(model_dir, long, 4)
    assert result_a.token_ids == hf.greedy(model_dir, short, 40)
    want = hf.logits(model_dir, long)[-1].log_softmax(-1)[result_b.token_ids[0]]  # (one pass of 120)
    assert abs(result_b.logprobs[0] - float(want)) < 1e-4

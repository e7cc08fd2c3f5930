"""Request settings that change the logits before sampling (logit_bias, min_tokens, repetition,
presence and frequency penalties), stop_token_ids and top_logprobs: the processor function
against transformers' logits processors (hand math for OpenAI's presence / frequency formula) on
the same tokens, then end to end through `LLM` on the shipped model against a greedy loop over
`LLM.logits` processed in float64, alone, in a batch of mixed settings and in a stream. Bad values
are UserErrors naming their field."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from minidecode import LLM, Request, SamplingParams, UserError
from minidecode.request import MAX_TOP_LOGPROBS, logit_bias_ids
from minidecode.sampling import (
    FILTER,
    GREEDY,
    SAMPLE,
    ProcessorRows,
    SamplingRows,
    process,
    sample,
    top_logprobs,
)

V = 96


def reference(
    logits: torch.Tensor,
    prompt: list[int],
    generated: list[int],
    logit_bias: dict[int, float] | None = None,
    min_tokens: int = 0,
    end_ids: tuple[int, ...] = (),
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
) -> torch.Tensor:
    """logits [V] of the token after prompt + generated -> [V] processed as transformers' processors
    (SequenceBias, MinNewTokensLength, RepetitionPenalty) and OpenAI's penalty formula do it, in
    the order the settings apply (and in the logits' dtype)."""
    scores, ids = logits[None].clone(), torch.tensor([prompt + generated])
    if logit_bias:
        scores = SequenceBiasLogitsProcessor([[[t], b] for t, b in logit_bias.items()])(ids, scores)
    if min_tokens and end_ids:
        scores = MinNewTokensLengthLogitsProcessor(len(prompt), min_tokens, list(end_ids))(ids, scores)
    if repetition_penalty != 1:
        scores = RepetitionPenaltyLogitsProcessor(repetition_penalty)(ids, scores)
    counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=len(logits)).to(scores.dtype)
    scores = scores - frequency_penalty * counts
    return (scores - presence_penalty * (counts > 0).to(scores.dtype))[0]


Case = tuple[SamplingParams, list[int], list[int]]  # settings, prompt, generated tokens


def started_rows(cases: list[Case]) -> tuple[ProcessorRows, torch.Tensor]:
    """ProcessorRows of (params, prompt, generated) rows, each started after its prompt and then
    counting its generated tokens as the decode steps do -> (rows, positions [B] of the next token)."""
    rows = ProcessorRows.zeros(len(cases), V, torch.device("cpu"))
    for row, (params, prompt, _) in enumerate(cases):
        rows.set(row, params, prompt, len(prompt))
    steps = max(len(generated) for _, _, generated in cases)
    for i in range(steps):  # one step of every row; a row with fewer tokens is idle (active 0)
        tokens = torch.tensor([g[i] if i < len(g) else 0 for _, _, g in cases])
        active = torch.tensor([int(i < len(g)) for _, _, g in cases], dtype=torch.int32)
        rows.count(tokens, active)
    positions = torch.tensor([len(p) + len(g) for _, p, g in cases])
    return rows, positions


def settings(params: SamplingParams) -> dict:
    return dict(
        logit_bias=params.logit_bias, min_tokens=params.min_tokens, end_ids=tuple(sorted(params.end_ids)),
        repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
    )  # fmt: skip


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


UNIT_CASES = [
    SamplingParams(),  # neutral: beside the others, its logits pass unchanged
    SamplingParams(logit_bias={3: 5.5, 17: -100.0, 40: 0.25}),
    SamplingParams(min_tokens=8, end_ids=frozenset({2, 9})),  # 7 generated: still masked
    SamplingParams(min_tokens=7, end_ids=frozenset({2, 9})),  # 7 generated: no longer masked
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6),  # < 1 rewards repetition
    SamplingParams(presence_penalty=1.5, frequency_penalty=-0.75),
    SamplingParams(
        logit_bias={2: 30.0, 5: -3.0}, min_tokens=9, end_ids=frozenset({2}), repetition_penalty=1.3,
        presence_penalty=-2.0, frequency_penalty=2.0,
    ),  # fmt: skip
]


def test_process_equals_transformers_processors_row_by_row():
    """Each row of a batch of mixed settings is processed as transformers' processors (and OpenAI's
    penalty formula) process it alone, on the same prompt and generated tokens (repeats among them);
    a row with no settings is unchanged."""
    generated = ids(4, seed=100) + [4, 4, 2]  # 7 tokens: one three times, the last an end id
    lengths = [7, 6, 7, 7, 6, 7, 6, 7]  # a row with 6 is idle in the last step (active 0)
    cases = [(p, ids(20 + i, seed=i), generated[: lengths[i]]) for i, p in enumerate(UNIT_CASES)]
    rows, positions = started_rows(cases)
    logits = torch.randn(len(cases), V, generator=torch.Generator().manual_seed(0)) * 4
    ours = process(logits, rows, positions)
    for row, (params, prompt, generated) in enumerate(cases):
        ref = reference(logits[row], prompt, generated, **settings(params))
        torch.testing.assert_close(ours[row], ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(ours[0], logits[0])
    assert torch.isinf(ours[2, [2, 9]]).all() and torch.isfinite(ours[3]).all()


def test_greedy_and_sampled_tokens_come_from_the_processed_logits():
    """sample() on processed logits: a greedy row takes their argmax; a sampling row never draws an
    id that min_tokens masks, over many positions (the draw's counter)."""
    masked = SamplingParams(temperature=1.0, min_tokens=50, end_ids=frozenset(range(0, V, 2)))
    cases = [
        (SamplingParams(repetition_penalty=2.0, logit_bias={7: 3.0}), ids(30, seed=1), ids(5, seed=2)),
        (masked, ids(10, seed=3), []),
    ]
    rows, positions = started_rows(cases)
    sampling = SamplingRows.zeros(2, torch.device("cpu"))
    for row, (params, _, _) in enumerate(cases):
        sampling.set(row, params)
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(5))
    greedy = sample(process(logits, rows, positions), sampling, positions, GREEDY)
    assert greedy[0] == reference(logits[0].double(), *cases[0][1:], **settings(cases[0][0])).argmax()
    draws = [
        int(sample(process(logits, rows, positions + step), sampling, positions + step, SAMPLE)[1])
        for step in range(60)
    ]
    assert all(t % 2 == 1 for t in draws[:50])  # the even ids are masked for 50 tokens
    assert any(t % 2 == 0 for t in draws[50:])  # and drawn again after them


def test_top_logprobs_are_the_distributions_top_k():
    logprobs = torch.randn(3, V).log_softmax(-1)
    values = torch.zeros(3, MAX_TOP_LOGPROBS)
    token_ids = torch.zeros(3, MAX_TOP_LOGPROBS, dtype=torch.long)
    top_logprobs(logprobs, values, token_ids)
    expected = logprobs.topk(MAX_TOP_LOGPROBS, dim=-1)
    assert torch.equal(values, expected.values) and torch.equal(token_ids, expected.indices)
    assert (values[:, :-1] >= values[:, 1:]).all()  # most likely first


# ---- end to end on the shipped model -----------------------------------------------------------


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu")


PROMPT = "def fibonacci(n):\n"
NEW = 12


def greedy_loop(llm: LLM, prompt: list[int], n: int, stop_ids=(), **kw) -> tuple[list[int], str]:
    """Greedy decoding over LLM.logits of the whole sequence at each step, the logits processed in
    float64 as transformers' processors process them -> (new tokens, finish reason)."""
    end = set(llm.eos_ids) | set(stop_ids)
    generated: list[int] = []
    for _ in range(n):
        logits = llm.logits(prompt + generated)[-1].double()
        token = int(reference(logits, prompt, generated, end_ids=tuple(sorted(end)), **kw).argmax())
        if token in end:
            return generated, "eos" if token in llm.eos_ids else "stop"
        generated.append(token)
    return generated, "length"


@pytest.fixture(scope="module")
def prompt(llm) -> list[int]:
    return llm.encode(Request(prompt=PROMPT).check())


@pytest.fixture(scope="module")
def plain(llm, prompt) -> list[int]:
    return llm.generate(token_ids=prompt, max_new_tokens=NEW, temperature=0).token_ids


def test_processor_state_is_allocated_only_once_a_request_needs_it(prompt):
    fresh = LLM(device="cpu")
    fresh.generate(token_ids=prompt, max_new_tokens=3, temperature=0, top_logprobs=2, stop_token_ids=[5])
    assert fresh.engine.state.processors is None  # top log-probs and stop ids need none
    fresh.generate(token_ids=prompt, max_new_tokens=3, temperature=0, presence_penalty=0.5)
    rows = fresh.engine.state.processors
    assert rows is not None and rows.counts.shape == (fresh.engine.max_batch, fresh.config.vocab_size)


@pytest.mark.parametrize(
    "kw",
    [
        dict(repetition_penalty=1.5),
        dict(repetition_penalty=0.7),
        dict(presence_penalty=1.5, frequency_penalty=1.0),
        dict(frequency_penalty=2.0),
        dict(repetition_penalty=1.2, presence_penalty=0.5, logit_bias={279: -5.0, 434: 4.0}),
    ],
    ids=["repetition", "repetition<1", "presence+frequency", "frequency", "mixed"],
)
def test_greedy_with_processors_equals_a_processed_loop_over_logits(llm, prompt, plain, kw):
    """The first token (from prefill logits) and every decode step's: as the float64 loop over
    LLM.logits with transformers' processors on the same tokens picks them."""
    out = llm.generate(token_ids=prompt, max_new_tokens=NEW, temperature=0, ignore_eos=True, **kw)
    expected, _ = greedy_loop(llm, prompt, NEW, **kw)
    assert out.token_ids == expected
    assert out.token_ids != plain  # the setting changed the output: the comparison is not vacuous


def test_the_first_token_counts_for_the_penalties(llm, prompt, plain):
    """A token favoured by a bias repeats until the frequency penalty outweighs it: the count that
    the first token (sampled from prefill logits) starts decides where that happens."""
    kw = dict(logit_bias={plain[1]: 12.0}, frequency_penalty=2.0)
    out = llm.generate(token_ids=prompt, max_new_tokens=NEW, temperature=0, ignore_eos=True, **kw)
    assert out.token_ids[0] == plain[1] and out.token_ids.count(plain[1]) > 1
    assert out.token_ids == greedy_loop(llm, prompt, NEW, **kw)[0]


def test_logit_bias_minus_100_removes_the_greedy_token(llm, prompt, plain):
    """Keys as JSON sends them (decimal strings) or ints: the biased token never comes again."""
    for key in (str(plain[0]), plain[0]):
        out = llm.generate(token_ids=prompt, max_new_tokens=NEW, temperature=0, logit_bias={key: -100})
        assert plain[0] not in out.token_ids
        assert out.token_ids == greedy_loop(llm, prompt, NEW, logit_bias={plain[0]: -100.0})[0]


def test_min_tokens_keeps_eos_away(llm, prompt):
    """With eos favoured by +100 the request ends at once; min_tokens=3 holds it back for 3 tokens
    (the first from prefill logits, two from decode steps), then it ends with eos."""
    (eos,) = llm.eos_ids
    bias = {eos: 100}
    kw = dict(token_ids=prompt, max_new_tokens=NEW, temperature=0)
    early = llm.generate(**kw, logit_bias=bias)
    assert early.finish_reason == "eos" and early.token_ids == []
    held = llm.generate(**kw, logit_bias=bias, min_tokens=3)
    assert held.finish_reason == "eos" and len(held.token_ids) == 3
    assert held.token_ids == greedy_loop(llm, prompt, NEW, logit_bias={eos: 100.0}, min_tokens=3)[0]
    # ignore_eos: eos ends nothing, so min_tokens holds nothing back: eos tokens are returned
    ignored = llm.generate(**dict(kw, max_new_tokens=4), logit_bias=bias, min_tokens=3, ignore_eos=True)
    assert ignored.token_ids == [eos] * 4 and ignored.finish_reason == "length"


def test_stop_token_ids_end_with_stop(llm, prompt, plain):
    """The first sampled stop id ends the request, unreturned, also with ignore_eos; min_tokens
    holds stop ids back too."""
    stop = plain[3]
    first = plain.index(stop)
    for ignore_eos in (False, True):
        out = llm.generate(
            token_ids=prompt, max_new_tokens=NEW, temperature=0, stop_token_ids=[stop], ignore_eos=ignore_eos
        )
        assert out.finish_reason == "stop" and out.token_ids == plain[:first]
    held = llm.generate(
        token_ids=prompt, max_new_tokens=NEW, temperature=0, stop_token_ids=[stop], min_tokens=5
    )
    expected, reason = greedy_loop(llm, prompt, NEW, stop_ids=[stop], min_tokens=5)
    assert len(held.token_ids) >= 5 and stop not in held.token_ids
    assert (held.token_ids, held.finish_reason) == (expected, reason)


def test_top_logprobs_equal_the_logits_top_k(llm, prompt):
    """Each new token's top-k (the first's from prefill, the others' from decode steps) equals the
    log_softmax top-k of LLM.logits at its position: of the model's raw distribution, also when a
    processor changes which token is sampled; top_logprobs implies logprobs."""
    k = 5
    for kw in (dict(temperature=0), dict(repetition_penalty=1.5, temperature=0.8, seed=3)):
        out = llm.generate(token_ids=prompt, max_new_tokens=NEW, top_logprobs=k, ignore_eos=True, **kw)
        assert len(out.top_logprobs) == len(out.logprobs) == len(out.token_ids) == NEW
        scored = llm.logits(prompt + out.token_ids)[len(prompt) - 1 : -1].double().log_softmax(-1)  # [NEW, V]
        top = scored.topk(k, dim=-1)
        for i, alternatives in enumerate(out.top_logprobs):
            assert [t for t, _ in alternatives] == top.indices[i].tolist()
            got = torch.tensor([lp for _, lp in alternatives], dtype=torch.float64)
            torch.testing.assert_close(got, top.values[i], rtol=0, atol=1e-4)
            assert out.logprobs[i] == pytest.approx(float(scored[i, out.token_ids[i]]), abs=1e-4)
    assert llm.generate(token_ids=prompt, max_new_tokens=2).top_logprobs is None


def test_stream_events_carry_top_logprobs(llm, prompt):
    with llm.stream(token_ids=prompt, max_new_tokens=6, temperature=0, top_logprobs=2,
                    repetition_penalty=1.4) as stream:  # fmt: skip
        events = [e for e in stream.events() if e.token is not None]
    result = stream.result
    assert [e.token for e in events] == result.token_ids
    assert [e.top_logprobs for e in events] == result.top_logprobs
    assert all(len(e.top_logprobs) == 2 for e in events)
    alone = llm.generate(token_ids=prompt, max_new_tokens=6, temperature=0, repetition_penalty=1.4)
    assert result.token_ids == alone.token_ids


@pytest.mark.parametrize("max_batch", [2, 32])
def test_a_batch_of_mixed_settings_gives_each_request_its_result_alone(llm, prompt, plain, max_batch):
    """Rows with and without processors, sampling and greedy, of different lengths (so rows end,
    move and refill at max_batch 2): each request gets what it gets alone."""
    other = llm.encode(Request(prompt="import os\n").check())
    items = [
        Request(token_ids=prompt, max_new_tokens=NEW),
        Request(token_ids=other, max_new_tokens=5, repetition_penalty=1.5, top_logprobs=3),
        Request(token_ids=prompt, max_new_tokens=9, logit_bias={plain[0]: -100}),
        Request(token_ids=other, max_new_tokens=NEW, temperature=0.9, seed=4, frequency_penalty=1.0),
        Request(token_ids=prompt, max_new_tokens=7, stop_token_ids=[plain[3]], min_tokens=5),
        Request(token_ids=other, max_new_tokens=3, logprobs=True),
    ]
    batched = LLM(device="cpu", max_batch=max_batch).generate(items, temperature=0, ignore_eos=True)
    for item, result in zip(items, batched, strict=True):
        alone = llm.generate(item, temperature=0, ignore_eos=True)
        assert (result.token_ids, result.finish_reason) == (alone.token_ids, alone.finish_reason)
        assert same_top_logprobs(result.top_logprobs, alone.top_logprobs)
    assert batched[2].token_ids != plain[:9] and batched[1].top_logprobs is not None


def same_top_logprobs(a: list | None, b: list | None) -> bool:
    """The same alternatives, their log-probs within float32 noise (a batch's matmuls are not a
    single row's)."""
    if a is None or b is None:
        return a is b
    ids_a, ids_b = ([[t for t, _ in token] for token in x] for x in (a, b))
    values_a, values_b = (torch.tensor([[lp for _, lp in token] for token in x]) for x in (a, b))
    return ids_a == ids_b and torch.allclose(values_a, values_b, rtol=0, atol=1e-4)


# ---- bad values ---------------------------------------------------------------------------------

BAD = [
    (dict(min_tokens=-1), "min_tokens", "min_tokens must be >= 0, got -1"),
    (dict(min_tokens=1.5), "min_tokens", "min_tokens must be an integer"),
    (dict(min_tokens=9, max_new_tokens=4), "min_tokens", "min_tokens (9) must be <= max_new_tokens (4)"),
    (dict(stop_token_ids=5), "stop_token_ids", "stop_token_ids must be a list of integers"),
    (dict(stop_token_ids=[1, "2"]), "stop_token_ids", "stop_token_ids must be integers, got '2'"),
    (dict(presence_penalty=2.5), "presence_penalty", "presence_penalty must be in [-2, 2], got 2.5"),
    (dict(frequency_penalty="1"), "frequency_penalty", "frequency_penalty must be a number"),
    (dict(frequency_penalty=math.nan), "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
    (dict(repetition_penalty=0), "repetition_penalty", "repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=True), "repetition_penalty", "repetition_penalty must be a number"),
    (dict(repetition_penalty=math.inf), "repetition_penalty", "must be a finite number > 0, got inf"),
    (dict(logit_bias=[1, 2]), "logit_bias", "logit_bias must be an object of token id -> bias"),
    (dict(logit_bias={"a": 1}), "logit_bias", "logit_bias keys must be token ids"),
    (dict(logit_bias={1.0: 1}), "logit_bias", "logit_bias keys must be token ids"),
    (dict(logit_bias={"3": 101}), "logit_bias", "logit_bias['3'] must be in [-100, 100], got 101"),
    (dict(logit_bias={3: "1"}), "logit_bias", "logit_bias[3] must be a number"),
    (dict(logit_bias={3: 1, "3": 2}), "logit_bias", "logit_bias gives token 3 more than once"),
    (dict(top_logprobs=21), "top_logprobs", "top_logprobs must be <= 20, got 21"),
    (dict(top_logprobs=-1), "top_logprobs", "top_logprobs must be >= 0"),
    (dict(top_logprobs=True), "top_logprobs", "top_logprobs must be an integer"),
    (dict(temperature=-1), "temperature", "temperature must be a finite number >= 0"),
    (dict(max_new_tokens=0), "max_new_tokens", "max_new_tokens must be >= 1, got 0"),
    (dict(logprobs="true"), "logprobs", "logprobs must be true or false"),
]


@pytest.mark.parametrize("kw,field,message", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_values_are_user_errors_naming_their_field(kw, field, message):
    with pytest.raises(UserError) as error:
        Request(prompt="x", **kw).check()
    assert message in str(error.value) and error.value.field == field


def test_caller_names_in_messages():
    """names: the caller's own spelling of a field in the message; `field` stays the Request's."""
    names = {"max_new_tokens": "max_tokens"}
    with pytest.raises(UserError, match=r"^max_tokens must be >= 1, got 0$") as error:
        Request(prompt="x", max_new_tokens=0).check(names=names)
    assert error.value.field == "max_new_tokens"
    with pytest.raises(UserError, match=r"min_tokens \(5\) must be <= max_tokens \(2\)"):
        Request(prompt="x", max_new_tokens=2, min_tokens=5).check(names=names)
    with pytest.raises(UserError) as error:
        Request(prompt="x", messages=[{"role": "user", "content": "hi"}]).check()
    assert error.value.field == "messages"


def test_json_fields_and_vocabulary_checks(llm):
    """A batch line's logit_bias keys are strings; ids outside the vocabulary are refused when
    the runtime resolves the request, naming the field."""
    line = {"prompt": "x", "logit_bias": {"5": -1, "7": 2.5}, "stop_token_ids": [9]}
    request = Request.from_dict(line).check()
    assert logit_bias_ids(request.logit_bias) == {5: -1.0, 7: 2.5}
    vocab = llm.config.vocab_size
    for field, value in (("logit_bias", {str(vocab): 1}), ("stop_token_ids", [-1])):
        with pytest.raises(UserError, match=rf"out of range \[0, {vocab}\)") as error:
            llm.generate("x", max_new_tokens=2, **{field: value})
        assert error.value.field == field
    results = llm.generate(["x", Request(prompt="y", stop_token_ids=[vocab])], max_new_tokens=2)
    assert results[0].error is None and "stop_token_ids out of range" in results[1].error


# ---- CUDA: the captured step ----------------------------------------------------------------------


def mixed_items(llm: LLM) -> list[Request]:
    prompt = llm.encode(Request(prompt=PROMPT).check())
    other = llm.encode(Request(prompt="import os\n").check())
    return [
        Request(token_ids=prompt, max_new_tokens=NEW),
        Request(token_ids=other, max_new_tokens=5, repetition_penalty=1.5, top_logprobs=3),
        Request(token_ids=prompt, max_new_tokens=9, logit_bias={704: -100, 259: 3}),
        Request(token_ids=other, max_new_tokens=NEW, temperature=0.9, seed=4, frequency_penalty=1.0),
        Request(token_ids=prompt, max_new_tokens=7, stop_token_ids=[436], min_tokens=5, presence_penalty=1),
        Request(token_ids=other, max_new_tokens=3, top_logprobs=20),
    ]


@pytest.mark.gpu
def test_graph_steps_with_processors_equal_eager_steps_and_each_alone():
    """fp32 on CUDA: a batch of mixed settings through the captured steps (buckets 8 down to 1 as
    rows end) gives the eager steps' tokens and top log-probs, and each request's alone; a plain
    request keeps the plain step's graph (its key has neither processors nor top log-probs)."""
    graph = LLM(device="cuda", dtype="float32")
    eager = LLM(device="cuda", dtype="float32", cuda_graph=False)
    items = mixed_items(graph)
    kw = dict(temperature=0, ignore_eos=True)
    a, b = (llm.generate(items, **kw) for llm in (graph, eager))
    alone = [graph.generate(item, reuse_prefix=False, **kw) for item in items]
    for x, y, z in zip(a, b, alone, strict=True):
        assert x.token_ids == y.token_ids == z.token_ids
        assert same_top_logprobs(x.top_logprobs, y.top_logprobs)
        assert same_top_logprobs(x.top_logprobs, z.top_logprobs)
    assert all(len(top) == 20 for top in a[-1].top_logprobs)
    assert any(key[3:] == (True, True) for key in graph.engine.graphs._graphs)
    plain = LLM(device="cuda", dtype="float32")
    assert plain.generate(items[0], **kw).token_ids == a[0].token_ids
    assert {key[2:] for key in plain.engine.graphs._graphs} == {(False, False, False)}
    assert plain.engine.state.processors is None


@pytest.mark.gpu
def test_processors_and_top_logprobs_do_not_sync_on_cuda():
    """What the decode step adds (process, sample, count, top log-probs) queues device work only."""
    device = torch.device("cuda")
    cases = [(p, ids(20, seed=i), ids(6, seed=50 + i)) for i, p in enumerate(UNIT_CASES)]
    rows = ProcessorRows.zeros(len(cases), V, device)
    sampling = SamplingRows.zeros(len(cases), device)
    for row, (params, prompt, _) in enumerate(cases):
        rows.set(row, params, prompt, len(prompt))
        sampling.set(row, dataclasses.replace(params, temperature=0.7, top_p=0.9))
    logits = torch.randn(len(cases), V, device=device)
    positions = torch.full((len(cases),), 30, device=device)
    active = torch.ones(len(cases), dtype=torch.int32, device=device)
    values = torch.zeros(len(cases), MAX_TOP_LOGPROBS, device=device)
    top_ids = torch.zeros(len(cases), MAX_TOP_LOGPROBS, dtype=torch.long, device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for mode in (GREEDY, SAMPLE, FILTER):
            nxt = sample(process(logits, rows, positions), sampling, positions, mode)
            rows.count(nxt, active)
            top_logprobs(logits.log_softmax(-1), values, top_ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(rows.counts.sum()) == 3 * len(cases)

"""What a user of an OpenAI-compatible server expects of `minidecode serve`, end to end (the real
`openai` client and raw HTTP against a server subprocess, as tests/test_server.py starts them):
a field the server does not implement is a 400 naming it (never a silent 200), null is an
omitted field, errors name the client's field; n choices (one shared prefill), top log-probs,
logit_bias, stop_token_ids, min_tokens and the penalties, checked against the Python API on the
shipped model; a non-streamed client that leaves frees its row; the API key; the access line;
Ctrl-C once (running requests finish) and twice (they end cleanly), exit code 130. The prefix
reuse from a running sequence is also checked through the Python API."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import random_ids
from test_server import WAIT, client, metrics, post, server, started

openai = pytest.importorskip("openai")

from minidecode import LLM, Request  # noqa: E402

MODEL = "stdlib-tiny"


def access_line(log: Path, request_id: str) -> str:
    """The server's access line of a request: written once its response has gone, so a client
    may read the response before the line is in the log."""
    deadline = time.monotonic() + WAIT
    while not (found := [x for x in log.read_text().splitlines() if x.startswith(request_id)]):
        assert time.monotonic() < deadline, f"no access line for {request_id}"
        time.sleep(0.05)
    return found[0]


@pytest.fixture(scope="module")
def reference():
    """The shipped model through the Python API, as the server loads it."""
    return LLM(device="cpu")


@pytest.fixture(scope="module")
def chat(chat_model):
    with server(chat_model, "--served-model-name", "tiny-chat") as base:
        yield base


def refused(base: str, path: str, body: dict) -> dict:
    status, answer = post(base, path, body)
    assert status == 400, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


def stream_lines(base: str, body: dict):
    request = urllib.request.Request(
        base + "/v1/completions", json.dumps({**body, "stream": True}).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    return urllib.request.urlopen(request, timeout=WAIT)


# ---- fields: every one the server does not implement is refused, naming it -------------------------

COMPLETION_REFUSED = [
    ("foo_bar", 1), ("bad_words", ["x"]), ("guided_json", {"type": "object"}), ("echo", True),
    ("suffix", "x"), ("best_of", 2), ("functions", [{"name": "f"}]), ("messages", [{"role": "user"}]),
    ("top_logprobs", 2), ("max_completion_tokens", 4),
]  # fmt: skip
CHAT_REFUSED = [
    ("foo_bar", None), ("functions", [{"name": "f", "parameters": {}}]), ("function_call", "auto"),
    ("tool_choice", "auto"), ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("guided_json", {"type": "object"}), ("bad_words", ["a"]), ("response_format", {"type": "json_object"}),
    ("parallel_tool_calls", True), ("prompt", "x"), ("echo", False),
]  # fmt: skip


@pytest.mark.parametrize(("name", "value"), COMPLETION_REFUSED, ids=[n for n, _ in COMPLETION_REFUSED])
def test_a_completion_field_not_implemented_is_a_400_naming_it(shipped, name, value):
    error = refused(shipped, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, name: value})
    assert error["param"] == name and name in error["message"]


@pytest.mark.parametrize(("name", "value"), CHAT_REFUSED, ids=[n for n, _ in CHAT_REFUSED])
def test_a_chat_field_not_implemented_is_a_400_naming_it(chat, name, value):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, name: value}
    error = refused(chat, "/v1/chat/completions", body)
    assert error["param"] == name and name in error["message"]


def test_roles_are_checked_and_developer_is_system(chat):
    def ask(role: str) -> tuple[int, dict]:
        messages = [{"role": role, "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]
        body = {"messages": messages, "max_tokens": 12, "temperature": 0}
        return post(chat, "/v1/chat/completions", body)

    status, answer = ask("wizard")
    assert status == 400 and answer["error"]["param"] == "messages[0].role"
    assert "wizard" in answer["error"]["message"]
    (_, system), (_, developer) = ask("system"), ask("developer")
    assert developer["choices"][0]["message"] == system["choices"][0]["message"]
    named = {"messages": [{"role": "user", "content": "x", "name": "me"}]}
    assert refused(chat, "/v1/chat/completions", named)["param"] == "messages[0].name"


def test_null_is_an_omitted_field(shipped):
    body = {"model": MODEL, "prompt": "import os\n", "temperature": 0, "ignore_eos": True, "max_tokens": None,
            "n": None, "stop": None, "seed": None, "logprobs": None, "echo": None, "user": None}  # fmt: skip
    status, answer = post(shipped, "/v1/completions", body)
    assert status == 200, answer
    assert len(answer["choices"]) == 1 and answer["usage"]["completion_tokens"] == 16  # OpenAI's default
    assert answer["choices"][0]["logprobs"] is None


def test_errors_name_the_clients_field(shipped, chat):
    error = refused(shipped, "/v1/completions", {"prompt": "x", "min_tokens": 20})  # max_tokens: 16
    assert error["param"] == "min_tokens" and "max_tokens (16)" in error["message"]
    error = refused(shipped, "/v1/completions", {"prompt": [5, 10**6], "max_tokens": 2})
    assert error["param"] == "prompt"
    body = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}
    error = refused(chat, "/v1/chat/completions", body)
    assert error["param"] == "max_completion_tokens" and "max_completion_tokens must be" in error["message"]
    body = {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}
    assert refused(chat, "/v1/chat/completions", body)["param"] == "top_logprobs"  # (no logprobs: true)
    error = refused(shipped, "/v1/completions", {"prompt": "x " * 5000, "max_tokens": 4})
    assert error["code"] == "context_length_exceeded" and "--allow-extrapolation" in error["message"]


# ---- n choices ------------------------------------------------------------------------------------


def test_n_greedy_choices_are_equal_and_share_one_prefill(shipped_server):
    """n=3 greedy: three equal choices, the first's text alone; choices 1 and 2 copy the prompt
    positions of choice 0 while it runs (the access line's cached tokens, per choice)."""
    base = shipped_server.base
    c = client(base)
    prompt = [7, *random_ids(40, seed=55, vocab_size=4000)]  # (BOS-less: shares nothing cached)
    before = metrics(base)["minidecode_prefix_cache_hits_total"]
    out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, n=3)
    assert [ch.index for ch in out.choices] == [0, 1, 2] and len({ch.text for ch in out.choices}) == 1
    assert metrics(base)["minidecode_prefix_cache_hits_total"] == before + 2
    assert out.usage.prompt_tokens == len(prompt) and out.usage.prompt_tokens_details.cached_tokens == 0
    line = access_line(shipped_server.log, out.id)
    assert f" cached=0,{len(prompt) - 1},{len(prompt) - 1} " in line
    single = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert out.choices[0].text == single.choices[0].text
    assert out.usage.completion_tokens == 3 * single.usage.completion_tokens


def test_n_seeded_choices_are_reproducible_and_choice_i_uses_seed_plus_i(shipped):
    c = client(shipped)
    kw = dict(model=MODEL, prompt="def parse(text):", max_tokens=16, temperature=1.0)
    first = [ch.text for ch in c.completions.create(**kw, n=3, seed=40).choices]
    again = [ch.text for ch in c.completions.create(**kw, n=3, seed=40).choices]
    assert first == again and len(set(first)) > 1
    assert c.completions.create(**kw, seed=41).choices[0].text == first[1]


def test_n_in_a_stream_and_several_prompts(shipped, reference):
    c = client(shipped)
    chunks = list(c.completions.create(model=MODEL, prompt="import re\n", max_tokens=8, temperature=0, n=2,
                                       stream=True, stream_options={"include_usage": True}))  # fmt: skip
    texts = ["".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == i)
             for i in (0, 1)]  # fmt: skip
    expected = reference.generate("import re\n", max_new_tokens=8, temperature=0).text
    assert texts == [expected, expected] and chunks[-1].usage.completion_tokens == 16
    prompts = ["import re\n", "class A:"]
    out = c.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0, n=2)
    other = reference.generate("class A:", max_new_tokens=8, temperature=0).text
    assert [ch.text for ch in out.choices] == [expected, expected, other, other]


def test_a_running_sequence_lends_its_prompt_and_fed_tokens(long_model):
    """Python API: three identical prompts submitted together prefill once (the later two copy the
    first's prompt positions while it runs); a prompt that extends a running sequence's prompt and
    its fed-back tokens reuses them all; every result equals a run without reuse."""
    llm = LLM(long_model, device="cpu", dtype="float32")
    prompt = random_ids(60, seed=21)
    ask = dict(max_new_tokens=8, temperature=0, ignore_eos=True)
    results = llm.generate_batch([prompt] * 3, **ask)
    assert [r.stats.reused_tokens for r in results] == [0, len(prompt) - 1, len(prompt) - 1]
    fresh = llm.generate(token_ids=prompt, reuse_prefix=False, **ask).token_ids
    assert all(r.token_ids == fresh for r in results)
    other = random_ids(50, seed=22)
    with llm.stream(token_ids=other, max_new_tokens=20_000, temperature=0, ignore_eos=True) as running:
        events = running.events()  # (kept: dropping it would abort the stream)
        tokens = [next(events).token for _ in range(12)]
        longer = other + tokens[:6] + [3, 4]
        out = llm.generate(token_ids=longer, **ask)
        assert out.stats.reused_tokens == len(other) + 6
        assert llm.loop.counts()[0] == 1  # the lender still runs
    assert out.token_ids == llm.generate(token_ids=longer, reuse_prefix=False, **ask).token_ids


# ---- log-probs, logit_bias, stop_token_ids, min_tokens, penalties -----------------------------------


def test_top_logprobs_equal_the_models_log_softmax(shipped, reference):
    prompt = "def fibonacci(n):"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 5}
    status, answer = post(shipped, "/v1/completions", body)
    assert status == 200, answer
    logprobs = answer["choices"][0]["logprobs"]
    ids = reference.generate(prompt, max_new_tokens=6, temperature=0).token_ids
    prompt_ids = reference.encode(Request(prompt=prompt).check())
    rows = reference.logits(prompt_ids + ids)[len(prompt_ids) - 1 : -1].log_softmax(-1)
    decode = reference.tokenizer.decode
    assert logprobs["tokens"] == [decode([t]) for t in ids]
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])
    for row, token, got_lp, got_top in zip(rows, ids, logprobs["token_logprobs"], logprobs["top_logprobs"],
                                          strict=True):  # fmt: skip
        values, top_ids = row.topk(5)
        expected = {decode([int(t)]): float(v) for t, v in zip(top_ids, values, strict=True)}
        assert set(got_top) == set(expected) and len(got_top) == 5
        assert all(abs(got_top[k] - expected[k]) < 1e-3 for k in expected)
        assert abs(got_lp - float(row[token])) < 1e-3


def test_chat_top_logprobs_shape(chat):
    out = client(chat).chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "Hello"}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)


def test_a_partial_character_token_keeps_its_bytes_in_log_probs(chat, chat_model):
    """A token that is the first byte of a 4-byte character (forced by logit_bias): its log-prob
    entry names its byte, not U+FFFD (which every partial token would share as a dict key), and
    `bytes` holds exactly it; completions' legacy tokens and top-log-probs keys say the same."""
    from minidecode.tokenizer import Tokenizer

    tokenizer = Tokenizer(chat_model)
    lead = tokenizer.token_id("ð")  # byte 0xF0 in the byte-level alphabet: it stands for itself
    assert tokenizer.token_bytes(lead) == b"\xf0"
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "temperature": 0,
            "logit_bias": {str(lead): 100}, "logprobs": True, "top_logprobs": 2}  # fmt: skip
    status, answer = post(chat, "/v1/chat/completions", body)
    assert status == 200, answer
    entry = answer["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == "bytes:\\xf0" and entry["bytes"] == [0xF0]
    assert answer["choices"][0]["message"]["content"] == "\ufffd"  # the text itself: replaced
    body = {"prompt": "x", "max_tokens": 1, "temperature": 0, "logit_bias": {str(lead): 100}, "logprobs": 2}
    status, answer = post(chat, "/v1/completions", body)
    logprobs = answer["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["bytes:\\xf0"] and "bytes:\\xf0" in logprobs["top_logprobs"][0]


def test_logit_bias_removes_the_greedy_token(shipped, reference):
    prompt = "def fibonacci(n):"
    ids = reference.encode(Request(prompt=prompt).check())
    greedy = int(reference.logits(ids)[-1].argmax())
    c = client(shipped)
    plain = c.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0).choices[0].text
    assert plain == reference.tokenizer.decode([greedy])
    biased = c.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                  logit_bias={str(greedy): -100}).choices[0].text  # fmt: skip
    assert biased != plain


def test_stop_token_ids_and_min_tokens_are_obeyed(shipped, reference):
    prompt = "class Stack:"
    ids = reference.generate(prompt, max_new_tokens=12, temperature=0, ignore_eos=True).token_ids
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    c = client(shipped)
    kw = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    out = c.completions.create(**kw, extra_body={"stop_token_ids": [ids[k]], "ignore_eos": True})
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == k
    assert out.choices[0].text == reference.tokenizer.decode(ids[:k])
    held = c.completions.create(**kw, extra_body={"stop_token_ids": [ids[k]], "min_tokens": k + 2})
    assert held.usage.completion_tokens >= k + 2


def test_penalties_match_the_python_api(shipped, reference):
    settings = dict(presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.3)
    prompt = "for i in range(10):"
    expected = reference.generate(prompt, max_new_tokens=24, temperature=0, **settings).text
    assert expected != reference.generate(prompt, max_new_tokens=24, temperature=0).text
    out = client(shipped).completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
        presence_penalty=1.5, frequency_penalty=1.0, extra_body={"repetition_penalty": 1.3},
    )  # fmt: skip
    assert out.choices[0].text == expected


# ---- a client that leaves, the API key, the access line ---------------------------------------------


def test_a_non_streamed_client_that_leaves_frees_its_row(long_model):
    with server(long_model) as base:
        impatient = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=1.5)
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(
                model=str(long_model), prompt="Go on", max_tokens=50_000, extra_body={"ignore_eos": True}
            )
        left = time.monotonic()
        while metrics(base)["minidecode_requests_running"] != 0:
            assert time.monotonic() - left < 1.5, "the request ran on after its client left"
            time.sleep(0.05)
        tokens = metrics(base)["minidecode_generation_tokens_total"]
        time.sleep(0.3)
        assert metrics(base)["minidecode_generation_tokens_total"] == tokens < 50_000


def test_api_key_extrapolation_and_the_access_line():
    with started(None, "--allow-extrapolation", env={"MINIDECODE_API_KEY": "sesame"}) as served:
        base = served.base
        assert urllib.request.urlopen(base + "/health", timeout=WAIT).status == 200
        for path in ("/v1/models", "/metrics"):
            with pytest.raises(urllib.error.HTTPError) as denied:
                urllib.request.urlopen(base + path, timeout=WAIT)
            assert denied.value.code == 401
            assert json.loads(denied.value.read())["error"]["code"] == "invalid_api_key"
        wrong = openai.OpenAI(base_url=base + "/v1", api_key="open", max_retries=0, timeout=WAIT)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        right = openai.OpenAI(base_url=base + "/v1", api_key="sesame", max_retries=0, timeout=WAIT)
        out = right.completions.create(model=MODEL, prompt="x " * 5000, max_tokens=3, temperature=0)
        assert out.usage.prompt_tokens > 4096  # past the model's positions: --allow-extrapolation
        line = access_line(served.log, out.id)
        assert " POST /v1/completions 200 " in line and f"prompt={out.usage.prompt_tokens}" in line
        assert f"completion={out.usage.completion_tokens}" in line and "ttft=" in line and "finish=" in line
        assert any(" GET /v1/models 401 " in x for x in served.log.read_text().splitlines())


# ---- Ctrl-C -----------------------------------------------------------------------------------------


def test_ctrl_c_on_an_idle_server_exits_130():
    with started(None) as served:
        served.proc.send_signal(signal.SIGINT)
        assert served.proc.wait(timeout=30) == 130
        assert "Traceback" not in served.log.read_text()


def test_ctrl_c_once_lets_a_running_request_finish(long_model):
    with started(long_model) as served:
        stream = stream_lines(served.base, {"prompt": "Go on", "max_tokens": 400, "ignore_eos": True})
        assert stream.readline().startswith(b"data: {")
        served.proc.send_signal(signal.SIGINT)
        events = [line for line in stream.read().decode().split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
        assert served.proc.wait(timeout=30) == 130
        assert "Traceback" not in served.log.read_text()


def test_ctrl_c_lets_requests_finish_and_a_second_ends_them_cleanly(long_model):
    long = {"prompt": "Go on", "max_tokens": 50_000, "ignore_eos": True}
    with started(long_model) as served:
        base = served.base
        streams = [stream_lines(base, long) for _ in range(2)]
        answer: dict = {}
        waiting = threading.Thread(target=lambda: answer.update(zip(("status", "body"), post(
            base, "/v1/completions", long), strict=True)))  # fmt: skip
        waiting.start()
        deadline = time.monotonic() + WAIT
        while metrics(base)["minidecode_requests_running"] != 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        served.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        for stream in streams:  # still decoding
            assert all(stream.readline().startswith((b"data: {", b"\n")) for _ in range(20))
        try:
            status, _ = post(base, "/v1/completions", {"prompt": "x", "max_tokens": 2})
            assert status == 503
        except urllib.error.URLError:
            pass  # the listener is closed
        assert served.proc.poll() is None
        served.proc.send_signal(signal.SIGINT)
        for stream in streams:
            events = [line for line in stream.read().decode().split("\n\n") if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            error = json.loads(events[-2].removeprefix("data: "))["error"]
            assert error["code"] == "server_shutdown" and error["type"] == "server_error"
        waiting.join(timeout=WAIT)
        assert answer["status"] == 503 and answer["body"]["error"]["code"] == "server_shutdown"
        assert served.proc.wait(timeout=30) == 130
        log = served.log.read_text()
        assert "Traceback" not in log and "aborting 3 running request(s)" in log, log

"""`minidecode serve` end to end: the server runs in a subprocess on a free port (the shipped model
for completions, a tiny checkpoint with a chat template for chat) and is driven with the real
`openai` client (no retries) and with raw HTTP for the error shapes, SSE and /metrics; the
engine loop's failure path runs an in-process server. References are transformers' greedy tokens."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import wait_healthy

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from minidecode.loading import DEFAULT_MODEL  # noqa: E402

ENV = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONIOENCODING="utf-8")
WAIT = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    base: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen
    log: Path  # its stdout and stderr


@contextmanager
def server(model: Path | None, *options: str, env: dict[str, str] | None = None):
    """`minidecode serve` in a subprocess, up once /health answers 200; -> its base URL."""
    with started(model, *options, env=env) as served:
        yield served.base


@contextmanager
def started(model: Path | None, *options: str, env: dict[str, str] | None = None):
    """`minidecode serve` in a subprocess, up once /health answers 200; -> Served (stopped by
    SIGTERM at the end, killed if it has not exited 30 s later)."""
    port = free_port()
    args = [] if model is None else [str(model)]
    command = [
        sys.executable,
        "-m",
        "minidecode_cli.cli",
        "serve",
        *args,
        "--port",
        str(port),
        "--device",
        "cpu",
    ]
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"minidecode-serve-{port}.log", "w+")  # noqa: SIM115
    environment = {**ENV, **(env or {})}
    proc = subprocess.Popen([*command, *options], stdout=log, stderr=subprocess.STDOUT, env=environment)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, Path(log.name), WAIT)
        yield Served(base, proc, Path(log.name))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def client(base: str):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=WAIT)


def post(base: str, path: str, body: bytes | dict) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=WAIT) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metrics(base: str) -> dict[str, float]:
    text = urllib.request.urlopen(base + "/metrics", timeout=WAIT).read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def chat(chat_model):
    with server(chat_model, "--served-model-name", "tiny-chat", "--max-tokens-default", "40") as base:
        yield base


def hf_text(hf, model_dir: Path, ids: list[int], new: int) -> str:
    tokens = hf.greedy(model_dir, ids, new, eos=True)
    return hf.tokenizer(model_dir).decode(tokens, skip_special_tokens=True)


# ---- completions (the shipped model) -------------------------------------------------------------


def test_completion_and_its_stream_equal_greedy_transformers(shipped, hf):
    prompt = "def fibonacci(n):"
    expected = hf_text(hf, DEFAULT_MODEL, hf.tokenizer(DEFAULT_MODEL)(prompt).input_ids, 24)
    c = client(shipped)
    out = c.completions.create(model="stdlib-tiny", prompt=prompt, max_tokens=24, temperature=0)
    assert out.object == "text_completion" and out.choices[0].text == expected
    assert out.choices[0].finish_reason in ("stop", "length")
    usage = out.usage
    assert (
        usage.completion_tokens <= 24 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    )
    chunks = list(
        c.completions.create(
            model="stdlib-tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == expected and chunks[-2].choices[0].finish_reason == out.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1  # the reuse


def test_default_max_tokens_stop_strings_and_seeds(shipped):
    c = client(shipped)
    out = c.completions.create(model="stdlib-tiny", prompt="import os\n", temperature=0)
    assert out.usage.completion_tokens <= 16  # OpenAI's default for completions
    long = c.completions.create(model="stdlib-tiny", prompt="class A:", max_tokens=40, temperature=0).choices[
        0
    ]
    stop = long.text[5:8]
    assert stop and stop not in long.text[:5]
    cut = c.completions.create(
        model="stdlib-tiny", prompt="class A:", max_tokens=40, temperature=0, stop=[stop]
    )
    assert (
        cut.choices[0].text == long.text[: long.text.index(stop)] and cut.choices[0].finish_reason == "stop"
    )
    kw = dict(model="stdlib-tiny", prompt="def f(x):", max_tokens=24, temperature=1.0)
    a, b = (c.completions.create(**kw, seed=5).choices[0].text for _ in range(2))
    assert a == b and c.completions.create(**kw, seed=6).choices[0].text != a


def test_tokenize_detokenize_and_models(shipped):
    status, body = post(shipped, "/tokenize", {"prompt": "def f(x):"})
    assert status == 200 and body["count"] == len(body["tokens"])
    status, text = post(shipped, "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and text["prompt"] == "def f(x):"
    (card,) = client(shipped).models.list().data
    assert card.id == "stdlib-tiny" and card.max_model_len > 0


X = {"model": "stdlib-tiny", "prompt": "x"}
BAD_REQUESTS = [  # (body, in the message, param: the client's field)
    (b"{not json", "not valid JSON", None),
    ({**X, "temperature": -1}, "temperature", "temperature"),
    ({**X, "max_tokens": "5"}, "max_tokens must be an integer", "max_tokens"),
    ({**X, "n": 0}, "n must be an integer in [1, 128]", "n"),
    ({"model": "gpt-4", "prompt": "x"}, "does not exist", "model"),
    ({"model": "stdlib-tiny"}, "prompt must be a string", "prompt"),
    ({**X, "stop": 5}, "stop must be a string", "stop"),
    ({**X, "stream": "yes"}, "stream must be true or false", "stream"),
    ({**X, "prompt": "x " * 5000, "max_tokens": 10}, "exceeds", "prompt"),
    ({**X, "logprobs": 21}, "logprobs must be <= 20", "logprobs"),
    ({**X, "presence_penalty": 3}, "presence_penalty must be in", "presence_penalty"),
    ({**X, "foo": 1}, "unknown field 'foo'", "foo"),
]


@pytest.mark.parametrize(("body", "message", "param"), BAD_REQUESTS, ids=[m for _, m, _ in BAD_REQUESTS])
def test_every_bad_request_is_a_400_in_openai_shape(shipped, body, message, param):
    status, answer = post(shipped, "/v1/completions", body)
    assert status == 400, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"} and message in error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_logprobs_given_and_user_accepted(shipped, hf):
    status, answer = post(
        shipped,
        "/v1/completions",
        {"model": "stdlib-tiny", "prompt": "x = 1", "max_tokens": 4, "temperature": 0, "logprobs": 0,
         "user": "me"},
    )  # fmt: skip
    assert status == 200
    logprobs = answer["choices"][0]["logprobs"]["token_logprobs"]
    assert len(logprobs) == answer["usage"]["completion_tokens"] and all(lp <= 0 for lp in logprobs)


# ---- chat (a tiny checkpoint with a template) ------------------------------------------------------


def test_chat_and_its_stream_equal_greedy_transformers(chat, chat_model, hf):
    messages = [{"role": "user", "content": "Hello there!"}]
    tok = hf.tokenizer(chat_model)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = hf_text(hf, chat_model, ids, 40)  # the server's default: --max-tokens-default 40
    c = client(chat)
    out = c.chat.completions.create(model="tiny-chat", messages=messages, temperature=0)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected and out.usage.prompt_tokens == len(ids)
    chunks = list(c.chat.completions.create(model="tiny-chat", messages=messages, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)


def test_eight_concurrent_clients_each_get_their_own_greedy_text(chat, chat_model, hf):
    tok = hf.tokenizer(chat_model)
    questions = [f"Question number {i}: {'why ' * i}?" for i in range(8)]
    expected = []
    for q in questions:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False
        )
        expected.append(hf_text(hf, chat_model, ids, 30))
    got: dict[int, str] = {}
    barrier = threading.Barrier(8, timeout=WAIT)

    def ask(i: int) -> None:
        barrier.wait()
        out = client(chat).chat.completions.create(
            model="tiny-chat",
            messages=[{"role": "user", "content": questions[i]}],
            max_tokens=30,
            temperature=0,
        )
        got[i] = out.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=WAIT)
    assert [got.get(i) for i in range(8)] == expected


def test_a_client_that_disconnects_frees_its_row(long_model):
    """A stream closed mid-way: the request is aborted at the next step (/metrics: nothing running,
    and the token counter stops), where it would otherwise run 50,000 tokens."""
    body = {"prompt": "Go on", "max_tokens": 50_000, "stream": True, "ignore_eos": True}
    with server(long_model) as base:
        request = urllib.request.Request(
            base + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        response = urllib.request.urlopen(request, timeout=WAIT)
        for _ in range(5):
            assert response.readline().startswith((b"data: ", b"\n"))
        assert metrics(base)["minidecode_requests_running"] == 1
        response.close()
        deadline = time.monotonic() + 30
        while metrics(base)["minidecode_requests_running"] != 0:
            assert time.monotonic() < deadline, "the aborted request kept running"
            time.sleep(0.1)
        tokens = metrics(base)["minidecode_generation_tokens_total"]
        time.sleep(0.5)
        assert metrics(base)["minidecode_generation_tokens_total"] == tokens < 50_000


def test_metrics_parse_and_count(chat):
    before = metrics(chat)
    client(chat).completions.create(model="tiny-chat", prompt="abc", max_tokens=5, temperature=0)
    after = metrics(chat)
    assert after["minidecode_requests_finished_total"] == before["minidecode_requests_finished_total"] + 1
    assert after["minidecode_prompt_tokens_total"] > before["minidecode_prompt_tokens_total"]
    assert after["minidecode_time_to_first_token_seconds_count"] >= 1
    assert after["minidecode_cache_reallocations_total"] >= 1  # the cache was made for the first request
    for name in (
        "minidecode_requests_waiting",
        "minidecode_kv_cache_usage_ratio",
        "minidecode_prefix_cache_hits_total",
        "minidecode_graph_captures_total",  # (none on the CPU: no CUDA graphs)
        "minidecode_graph_capture_seconds_total",
    ):
        assert name in after


def test_a_full_queue_is_a_503_and_a_waiting_stream_keeps_alive(long_model):
    """One row, one waiting place: a third request gets 503; the waiting stream receives SSE
    keep-alive comments until its turn."""
    with server(long_model, "--max-batch", "1", "--max-waiting", "1") as base:
        long = json.dumps({"prompt": "a", "max_tokens": 50_000, "ignore_eos": True, "stream": True}).encode()
        headers = {"Content-Type": "application/json"}
        first = urllib.request.urlopen(
            urllib.request.Request(base + "/v1/completions", long, headers), timeout=WAIT
        )
        first.readline()
        second = urllib.request.urlopen(
            urllib.request.Request(base + "/v1/completions", long, headers), timeout=WAIT
        )
        deadline = time.monotonic() + 30
        while metrics(base)["minidecode_requests_waiting"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        status, answer = post(base, "/v1/completions", {"prompt": "b", "max_tokens": 2})
        assert status == 503 and answer["error"]["type"] == "server_error"
        assert second.readline() == b": keep-alive\n"  # after 10 s of waiting
        first.close()
        second.close()


# ---- the engine loop dies: an in-process server ----------------------------------------------------


def test_a_dead_loop_is_a_503_on_health_and_the_next_request_restarts_it(chat_model, monkeypatch):
    import uvicorn

    from minidecode import LLM
    from minidecode.engine import Engine
    from minidecode.server import ServerSettings, create_app

    llm = LLM(chat_model, device="cpu", dtype="float32")
    port = free_port()
    config = uvicorn.Config(
        create_app(llm, ServerSettings("tiny")), host="127.0.0.1", port=port, log_level="error"
    )
    uvi = uvicorn.Server(config)
    thread = threading.Thread(target=uvi.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + WAIT
        while not uvi.started:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        real = Engine.step

        def failing(self, *args):
            raise RuntimeError("an illegal memory access was encountered (planted)")

        monkeypatch.setattr(Engine, "step", failing)
        status, answer = post(base, "/v1/completions", {"prompt": "abc", "max_tokens": 5})
        assert status == 500 and "planted" in answer["error"]["message"]
        with pytest.raises(urllib.error.HTTPError) as dead:
            urllib.request.urlopen(base + "/health", timeout=WAIT)
        assert dead.value.code == 503
        monkeypatch.setattr(Engine, "step", real)
        status, answer = post(base, "/v1/completions", {"prompt": "abc", "max_tokens": 5, "temperature": 0})
        assert status == 200 and answer["usage"]["completion_tokens"] >= 1
        assert urllib.request.urlopen(base + "/health", timeout=WAIT).status == 200
    finally:
        uvi.should_exit = True
        thread.join(timeout=30)

"""One engine on several CPU processes: `torchrun --nproc-per-node 2 -m minidecode serve` and
`batch` with --tp 2 / --cp 2 (gloo) give one process's greedy text. Rank 0 runs the engine loop
and listens (or reads and writes); rank 1 runs each of its step plans. Prefix reuse works across
requests under --tp and --cp; a killed rank ends the server and its clients with an error, not a hang.
Every launch runs in a session of its own and is killed with everything it started after a
deadline."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import wait_healthy

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

WAIT = 120
PROMPTS = [f"def f{i}(x):" for i in range(8)]
NEW = 16
# ~1,900 tokens: past the first chunk of positions --cp deals (1,024), so both ranks hold some
DOC = "".join(f"def add{i}(a, b):\n    return a + b + {i}\n\n" for i in range(100))


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONIOENCODING="utf-8")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("WORLD_SIZE", None)
    return env


def _torchrun(*args: str) -> list[str]:
    port = _free_port()  # torchrun's own rendezvous port: tests may run side by side
    launch = ["torchrun", "--nproc-per-node", "2", "--master-port", str(port)]
    return [*launch, "-m", "minidecode_cli.cli", *args]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _end(proc: subprocess.Popen, grace: float = 30) -> None:
    """SIGTERM to the launch, then SIGKILL to its whole session past `grace` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@contextmanager
def served(*options: str):
    """`torchrun ... serve --device cpu` up once /health answers -> (base URL, the torchrun process,
    its log)."""
    port = _free_port()
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"minidecode-torchrun-serve-{port}.log"
    with open(log_path, "w+") as log:
        command = _torchrun("serve", "--port", str(port), "--device", "cpu", *options)
        pipes = dict(stdout=log, stderr=subprocess.STDOUT)
        proc = subprocess.Popen(command, **pipes, env=_env(), start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(proc, base, log_path, WAIT)
            yield base, proc, log_path
        finally:
            _end(proc)


def client(base: str):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=WAIT)


@pytest.fixture(scope="module")
def one_process() -> list[str]:
    """The shipped model's greedy text of each prompt, in one process."""
    from minidecode import LLM

    llm = LLM(device="cpu")
    texts = [llm.generate(p, max_new_tokens=NEW, temperature=0).text for p in PROMPTS]
    llm.close()
    return texts


def ask_together(base: str, prompts: list[str]) -> list:
    """Every prompt from its own client thread at once -> their completions, in order."""
    got: dict[int, object] = {}
    barrier = threading.Barrier(len(prompts), timeout=WAIT)

    def ask(i: int) -> None:
        barrier.wait()
        got[i] = client(base).completions.create(
            model="stdlib-tiny", prompt=prompts[i], max_tokens=NEW, temperature=0
        )

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=WAIT)
    return [got.get(i) for i in range(len(prompts))]


def test_serve_on_two_ranks_answers_eight_clients_with_one_process_text(one_process):
    """8 concurrent openai clients against a --tp 2 server: each gets one process's greedy text
    (they decode as one batch, each rank holding its heads)."""
    with served("--tp", "2") as (base, _, log):
        answers = ask_together(base, PROMPTS)
        assert all(a is not None for a in answers), log.read_text()
        assert [a.choices[0].text for a in answers] == one_process


def test_serve_under_cp_answers_eight_clients_of_a_long_document_with_one_process_text():
    """8 concurrent clients against a --cp 2 server, each prompt a ~1,900-token document and its
    own question: every rank holds positions of each (the dealing's first chunk of 1,024 on rank
    0, the rest on rank 1), later prompts reuse the document's cached positions, and each answer
    is one process's greedy text."""
    from minidecode import LLM

    prompts = [DOC + p for p in PROMPTS]
    llm = LLM(device="cpu")
    alone = [llm.generate(p, max_new_tokens=NEW, temperature=0, reuse_prefix=False).text for p in prompts]
    llm.close()
    with served("--cp", "2") as (base, _, log):
        answers = ask_together(base, prompts)
        assert all(a is not None for a in answers), log.read_text()
        assert [a.choices[0].text for a in answers] == alone


def test_prefix_reuse_across_requests_under_tp(one_process):
    """A second request that starts like the first reuses its cached positions (both ranks' parts
    of them) and still gives one process's greedy text."""
    with served("--tp", "2") as (base, _, _):
        c = client(base)
        first = c.completions.create(model="stdlib-tiny", prompt=PROMPTS[3], max_tokens=NEW, temperature=0)
        again = c.completions.create(model="stdlib-tiny", prompt=PROMPTS[3], max_tokens=NEW, temperature=0)
        assert first.choices[0].text == again.choices[0].text == one_process[3]
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_prefix_reuse_across_requests_under_cp():
    """Under --cp 2 a prompt of ~1,900 tokens holds positions on both ranks (the dealing's first
    chunk of 1,024 on rank 0, the rest on rank 1); a second prompt that starts with it reuses both
    ranks' shares (cached_tokens past the first chunk) and both texts are one process's."""
    from minidecode import LLM

    prompts = [DOC + "def sub(a, b):", DOC + "def mul(a, b):"]
    llm = LLM(device="cpu")
    alone = [llm.generate(p, max_new_tokens=NEW, temperature=0, reuse_prefix=False).text for p in prompts]
    llm.close()
    with served("--cp", "2") as (base, _, log):
        c = client(base)
        ask = dict(model="stdlib-tiny", max_tokens=NEW, temperature=0)
        got = [c.completions.create(prompt=p, **ask) for p in prompts]
        assert [g.choices[0].text for g in got] == alone, log.read_text()
        assert got[0].usage.prompt_tokens_details.cached_tokens == 0
        assert got[1].usage.prompt_tokens_details.cached_tokens > 1024


def test_a_request_arriving_beside_a_running_one_under_cp():
    """Under --cp a prompt that arrives while another request decodes prefills a unit of its whole
    prefill after each of the running row's decode steps (no mixed steps under cp), then decodes
    beside it: both texts are one process's, and the second ended while the first still decoded."""
    from minidecode import LLM

    long_prompt, new, short = PROMPTS[5] * 6, 300, 4
    llm = LLM(device="cpu")
    alone = llm.generate(PROMPTS[0], max_new_tokens=new, temperature=0).text
    second_alone = llm.generate(long_prompt, max_new_tokens=short, temperature=0).text
    llm.close()
    with served("--cp", "2") as (base, _, log):
        first = client(base).completions.create(
            model="stdlib-tiny", prompt=PROMPTS[0], max_tokens=new, temperature=0, stream=True
        )
        arrivals: list[tuple[float, str]] = []
        started = threading.Event()

        def read() -> None:
            for chunk in first:
                if chunk.choices:
                    arrivals.append((time.monotonic(), chunk.choices[0].text))
                    started.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert started.wait(WAIT), log.read_text()  # the first request decodes
        second = client(base).completions.create(
            model="stdlib-tiny", prompt=long_prompt, max_tokens=short, temperature=0
        )
        second_done = time.monotonic()
        reader.join(WAIT)
        assert "".join(text for _, text in arrivals) == alone, log.read_text()
        assert second.choices[0].text == second_alone
        assert arrivals[-1][0] > second_done  # the first was still decoding: the second ran beside it


@pytest.mark.parametrize("split", ["--tp", "--cp"])
def test_batch_under_torchrun_writes_one_process_results(tmp_path, split):
    lines = [{"prompt": p, "id": f"r{i}"} for i, p in enumerate(PROMPTS[:5])]
    lines.append({"prompt": "import os", "max_new_tokens": 4, "id": "short"})
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    options = ["--max-new-tokens", str(NEW), "--temperature", "0", "--device", "cpu", "--no-progress"]

    def run(command: list[str], out: Path) -> dict[str, dict]:
        proc = subprocess.run(
            [*command, str(requests), *options, "--output", str(out)], env=_env(), capture_output=True,
            text=True, timeout=WAIT, cwd=tmp_path,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        results = [json.loads(line) for line in out.read_text().splitlines()]
        fields = ("text", "token_ids", "finish_reason", "prompt_tokens")
        return {r["id"]: {k: r[k] for k in fields} for r in results}

    single = run([sys.executable, "-m", "minidecode_cli.cli", "batch"], tmp_path / "one.jsonl")
    ranks = run(_torchrun("batch", split, "2"), tmp_path / "two.jsonl")
    assert len(single) == len(lines) and ranks == single


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of torchrun's worker of `rank` (its children's environments say which is which)."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        pids = []
        for task in Path(f"/proc/{launcher}/task").iterdir():
            pids += (task / "children").read_text().split()
        for pid in pids:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in environ:
                return int(pid)
        time.sleep(0.2)
    raise AssertionError(f"no worker of rank {rank} under {launcher}")


def test_a_killed_rank_ends_the_server_and_its_clients_with_an_error():
    """Rank 1 is killed while 4 clients stream: each client's request ends with an error (an error
    event, or the connection closed) and the server exits non-zero, within bounded time."""
    with served("--tp", "2") as (base, proc, log):
        outcomes: dict[int, str] = {}
        streaming = threading.Barrier(5, timeout=WAIT)

        def stream(i: int) -> None:
            try:
                chunks = client(base).completions.create(
                    model="stdlib-tiny", prompt=PROMPTS[i], max_tokens=900, temperature=0, stream=True
                )
                for n, _ in enumerate(chunks):
                    if n == 2:
                        streaming.wait()
                outcomes[i] = "finished"
            except Exception as e:  # an error event, or the connection closed under it
                outcomes[i] = f"error: {type(e).__name__}"

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        streaming.wait()  # every client has tokens: the ranks are decoding
        os.kill(_rank_pid(proc.pid, 1), signal.SIGKILL)
        killed = time.monotonic()
        for t in threads:
            t.join(timeout=60)
        assert all(not t.is_alive() for t in threads), "a client still waits after its rank died"
        assert sorted(outcomes) == [0, 1, 2, 3], outcomes
        assert all(o.startswith("error") for o in outcomes.values()), outcomes
        proc.wait(timeout=60)
        assert proc.returncode != 0, log.read_text()
        assert time.monotonic() - killed < 90


@contextmanager
def bare_ranks(*options: str):
    """The two ranks of `serve --tp 2` started as torchrun would start them but with no torchrun
    watching them (which would end every rank once one dies): what the ranks notice themselves.
    -> (base URL, rank 0's process, rank 1's, rank 0's log)."""
    port, master = _free_port(), _free_port()
    logs = [Path(os.environ.get("TMPDIR", "/tmp")) / f"minidecode-bare-{port}-{r}.log" for r in (0, 1)]
    procs = []
    command = [sys.executable, "-m", "minidecode_cli.cli", "serve", "--port", str(port), "--device", "cpu"]
    for r in (0, 1):
        env = dict(_env(), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master))
        with open(logs[r], "w") as log:
            pipes = dict(stdout=log, stderr=subprocess.STDOUT)
            procs.append(subprocess.Popen([*command, *options], **pipes, env=env, start_new_session=True))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + WAIT
        while True:
            assert procs[0].poll() is None, f"rank 0 exited: {logs[0].read_text()}"
            try:
                if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        yield base, procs[0], procs[1], logs[0]
    finally:
        for proc in procs:
            _end(proc, grace=10)


def test_rank_zero_notices_a_dead_peer_by_itself():
    """With no launcher to end it: rank 1 killed mid-stream -> the client's request ends with an
    error, rank 0's server says why and exits 1, within bounded time."""
    with bare_ranks("--tp", "2") as (base, rank0, rank1, log):
        outcome: list[str] = []
        streaming = threading.Event()

        def stream() -> None:
            try:
                chunks = client(base).completions.create(
                    model="stdlib-tiny", prompt=PROMPTS[0], max_tokens=900, temperature=0, stream=True
                )
                for n, _ in enumerate(chunks):
                    if n == 2:
                        streaming.set()
                outcome.append("finished")
            except Exception as e:
                outcome.append(f"error: {e}")

        thread = threading.Thread(target=stream, daemon=True)
        thread.start()
        assert streaming.wait(WAIT)
        rank1.kill()
        killed = time.monotonic()
        thread.join(timeout=60)
        assert not thread.is_alive() and outcome and outcome[0].startswith("error"), outcome
        assert rank0.wait(timeout=60) == 1, log.read_text()
        assert time.monotonic() - killed < 60
        assert "stopping: a rank stopped answering" in log.read_text()


def test_the_other_ranks_end_when_rank_zero_dies():
    """Rank 0 killed while idle: rank 1 (waiting for its next plan) exits with an error line."""
    with bare_ranks("--tp", "2") as (_, rank0, rank1, _):
        rank0.kill()
        killed = time.monotonic()
        assert rank1.wait(timeout=60) == 1
        assert time.monotonic() - killed < 60

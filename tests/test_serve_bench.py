"""bench/serve.py runs whole on the CPU with the shipped model (its phases in processes of their
own: the Python API, `minidecode serve` with client processes, the long prefill beside running
streams), so a broken harness shows here, not on a GPU. Its figures are not checked: timings
belong to the GPU run."""

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minidecode.llm import DEFAULT_MODEL

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_serve_bench_runs_every_phase_on_the_cpu(tmp_path):
    out = tmp_path / "serve"
    command = [sys.executable, str(REPO / "bench" / "serve.py"), "--model", str(DEFAULT_MODEL)]
    command += ["--prompt-tokens", "64", "--new-tokens", "4", "--clients", "1", "5", "--long", "512"]
    # No start delay: each HTTP load starts once its client processes report ready, so none is late
    # by its own start-up (imports, its prompts read, clients made), longer than the margin here.
    command += ["--start-delay", "0", "--stall-step-tokens", "0", "16", "--alternations", "2"]
    done = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "!! phase" not in done.stdout, done.stdout
    report = json.loads(out.with_suffix(".json").read_text())
    runs = {(r["path"], r["clients"]) for r in report["runs"]}
    assert runs == {("python", 1), ("python", 5), ("http", 1), ("http", 5)}  # 5: two client processes
    assert len(report["runs"]) == 8  # each (path, clients) once an alternation
    assert sorted(r["alternation"] for r in report["runs"]) == [0] * 4 + [1] * 4
    for run in (r for r in report["runs"] if r["path"] == "http"):
        assert run["clients_setup_s"] > 0 and 0 <= run["clients_late_s"] < 0.5  # READY_MARGIN_S
    for run in report["runs"]:  # every client got its 4 tokens
        assert run["tokens_per_s"] > 0 and run["ttft_p50_s"] > 0
        assert 0 < run["engine_ttft_mean_s"] <= run["ttft_p99_s"]  # the engine's part of the wait
        assert run["graph_captures"] == 0 and run["cache_reallocations"] >= 0  # (no CUDA graphs on the CPU)
    assert [stall["step_tokens"] for stall in report["stalls"]] == [32, 16]  # the CPU default, then 16
    for stall in report["stalls"]:
        assert stall["long_prompt_tokens"] == 512 and stall["stream_tokens_during_prefill"] > 0
    text = out.with_suffix(".md").read_text()
    assert "| 5 | http / python |" in text and text.count("(each alternation: ") == 2


@pytest.fixture
def serve():
    """bench/serve.py as a module."""
    spec = importlib.util.spec_from_file_location("serve_bench", REPO / "bench" / "serve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_bench"] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_a_client_that_raises_voids_its_run(serve):
    """A client thread's exception is the load's error, and the table reports that run as void
    instead of counting the client's tokens as none."""

    def one(i, load, lock):
        if i == 1:
            raise ConnectionError("the server closed the stream")
        serve.record(load, lock, 0.0, [0.1, 0.2])

    load = serve.run_clients("http", 3, one)
    assert load.errors == ["ConnectionError: the server closed the stream"] and load.tokens == 4
    ok = serve.Load("python", 3, seconds=1.0, tokens=6, ttft=[0.1] * 3, gaps=[0.1] * 3, engine_ttft=0.1)
    ok.stops = dict.fromkeys(serve.STOPS, 0)
    load.seconds, load.engine_ttft, load.stops = 1.0, 0.1, ok.stops
    rows = [ok.summary() | {"alternation": 0}, load.summary() | {"alternation": 0}]
    assert rows[1]["client_errors"] == 1
    text = serve.table(rows, (3,))
    assert "| 3 | http | void (alternation 1: 1 clients failed: ConnectionError" in text
    assert "http / python" not in text  # no ratio against a void run


def test_every_client_process_gets_the_start_before_any_is_waited_on(serve):
    """Client processes that report ready at different times all receive one start, at or after
    the last one's ready, while each is still running (a process given its start only after the
    one before it finished would send late by that one's whole load)."""
    # a stand-in client process: ready after `delay`, then the start read and when it came, then a
    # 1 s load
    script = (
        "import json, sys, time\n"
        "time.sleep(float(sys.argv[1]))\n"
        "print(json.dumps({'ready_s': float(sys.argv[1])}), flush=True)\n"
        "start = float(sys.stdin.readline())\n"
        "print(json.dumps({'start': start, 'got': time.monotonic()}), flush=True)\n"
        "time.sleep(1.0)\n"
    )
    delays = (0.0, 0.4, 0.2)
    pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(d)], **pipes) for d in delays]
    setup, start = serve.start_together(procs, earliest=0.0)
    sent = time.monotonic()
    assert all(proc.poll() is None for proc in procs)  # none waited on
    got = [json.loads(proc.communicate()[0].splitlines()[-1]) for proc in procs]
    assert setup == max(delays)
    assert all(g["start"] == start for g in got) and start > sent  # READY_MARGIN_S after the last ready
    assert max(g["got"] for g in got) < sent + 0.5  # every start delivered at once, not after a load

"""The README as a user reads it: every Python block of its Python section runs as written (the
shipped model, on the CPU), the server example runs against the server its command starts, the
stats line it shows has the format the runtime prints, and the request options it lists exist on
each command with the API's defaults. (Its shell commands are run by the tests of the features
they show.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from typer.main import get_command

from minidecode import Request
from minidecode.sequence import GenerationStats
from minidecode_cli.cli import REQUEST_OPTIONS, app

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
ENV = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONIOENCODING="utf-8")


def section(title: str) -> str:
    return README.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def blocks(text: str, language: str) -> list[str]:
    return [part.split("```", 1)[0] for part in text.split(f"```{language}\n")[1:]]


@pytest.mark.parametrize("index", range(len(blocks(section("Python"), "python"))))
def test_python_blocks_run_as_written(index, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = blocks(section("Python"), "python")[index]
    exec(compile(code, f"README.md python block {index}", "exec"), {})
    assert capsys.readouterr().out.strip()


def test_the_stats_line_shown_is_the_runtime_format():
    (shown,) = [line for line in README.splitlines() if line.startswith("[length] prompt")]
    stats = GenerationStats(1120, 1089, 31, 0.0, 0.01, 2905.0, 0.012, 64, 0.45, 140.2, 333_000_000, "float32")
    number = r"[\d,.]+"
    pattern = re.sub(r"\d[\d,.]*", lambda _: number, re.escape(f"[length] {stats.summary()}"))
    assert re.fullmatch(pattern, shown), (shown, stats.summary())


def test_each_listed_option_is_on_generate_and_batch_with_the_api_default():
    """README's list is the one table of request options (REQUEST_OPTIONS), each a Request field
    by its API name, on both commands, its default the API's (None, a flag off, or 256)."""
    paragraph = section("Command line").split("share one set of request options")[1].split("\n\n")[0]
    listed = re.findall(r"`(--[a-z-]+)`", paragraph)
    defaults = Request()
    for name in ("generate", "batch"):
        command = get_command(app).commands[name]
        table = [param for param in command.params if param.name in REQUEST_OPTIONS]
        assert [param.name for param in table] == list(REQUEST_OPTIONS)
        assert sorted(listed) == sorted(param.opts[0] for param in table)
        for param in table:
            api = defaults.new_tokens if param.name == "max_new_tokens" else getattr(defaults, param.name)
            assert (param.default or None) == api, (name, param.name)


@pytest.mark.slow
def test_the_server_example_as_written(tmp_path):
    """`minidecode serve --port 8000` as written, then the README's client code against it."""
    (command,) = [
        line for line in blocks(section("Server"), "bash")[0].splitlines() if line.startswith("minidecode")
    ]
    serve = command.split("#")[0].split() + ["--device", "cpu"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "minidecode_cli.cli", *serve[1:]], env=ENV, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        (code,) = blocks(section("Server"), "python")
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert "CompletionUsage" in done.stdout
    finally:
        proc.terminate()
        proc.wait(timeout=30)

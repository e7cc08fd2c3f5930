"""`minidecode batch`: a JSONL file of requests in, one JSON result a line out. Each good line's
answer equals transformers' greedy continuation of its prompt alone; each bad line gets an error
result naming its problem and the others still run; the exit code says whether any failed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from minidecode_cli.cli import app

REPO = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONIOENCODING="utf-8")
NEW = 12  # the --max-new-tokens default of the runs below
GOOD = [  # (prompt, the request's own fields)
    ("The quick brown fox", {"max_new_tokens": 5, "id": "fox"}),
    ("def fibonacci(n):", {"max_new_tokens": 9}),
    ("Long context decoding streams", {}),  # default max_new_tokens; a stop string is added below
]


@pytest.fixture(scope="module")
def model_dir(checkpoint_factory):
    return checkpoint_factory("llama", "default", max_positions=512)


@pytest.fixture(scope="module")
def references(model_dir, hf):
    """transformers' greedy answer to each GOOD prompt alone, stopping at eos: (ids, text); and a
    stop string for the third, taken from inside its answer, with the text it cuts to."""
    tok = hf.tokenizer(model_dir)
    refs = []
    for prompt, fields in GOOD:
        ids = hf.greedy(model_dir, tok(prompt).input_ids, fields.get("max_new_tokens", NEW), eos=True)
        refs.append((ids, tok.decode(ids, skip_special_tokens=True), len(tok(prompt).input_ids)))
    text = refs[2][1]
    stop = next(text[i : i + 2] for i in range(2, len(text) - 2) if text.find(text[i : i + 2]) == i)
    return refs, stop, text[: text.find(stop)]


def request_lines(stop: str) -> list[str]:
    """The mixed file: good requests at lines 1, 2 and 4; each other line is refused for a reason."""
    good = [json.dumps({"prompt": p, **f}) for p, f in GOOD]
    return [
        good[0],
        good[1],
        '{"prompt": "unterminated',  # 3: not JSON
        json.dumps({"prompt": GOOD[2][0], "stop": [stop]}),  # 4: good, ends at a stop string
        "",  # blank: skipped
        json.dumps({"prompt": ""}),  # 6: empty prompt
        json.dumps({"prompt": "hi", "temprature": 0.5}),  # 7: unknown field
        json.dumps({"prompt": "hi", "max_context": 100_000}),  # 8: beyond the 512 positions
        "[1, 2]",  # 9: not an object
        json.dumps({"prompt": "hi", "max_new_tokens": 10**6}),  # 10: too long as well
    ]


def invoke(*args, input: str | None = None):
    result = CliRunner().invoke(app, [str(a) for a in args], input=input)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def batch_args(model_dir, requests, *extra):
    return ["batch", model_dir, requests, "--device", "cpu", "-n", NEW, "--temperature", 0, *extra]


def by_line(text: str) -> dict[int, dict]:
    results = [json.loads(line) for line in text.splitlines()]
    lines = [r["line"] for r in results]
    assert len(lines) == len(set(lines)), "a line was answered twice"
    return {r["line"]: r for r in results}


def check_answers(results: dict[int, dict], references) -> None:
    """Lines 1 and 2 run to their max_new_tokens (or eos); line 4 ends at its stop string."""
    refs, _, stop_text = references
    for line, (ids, text, prompt_tokens) in zip((1, 2, 4), refs, strict=True):
        out = results[line]
        assert "error" not in out, out
        assert out["prompt_tokens"] == prompt_tokens
        assert out["stats"]["new_tokens"] == len(out["token_ids"])
        if line == 4:
            assert out["text"] == stop_text and out["finish_reason"] == "stop"
            assert out["token_ids"] == ids[: len(out["token_ids"])]
        else:
            assert out["token_ids"] == ids and out["text"] == text
            assert out["finish_reason"] in ("length", "eos")


def test_bad_lines_get_errors_the_others_their_answers(model_dir, references, tmp_path):
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(request_lines(references[1])) + "\n")
    result = invoke(*batch_args(model_dir, requests))
    assert result.exit_code == 1, result.stderr
    results = by_line(result.stdout)
    assert sorted(results) == [1, 2, 3, 4, 6, 7, 8, 9, 10]  # the blank line 5 is skipped
    check_answers(results, references)
    assert [results[n]["id"] for n in (1, 2, 4)] == ["fox", 2, 4]  # default id: the line number
    errors = {n: results[n]["error"] for n in (3, 6, 7, 8, 9, 10)}
    assert set(results[3]) == {"id", "line", "error"} and results[3]["id"] == 3
    assert errors[3].startswith("not valid JSON")
    assert errors[6] == "the prompt is empty"
    assert "unknown request field 'temprature'" in errors[7]
    assert "100,000 positions" in errors[8] and "exceeds the 512" in errors[8]
    assert errors[9].startswith("not a JSON object")
    assert "1,000,00" in errors[10] and "exceeds the 512" in errors[10]
    summary = result.stderr.strip().splitlines()[-1]
    assert summary.startswith("3 done, 6 failed of 9 requests | "), result.stderr
    assert "Traceback" not in result.stderr


def test_all_good_from_stdin_to_an_output_file(model_dir, references, tmp_path):
    lines = request_lines(references[1])
    out = tmp_path / "results.jsonl"
    out.write_text("an older file, writable: replaced\n")
    result = invoke(*batch_args(model_dir, "-", "--output", out, "--no-progress"), input="\n".join(
        [lines[0], lines[1], "", lines[3]]
    ))  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert result.stdout == ""
    assert result.stderr.strip().startswith("3 done, 0 failed of 3 requests | "), result.stderr  # no progress
    check_answers(by_line(out.read_text()), references)


def test_options_are_the_defaults(model_dir, references, tmp_path):
    """--stop (backslash-escaped as in generate) and -n apply where a request sets none."""
    refs, stop, stop_text = references
    requests = tmp_path / "r.jsonl"
    requests.write_text(
        json.dumps({"prompt": GOOD[2][0], "max_new_tokens": NEW})
        + "\n"
        + json.dumps({"prompt": GOOD[1][0]})
        + "\n"
    )
    escaped = stop.replace("\\", "\\\\").replace("\n", "\\n")
    result = invoke(*batch_args(model_dir, requests, "--stop", escaped, "-n", 3))
    assert result.exit_code == 0, result.stderr
    results = by_line(result.stdout)
    assert results[1]["text"] == stop_text and results[1]["finish_reason"] == "stop"
    assert results[2]["token_ids"] == refs[1][0][:3]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--output", "no/such/folder/out.jsonl"], "folder no/such/folder does not exist"),
        (["--top-p", "2"], "top_p must be in"),
        (["--max-batch", "1000"], "max_batch must be in"),  # refused by the API, after the load
        (["--step-tokens", "0"], "--step-tokens must be >= 1"),
    ],
)
def test_usage_errors_leave_an_existing_output_as_it_was(model_dir, tmp_path, extra, message):
    requests = tmp_path / "r.jsonl"
    requests.write_text(json.dumps({"prompt": "hi"}) + "\n")
    out = tmp_path / "out.jsonl"
    out.write_text("keep me\n")
    args = batch_args(model_dir, requests, *extra) + ([] if "--output" in extra else ["--output", out])
    result = invoke(*args)
    assert result.exit_code == 2 and message in result.stderr, result.stderr
    assert out.read_text() == "keep me\n"


def test_bad_paths(model_dir, tmp_path):
    requests = tmp_path / "r.jsonl"
    requests.write_text(json.dumps({"prompt": "hi"}) + "\n")
    same = invoke(*batch_args(model_dir, requests, "--output", requests))
    assert (
        same.exit_code == 2
        and same.stderr == f"error: --output {requests} is the requests file: give another file\n"
    )
    assert requests.read_text() == json.dumps({"prompt": "hi"}) + "\n"
    missing = invoke("batch", tmp_path / "nope.jsonl", "--device", "cpu")  # one argument: the requests
    assert (
        missing.exit_code == 2
        and missing.stderr == f"error: requests file {tmp_path / 'nope.jsonl'} does not exist\n"
    )
    folder = invoke(*batch_args(model_dir, tmp_path))
    assert folder.exit_code == 2 and "is a directory" in folder.stderr


def test_every_line_refused_as_read(model_dir, tmp_path):
    requests = tmp_path / "r.jsonl"
    requests.write_text("nope\n\n{}\n".replace("{}", '{"id": [1]}'))
    result = invoke(*batch_args(model_dir, requests))
    assert result.exit_code == 1
    results = by_line(result.stdout)
    assert results[1]["error"].startswith("not valid JSON") and results[3]["error"].startswith("id must be")
    assert result.stderr.strip().splitlines()[-1].startswith("0 done, 2 failed of 2 requests")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    result = invoke(*batch_args(model_dir, empty))
    assert result.exit_code == 2 and "holds no requests" in result.stderr


def test_ctrl_c_keeps_the_results_written(model_dir, tmp_path):
    """SIGINT while a long request runs: the short one's line is already out, exit 130."""
    requests = tmp_path / "r.jsonl"
    long = {"prompt": "import os", "max_new_tokens": 100_000, "allow_extrapolation": True}
    requests.write_text(json.dumps({"prompt": "hi", "max_new_tokens": 1}) + "\n" + json.dumps(long) + "\n")
    cmd = [sys.executable, "-m", "minidecode_cli.cli", *map(str, batch_args(model_dir, requests))]
    env = {k: v for k, v in ENV.items() if k != "PYTHONUNBUFFERED"}  # each result must flush itself
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    watchdog = threading.Timer(120, proc.kill)  # a result never flushed must not hang the test
    watchdog.start()
    first = proc.stdout.readline()  # the short request ended: the long one is decoding
    watchdog.cancel()
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert json.loads(first)["line"] == 1 and rest == ""
    assert err.strip().splitlines()[-1] == "error: interrupted" and "Traceback" not in err


def test_readme_batch_command(tmp_path):
    """The README's batch example, exactly as written, through a shell (shipped model): every
    answer equals the shipped model's greedy answer to its prompt alone."""
    block = (REPO / "README.md").read_text().split("## Command line", 1)[1].split("```", 2)[1]
    commands = [line for line in block.splitlines() if "requests.jsonl" in line]
    assert len(commands) == 2 and commands[1].startswith("minidecode batch requests.jsonl")
    env = dict(ENV, PATH=f"{Path(sys.executable).parent}{os.pathsep}{ENV.get('PATH', '')}")
    for command in commands:
        proc = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300
        )
        assert proc.returncode == 0, proc.stderr
    from minidecode import LLM

    llm = LLM(device="cpu")
    requests = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    results = by_line((tmp_path / "results.jsonl").read_text())
    assert sorted(results) == list(range(1, len(requests) + 1))
    for line, request in enumerate(requests, 1):
        assert results[line]["id"] == request.pop("id", line)
        alone = llm.generate(temperature=0, **{"max_new_tokens": 16, **request})
        assert results[line]["text"] == alone.text and results[line]["token_ids"] == alone.token_ids

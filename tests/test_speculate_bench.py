"""bench/speculate.py runs whole on the CPU with the shipped model for every task (the random one
too, in place of the synthetic 8B), so a broken harness shows here, not on a GPU: its JSON and
table hold what each run gave, and its check of the outputs fails where they differ. Its figures
are not checked: timings belong to the GPU run."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from minidecode.llm import DEFAULT_MODEL

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "speculate.py"


def bench_module():
    spec = importlib.util.spec_from_file_location("speculate_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_the_bench_runs_every_task_and_reports_each_run(tmp_path):
    out = tmp_path / "speculate"
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--dtype", "float32", "--random-model"]
    command += [str(DEFAULT_MODEL), "--long-tokens", "300", "--random-tokens", "120", "--new-tokens", "16"]
    command += ["--repeats", "2", "--speculate", "8", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["env"]["device"] == "CPU" and report["env"]["commit"] and report["env"]["date"]
    assert report["failures"] == []
    tasks = {t["task"]: t for t in report["tasks"]}
    assert list(tasks) == ["code", "long", "random"]
    for task in tasks.values():
        assert task["same_output"] and task["new_tokens"] == 16 and task["speculate"] == 8
        assert len(task["plain_tok_s"]) == len(task["speculating_tok_s"]) == len(task["ratios"]) == 2
        for plain, spec, ratio in zip(
            task["plain_tok_s"], task["speculating_tok_s"], task["ratios"], strict=True
        ):
            assert plain > 0 and spec > 0 and ratio == pytest.approx(spec / plain)
        steps, accepted = task["decode_steps"], task["accepted_tokens"]
        assert 0 <= accepted <= task["proposed_tokens"]
        assert task["tokens_per_step"] == pytest.approx((steps + accepted) / steps, abs=1e-3)
        assert task["plain_decode_steps"] >= 15  # one token a step: every token after the first
        assert task["ratio_spread"]["n"] == 2
    for name in ("code", "long"):  # the shipped model's answers repeat its prompt: drafts are kept
        assert tasks[name]["accepted_tokens"] > 0 and tasks[name]["decode_steps"] < 15
    assert tasks["long"]["prompt_tokens"] > 300  # the document, then its first lines again
    rows = [line for line in out.with_suffix(".md").read_text().splitlines() if line.startswith("| ")]
    assert len(rows) == 5 and rows[0].startswith("| task | model |")  # the head, its rule, 3 tasks
    assert done.stdout.rstrip().splitlines()[-5:] == rows  # the table printed last


def test_the_output_check_fails_where_speculation_changed_a_token():
    bench = bench_module()
    bench.check_same("code", [5, 6, 7], [5, 6, 7])
    with pytest.raises(
        bench.OutputMismatch, match="code: speculation changed the output at new token 2 of 3"
    ):
        bench.check_same("code", [5, 6, 7], [5, 6, 8])
    with pytest.raises(bench.OutputMismatch, match="at new token 2 of 3"):
        bench.check_same("code", [5, 6, 7], [5, 6])  # one cut short


def test_a_mismatch_names_how_close_the_plain_runs_top_two_were():
    """top_two_gap: the plain run's log-probs of its two likeliest tokens at a new token, apart: the
    chosen token's log p (a plain run's logprobs) minus the runner-up's, never negative."""
    from minidecode import LLM

    bench = bench_module()
    llm = LLM(device="cpu", dtype="float32")
    prompt = llm.tokenizer.encode("def add(a, b):\n")
    run = llm.generate(token_ids=prompt, max_new_tokens=6, temperature=0, ignore_eos=True, top_logprobs=3)
    for at in (0, 5):
        (best, lp1), (_, lp2) = run.top_logprobs[at][:2]
        assert best == run.token_ids[at] and run.logprobs[at] == pytest.approx(lp1, abs=1e-5)
        assert bench.top_two_gap(llm, prompt, at) == pytest.approx(lp1 - lp2, abs=1e-4) and lp1 >= lp2

"""The benchmark's arithmetic and its transformers peer (CPU): the bytes a decode step reads, the
decode windows, the prompts the peer sees, and the command's checks before it runs."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import minidecode
from minidecode import LLM
from minidecode.benchmarks.e2e import (
    BenchSettings,
    Spread,
    benchmark_prompt,
    finite_or_none,
    pad_id_for,
    peer_generation,
    provenance,
    special_token_ids,
    step_bytes,
    timed_generation,
    transformers_peer,
    window_contexts,
    window_rates,
)
from minidecode.loading import DEFAULT_MODEL
from minidecode.models.presets import preset_config
from minidecode_cli.cli import app

EMBEDDING = "model.embed_tokens.weight"


def load(model_dir) -> LLM:
    return LLM(model_dir, device="cpu", dtype="float32")


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("family", ["llama", "llama-tied"])
def test_step_bytes_read_one_embedding_row_and_a_tied_table_once(checkpoint_factory, family):
    llm = load(checkpoint_factory(family, "default"))
    named = dict(llm.model.named_parameters())  # a tied lm_head is the embedding itself: listed once
    hidden = llm.config.hidden_size
    if family == "llama-tied":
        assert "lm_head.weight" not in named
        expected = sum(p.numel() for p in named.values())  # the whole table, as lm_head
    else:
        expected = sum(p.numel() for n, p in named.items() if n != EMBEDDING) + hidden  # one row
    got = step_bytes(llm.config, 4)
    assert got.weights == 4 * expected
    cfg = llm.config
    assert got.kv_per_token == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4


def test_step_bytes_of_llama_3_8b():
    # Llama-3-8B has 8,030,261,248 parameters; its 128,256 x 4,096 embedding table is read one row
    # per step, its (untied) lm_head whole. KV: 32 layers x 8 heads x 128 x (K, V) x 2 bytes.
    got = step_bytes(preset_config("llama-3-8b"), 2)
    assert got.weights == (8_030_261_248 - 128_256 * 4096 + 4096) * 2
    assert got.kv_per_token == 128 * 1024


def test_window_mean_context_and_its_kv_bytes():
    # Prompt 100: new token k (k >= 1) is made by a step attending over 100 + k positions.
    assert window_contexts(100, 4, 2) == [102.5, 106.5]
    per_step = step_bytes(preset_config("llama-3-8b"), 2)
    window_bytes = sum(per_step.weights + per_step.kv_per_token * (100 + k) for k in range(5, 9)) / 4
    assert per_step.at(window_contexts(100, 4, 2)[1]) == window_bytes


def test_decode_rate_excludes_the_first_token():
    # The first token arrives after a 10 s prefill; then one token every 0.1 s.
    times = [10.0 + 0.1 * i for i in range(9)]
    assert window_rates(times, 4) == pytest.approx([10.0, 10.0])
    assert window_rates(times[:8], 4) == pytest.approx([10.0])  # a partial window is not counted


def test_timed_generation_makes_every_token(tiny_llama):
    llm = load(tiny_llama)
    ids = benchmark_prompt(llm.config.vocab_size, 30, 0, special_token_ids(llm))
    stats, times = timed_generation(llm, ids, 9, 64)
    assert len(times) == stats.new_tokens == 9 and times == sorted(times)


def test_spread_median_and_range():
    s = Spread.of([3.0, 1.0, 2.0, 10.0])
    assert (s.median, s.low, s.high, s.n) == (2.5, 1.0, 10.0, 4)
    assert Spread.of([4.0]).format() == "4.0 n=1"


def test_prompt_has_no_special_or_pad_ids(tiny_llama, hf):
    llm = load(tiny_llama)
    tok = hf.tokenizer(tiny_llama)
    special = set(tok.all_special_ids) | {t for t, a in tok.added_tokens_decoder.items() if a.special}
    assert special and special <= special_token_ids(llm)
    pad = pad_id_for(special_token_ids(llm))
    ids = benchmark_prompt(llm.config.vocab_size, 20_000, 5, special_token_ids(llm) | {pad})
    assert not (set(ids) & (special | {pad}))
    assert set(ids) == set(range(llm.config.vocab_size)) - special - {pad}  # every other id drawn


def _sdpa_calls(monkeypatch) -> list[dict]:
    calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append({"mask": attn_mask, "causal": is_causal, "q_len": q.shape[-2]})
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("old_method", [False, True])
def test_peer_sees_no_mask(tiny_llama, monkeypatch, old_method):
    llm = load(tiny_llama)
    special = special_token_ids(llm)
    pad = pad_id_for(special)
    prompt = benchmark_prompt(llm.config.vocab_size, 40, 3, special | {pad})
    model = transformers_peer(llm)
    calls = _sdpa_calls(monkeypatch)
    if old_method:  # the spy's control: a prompt holding the pad id, no mask given -> a masked SDPA
        prompt[7] = pad
        with torch.inference_mode():
            model.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False, pad_token_id=pad)
    else:
        peer_generation(model, torch.tensor([prompt]), 3, pad)
    assert calls and calls[0]["q_len"] == 40
    masked = [c for c in calls if c["mask"] is not None]
    if old_method:
        assert masked
    else:
        assert not masked and calls[0]["causal"]


def test_json_has_no_nan():
    data = finite_or_none({"a": math.nan, "b": [math.inf, 1.5, {"c": -math.inf}], "d": "x"})
    assert data == {"a": None, "b": [None, 1.5, {"c": None}], "d": "x"}
    json.dumps(data, allow_nan=False)


def test_bench_on_cpu_writes_strict_json(tiny_llama, tmp_path):
    out = tmp_path / "e2e"
    result = invoke(
        "bench", tiny_llama, "--prompt-tokens", 20, "--new-tokens", 3, "--repeats", 2, "--out", out, "--json"
    )
    assert result.exit_code == 0, result.output
    assert "nan" not in result.output.lower()

    def refuse(name):
        raise AssertionError(f"{name} in the JSON")

    data = json.loads(out.with_suffix(".json").read_text(), parse_constant=refuse)
    assert "| prompt" in out.with_suffix(".md").read_text()
    assert json.loads(result.stdout, parse_constant=refuse) == data  # --json: the same object on stdout
    assert data["dtype"] == "float32" and data["device"] == "CPU" and data["formula"]
    assert data["command"].startswith("minidecode bench") and data["commit"] and data["date"]
    assert " --json " in data["command"] and "True" not in data["command"]  # a flag, as given
    assert data["read_ceiling_bytes_per_s"] > 0
    (row,) = data["results"]
    assert row["decode_tokens_per_s"]["n"] == 2 and row["prefill_seconds"]["n"] == 2
    assert row["percent_of_read_ceiling"]["median"] > 0
    # the wait between the prefill's end and the first token, for each request that prefilled
    wait = row["first_token_wait_seconds"]
    assert wait["n"] == 2 and 0 <= wait["low"] <= wait["median"] < 0.5
    assert "| TTFT - prefill s |" in out.with_suffix(".md").read_text()


def test_bench_with_speculate_reports_each_lengths_drafts(tmp_path):
    """--speculate K: the timed generation speculates; the JSON and a table hold its decode steps,
    the drafts verified and kept and the tokens a step (none of it without --speculate). The shipped
    model's answer to random ids repeats itself: drafts are kept."""
    out = tmp_path / "e2e"
    args = ["bench", DEFAULT_MODEL, "--device", "cpu", "--dtype", "float32", "--prompt-tokens", 64]
    args += ["--new-tokens", 16, "--repeats", 2, "--out", out]
    result = invoke(*args, "--speculate", 4)
    assert result.exit_code == 0, result.output
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["settings"]["speculate"] == 4
    (row,) = data["results"]
    drafts = row["drafts"]
    steps, proposed, accepted = drafts["decode_steps"], drafts["proposed_tokens"], drafts["accepted_tokens"]
    assert drafts["speculate"] == 4 and 0 < accepted <= proposed
    assert steps < 32 <= steps + accepted  # the decode steps made every token after the first (2 x 16)
    assert drafts["tokens_per_step"] == pytest.approx((steps + accepted) / steps)
    assert drafts["acceptance"] == (pytest.approx(accepted / proposed) if proposed else None)
    markdown = out.with_suffix(".md").read_text()
    assert (
        f"| 64 | 4 | {steps:,} | {(steps + accepted) / steps:.2f} | {accepted:,} / {proposed:,} |" in markdown
    )
    plain = invoke(*args)
    assert plain.exit_code == 0, plain.output
    assert json.loads(out.with_suffix(".json").read_text())["results"][0]["drafts"] is None
    assert "| speculate |" not in out.with_suffix(".md").read_text()


def test_batch_bench_writes_its_table_and_json(tiny_llama, tmp_path):
    out = tmp_path / "batch"
    result = invoke("bench", tiny_llama, "--batch", "2x16", "--new-tokens", 2, "--repeats", 1, "--out", out)
    assert result.exit_code == 0, result.output
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["metadata"]["model"] and data["metadata"]["commit"] and data["metadata"]["command"]
    assert len(data["results"]) == 1 and data["ceiling_read_gb_per_s"] > 0
    markdown = out.with_suffix(".md").read_text()
    assert markdown.startswith("# Batched decode") and "| 2x16 |" in markdown


def test_json_into_a_missing_folder_fails_before_running(tmp_path):
    # synthetic:llama-3-8b would need 15 GiB: the check must come before the model loads
    result = invoke("bench", "synthetic:llama-3-8b", "--out", tmp_path / "missing" / "e2e")
    assert result.exit_code == 2
    assert "does not exist" in result.output and "GiB" not in result.output


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a)
    )
    result = invoke("bench", "synthetic:llama-3-8b", "--out", tmp_path / "e2e", "--plot")
    assert result.exit_code == 2
    assert 'pip install "minidecode[bench]"' in result.output


def test_ctrl_c_during_bench_is_one_line_and_exit_130(tiny_llama, monkeypatch):
    import minidecode.benchmarks.e2e

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(minidecode.benchmarks.e2e, "run_bench", interrupted)
    result = invoke("bench", tiny_llama, "--prompt-tokens", 8)
    assert result.exit_code == 130
    assert result.output.strip().splitlines()[-1] == "error: interrupted"


def test_peer_limits():
    settings = BenchSettings(
        [1024], peers=["eager", "compiled"], peer_max_tokens=4096, compiled_max_tokens=1024
    )
    assert settings.peer_runs("eager", 4096) and not settings.peer_runs("eager", 8192)
    assert settings.peer_runs("compiled", 1024) and not settings.peer_runs("compiled", 4096)


def test_a_prompt_too_large_for_the_memory_is_refused_before_it_is_drawn(tiny_llama):
    """The memory plan's one-line error, before the 10^10 prompt ids (80 GB) are drawn: the
    context is the longest prompt + 1 + repeats x window new tokens (the bench's one cache)."""
    result = invoke("bench", tiny_llama, "--prompt-tokens", 10**10, "--device", "cpu")
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: a context of 10,000,000,193 tokens needs"), line


CLI = [sys.executable, "-m", "minidecode_cli.cli"]


def run_cli(*args, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ if env is None else env, HF_HUB_OFFLINE="1", PYTHONIOENCODING="utf-8")
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout)


def without_transformers(tmp_path) -> dict:
    """An environment in which `import transformers` fails: a package of that name first on the
    path, raising ImportError as a missing one would."""
    shim = tmp_path / "shim" / "transformers"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text('raise ImportError("No module named \'transformers\'")\n')
    path = [str(shim.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path))


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--prompt-tokens", 16, "--compare", "transformers"],
            "error: --compare transformers needs the transformers package (pip install transformers)",
        ),
        (  # the batch bench's default peer
            ["--batch", "2x64"],
            "error: --batch-peer transformers (the default) needs the transformers package (pip install "
            "transformers), or run minidecode alone: --batch-peer none",
        ),
    ],
)
def test_a_peer_that_does_not_import_is_refused_before_the_model_loads(tiny_llama, tmp_path, args, message):
    """Not after minutes of measuring: the peer is imported before anything loads. The model's
    weights are broken too, so the peer's line can only come first if nothing was loaded."""
    broken = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, broken)
    (broken / "model.safetensors").write_bytes(b"")
    env = without_transformers(tmp_path)
    proc = run_cli("bench", broken, *args, "--device", "cpu", "--out", tmp_path / "results", env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [message], proc.stderr
    assert proc.stdout == "" and not list(tmp_path.glob("results*"))
    # without a peer the same (broken) model is loaded, and refused for its weights
    alone = run_cli("bench", broken, "--batch", "2x64", "--batch-peer", "none", "--device", "cpu")
    assert alone.returncode == 2 and "could not read model.safetensors" in alone.stderr


def test_a_prompt_past_the_trained_positions_is_refused_as_generate_refuses_it():
    """100k tokens on the shipped 4,096-position model: refused in seconds, with generate's line
    (the same check in the runtime), not prefilled for minutes. The bench's context is the prompt
    + 1 + 3 windows of 64 new tokens, generate's the prompt + -n."""
    bench = run_cli("bench", DEFAULT_MODEL, "--prompt-tokens", 100_000, "--device", "cpu", timeout=60)
    generate = run_cli("generate", "--prompt-tokens", 100_000, "-n", 193, "--device", "cpu", timeout=60)
    assert bench.returncode == generate.returncode == 2, bench.stderr
    (line,) = bench.stderr.splitlines()
    assert line == generate.stderr.strip()
    assert line.startswith("error: a context of 100,193 positions") and "exceeds the 4,096" in line


def test_allow_extrapolation_warns_and_shows_the_prefill(checkpoint_factory):
    """--allow-extrapolation runs it, with a warning first and the prefill's progress (plain
    lines in a log); without it, generate's refusal."""
    model = checkpoint_factory("llama", "default", max_positions=512)
    args = ["bench", model, "--prompt-tokens", 16384, "--new-tokens", 2, "--repeats", 1, "--device", "cpu"]
    refused = invoke(*args)
    assert refused.exit_code == 2
    assert refused.stderr.startswith("error: a context of 16,387 positions (max_context, else prompt +")
    result = invoke(*args, "--allow-extrapolation")
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert lines[0] == (
        f"warning: a context of 16,387 positions exceeds the 512 {model} was trained for: extrapolating "
        "(--allow-extrapolation)"
    )
    assert "prefill 100% 16,384/16,384 tok" in result.stderr
    assert "| 16,384 |" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--batch", "2x16", "--json", "--prompt-tokens", 8],
            "--prompt-tokens / --json do not apply to bench --batch",
        ),
        (["--batch", "2x16", "--quantization", "fp8"], "--quantization does not apply to bench --batch"),
        (["--batch-peer", "none"], "--batch-peer does not apply without --batch"),
        (["--batch", "2x16", "--batch-peer", "vllm"], "unknown batch peer 'vllm'; known: transformers, none"),
        (["--compare", "vllm"], "unknown --compare 'vllm'; only 'transformers' is supported"),
        (["--speculate", "17"], "--speculate must be <= 16, got 17"),
        (["--batch", "2x16", "--speculate", "4"], "--speculate does not apply to bench --batch"),
    ],
)
def test_options_that_do_not_apply_are_refused_before_loading(args, message):
    result = invoke("bench", "synthetic:llama-3-8b", *args)  # 15 GiB of weights: never loaded
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [f"error: {message}"], result.stderr


def git(folder, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=folder, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_provenance_is_minidecodes_own_commit_not_the_current_folders(tmp_path, monkeypatch):
    """Run from another git checkout, the bench records minidecode's version and the commit of
    the checkout minidecode runs from (or none), never the current folder's; a checkout counts
    only if its minidecode/ folder is the package and its pyproject.toml names minidecode."""
    other = tmp_path / "other"
    (other / "minidecode").mkdir(parents=True)
    (other / "pyproject.toml").write_text('[project]\nname = "something-else"\n')
    git(other, "init", "-q")
    git(other, "add", "pyproject.toml")
    git(other, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "other")
    head = git(other, "rev-parse", "--short", "HEAD")
    code = "import json; from minidecode.benchmarks.e2e import provenance; print(json.dumps(provenance()))"
    monkeypatch.delenv("MINIDECODE_COMMIT", raising=False)  # set where a tree is copied without history
    (other / "docs").mkdir()  # not the checkout's root: its minidecode/ folder would shadow the package
    run = subprocess.run([sys.executable, "-c", code], cwd=other / "docs", capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    recorded = json.loads(run.stdout)
    assert recorded["version"] == minidecode.__version__
    assert recorded["commit"] is None or not recorded["commit"].startswith(head)
    repo = Path(minidecode.__file__).resolve().parents[1]
    if (repo / ".git").exists():  # an editable install in a checkout: its commit
        assert recorded["commit"].removesuffix("+changes") == git(repo, "rev-parse", "--short", "HEAD")
    assert provenance(other / "minidecode")["commit"] is None  # another project's
    (other / "pyproject.toml").write_text('[project]\nname = "minidecode"\n')
    assert provenance(other / "minidecode")["commit"] == f"{head}+changes"
    assert provenance(other)["commit"] is None  # not a minidecode/ package folder

"""The `minidecode` command end to end, in process through typer's CliRunner and once as a real
subprocess, with transformers' greedy generation as the reference."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from minidecode_cli import cli
from minidecode_cli.cli import app

PROMPT = "The quick brown fox 🙂"
NEW = 12


@pytest.fixture(scope="module")
def model_dir(checkpoint_factory):
    return checkpoint_factory("llama", "default", max_positions=512)


@pytest.fixture(scope="module")
def reference(model_dir, hf):
    """transformers' greedy continuation of PROMPT (stopping at eos, as the CLI does): ids, text."""
    tok = hf.tokenizer(model_dir)
    ids = hf.greedy(model_dir, tok(PROMPT).input_ids, NEW, eos=True)
    return ids, tok.decode(ids, skip_special_tokens=True)


def invoke(*args: str, input: str | None = None):
    result = CliRunner().invoke(app, [str(a) for a in args], input=input)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def generate_args(model_dir, *extra):
    return ["generate", model_dir, "--device", "cpu", "--max-new-tokens", NEW, "--temperature", 0, *extra]


def test_generate_json(model_dir, reference):
    result = invoke(*generate_args(model_dir, "--prompt", PROMPT, "--json"))
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["token_ids"] == reference[0]
    assert out["text"] == reference[1]
    assert out["finish_reason"] in ("length", "eos")
    assert out["stats"]["new_tokens"] == len(out["token_ids"])  # one count: eos is in neither


def test_generate_text_to_stdout_stats_to_stderr(model_dir, reference):
    result = invoke(*generate_args(model_dir, "--prompt", PROMPT))
    assert result.exit_code == 0, result.stderr
    assert result.stdout == reference[1] + "\n"
    assert "new tok" in result.stderr and "error" not in result.stderr
    assert "still loading" not in result.stderr  # a load within SLOW_LOAD_S says nothing


def test_a_load_past_the_slow_load_time_says_why_once(model_dir, reference, monkeypatch):
    monkeypatch.setattr(cli, "SLOW_LOAD_S", 0.0)
    result = invoke(*generate_args(model_dir, "--prompt", PROMPT))
    assert result.exit_code == 0, result.stderr
    assert result.stdout == reference[1] + "\n"
    assert result.stderr.count("note: still loading") == 1


def test_generate_prompt_file(model_dir, reference, tmp_path):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(PROMPT, encoding="utf-8")
    result = invoke(*generate_args(model_dir, "--prompt-file", prompt_file, "--json"))
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["token_ids"] == reference[0]


def test_generate_stdin(model_dir, reference):
    result = invoke(*generate_args(model_dir, "--json"), input=PROMPT)
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["token_ids"] == reference[0]


def test_generate_chat(model_dir, hf):
    tok = hf.tokenizer(model_dir)
    messages = [{"role": "user", "content": PROMPT}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ref = hf.greedy(model_dir, list(ids), NEW, eos=True)
    result = invoke(*generate_args(model_dir, "--prompt", PROMPT, "--chat", "--json"))
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["token_ids"] == ref


def test_generate_max_new_tokens_and_stop(model_dir, reference):
    result = invoke(
        "generate", model_dir, "--device", "cpu", "-n", 3, "--temperature", 0, "--prompt", PROMPT, "--json"
    )
    out = json.loads(result.stdout)
    assert out["token_ids"] == reference[0][:3]
    assert out["finish_reason"] == ("length" if len(reference[0]) >= 3 else "eos")

    text = reference[1]
    stop = next(text[i : i + 2] for i in range(2, len(text) - 2) if text.find(text[i : i + 2]) == i)
    cut = text.find(stop)
    result = invoke(
        *generate_args(model_dir, "--prompt", PROMPT, "--stop", "<never>", "--stop", stop, "--json")
    )
    out = json.loads(result.stdout)
    assert out["text"] == text[:cut] and out["finish_reason"] == "stop"


def test_generate_seeded_sampling_is_reproducible(model_dir):
    args = ["generate", model_dir, "--device", "cpu", "-n", 16, "--prompt", PROMPT, "--json"]
    sampled = [*args, "--temperature", 1.0, "--top-k", 50, "--top-p", 0.9, "--seed", 7]
    a, b = (json.loads(invoke(*sampled).stdout) for _ in range(2))
    assert a["token_ids"] == b["token_ids"]


def test_info(model_dir):
    result = invoke("info", model_dir, "--device", "cpu")
    assert result.exit_code == 0, result.stderr
    config = json.loads((model_dir / "config.json").read_text())
    text = result.stdout
    assert (
        f"{config['model_type']}: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}"
        in text
    )
    assert f"heads {config['num_attention_heads']} q / {config['num_key_value_heads']} kv x 16" in text
    assert f"vocabulary   {config['vocab_size']}" in text
    assert f"{config['max_position_embeddings']:,} positions" in text
    assert "fits" in text and "DOES NOT FIT" not in text
    huge = invoke("info", model_dir, "--device", "cpu", "--context", 10**12)
    assert huge.exit_code == 0 and "DOES NOT FIT" in huge.stdout


def test_real_subprocess(model_dir, reference, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONIOENCODING="utf-8")
    cmd = [sys.executable, "-m", "minidecode_cli.cli", *map(str, generate_args(model_dir, "--json"))]
    proc = subprocess.run(cmd, input=PROMPT, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["token_ids"] == reference[0]

    script = shutil.which("minidecode")
    assert script, "the minidecode console script is not installed"
    proc = subprocess.run(
        [
            script,
            "generate",
            str(model_dir),
            "--device",
            "cpu",
            "-n",
            str(NEW),
            "--temperature",
            "0",
            "-p",
            PROMPT,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == reference[1] + "\n"


def test_weights_and_prefill_attention_options(model_dir):
    """--quantization fp8 runs FP8 weights and says so (stats line, --json, info); --prefill-attention
    fp8 on the CPU is one line; an unknown value of either is one line before the model loads."""
    result = invoke(*generate_args(model_dir, "--prompt", PROMPT, "--quantization", "fp8", "--json"))
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["stats"]["weights"].startswith("fp8_e4m3 per-channel")
    plain = invoke(*generate_args(model_dir, "--prompt", PROMPT))
    assert "weights" not in plain.stderr and "KV cache" in plain.stderr
    info = invoke("info", model_dir, "--device", "cpu", "--quantization", "fp8")
    assert info.exit_code == 0 and "fp8_e4m3 per-channel" in info.stdout
    for args, message in (
        (("--prefill-attention", "fp8"), "error: FP8 prefill attention runs on a CUDA GPU"),
        (
            ("--prefill-attention", "flash3"),
            "error: unknown --prefill-attention 'flash3'; use one of auto, fp8",
        ),
        (("--quantization", "int4"), "error: unknown --quantization 'int4'; use one of none, fp8"),
    ):
        bad = invoke(*generate_args(model_dir, "--prompt", PROMPT, *args))
        assert bad.exit_code == 2 and bad.stderr.strip().splitlines() == [bad.stderr.strip()]
        assert bad.stderr.startswith(message), bad.stderr


PROCESSORS = {  # the request options of the logits processors, as the API's keywords and as options
    "min_tokens": (4, ["--min-tokens", 4]),
    "repetition_penalty": (1.3, ["--repetition-penalty", 1.3]),
    "presence_penalty": (0.5, ["--presence-penalty", 0.5]),
    "frequency_penalty": (-0.25, ["--frequency-penalty", -0.25]),
    "logit_bias": ({7: 4.0, 9: -100.0}, ["--logit-bias", "7=4", "--logit-bias", " 9 = -100"]),
    "stop_token_ids": ([11, 12], ["--stop-token-id", 11, "--stop-token-id", 12]),
    "top_logprobs": (3, ["--top-logprobs", 3]),
}


def test_every_request_option_reaches_the_api(model_dir, tmp_path):
    """generate's and batch's request options are the API's keywords: the same tokens and top
    log-probabilities (in --json and in each result line) as LLM.generate with them."""
    from minidecode import LLM

    kwargs = {name: value for name, (value, _) in PROCESSORS.items()}
    expected = LLM(model_dir, device="cpu").generate(PROMPT, max_new_tokens=NEW, temperature=0, **kwargs)
    top = [[list(pair) for pair in token] for token in expected.top_logprobs]
    assert len(top) == len(expected.token_ids) and all(len(token) == 3 for token in top)
    options = [arg for _, args in PROCESSORS.values() for arg in args]
    out = json.loads(invoke(*generate_args(model_dir, "--prompt", PROMPT, "--json", *options)).stdout)
    assert out["token_ids"] == expected.token_ids and out["top_logprobs"] == top
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    batch = invoke("batch", model_dir, requests, "--device", "cpu", "-n", NEW, "--temperature", 0, *options)
    assert batch.exit_code == 0, batch.stderr
    (line,) = [json.loads(text) for text in batch.stdout.splitlines()]
    assert line["token_ids"] == expected.token_ids and line["top_logprobs"] == top


@pytest.mark.parametrize(
    "args, message",
    [  # parsed by the command, checked by Request.check (the API's names)
        (["--logit-bias", "7"], "--logit-bias takes ID=BIAS (a token id and a number), got '7'"),
        (["--logit-bias", "7=much"], "--logit-bias takes ID=BIAS (a token id and a number), got '7=much'"),
        (["--logit-bias", "x=1"], "logit_bias keys must be token ids (integers or decimal strings), got 'x'"),
        (["--logit-bias", "7=101"], r"logit_bias['7'] must be in [-100, 100], got 101.0"),
        (["--presence-penalty", 3], "presence_penalty must be in [-2, 2], got 3.0"),
        (["--top-logprobs", 21], "top_logprobs must be <= 20, got 21"),
        (["--min-tokens", 20], "min_tokens (20) must be <= max_new_tokens (12)"),
        (["--stop-token-id", "x"], "Invalid value for '--stop-token-id'"),  # click's, as one line
        (["--stop-token-id", 5000], r"stop_token_ids out of range [0, "),  # against the model's vocabulary
    ],
)
def test_a_bad_request_option_is_one_error_line(model_dir, args, message):
    """In generate, and in batch (where a default that only the model can refuse, an id past
    its vocabulary, is each request's error instead)."""
    result = invoke(*generate_args(model_dir, "--prompt", PROMPT, *args))
    assert result.exit_code == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and message in line, line
    lines = json.dumps({"prompt": PROMPT})
    batch = invoke("batch", model_dir, "-", "--device", "cpu", "-n", NEW, *args, input=lines)
    if "out of range" in message:
        assert batch.exit_code == 1 and message in json.loads(batch.stdout)["error"]
    else:
        assert batch.exit_code == 2 and batch.stderr.strip() == line


def test_one_list_of_each_choice():
    """The CLI's choices, `info`'s dtypes and the runtime's checks read validate.py's lists (and
    kernels/choices.py's, the kernels' own)."""
    from typer.main import get_command

    from minidecode import info, validate
    from minidecode.kernels import choices as kernel_choices
    from minidecode.kernels import prefill

    assert prefill.PREFILL_ATTENTION is kernel_choices.PREFILL_ATTENTION
    assert list(info.DTYPES) == list(validate.DTYPE_NAMES)
    options = {opt: param for param in get_command(app).commands["generate"].params for opt in param.opts}
    for option, choices in (
        ("--kv-cache-dtype", validate.KV_CACHE_DTYPES),
        ("--quantization", validate.QUANTIZATIONS),
        ("--prefill-attention", kernel_choices.PREFILL_ATTENTION),
        ("--dtype", tuple(validate.DTYPE_NAMES)),
    ):
        assert options[option].metavar == "[" + "|".join(choices) + "]"

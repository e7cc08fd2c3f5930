"""Every bad input: the API raises minidecode.UserError naming the problem; the CLI prints one
line `error: ...` on stderr, no traceback, nothing on stdout, and exits non-zero."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from minidecode import LLM, UserError
from minidecode_cli.cli import app

MAX_POS = 512


@pytest.fixture(scope="module")
def model_dir(checkpoint_factory) -> Path:
    return checkpoint_factory("llama", "default", max_positions=MAX_POS)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, device="cpu", dtype="float32")


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No hub access: HF_HUB_OFFLINE=1 (the constant is read at import, so patch it too), and an
    empty hub cache."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))


def cli_error(args: list, match: str, input: str | None = None) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args], input=input)
    assert isinstance(result.exception, SystemExit), f"uncaught {result.exception!r}"
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert re.search(match, lines[0]), lines[0]
    return lines[0]


def api_error(fn, match: str) -> str:
    with pytest.raises(UserError, match=match) as info:
        fn()
    assert "\n" not in str(info.value)
    return str(info.value)


# ---- broken checkpoints ----------------------------------------------------------------------


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(model_dir: Path, **changes) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (model_dir / "config.json").write_text(json.dumps(config))


def edit_tensors(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def break_missing_tensor(d):
    edit_tensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))


def break_extra_tensor(d):
    edit_tensors(d, lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.zeros(3)}))


def break_misshapen_tensor(d):
    edit_tensors(d, lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(32, 64)}))


def break_all_three(d):
    def edit(t):
        t.pop("model.norm.weight")
        t["lm_head.bias"] = torch.zeros(384)
        t["model.embed_tokens.weight"] = torch.zeros(383, 64)

    edit_tensors(d, edit)


def grow_tokenizer(d):
    """Add tokens until the tokenizer is larger than the model's 384-entry vocabulary."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_tokens([f"<extra_{i}>" for i in range(400)])
    tok.save(str(d / "tokenizer.json"))


CHECKPOINT_CASES = {
    # name: (break the copy, what the error must say)
    "unsupported-model-type": (
        lambda d: edit_config(d, model_type="gpt2"),
        r"unsupported model_type 'gpt2'; supported: llama, mistral, qwen2, qwen3",
    ),
    "no-model-type": (
        lambda d: edit_config(d, model_type=None),
        r"unsupported model_type None; supported: llama, mistral, qwen2, qwen3",
    ),
    "unsupported-rope": (
        lambda d: edit_config(d, rope_parameters={"rope_type": "mrope", "rope_theta": 1e4}),
        r"unsupported RoPE type 'mrope'; supported: default, linear",
    ),
    "config-missing-key": (lambda d: edit_config(d, hidden_size=None), r"hidden_size"),
    "no-config": (lambda d: (d / "config.json").unlink(), r"no config\.json in"),
    "bad-config-json": (lambda d: (d / "config.json").write_text("{"), r"config\.json is not valid JSON"),
    "config-is-a-list": (
        lambda d: (d / "config.json").write_text("[1, 2]"),
        r"config\.json must hold a JSON object, not a list",
    ),
    "bad-tokenizer-config": (
        lambda d: (d / "tokenizer_config.json").write_text("{"),
        r"tokenizer_config\.json is not valid JSON",
    ),
    "tokenizer-larger-than-model": (
        grow_tokenizer,
        r"the tokenizer has [\d,]+ tokens but the model's vocab_size is 384",
    ),
    "missing-tensor": (break_missing_tensor, r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight$"),
    "extra-tensor": (break_extra_tensor, r"unexpected tensors: model\.layers\.0\.self_attn\.extra\.weight$"),
    "misshapen-tensor": (
        break_misshapen_tensor,
        r"match its config\.json: misshapen tensors: "
        r"model\.layers\.0\.self_attn\.q_proj\.weight \(32, 64\) \(expected \(64, 64\)\)$",
    ),
    "missing-extra-misshapen": (
        break_all_three,
        r"missing tensors: model\.norm\.weight; misshapen tensors: model\.embed_tokens\.weight \(383, 64\) "
        r"\(expected \(384, 64\)\); unexpected tensors: lm_head\.bias",
    ),
    "truncated-safetensors": (
        lambda d: truncate(d / "model.safetensors"),
        r"could not read model\.safetensors: .+",
    ),
    "garbage-safetensors": (
        lambda d: (d / "model.safetensors").write_bytes(os.urandom(4096)),
        r"could not read model\.safetensors: .+",
    ),
    "garbage-header": (
        lambda d: (d / "model.safetensors").write_bytes(b"\x10" + b"\x00" * 7 + b"{not json at all"),
        r"could not read model\.safetensors: .+",
    ),
    "empty-safetensors": (
        lambda d: (d / "model.safetensors").write_bytes(b""),
        r"could not read model\.safetensors: .+",
    ),
    "no-weights": (lambda d: (d / "model.safetensors").unlink(), r"no \*\.safetensors weights in"),
    "no-tokenizer": (lambda d: (d / "tokenizer.json").unlink(), r"no tokenizer\.json in"),
    "bad-tokenizer": (lambda d: (d / "tokenizer.json").write_text("{}"), r"could not read .*tokenizer\.json"),
    "bad-generation-config": (
        lambda d: (d / "generation_config.json").write_text("{"),
        r"generation_config\.json is not valid JSON",
    ),
}
CONFIG_LEVEL = {
    "unsupported-model-type",
    "no-model-type",
    "unsupported-rope",
    "config-missing-key",
    "no-config",
    "bad-config-json",
    "config-is-a-list",
}


@pytest.mark.parametrize("case", list(CHECKPOINT_CASES))
def test_broken_checkpoint(model_dir, tmp_path, case):
    breaker, match = CHECKPOINT_CASES[case]
    broken = copy(model_dir, tmp_path / "ckpt")
    breaker(broken)
    api_error(lambda: LLM(broken, device="cpu"), match)
    cli_error(["generate", broken, "--device", "cpu", "--prompt", "hi"], match)
    if case in CONFIG_LEVEL:  # info reads the config only
        cli_error(["info", broken, "--device", "cpu"], match)


def test_sharded_checkpoint_missing_or_corrupt_shard(checkpoint_factory, tmp_path):
    src = checkpoint_factory("llama", "default", shard_bytes=100_000)
    shards = sorted(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"].values())
    victim = shards[len(shards) // 2]

    missing = copy(src, tmp_path / "missing")
    (missing / victim).unlink()
    match = rf"shards listed in model\.safetensors\.index\.json are missing: {re.escape(victim)}"
    api_error(lambda: LLM(missing, device="cpu"), match)
    cli_error(["generate", missing, "--device", "cpu", "--prompt", "hi"], match)

    corrupt = copy(src, tmp_path / "corrupt")
    truncate(corrupt / victim, 0.7)
    match = rf"could not read {re.escape(victim)}: .+"
    api_error(lambda: LLM(corrupt, device="cpu"), match)
    cli_error(["generate", corrupt, "--device", "cpu", "--prompt", "hi"], match)


def test_missing_path(tmp_path):
    missing = tmp_path / "no-such-dir"
    api_error(lambda: LLM(missing, device="cpu"), r"is not a directory")
    cli_error(["generate", missing, "--prompt", "hi"], r"is not a directory")
    cli_error(["info", missing], r"is not a directory")
    api_error(lambda: LLM("./relative/missing", device="cpu"), r"is not a directory")


def test_repo_id_not_available_offline():
    repo = "minidecode-tests/no-such-model"
    match = r"could not be fetched from the hub \(offline, or no such repo\?\)"
    api_error(lambda: LLM(repo, device="cpu"), match)
    cli_error(["generate", repo, "--prompt", "hi"], match)
    cli_error(["info", repo], match)


def test_real_subprocess_errors_are_one_line(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub-cache"))
    for model, match in (
        ("minidecode-tests/no-such-model", r"could not be fetched from the hub"),
        (str(tmp_path / "nope"), r"is not a directory"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "minidecode_cli.cli", "generate", model, "--prompt", "hi"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert proc.returncode != 0
        assert proc.stdout == "" and "Traceback" not in proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and re.search(match, lines[0])


# ---- bad requests ----------------------------------------------------------------------------


def gen_args(model_dir, *extra) -> list:
    return ["generate", model_dir, "--device", "cpu", *extra]


def test_empty_prompt(llm, model_dir, tmp_path):
    api_error(lambda: llm.generate(""), r"the prompt is empty")
    api_error(lambda: llm.generate(token_ids=[]), r"the prompt is empty")
    cli_error(gen_args(model_dir, "--prompt", ""), r"the prompt is empty")
    cli_error(gen_args(model_dir), r"the prompt is empty", input="")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    cli_error(gen_args(model_dir, "--prompt-file", empty), r"the prompt is empty")


def test_prompt_sources(model_dir, tmp_path):
    prompt_file = tmp_path / "p.txt"
    prompt_file.write_text("hi")
    cli_error(gen_args(model_dir, "--prompt", "hi", "--prompt-file", prompt_file), r"either --prompt or")
    cli_error(gen_args(model_dir, "--prompt-file", tmp_path / "nope.txt"), r"nope\.txt does not exist")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\xfa not utf-8")
    cli_error(gen_args(model_dir, "--prompt-file", bad), r"could not read prompt file")


def test_beyond_max_positions_needs_opt_in(llm, model_dir, hf, prompt_ids):
    ids = prompt_ids(500, seed=20)
    match = r"a context of 520 positions .* exceeds the 512 the model was trained for.*allow_extrapolation"
    api_error(lambda: llm.generate(token_ids=ids, max_new_tokens=20), match)
    out = llm.generate(token_ids=ids, max_new_tokens=20, temperature=0, allow_extrapolation=True)
    assert out.token_ids == hf.greedy(model_dir, ids, 20, eos=True)

    # The boundary: exactly max positions is fine, one more is not.
    assert len(llm.generate(token_ids=ids, max_new_tokens=12, temperature=0).token_ids) <= 12
    api_error(lambda: llm.generate(token_ids=ids, max_new_tokens=13), r"a context of 513 positions")

    cli_error(gen_args(model_dir, "--prompt", "hi", "-n", 600), r"exceeds the 512 the model was trained for")
    result = CliRunner().invoke(
        app, [str(a) for a in gen_args(model_dir, "-p", "hi", "-n", 600, "--allow-extrapolation", "--json")]
    )
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["finish_reason"] in ("length", "eos")


SAMPLING_CASES = [
    ("temperature", -1.0, r"temperature must be a finite number >= 0"),
    ("temperature", math.nan, r"temperature must be a finite number >= 0"),
    ("temperature", math.inf, r"temperature must be a finite number >= 0"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
    ("top_p", -0.1, r"top_p must be in \(0, 1\]"),
    ("top_k", -1, r"top_k must be >= 0"),
    ("max_new_tokens", 0, r"max_new_tokens must be >= 1"),
    ("max_new_tokens", -5, r"max_new_tokens must be >= 1"),
    ("seed", -1, r"seed must be in"),
]


@pytest.mark.parametrize("name,value,match", SAMPLING_CASES, ids=[f"{n}={v}" for n, v, _ in SAMPLING_CASES])
def test_nonsensical_sampling_values(llm, model_dir, name, value, match):
    api_error(lambda: llm.generate("hi", **{name: value}), match)
    api_error(lambda: llm.stream("hi", **{name: value}), match)  # refused before anything streams
    flag = "--" + name.replace("_", "-")
    cli_error(gen_args(model_dir, "--prompt", "hi", f"{flag}={value}"), match)


def test_kv_cache_that_does_not_fit(llm, model_dir):
    match = (
        r"a context of 1,000,000,000,000 tokens needs [\d,.]+ GiB of KV cache plus [\d,.]+ GiB of "
        r"activations, but only [\d,.]+ GiB is free on cpu beside the weights \([\d.]+ GiB\); about "
        r"[1-9][\d,]{6,} tokens fit"  # millions fit in GiBs of host memory (not "0": planner's fit)
    )
    api_error(lambda: llm.generate("hi", max_context=10**12, allow_extrapolation=True), match)
    cli_error(gen_args(model_dir, "-p", "hi", "--max-context", 10**12, "--allow-extrapolation"), match)
    # Without the opt-in, the position limit refuses it first.
    api_error(lambda: llm.generate("hi", max_context=10**12), r"the 512 the model was trained for")
    # A max_context too small for the request.
    api_error(lambda: llm.generate("hi", max_new_tokens=10, max_context=5), r"max_context 5 is less than")


def test_other_bad_requests(llm, model_dir):
    api_error(lambda: llm.generate("hi", stop=["ok", ""]), r"stop strings must be non-empty")
    api_error(lambda: llm.generate(token_ids=[5, 384]), r"token ids out of range \[0, 384\): \[384\]")
    api_error(lambda: llm.generate(token_ids=[-1]), r"token ids out of range")
    api_error(lambda: llm.generate(messages=[{"text": "hi"}]), r"messages\[0\]\.role must be a string")
    api_error(lambda: llm.generate("hi", messages=[{"role": "user", "content": "hi"}]), r"exactly one of")
    api_error(lambda: LLM(model_dir, device="cpu", dtype="int8"), r"unknown dtype 'int8'")
    api_error(lambda: LLM(model_dir, device="tpu"), r"unknown device|unsupported device")
    api_error(lambda: LLM(model_dir, device="cpu", prefill_chunk=0), r"prefill_chunk must be >= 1")
    cli_error(gen_args(model_dir, "-p", "hi", "--dtype", "int8"), r"unknown dtype 'int8'")
    cli_error(["generate", model_dir, "--device", "tpu", "-p", "hi"], r"unknown device|unsupported device")
    cli_error(["info", model_dir, "--context", -5], r"context must be >= 1")


def test_info_context_zero_is_refused(model_dir):
    cli_error(["info", model_dir, "--context", 0], r"context must be >= 1")


def test_chat_without_template(model_dir, tmp_path):
    no_template = copy(model_dir, tmp_path / "ckpt")
    config = json.loads((no_template / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    llm = LLM(no_template, device="cpu")
    api_error(lambda: llm.generate(messages=[{"role": "user", "content": "hi"}]), r"no chat template")
    cli_error(gen_args(no_template, "-p", "hi", "--chat"), r"no chat template")


# ---- Mistral sliding window ------------------------------------------------------------------


@pytest.fixture(scope="module")
def mistral_window_64(checkpoint_factory, tmp_path_factory) -> Path:
    model_dir = copy(checkpoint_factory("mistral", "default"), tmp_path_factory.mktemp("sw") / "ckpt")
    edit_config(model_dir, sliding_window=64)
    return model_dir


def test_sliding_window_smaller_than_context_is_refused(mistral_window_64, hf, prompt_ids):
    llm = LLM(mistral_window_64, device="cpu")
    assert llm.config.sliding_window == 64
    ids = prompt_ids(50, seed=21)
    match = r"sliding-window attention \(64 tokens\).*within 64 tokens"
    api_error(lambda: llm.generate(token_ids=ids, max_new_tokens=30), match)
    # allow_extrapolation is about positions, not the window: still refused.
    api_error(lambda: llm.generate(token_ids=ids, max_new_tokens=30, allow_extrapolation=True), match)
    api_error(lambda: llm.generate(token_ids=ids, max_new_tokens=14, max_context=100), match)
    cli_error(gen_args(mistral_window_64, "-p", "hi", "-n", 100), match)

    # Within the window the model is plain full attention: transformers (window 64 too) agrees.
    out = llm.generate(token_ids=ids, max_new_tokens=14, temperature=0)
    assert out.token_ids == hf.greedy(mistral_window_64, ids, 14, eos=True)


# ---- issue 12: wrong types, wording, devices, non-finite weights -----------------------------


def test_api_values_of_the_wrong_type(llm):
    api_error(lambda: llm.generate("hi", max_new_tokens=2.5), r"max_new_tokens must be an integer, got 2\.5")
    api_error(lambda: llm.generate("hi", max_new_tokens="5"), r"max_new_tokens must be an integer, got '5'")
    api_error(lambda: llm.generate(token_ids="abc"), r"token_ids must be a list of integers, got str")
    api_error(lambda: llm.generate(token_ids=[1, 2.5]), r"token_ids must be integers, got 2\.5")
    api_error(lambda: llm.generate("hi", temperature="0.5"), r"temperature must be a number")
    api_error(lambda: llm.generate("hi", top_k=1.5), r"top_k must be an integer")
    api_error(lambda: llm.generate("ok \udcff"), r"the prompt is not valid UTF-8 text.*byte 0xff")
    api_error(lambda: llm.generate("hi", stop=[3]), r"stop must be a string or a list of strings")


# Each field takes exactly its type: a string "false" is not a boolean, a dict is not a stop list.
WRONG_TYPES = [
    ("allow_extrapolation", "false", r"allow_extrapolation must be true or false, got 'false'"),
    ("ignore_eos", "false", r"ignore_eos must be true or false, got 'false'"),
    ("logprobs", "no", r"logprobs must be true or false, got 'no'"),
    ("reuse_prefix", "no", r"reuse_prefix must be true or false, got 'no'"),
    ("logprobs", 1, r"logprobs must be true or false, got 1"),
    ("stop", {"y": 1}, r"stop must be a string or a list of strings"),
    ("stop", 5, r"stop must be a string or a list of strings, got 5"),
    ("stop", True, r"stop must be a string or a list of strings, got True"),
    ("max_context", "600", r"max_context must be an integer"),
    ("seed", 1.5, r"seed must be an integer"),
    ("top_p", "0.9", r"top_p must be a number"),
]


@pytest.mark.parametrize(
    ("field", "value", "match"), WRONG_TYPES, ids=[f"{f}={v!r}" for f, v, _ in WRONG_TYPES]
)
def test_a_field_of_the_wrong_type_is_one_error(llm, model_dir, tmp_path, field, value, match):
    """In the API a UserError; in a batch line that line's {"error"} while the others run."""
    api_error(lambda: llm.generate("hi", max_new_tokens=2, **{field: value}), match)
    lines = [{"prompt": "hi", field: value}, {"prompt": "x = 1", "max_new_tokens": 2}]
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = CliRunner().invoke(app, ["batch", str(model_dir), str(path), "--device", "cpu", "--no-progress"])
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert result.exit_code == 1, result.stderr
    bad, good = sorted(records, key=lambda r: r["line"])
    assert re.search(match, bad["error"]) and "error" not in good and good["finish_reason"] == "length"


@pytest.mark.parametrize("command", ["batch", "serve"])
def test_torchrun_without_tp_or_cp_is_refused_in_one_line(model_dir, tmp_path, command):
    """`minidecode batch` / `serve` started by torchrun (WORLD_SIZE 2) without --tp / --cp whose
    product is 2 refuse rather than run every rank in full and write the same output from each."""
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt": "hi"}\n')
    out = tmp_path / "out.jsonl"
    env = {"WORLD_SIZE": "2", "RANK": "0"}
    args = [str(path), "-o", str(out)] if command == "batch" else ["--port", "0"]
    result = CliRunner().invoke(app, [command, str(model_dir), *args], env=env)
    assert result.exit_code == 2 and not out.exists()
    assert result.stderr.strip().splitlines() == [
        "error: torchrun started 2 processes but --tp 1 x --cp 1 needs 1: "
        "give --nproc-per-node 1, or --tp / --cp whose product is 2"
    ]


def test_an_unwritable_save_path_is_refused_before_prefill(model_dir, tmp_path, monkeypatch):
    """--save-cache into a folder that refuses files fails before the model loads, not after."""
    import tempfile

    from minidecode import llm as llm_module

    locked = tmp_path / "locked"
    locked.mkdir()
    real = tempfile.TemporaryFile

    def refuse(*args, dir=None, **kwargs):
        if dir is not None and Path(dir) == locked:
            raise OSError(30, "Read-only file system")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    monkeypatch.setattr(llm_module, "LLM", None)  # loading the model would fail the test
    result = CliRunner().invoke(
        app,
        ["generate", str(model_dir), "--device", "cpu", "-p", "x", "--save-cache", str(locked / "c.cache")],
    )
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: cannot write {locked / 'c.cache'}: Read-only file system"
    dir_result = CliRunner().invoke(
        app, ["generate", str(model_dir), "--device", "cpu", "-p", "x", "--load-cache", str(tmp_path)]
    )
    assert dir_result.exit_code == 2
    assert dir_result.stderr.strip() == (
        f"error: cache file {tmp_path} is a directory; give the path of a file that --save-cache wrote"
    )


def test_max_context_wording(llm, model_dir):
    match = r"a context of 600 positions \(max_context, else prompt \+ max_new_tokens\) exceeds the 512"
    api_error(lambda: llm.generate("hi", max_new_tokens=4, max_context=600), match)
    cli_error(gen_args(model_dir, "-p", "hi", "-n", 4, "--max-context", 600), match)


def test_huge_prompt_tokens_is_refused_by_the_memory_plan(model_dir):
    match = (
        r"a context of 100,000,000,255 tokens needs [\d,.]+ GiB of KV cache .* but only [\d,.]+ GiB is "
        r"free on cpu"
    )
    cli_error(gen_args(model_dir, "--prompt-tokens", 99999999999), match)


def test_info_beyond_trained_positions_says_so(model_dir):
    result = CliRunner().invoke(app, ["info", str(model_dir), "--device", "cpu", "--context", "1024"])
    assert result.exit_code == 0, result.stderr
    assert "1,024 tokens exceed the 512 positions the model was trained for" in result.stdout
    inside = CliRunner().invoke(app, ["info", str(model_dir), "--device", "cpu", "--context", "512"])
    assert "exceed" not in inside.stdout


def test_device_cpu_index_is_the_cpu(llm, model_dir):
    expected = llm.generate("hi", max_new_tokens=4, temperature=0).token_ids
    assert (
        LLM(model_dir, device="cpu:0").generate("hi", max_new_tokens=4, temperature=0).token_ids == expected
    )
    args = ["generate", str(model_dir), "--device", "cpu:0", "-p", "hi", "-n", "4", "--temperature", "0"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["token_ids"] == expected


def test_nan_weights_name_the_first_layer(model_dir, tmp_path):
    broken = copy(model_dir, tmp_path / "ckpt")

    def poison(t):
        t["model.layers.1.mlp.down_proj.weight"][0, 0] = math.nan

    edit_tensors(broken, poison)
    llm = LLM(broken, device="cpu")
    match = r"NaN/inf logits, first in layer 1 \(model\.layers\.1\.mlp.*\)"
    api_error(lambda: llm.generate("hi", max_new_tokens=3), match)
    cli_error(gen_args(broken, "-p", "hi", "-n", 3), match)
    # the engine is free again after the error
    api_error(lambda: llm.generate("hi", max_new_tokens=3), match)


def test_a_head_size_the_gpu_kernel_lacks_is_named_before_anything_runs():
    """On a GPU the lean decode kernel takes head_dim 64 or 128: another one is refused in one line
    when the engine is made (the CPU's PyTorch twin takes any)."""
    from minidecode.kernels.ops import decode_attention_problem

    assert decode_attention_problem(torch.device("cpu"), 16) is None
    assert decode_attention_problem(torch.device("cuda"), 64) is None
    assert decode_attention_problem(torch.device("cuda"), 16) == (
        "the GPU decode kernel takes head_dim 64 or 128; this model's is 16: run it with --device cpu"
    )

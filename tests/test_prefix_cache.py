"""Prefix reuse and cache files, against transformers (fp32): a second question on a cached
document, a growing chat, a prompt diverging mid-cache, the RoPE types whose angles depend on
the length, save -> load in a new process, and every bad cache file refused in one line."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import random_ids
from helpers import max_rel_err
from safetensors import safe_open
from typer.testing import CliRunner

from minidecode import LLM, Request, UserError
from minidecode import cache_file as cache_file_module
from minidecode.cache_file import read_cache_file
from minidecode.kernels.quant import V_BLOCK, read_v_rows, v_blocks
from minidecode.models.cache import KVCache
from minidecode_cli.cli import app

REPO = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONIOENCODING="utf-8")
NEW = 8
DOC = random_ids(300, seed=1)
QUESTION_A, QUESTION_B = random_ids(12, seed=2), random_ids(20, seed=3)


@pytest.fixture(scope="module")
def model_dir(checkpoint_factory):
    return checkpoint_factory("llama", "default", max_positions=512)


def load(model_dir, **kw) -> LLM:
    return LLM(model_dir, device="cpu", dtype="float32", **kw)


def greedy(llm: LLM, ids: list[int], **kw):
    return llm.generate(token_ids=ids, max_new_tokens=NEW, temperature=0, ignore_eos=True, **kw)


def cached(llm: LLM) -> tuple[list[int], KVCache]:
    """The last finished request's cached ids and its region of the cache."""
    prefix = llm.loop.scheduler.latest()
    return (prefix.ids, llm.engine.region(prefix.start, prefix.size)) if prefix else ([], None)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def hf_logprobs(hf, model_dir, prompt: list[int], new: list[int]) -> torch.Tensor:
    """transformers' log p of each new token, from one forward pass over prompt + new."""
    logits = hf.logits(model_dir, prompt + new)[len(prompt) - 1 : -1]
    return logits.log_softmax(-1).gather(-1, torch.tensor(new)[:, None])[:, 0]


# ---- prefix reuse ------------------------------------------------------------------------------


def test_second_question_reuses_the_document(model_dir, hf):
    llm = load(model_dir)
    first = greedy(llm, DOC + QUESTION_A, max_context=400)
    assert (first.stats.reused_tokens, first.stats.prefilled_tokens) == (0, len(DOC + QUESTION_A))
    prompt = DOC + QUESTION_B
    second = greedy(llm, prompt, max_context=400, logprobs=True)
    assert second.stats.reused_tokens == len(DOC) and second.stats.prefilled_tokens == len(QUESTION_B)
    assert f"({len(DOC)} from the cache)" in second.stats.summary()
    assert second.token_ids == hf.greedy(model_dir, prompt, NEW)
    ref = hf_logprobs(hf, model_dir, prompt, second.token_ids)
    assert max_rel_err(torch.tensor(second.logprobs), ref) <= 1e-4


def test_suffix_prefill_logits_equal_a_full_pass(model_dir, hf):
    """Every row of a suffix prefilled after a cached prefix (positions c..T-1) has the logits of
    transformers' full pass over the whole prompt."""
    llm = load(model_dir)
    greedy(llm, DOC + QUESTION_A, max_context=400)
    prompt, c = DOC + QUESTION_B, len(DOC)
    with torch.inference_mode():
        suffix = torch.tensor([prompt[c:]])
        hidden = llm.model.prefill(suffix, cached(llm)[1], 7, last_only=False, start=c)  # 7: odd chunks
        logits = llm.model.logits(hidden[0])
    assert max_rel_err(logits, hf.logits(model_dir, prompt)[c:]) <= 1e-4


def test_three_turn_chat_through_reuse_equals_fresh_runs(model_dir, hf):
    llm = load(model_dir)
    messages: list[dict[str, str]] = []
    previous_prompt: list[int] = []
    for question in ["Hello there!", "And 長文脈?", "One more 🙂"]:
        messages.append({"role": "user", "content": question})
        ids = llm.encode(Request(messages=messages).check())
        before = list(cached(llm)[0])
        out = llm.generate(messages=messages, max_new_tokens=NEW, temperature=0, max_context=400)
        assert out.token_ids == hf.greedy(model_dir, ids, NEW, eos=True)
        assert out.stats.reused_tokens == min(common_prefix(before, ids), len(ids) - 1)
        assert out.stats.reused_tokens >= len(previous_prompt)  # the earlier turns cost nothing
        previous_prompt = ids
        messages.append({"role": "assistant", "content": out.text})


def test_prompt_diverging_mid_cache_reuses_exactly_the_common_part(model_dir, hf):
    llm = load(model_dir)
    greedy(llm, DOC + QUESTION_A, max_context=400)
    prompt = DOC[:137] + [(DOC[137] + 1) % 384] + DOC[138:200]
    out = greedy(llm, prompt, max_context=400)
    assert out.stats.reused_tokens == 137 and out.stats.prefilled_tokens == len(prompt) - 137
    assert out.token_ids == hf.greedy(model_dir, prompt, NEW)


def test_generated_tokens_are_reused(model_dir, hf):
    """The answer's tokens fed back to decode steps are cached (the last one too: a step ran with
    it while it was handed out)."""
    llm = load(model_dir)
    first = greedy(llm, DOC, max_context=400)
    assert cached(llm)[0] == DOC + first.token_ids
    prompt = DOC + first.token_ids + QUESTION_A
    out = greedy(llm, prompt, max_context=400)
    assert out.stats.reused_tokens == len(DOC) + NEW
    assert out.token_ids == hf.greedy(model_dir, prompt, NEW)


def test_off_switches_and_a_region_too_small(model_dir, hf):
    prompt = DOC + QUESTION_B
    off = load(model_dir, prefix_reuse=False)
    greedy(off, DOC + QUESTION_A, max_context=400)
    assert greedy(off, prompt, max_context=400).stats.reused_tokens == 0
    llm = load(model_dir)
    greedy(llm, DOC + QUESTION_A, max_context=400)
    assert greedy(llm, prompt, max_context=400, reuse_prefix=False).stats.reused_tokens == 0
    llm = load(model_dir)
    greedy(llm, DOC + QUESTION_A)  # a region of exactly prompt + new positions
    out = greedy(llm, prompt)  # needs more: the prefix is copied into a larger region
    assert out.stats.reused_tokens == len(DOC) and out.token_ids == hf.greedy(model_dir, prompt, NEW)


def test_memory_pressure_evicts_the_least_recently_used_prefix(model_dir):
    """A and B run together (a cache of exactly their two regions), both stay cached; A's prompt
    comes back (A is now the more recent); an unrelated request C then needs a region with none
    free and nothing running: the least recently used prefix, B's, is evicted for it, not A's."""
    prompt_a, prompt_b, prompt_c = (random_ids(100, seed=s) for s in (11, 12, 13))
    llm = load(model_dir)
    ask = dict(max_new_tokens=NEW, temperature=0, ignore_eos=True, max_context=120)
    first = llm.generate_batch([prompt_a, prompt_b], **ask)
    assert [r.stats.reused_tokens for r in first] == [0, 0]
    scheduler = llm.loop.scheduler
    assert len(scheduler.prefixes) == 2 and not scheduler.regions.free  # no room for a third
    assert llm.generate(token_ids=prompt_a, **ask).stats.reused_tokens == len(prompt_a) - 1  # touch A
    assert llm.generate(token_ids=prompt_c, **ask).stats.reused_tokens == 0  # evicts one
    held = sorted(p.ids[:5] for p in scheduler.prefixes)
    assert held == sorted([prompt_a[:5], prompt_c[:5]])  # B went first
    assert llm.generate(token_ids=prompt_a + QUESTION_A, **ask).stats.reused_tokens == len(prompt_a)
    assert llm.generate(token_ids=prompt_b, **ask).stats.reused_tokens == 0


@pytest.mark.parametrize("rope", ["dynamic", "longrope"])
def test_length_dependent_rope_reuses_only_below_its_switch(checkpoint_factory, hf, rope):
    """Dynamic NTK rescales past max_position_embeddings (64 here), LongRoPE switches factors
    past original_max_position_embeddings (256): positions computed under a longer pass are not
    reused, and both ways the tokens are transformers'."""
    model_dir = checkpoint_factory("llama", rope, max_positions=64 if rope == "dynamic" else 512)
    switch = 64 if rope == "dynamic" else 256
    llm = load(model_dir)
    short_doc, long_doc = DOC[: switch // 2], DOC[: switch + 10]
    greedy(llm, short_doc + QUESTION_A[:4], max_context=switch, allow_extrapolation=True)
    prompt = short_doc + QUESTION_B[:4]
    out = greedy(llm, prompt, max_context=switch, allow_extrapolation=True)
    assert out.stats.reused_tokens == len(short_doc)
    assert out.token_ids == hf.greedy(model_dir, prompt, NEW)
    greedy(llm, long_doc + QUESTION_A[:4], max_context=400, allow_extrapolation=True)
    prompt = long_doc + QUESTION_B[:4]
    out = greedy(llm, prompt, max_context=400, allow_extrapolation=True)
    assert out.stats.reused_tokens == 0
    assert out.token_ids == hf.greedy(model_dir, prompt, NEW)


# ---- cache files -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(model_dir, tmp_path_factory):
    """A cache file of DOC + QUESTION_A and its answer, and the ids it holds."""
    llm = load(model_dir)
    greedy(llm, DOC + QUESTION_A, max_context=400)
    path = tmp_path_factory.mktemp("cache") / "doc.safetensors"
    size = llm.save_cache(path)
    assert size == path.stat().st_size
    ids, region = cached(llm)
    return path, list(ids), region.k[:, :, :, : len(ids)].clone()


def test_cache_file_is_safetensors_of_the_valid_positions(saved):
    path, ids, k = saved
    with safe_open(path, "pt") as f:
        meta = f.metadata()
        assert meta["format_version"] == str(cache_file_module.FORMAT_VERSION)
        assert meta["cache_dtype"] == "float32"
        assert int(meta["length"]) == len(ids) and len(meta["config_sha256"]) == 64
        assert f.get_tensor("token_ids").tolist() == ids
        assert torch.equal(f.get_tensor("k"), k)
        assert f.get_tensor("v").shape == k.shape


def test_loaded_cache_gives_the_same_tokens(model_dir, saved, hf):
    path, ids, _ = saved
    llm = load(model_dir)
    assert llm.load_cache(path) == len(ids)
    prompt = DOC + QUESTION_B
    out = greedy(llm, prompt, logprobs=True)
    assert out.stats.reused_tokens == len(DOC) and out.stats.cache_load_seconds > 0
    assert out.token_ids == hf.greedy(model_dir, prompt, NEW)
    assert max_rel_err(torch.tensor(out.logprobs), hf_logprobs(hf, model_dir, prompt, out.token_ids)) <= 1e-4


def invoke(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def test_cli_save_then_load_in_a_new_process(model_dir, hf, tmp_path):
    tok = hf.tokenizer(model_dir)
    doc = "def add(a, b):\n    return a + b\n\n" * 20
    common = ["--device", "cpu", "-n", NEW, "--temperature", 0, "--json"]
    path = tmp_path / "doc.cache"
    first = invoke("generate", model_dir, "-p", doc + "# first", "--save-cache", path, *common)
    assert first.exit_code == 0, first.stderr
    assert "saved" in first.stderr and path.is_file()
    first_ids = tok(doc + "# first").input_ids

    prompt = doc + "# second question"
    proc = subprocess.run(
        [sys.executable, "-m", "minidecode_cli.cli", "generate", str(model_dir), "-p", prompt,
         "--load-cache", str(path), *map(str, common)],
        capture_output=True, text=True, env=ENV, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    ids = tok(prompt).input_ids
    assert out["token_ids"] == hf.greedy(model_dir, ids, NEW, eos=True)
    assert out["stats"]["reused_tokens"] >= common_prefix(first_ids, ids) > 100
    assert out["stats"]["prefilled_tokens"] == len(ids) - out["stats"]["reused_tokens"]


def rewrite_header(src: Path, dst: Path, edit) -> None:
    """Copy a cache file with its JSON header changed by edit(header)."""
    data = src.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    edit(header)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    dst.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + n :])


def bad_files(saved, tmp_path, checkpoint_factory, model_dir):
    """(name, cache file, model) cases that must be refused, and the message each gives."""
    path = saved[0]
    data = path.read_bytes()
    truncated, corrupted, newer = tmp_path / "truncated", tmp_path / "corrupted", tmp_path / "newer"
    truncated.write_bytes(data[:-100])
    corrupted.write_bytes(data[:20] + b"\xff" * 8 + data[28:])
    newer_version = str(cache_file_module.FORMAT_VERSION + 1)
    rewrite_header(path, newer, lambda h: h["__metadata__"].update(format_version=newer_version))
    other_config = checkpoint_factory("llama", "default", max_positions=256)
    other_weights = checkpoint_factory("llama", "default", max_positions=512, seed=1)
    return [
        ("another model", path, other_config, "was made by another model"),
        ("other weights", path, other_weights, "was made with other weights"),
        ("truncated", truncated, model_dir, "is truncated"),
        ("corrupted header", corrupted, model_dir, "is corrupted"),
        ("newer format", newer, model_dir, "was written by a newer minidecode"),
    ]


def test_bad_cache_files_are_refused_in_one_line(saved, tmp_path, checkpoint_factory, model_dir):
    keep = tmp_path / "keep.cache"
    for name, path, model, message in bad_files(saved, tmp_path, checkpoint_factory, model_dir):
        before = path.read_bytes()
        keep.write_bytes(b"an earlier cache")
        result = invoke(
            "generate", model, "--device", "cpu", "-p", "x = 1", "-n", 2,
            "--load-cache", path, "--save-cache", keep,
        )  # fmt: skip
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1, (name, result.stderr)
        assert lines[0].startswith(f"error: cache file {path} {message}"), (name, lines)
        assert path.read_bytes() == before and keep.read_bytes() == b"an earlier cache", name


def test_load_into_a_warm_model_then_save_and_ask_again(model_dir, saved, hf, tmp_path):
    """load_cache into a model that already holds a cache: the next request reads the file, a save
    after it writes that request's cache, and the request after reads no stale file data."""
    path, ids, _ = saved
    llm = load(model_dir)
    greedy(llm, QUESTION_A + DOC[:50], max_context=400)  # warm: a cache of another prompt
    assert llm.load_cache(path) == len(ids)
    prompt = DOC + QUESTION_B
    out = greedy(llm, prompt)
    assert out.stats.reused_tokens == len(DOC) and out.token_ids == hf.greedy(model_dir, prompt, NEW)
    again = tmp_path / "again.cache"
    llm.save_cache(again)
    with safe_open(again, "pt") as f:
        assert f.get_tensor("token_ids").tolist() == prompt + out.token_ids
    longer = prompt + out.token_ids + QUESTION_A
    last = greedy(llm, longer)
    assert last.stats.reused_tokens == len(prompt) + NEW and last.token_ids == hf.greedy(
        model_dir, longer, NEW
    )


def test_an_unrelated_prompt_after_a_load_just_runs(saved, model_dir):
    """A loaded cache longer than the next request's context does not refuse it: nothing of it is
    reused, the request runs."""
    path, ids, _ = saved
    result = invoke(
        "generate", model_dir, "--device", "cpu", "-p", "x = 1", "-n", 2, "--load-cache", path, "--json"
    )
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["stats"]["reused_tokens"] == 0


def test_cache_dtype_mismatch_and_reuse_off(saved, model_dir):
    path, ids, _ = saved
    with pytest.raises(UserError, match=r"holds a float32 cache, but this model's cache is bfloat16"):
        LLM(model_dir, device="cpu", dtype="bfloat16").load_cache(path)
    with pytest.raises(UserError, match=r"prefix reuse is off"):
        load(model_dir, prefix_reuse=False).load_cache(path)


def test_a_failed_write_leaves_no_file(model_dir, tmp_path, monkeypatch):
    llm = load(model_dir)
    greedy(llm, DOC, max_context=400)
    target = tmp_path / "doc.cache"
    target.write_bytes(b"an earlier cache")
    writes = []

    def failing_write(f, tensor, staging):
        writes.append(tensor)
        if len(writes) == 2:  # the K tensor is on disk, V fails midway
            raise OSError(28, "No space left on device")
        return original(f, tensor, staging)

    original = cache_file_module._write_tensor
    monkeypatch.setattr(cache_file_module, "_write_tensor", failing_write)
    with pytest.raises(UserError, match=r"could not write cache file .*: No space left on device"):
        llm.save_cache(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.cache"]
    assert target.read_bytes() == b"an earlier cache"
    monkeypatch.setattr(cache_file_module, "_write_tensor", original)
    llm.save_cache(target)
    with safe_open(target, "pt") as f:
        assert f.get_tensor("token_ids").tolist() == cached(llm)[0]


def readme_commands(prefix: str) -> list[str]:
    block = (REPO / "README.md").read_text().split("## Command line", 1)[1].split("```", 2)[1]
    return [line for line in block.splitlines() if line.startswith(prefix)]


def test_readme_cache_commands(tmp_path):
    """The README's save / load pair, exactly as written, through a shell (shipped model)."""
    save, ask = readme_commands("minidecode generate --prompt-file book.txt") + readme_commands(
        "(cat book.txt"
    )
    shutil.copy(REPO / "minidecode" / "assets" / "stdlib-tiny" / "README.md", tmp_path / "book.txt")
    env = dict(ENV, PATH=f"{Path(sys.executable).parent}{os.pathsep}{ENV.get('PATH', '')}")
    for command in (save, ask):
        proc = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300
        )
        assert proc.returncode == 0, proc.stderr
    assert "from the cache)" in proc.stderr and (tmp_path / "book.cache").is_file()


# ---- GPU: CUDA-graph decode over a reused prefix -------------------------------------------------


@pytest.mark.gpu
def test_reuse_with_cuda_graph_recapture(checkpoint_factory):
    """A recapture (logprobs switched on) runs real decode steps at position 0, inside the
    reused prefix: its K/V must be put back. Tokens equal a run without reuse."""
    model_dir = checkpoint_factory("gpu-llama-hd64", "default", max_positions=512)  # lean: head_dim 64
    llm = LLM(model_dir, device="cuda", dtype="float32")
    fresh = LLM(model_dir, device="cuda", dtype="float32", prefix_reuse=False)
    greedy(llm, DOC + QUESTION_A, max_context=400)
    out = greedy(llm, DOC + QUESTION_B, max_context=400, logprobs=True)
    ref = greedy(fresh, DOC + QUESTION_B, max_context=400, logprobs=True)
    assert out.stats.reused_tokens == len(DOC) and out.token_ids == ref.token_ids
    assert max_rel_err(torch.tensor(out.logprobs), torch.tensor(ref.logprobs)) <= 1e-4


def test_fp8_cache_reuses_the_dequantized_prefix(model_dir, tmp_path):
    """With an FP8 cache the suffix attends to the cached prefix as decode would read it
    (dequantized): the second question reuses the document, and its first-token log-prob matches a
    model-dtype run within the FP8 error; a cache file round-trips with its scales."""
    fp8 = load(model_dir, kv_cache_dtype="fp8")
    greedy(fp8, DOC + QUESTION_A, max_context=400)
    ask_b = dict(token_ids=DOC + QUESTION_B, max_new_tokens=1, temperature=0, logprobs=True)
    second = fp8.generate(**ask_b, max_context=400)
    assert second.stats.reused_tokens == len(DOC) and second.stats.prefilled_tokens == len(QUESTION_B)
    exact = load(model_dir).generate(**ask_b)
    assert second.token_ids == exact.token_ids
    assert abs(second.logprobs[0] - exact.logprobs[0]) < 0.05
    fp8.save_cache(tmp_path / "doc.safetensors")
    fresh = load(model_dir, kv_cache_dtype="fp8")
    fresh.load_cache(tmp_path / "doc.safetensors")
    again = fresh.generate(**ask_b, max_context=400)
    # the file holds document + question B: all but the last prompt token come from it, quantized
    assert again.stats.reused_tokens == len(DOC + QUESTION_B) - 1 and again.token_ids == exact.token_ids
    assert abs(again.logprobs[0] - exact.logprobs[0]) < 0.05


def test_fp8_cache_file_holds_v_blocks_and_loads_them_exactly(model_dir, tmp_path):
    """An FP8 cache file holds V as the ceil(n / 64) blocks of its n positions (the cache's own
    bytes), and reading it back, whole or a prefix that ends inside a block, restores every valid
    position's K, V and scales."""
    llm = load(model_dir, kv_cache_dtype="fp8")
    greedy(llm, DOC + QUESTION_A[:5], max_context=400)  # 313 positions: 4 blocks and 57
    path = tmp_path / "doc.cache"
    llm.save_cache(path)
    ids, cache = cached(llm)
    n = len(ids)
    blocks = v_blocks(n)
    assert n % V_BLOCK and cache.v.shape[3] > blocks  # a partial last block, more blocks in the region
    with safe_open(path, "pt") as f:
        assert f.metadata()["cache_dtype"] == "float8_e4m3fn"
        v = f.get_tensor("v")
        assert v.shape == (*cache.v.shape[:3], blocks, *cache.v.shape[4:])
        assert torch.equal(v.view(torch.uint8), cache.v[:, :, :, :blocks].view(torch.uint8))
    fresh = load(model_dir, kv_cache_dtype="fp8")
    assert fresh.load_cache(path) == n
    (loaded,) = fresh.loop.scheduler.prefixes
    cfg = fresh.config
    for count in (n, 100):
        target = KVCache(cfg.num_layers, 1, cfg.num_kv_heads, 400, cfg.head_dim, fresh.kv_dtype, "cpu")
        read_cache_file(loaded.file, target.region(0, count).tensors())
        for name in ("k", "kv_scale"):
            got, want = (getattr(c, name)[:, :, :, :count] for c in (target, cache))
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
        got, want = (read_v_rows(c.v, 0, count) for c in (target, cache))
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_older_cache_files_are_refused(model_dir, saved, tmp_path):
    """Format 1 stored an FP8 cache's V by position, format 2 its scales as float32 k_scale and
    v_scale, and no format before 4 has checksums: a file of an older format, of any cache dtype,
    is refused in one line (a cache is made again by a prefill)."""
    llm = load(model_dir, kv_cache_dtype="fp8")
    greedy(llm, DOC, max_context=400)
    written = tmp_path / "fp8.cache"
    llm.save_cache(written)
    for version, path in (("1", saved[0]), ("2", written), ("3", written), ("3", saved[0])):
        old = tmp_path / f"v{version}.cache"
        rewrite_header(path, old, lambda h, v=version: h["__metadata__"].update(format_version=v))
        fp8 = path == written
        with pytest.raises(UserError) as refused:
            load(model_dir, kv_cache_dtype="fp8" if fp8 else "auto").load_cache(old)
        assert str(refused.value) == (
            f"cache file {old} was written by an older minidecode (format {version}, without the "
            "checksums of format 4): prefill the prompt again and save a new cache file"
        )
    assert load(model_dir, kv_cache_dtype="fp8").load_cache(written) == len(DOC) + NEW  # today's format


def test_an_aborted_prefill_after_a_load_leaves_no_load_behind(model_dir, saved, hf):
    """A request that reads the loaded file, closed while it prefills: the next requests run as if
    nothing had been loaded or read (no stale file state: the tokens of a fresh model)."""
    import threading

    path, ids, _ = saved
    llm = load(model_dir, prefill_chunk=8)
    llm.load_cache(path)
    prompt = DOC + QUESTION_B
    started = threading.Event()

    def progress(done: int, total: int) -> None:
        if done and not started.is_set():
            started.set()
            stream.close()  # the caller goes away mid-prefill

    stream = llm.stream(
        token_ids=prompt, max_new_tokens=NEW, temperature=0, ignore_eos=True, on_prefill_progress=progress
    )
    for _ in stream.events():
        pass
    assert started.is_set() and stream.result.finish_reason == "abort" and not stream.result.token_ids
    assert llm.loop.scheduler.prefixes == []  # the file was read once, for the aborted request
    again = greedy(llm, prompt)
    assert again.stats.reused_tokens == 0 and again.token_ids == hf.greedy(model_dir, prompt, NEW)

"""Cache files are refused when anything in them is wrong (CPU): a range of K overwritten, one
byte of an FP8 cache's K, V or scales flipped, a token id changed, only the chunks read checked;
another model whose weights differ outside any sample; a folder. The checksums against exact
integer arithmetic, and the same sums on the GPU."""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import pytest
import torch
from conftest import random_ids
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from minidecode import LLM, UserError
from minidecode.cache_file import (
    CHUNK_WORDS,
    chunk_entries,
    chunk_sums,
    open_cache_file,
    read_cache_file,
    run_words,
    weights_fingerprint,
    write_cache_file,
)
from minidecode_cli.cli import app

SHIPPED = Path(__file__).resolve().parents[1] / "minidecode" / "assets" / "stdlib-tiny"
DOC, QUESTION = random_ids(300, seed=1), random_ids(12, seed=2)


@pytest.fixture(scope="module")
def model_dir(checkpoint_factory):
    return checkpoint_factory("llama", "default", max_positions=512)


def load(model_dir, **kw) -> LLM:
    return LLM(model_dir, device="cpu", dtype="float32", **kw)


def ask(llm: LLM, ids: list[int], **kw):
    return llm.generate(token_ids=ids, max_new_tokens=4, temperature=0, ignore_eos=True, **kw)


def load_with(model_dir, path: Path, **kw) -> LLM:
    llm = load(model_dir, **kw)
    llm.load_cache(path)
    return llm


def save(model_dir, path: Path, **kw) -> Path:
    llm = load(model_dir, **kw)
    ask(llm, DOC + QUESTION, max_context=400)
    llm.save_cache(path)
    return path


def data_range(path: Path, name: str) -> tuple[int, int]:
    """Where tensor `name`'s bytes lie in the file: [begin, end)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        begin, end = json.loads(f.read(n))[name]["data_offsets"]
    return 8 + n + begin, 8 + n + end


def damaged(path: Path, out: Path, at: int, new: bytes) -> Path:
    """A copy of the file with bytes at..at+len(new)-1 replaced: same size, header intact."""
    data = bytearray(path.read_bytes())
    assert data[at : at + len(new)] != new
    data[at : at + len(new)] = new
    out.write_bytes(bytes(data))
    return out


def flip_byte(path: Path, out: Path, at: int) -> Path:
    return damaged(path, out, at, bytes([path.read_bytes()[at] ^ 0x01]))


def test_overwritten_k_data_is_refused_when_read_and_the_engine_recovers(model_dir, tmp_path):
    """4 KiB of K overwritten (of 75 KiB): the header still matches, so the file loads, and the
    next request that reuses it is refused in one line; the one after it prefills from scratch
    and gives the tokens of a model that never saw the file."""
    path = save(model_dir, tmp_path / "doc.cache")
    begin, end = data_range(path, "k")
    noise = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    bad = damaged(path, tmp_path / "bad.cache", (begin + end) // 2, bytes(noise.tolist()))
    assert bad.stat().st_size == path.stat().st_size
    llm = load(model_dir)
    assert llm.load_cache(bad) == len(DOC + QUESTION) + 4  # and the 4 answer tokens fed back
    prompt = DOC + random_ids(20, seed=3)
    with pytest.raises(UserError) as refused:
        ask(llm, prompt)
    assert str(refused.value) == (
        f"cache file {bad} is corrupted: its k data does not match the checksum saved with it; "
        "prefill the prompt again and save a new cache file"
    )
    again = ask(llm, prompt)
    assert again.stats.reused_tokens == 0
    assert again.token_ids == ask(load(model_dir), prompt).token_ids
    assert ask(load_with(model_dir, path), prompt).stats.reused_tokens == len(DOC)  # the intact file


def test_cli_refuses_a_corrupted_cache_in_one_line(model_dir, tmp_path):
    """The issue's case through the command: a cache saved by `generate --save-cache`, 1 KiB of
    its K overwritten, then a longer prompt that starts with the saved one."""
    doc = "def add(a, b):\n    return a + b\n\n" * 20
    common = ["--device", "cpu", "-n", 2, "--temperature", 0]
    path = tmp_path / "doc.cache"
    run = CliRunner().invoke(
        app, [str(a) for a in ["generate", model_dir, "-p", doc, "--save-cache", path, *common]]
    )
    assert run.exit_code == 0, run.stderr
    begin, _ = data_range(path, "k")
    bad = damaged(path, tmp_path / "bad.cache", begin + 512, b"\0" * 1024)
    args = ["generate", model_dir, "-p", doc + "# more", "--load-cache", bad, *common]
    run = CliRunner().invoke(app, [str(a) for a in args])
    assert run.exit_code == 2 and run.stdout == ""
    assert run.stderr.strip().splitlines() == [
        f"error: cache file {bad} is corrupted: its k data does not match the checksum saved with it; "
        "prefill the prompt again and save a new cache file"
    ]


@pytest.mark.parametrize("name", ["k", "v", "kv_scale"])
def test_one_flipped_byte_of_an_fp8_cache_is_refused(model_dir, tmp_path, name):
    """One bit of one byte of the second run's last entry: an e4m3 row of K, a V block, a pair of
    bfloat16 scales, past the 100 positions reused: the chunks read are checked whole."""
    path = save(model_dir, tmp_path / "doc.cache", kv_cache_dtype="fp8")
    begin, _ = data_range(path, name)
    with safe_open(path, "pt") as f:
        shape = f.get_slice(name).get_shape()
    entry_bytes = math.prod(shape[4:]) * (2 if name == "kv_scale" else 1)
    at = begin + shape[3] * entry_bytes + (shape[3] - 1) * entry_bytes + entry_bytes // 2
    bad = flip_byte(path, tmp_path / "bad.cache", at)
    prompt = DOC[:100] + QUESTION
    llm = load_with(model_dir, bad, kv_cache_dtype="fp8")
    with pytest.raises(UserError, match=f"is corrupted: its {name} data does not match the checksum"):
        ask(llm, prompt, max_context=400)
    intact = load_with(model_dir, path, kv_cache_dtype="fp8")
    assert ask(intact, prompt, max_context=400).stats.reused_tokens == 100


def test_a_changed_token_id_is_refused_on_load(model_dir, tmp_path):
    path = save(model_dir, tmp_path / "doc.cache")
    begin, _ = data_range(path, "token_ids")
    bad = flip_byte(path, tmp_path / "bad.cache", begin + 8 * 7)  # the 8th id, its low byte
    with pytest.raises(UserError, match="is corrupted: its token_ids data does not match the checksum"):
        load(model_dir).load_cache(bad)


def test_files_without_checksums_are_refused(model_dir, tmp_path):
    path = save(model_dir, tmp_path / "doc.cache")
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    del header["__metadata__"]["checksums"]
    header["__metadata__"]["format_version"] = "3"
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    old = tmp_path / "old.cache"
    old.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + n :])
    with pytest.raises(UserError) as refused:
        load(model_dir).load_cache(old)
    assert str(refused.value) == (
        f"cache file {old} was written by an older minidecode (format 3, without the checksums of "
        "format 4): prefill the prompt again and save a new cache file"
    )


# ---- the chunks: only what is read is checked, all of it ----------------------------------------
IDENTITY = {"config_sha256": "c", "weights_fingerprint": "w", "cache_dtype": "float32"}
RUNS, ENTRY = (2, 1, 2), 16  # 2 layers, 1 sequence, 2 KV heads; 16 float32 a position (64 bytes)


def layout(length: int) -> dict:
    return {"k": (torch.float32, (*RUNS, length, ENTRY))}


def test_reading_a_prefix_checks_the_chunks_it_reads_and_only_those(tmp_path):
    """5,000 positions of 64 bytes: chunks of 1,024 positions (64 KiB of a run). Reading 1,500
    positions reads 2 chunks of each run: a flipped byte at position 1,600 (read, not copied) is
    refused, one at position 3,000 (never read) is not, and what was copied is the file's."""
    assert chunk_entries(ENTRY * 4) == 2 * CHUNK_WORDS // 64 == 1024
    k = torch.randn(*RUNS, 5000, ENTRY, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "synthetic.cache"
    write_cache_file(path, {"k": k}, list(range(5000)), IDENTITY)
    begin, _ = data_range(path, "k")
    run_bytes = 5000 * ENTRY * 4
    last_run = begin + 3 * run_bytes  # the 4th (layer 1, KV head 1) run: its position p at + p * 64
    for position, refused in ((1600, True), (3000, False), (10, True)):
        bad = flip_byte(path, tmp_path / f"bad-{position}.cache", last_run + position * ENTRY * 4 + 5)
        file = open_cache_file(bad, IDENTITY, layout)
        target = torch.zeros(*RUNS, 1500, ENTRY)
        if refused:
            with pytest.raises(UserError, match="its k data does not match"):
                read_cache_file(file, {"k": target})
        else:
            read_cache_file(file, {"k": target})
            assert torch.equal(target, k[:, :, :, :1500])


@pytest.mark.gpu
def test_a_gpu_cache_file_round_trips_and_is_checked_through_the_pinned_buffer(tmp_path):
    """Saved from the GPU (sums on the GPU), read back on the GPU whole and as a prefix that ends
    inside a chunk (the rest of it summed on the host, from the pinned buffer), and on the CPU
    (the same sums there); a flipped byte in the part read but not copied is refused on the GPU."""
    k = torch.randn(*RUNS, 5000, ENTRY, device="cuda")
    path = tmp_path / "gpu.cache"
    write_cache_file(path, {"k": k}, list(range(5000)), IDENTITY)
    file = open_cache_file(path, IDENTITY, layout)
    for count, device in ((5000, "cuda"), (1500, "cuda"), (1500, "cpu")):
        target = torch.zeros(*RUNS, count, ENTRY, device=device)
        read_cache_file(file, {"k": target})
        assert torch.equal(target.cpu(), k[:, :, :, :count].cpu()), (count, device)
    begin, _ = data_range(path, "k")
    bad = flip_byte(path, tmp_path / "bad.cache", begin + 3 * 5000 * ENTRY * 4 + 1600 * ENTRY * 4 + 5)
    with pytest.raises(UserError, match="its k data does not match"):
        read_cache_file(
            open_cache_file(bad, IDENTITY, layout), {"k": torch.zeros(*RUNS, 1500, ENTRY, device="cuda")}
        )


def reference_sums(words: list[int], first: int, chunk: int, width: int) -> list[int]:
    """The weighted chunk sums in Python integers (exact), from the documented weights."""
    sums: dict[int, int] = {}
    for i, w in enumerate(words):
        entry, within = divmod(i, width)
        place = (first + entry) % chunk * width + within
        weight = (place * 1103515245 + 12345) % (2**31 - 1) + 1
        c = (first + entry) // chunk
        sums[c] = sums.get(c, 0) + w * weight
    return [sums[c] for c in sorted(sums)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_chunk_sums_are_exact_and_add_up_over_parts(device):
    """Against Python's integers: random words, the extreme words (-32768 at the largest weights:
    no int64 overflow), and a run cut in two at an entry inside a chunk (the parts' sums add up
    to the whole's)."""
    gen = torch.Generator().manual_seed(0)
    width, chunk, entries = 6, 7, 40
    words = torch.randint(-(2**15), 2**15, (entries, width), generator=gen, dtype=torch.int16)
    whole = chunk_sums(words.to(device), 0, chunk).cpu().tolist()
    assert whole == reference_sums(words.flatten().tolist(), 0, chunk, width)
    head, tail = chunk_sums(words[:17].to(device), 0, chunk), chunk_sums(words[17:].to(device), 17, chunk)
    assert tail.cpu().tolist() == reference_sums(words[17:].flatten().tolist(), 17, chunk, width)
    joined = torch.cat([head[:-1], head[-1:] + tail[:1], tail[1:]]).cpu().tolist()
    assert joined == whole
    extreme = torch.full((2 * CHUNK_WORDS, 1), -(2**15), dtype=torch.int16)
    got = chunk_sums(extreme.to(device), 0, CHUNK_WORDS).cpu().tolist()
    assert got == reference_sums([-(2**15)] * (2 * CHUNK_WORDS), 0, CHUNK_WORDS, 1)


def test_run_words_are_the_raw_bytes():
    fp8 = torch.tensor([[1.0, -2.0, 0.5, 448.0]]).to(torch.float8_e4m3fn)
    assert run_words(fp8).view(torch.uint8).tolist() == [fp8.view(torch.uint8).flatten().tolist()]
    ids = torch.tensor([5, -1])
    assert run_words(ids).shape == (2, 4) and run_words(ids)[1].tolist() == [-1] * 4


# ---- the model's identity ------------------------------------------------------------------------
def test_weights_differing_outside_any_sample_are_another_model(tmp_path):
    """A copy of the shipped model with rows 1-7 of every k_proj and v_proj negated and its
    config.json unchanged must not reuse the original's cache (a fingerprint of 16 evenly spaced
    values a tensor missed these rows)."""
    other = tmp_path / "negated"
    shutil.copytree(SHIPPED, other)
    weights = load_file(other / "model.safetensors")
    for name, t in weights.items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            t[1:8] = -t[1:8]
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    original = LLM(device="cpu")
    ask(original, random_ids(40, seed=4, vocab_size=4000))
    path = tmp_path / "original.cache"
    original.save_cache(path)
    with pytest.raises(UserError, match="was made with other weights"):
        LLM(other, device="cpu").load_cache(path)
    assert LLM(SHIPPED, device="cpu").load_cache(path) == 44  # the same weights from their folder


@pytest.mark.gpu
def test_weights_fingerprint_is_the_same_on_the_gpu(checkpoint_factory):
    model_dir = checkpoint_factory("gpu-llama-hd64", "default", max_positions=512)  # the GPU's head_dim
    cpu, gpu = load(model_dir), LLM(model_dir, device="cuda", dtype="float32")
    assert weights_fingerprint(cpu.model) == weights_fingerprint(gpu.model)


def test_a_folder_is_not_a_cache_file(model_dir, tmp_path):
    with pytest.raises(UserError) as refused:
        load(model_dir).load_cache(tmp_path)
    assert str(refused.value) == (
        f"cache file {tmp_path} is a directory; give the path of a file that --save-cache wrote"
    )
    with pytest.raises(UserError, match="does not exist"):
        load(model_dir).load_cache(tmp_path / "missing.cache")

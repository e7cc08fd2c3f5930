"""Cache files under torchrun (CPU, gloo, the shipped model): `generate --tp 2 --save-cache F` writes
a part per rank (F and F.rank1-of-2), `--load-cache F` under --tp 2 reads them back (the stats count
its tokens as from the cache, the greedy text is one process's), and a file of another launch (one
process's under --tp 2, a --tp 2 one in one process), a missing part, or parts of two saves are
refused with one `error:` line. Under --cp 2 each part holds its rank's positions of the prefix
(models/sharding.py's dealing) and a longer prompt reuses them. Every launch runs in a session of
its own and is killed with everything it started after a deadline."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

WAIT = 120
DOC = "def add(a, b):\n    return a + b\n\n" * 6
QUESTION = "# and now subtract\ndef sub(a, b):"
COMMON = ["--device", "cpu", "--temperature", "0", "-n", "12", "--json"]
# ~1,800 tokens: past the dealing's first chunk (1,024 positions), so each --cp 2 rank holds a part
LONG_DOC = "".join(f"def add{i}(a, b):\n    return a + b + {i}\n\n" for i in range(100))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """A command in a session of its own, killed with everything it started past WAIT seconds."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONIOENCODING="utf-8")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("WORLD_SIZE", None)
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with subprocess.Popen(args, env=env, cwd=cwd, start_new_session=True, **pipes) as process:
        try:
            stdout, stderr = process.communicate(timeout=WAIT)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            pytest.fail(f"{' '.join(args[:8])} ... did not finish within {WAIT} s")
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)


def ranks(*args: str, cwd: Path, split: str = "--tp") -> subprocess.CompletedProcess:
    launch = ["torchrun", "--nproc-per-node", "2", "--master-port", str(_free_port())]
    return run([*launch, "-m", "minidecode_cli.cli", "generate", split, "2", *args], cwd)


def one(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "minidecode_cli.cli", "generate", *args], cwd)


def one_error(proc: subprocess.CompletedProcess) -> str:
    """The one `error:` line of a refused launch (rank 0 prints it; nothing else does)."""
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error: " in line]
    assert len(errors) == 1, proc.stderr
    return errors[0][errors[0].index("error: ") :]


def test_a_tp_cache_is_reused_under_tp_and_refused_in_one_process(tmp_path):
    saved = ranks("-p", DOC, "--save-cache", "doc.cache", *COMMON, cwd=tmp_path)
    assert saved.returncode == 0, saved.stderr
    assert saved.stderr.count("saved the cache") == 1
    parts = ["doc.cache", "doc.cache.rank1-of-2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == parts  # and no temporaries left
    doc_tokens = json.loads(saved.stdout)["stats"]["prompt_tokens"]

    reused = ranks("-p", DOC + QUESTION, "--load-cache", "doc.cache", *COMMON, cwd=tmp_path)
    assert reused.returncode == 0, reused.stderr
    alone = one("-p", DOC + QUESTION, *COMMON, cwd=tmp_path)
    assert alone.returncode == 0, alone.stderr
    got, want = json.loads(reused.stdout), json.loads(alone.stdout)
    assert got["stats"]["reused_tokens"] >= doc_tokens - 1 > 50
    assert got["text"] == want["text"] and got["token_ids"] == want["token_ids"]

    refused = one_error(one("-p", DOC + QUESTION, "--load-cache", "doc.cache", *COMMON, cwd=tmp_path))
    assert refused == (
        "error: cache file doc.cache was saved under --tp 2 (a part per rank), but this run is one "
        "process: load it under torchrun --nproc-per-node 2 with --tp 2, or prefill the prompt again "
        "and save a new cache file"
    )

    # another save's rank-1 part beside this one's rank-0 part
    other = ranks("-p", QUESTION, "--save-cache", "other.cache", *COMMON, cwd=tmp_path)
    assert other.returncode == 0, other.stderr
    shutil.copy(tmp_path / "other.cache.rank1-of-2", tmp_path / "doc.cache.rank1-of-2")
    mixed = ranks("-p", DOC + QUESTION, "--load-cache", "doc.cache", *COMMON, cwd=tmp_path)
    assert one_error(mixed) == (
        "error: cache file doc.cache and its part doc.cache.rank1-of-2 were written by different "
        "saves: save it again under --tp 2"
    )

    (tmp_path / "doc.cache.rank1-of-2").unlink()
    missing = ranks("-p", DOC + QUESTION, "--load-cache", "doc.cache", *COMMON, cwd=tmp_path)
    assert one_error(missing) == (
        "error: cache file doc.cache has no part for rank 1: doc.cache.rank1-of-2 is missing (a cache "
        "saved under --tp 2 is a part per rank, side by side); save it again under --tp 2"
    )


def test_each_part_records_its_place_and_its_ranks_heads(tmp_path):
    """Rank k's part: a whole cache file of its KV heads, with tp, cp, rank and world size."""
    from minidecode import LLM

    saved = ranks("-p", DOC, "--save-cache", "doc.cache", *COMMON, cwd=tmp_path)
    assert saved.returncode == 0, saved.stderr
    llm = LLM(device="cpu")
    identity = llm.identity
    heads = llm.config.num_kv_heads
    llm.close()
    for rank, name in enumerate(["doc.cache", "doc.cache.rank1-of-2"]):
        meta = _metadata(tmp_path / name)
        assert {k: meta[k] for k in ("tp", "cp", "rank", "world_size")} == {
            "tp": "2", "cp": "1", "rank": str(rank), "world_size": "2"
        }  # fmt: skip
        assert meta["config_sha256"] == identity["config_sha256"]
        assert _header(tmp_path / name)["k"]["shape"][2] == heads // 2
    ids = {_metadata(tmp_path / name)["save_id"] for name in ("doc.cache", "doc.cache.rank1-of-2")}
    assert len(ids) == 1


def _header(path: Path) -> dict:
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + n])


def _metadata(path: Path) -> dict:
    return _header(path)["__metadata__"]


def test_a_one_process_cache_is_refused_under_tp_and_cp_in_one_line(tmp_path):
    saved = one("-p", DOC, "--save-cache", "doc.cache", *COMMON, cwd=tmp_path)
    assert saved.returncode == 0, saved.stderr
    assert _metadata(tmp_path / "doc.cache")["world_size"] == "1"
    refused = ranks("-p", DOC + QUESTION, "--load-cache", "doc.cache", *COMMON, cwd=tmp_path)
    assert one_error(refused) == (
        "error: cache file doc.cache was saved by one process, but this run is --tp 2 (2 ranks): load "
        "it in one process (without torchrun), or prefill the prompt again and save a new cache file"
    )
    cp = ranks("-p", DOC + QUESTION, "--load-cache", "doc.cache", *COMMON, cwd=tmp_path, split="--cp")
    assert one_error(cp) == (
        "error: cache file doc.cache was saved by one process, but this run is --cp 2 (2 ranks): load "
        "it in one process (without torchrun), or prefill the prompt again and save a new cache file"
    )


def test_a_cp_cache_holds_each_ranks_positions_and_is_reused_under_cp(tmp_path):
    """--cp 2 --save-cache: each rank's part holds its share of the prefix's positions (the first
    1,024 on rank 0, the rest on rank 1; a short prefix's rank 1 part none); a longer prompt under
    --cp 2 reads them back instead of prefilling (its stats count them) and gives one process's
    greedy tokens; the parts are refused under --tp 2 in one line."""
    from minidecode.models.sharding import held

    saved = ranks("-p", LONG_DOC, "--save-cache", "doc.cache", *COMMON, cwd=tmp_path, split="--cp")
    assert saved.returncode == 0, saved.stderr
    doc_tokens = json.loads(saved.stdout)["stats"]["prompt_tokens"]
    for rank, name in enumerate(["doc.cache", "doc.cache.rank1-of-2"]):
        meta = _metadata(tmp_path / name)
        assert (meta["tp"], meta["cp"], meta["rank"], meta["cp_chunk"]) == ("1", "2", str(rank), "1024")
        length = int(meta["length"])
        assert _header(tmp_path / name)["k"]["shape"][3] == held(length, 2, rank) > 0

    longer = ("-p", LONG_DOC + QUESTION, "--load-cache", "doc.cache", *COMMON)
    reused = ranks(*longer, cwd=tmp_path, split="--cp")
    assert reused.returncode == 0, reused.stderr
    alone = one("-p", LONG_DOC + QUESTION, *COMMON, cwd=tmp_path)
    assert alone.returncode == 0, alone.stderr
    got, want = json.loads(reused.stdout), json.loads(alone.stdout)
    assert got["stats"]["reused_tokens"] >= doc_tokens - 1 > 1024
    assert got["token_ids"] == want["token_ids"]

    short = ranks("-p", DOC, "--save-cache", "short.cache", *COMMON, cwd=tmp_path, split="--cp")
    assert short.returncode == 0, short.stderr  # rank 1's part: none of the prefix's positions
    assert _header(tmp_path / "short.cache.rank1-of-2")["k"]["shape"][3] == 0
    again = ranks("-p", DOC + QUESTION, "--load-cache", "short.cache", *COMMON, cwd=tmp_path, split="--cp")
    assert again.returncode == 0, again.stderr
    want_short = json.loads(one("-p", DOC + QUESTION, *COMMON, cwd=tmp_path).stdout)
    assert json.loads(again.stdout)["token_ids"] == want_short["token_ids"]

    tp = ranks(*longer, cwd=tmp_path)
    assert one_error(tp) == (
        "error: cache file doc.cache was saved under --cp 2 (a part per rank), but this run is --tp 2 "
        "(2 ranks): load it under torchrun --nproc-per-node 2 with --cp 2, or prefill the prompt again "
        "and save a new cache file"
    )

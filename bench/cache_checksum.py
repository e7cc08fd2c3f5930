"""What the cache file's checksums and the full-weights fingerprint cost (Llama-3-8B shapes,
random values, bf16, one GPU).

- Save and load of a 128k-token cache (16 GiB: K and V of 32 layers x 8 KV heads x 131,072
  positions x 128), each timed two ways in the same run: minidecode's (checksums summed on the
  GPU as the runs stream) and the same streaming through the same pinned buffer without them
  (the format-3 path, kept here as the peer). Each load reads from the disk (the file is dropped
  from the page cache first). Also the checksums alone: the chunk sums of every run on the GPU,
  CUDA events, median of REPEATS.
- The weights fingerprint of the 8B (every byte: chunk sums on the GPU, one transfer) against a
  read-only sum over the same bytes (the read ceiling's peer), wall time after a warm-up, median
  of REPEATS each.

    python bench/cache_checksum.py --dir /tmp      # about 1.5 min on an H100 (two 16 GiB saves, two loads)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch
from timing import event_ms  # bench/timing.py

from minidecode import LLM
from minidecode.cache_file import (
    chunk_entries,
    chunk_sums,
    open_cache_file,
    read_cache_file,
    run_words,
    weights_fingerprint,
    write_cache_file,
)
from minidecode.models.cache import KVCache

LENGTH, LAYERS, KV_HEADS, HEAD_DIM = 131072, 32, 8, 128
IDENTITY = {"config_sha256": "bench", "weights_fingerprint": "bench", "cache_dtype": "bfloat16"}


def drop_page_cache(path: Path) -> None:
    """Evict the (fsynced, so clean) file from the page cache: the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def plain_write(path: Path, tensors: dict[str, torch.Tensor], staging: torch.Tensor) -> None:
    """The peer: the same runs through the same pinned buffer to a file, fsynced, without sums."""
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)  # a header's worth
        for t in tensors.values():
            for run in t.flatten(0, 2):  # [length, D] each, contiguous
                host = staging[: run.numel() * run.element_size()].view(run.dtype).view(run.shape)
                host.copy_(run)
                f.write(host.view(torch.uint8).numpy())
        f.flush()
        os.fsync(f.fileno())


def plain_read(path: Path, tensors: dict[str, torch.Tensor], staging: torch.Tensor) -> None:
    """The peer: the same runs back through the same pinned buffer, without sums."""
    with open(path, "rb", buffering=0) as f:
        f.seek(4096)
        for t in tensors.values():
            for run in t.flatten(0, 2):
                host = staging[: run.numel() * run.element_size()]
                view, got = memoryview(host.numpy()), 0
                while got < len(view):
                    got += f.readinto(view[got:])
                run.copy_(host.view(run.dtype).view(run.shape))


def seconds(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):,.1f} ({min(values):,.1f}-{max(values):,.1f}) n={len(values)}"


def fingerprint_row(repeats: int) -> tuple[tuple[str, ...], dict]:
    """The 8B's weights fingerprint against a read-only sum over the same bytes: wall time, each
    call ending in a sync (the fingerprint's transfer; the peer's synchronize), after a warm-up."""
    llm = LLM("synthetic:llama-3-8b", device="cuda", dtype="bfloat16")
    params = [p for _, p in llm.model.named_parameters()]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    runs = range(repeats + 1)
    fingerprint = [1e3 * seconds(lambda: weights_fingerprint(llm.model)) for _ in runs][1:]
    read = [1e3 * seconds(lambda: [p.sum(dtype=torch.float32) for p in params]) for _ in runs][1:]
    median = statistics.median(fingerprint)
    row = (
        "8B weights: fingerprint of every byte", f"{nbytes / 1e9:.2f} GB", spread(fingerprint),
        f"{nbytes / median / 1e6:,.0f} GB/s; {median / statistics.median(read):.1f}x a read-only sum "
        f"({spread(read)} ms)",
    )  # fmt: skip
    return row, {"weight_bytes": nbytes, "fingerprint_ms": fingerprint, "weights_read_ms": read}


def cache_rows(folder: Path, repeats: int) -> tuple[list[tuple[str, ...]], dict]:
    """Save and load of a 128k cache with the checksums and without (the peer), and the checksums
    alone on the GPU."""
    cache = KVCache(LAYERS, 1, KV_HEADS, LENGTH + 128, HEAD_DIM, torch.bfloat16, torch.device("cuda"))
    for t in (cache.k, cache.v):
        for layer in t:
            layer.normal_()  # random values: never time on zeros
    tensors = cache.region(0, LENGTH).tensors()  # [32, 1, 8, 131072, 128] views, 16 GiB in all
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    chunk = chunk_entries(HEAD_DIM * 2)

    def sums_only() -> None:
        for t in tensors.values():
            for run in t.flatten(0, 2):
                chunk_sums(run_words(run), 0, chunk)

    def layout(n: int) -> dict:
        return {name: (t.dtype, (*t.shape[:3], n, *t.shape[4:])) for name, t in tensors.items()}

    sums_ms = event_ms(sums_only, repeats)
    staging = torch.empty(LENGTH * HEAD_DIM * 2, dtype=torch.uint8, pin_memory=True)  # one run
    path, ids = folder / "checksum_bench.cache", list(range(LENGTH))
    try:  # one 16 GiB file at a time: minidecode's, then the peer's
        save = seconds(lambda: write_cache_file(path, tensors, ids, IDENTITY))
        drop_page_cache(path)
        file = open_cache_file(path, IDENTITY, layout)
        load = seconds(lambda: read_cache_file(file, tensors))  # raises if a checksum did not match
        path.unlink()
        save_plain = seconds(lambda: plain_write(path, tensors, staging))
        drop_page_cache(path)
        load_plain = seconds(lambda: plain_read(path, tensors, staging))
    finally:
        path.unlink(missing_ok=True)
    sums_s, gb = statistics.median(sums_ms) / 1e3, nbytes / 1e9
    rows = [
        ("128k cache: checksums alone (GPU)", f"{nbytes / 2**30:.1f} GiB", spread(sums_ms),
         f"{gb / sums_s:,.0f} GB/s; {100 * sums_s / save:.2f}% of the save, "
         f"{100 * sums_s / load:.2f}% of the load"),
        ("128k cache: save with checksums", "", f"{1e3 * save:,.0f}", f"{gb / save:.2f} GB/s"),
        ("128k cache: save without (peer)", "", f"{1e3 * save_plain:,.0f}",
         f"{gb / save_plain:.2f} GB/s; with / without {save / save_plain:.3f}"),
        ("128k cache: load with checksums (disk)", "", f"{1e3 * load:,.0f}", f"{gb / load:.2f} GB/s"),
        ("128k cache: load without (peer, disk)", "", f"{1e3 * load_plain:,.0f}",
         f"{gb / load_plain:.2f} GB/s; with / without {load / load_plain:.3f}"),
    ]  # fmt: skip
    data = {"cache_bytes": nbytes, "sums_ms": sums_ms, "save_s": save, "save_plain_s": save_plain}
    return rows, data | {"load_s": load, "load_plain_s": load_plain}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("."), help="where the 16 GiB cache file goes")
    parser.add_argument("--repeats", type=int, default=5, help="samples of the fingerprint and sums timings")
    parser.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    args = parser.parse_args()
    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    row, weights = fingerprint_row(args.repeats)
    gc.collect()  # the 8B's weights go before the cache comes
    torch.cuda.empty_cache()
    rows, cache = cache_rows(args.dir, args.repeats)
    data |= weights | cache
    table = "| what | size | ms | note |\n| --- | --- | --- | --- |\n"
    table += "\n".join(f"| {' | '.join(r)} |" for r in [row, *rows])
    title = f"{data['device']}, torch {data['torch']}, bf16, synthetic:llama-3-8b shapes"
    title += "; one sample a save / load"
    print(f"\n{title}\n{table}")
    if args.out:
        Path(f"{args.out}.json").write_text(json.dumps(data, indent=1) + "\n")
        Path(f"{args.out}.md").write_text(
            f"# Cache checksums and weights fingerprint\n\n{title}\n\n{table}\n"
        )


if __name__ == "__main__":
    main()

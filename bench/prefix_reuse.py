"""Time to first token for a second question on a long cached document, and the cache file's
save and load speed (Llama-3-8B shapes, random weights, bf16, one GPU).

For each document length: request 1 prefills document + a 100-token question; request 2 asks
another 100-token question about the same document (only the question is prefilled). At 128k
(the first length) the cache is then saved, dropped from the page cache (so the load reads the
disk), loaded into the same model and a third question asked: its TTFT includes the load.

    python bench/prefix_reuse.py                 # 128k: about 1.5 min on an H200
    python bench/prefix_reuse.py --with-512k     # also 512k (TTFT only; ~3 more minutes, H200)

The cache file (16 GiB at 128k) goes to --dir (default: the current folder) and is deleted after.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from minidecode import LLM

QUESTION = 100  # tokens per question
NEW = 16  # tokens generated per answer


def ask(llm: LLM, ids: list[int], context: int):
    return llm.generate(
        token_ids=ids, max_new_tokens=NEW, temperature=0, ignore_eos=True, max_context=context
    )


def drop_page_cache(path: Path) -> bool:
    """Evict the (fsynced, so clean) file from the page cache: the next read comes from the disk."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--with-512k", action="store_true", help="also a 512k-token document (TTFT only)")
    parser.add_argument("--dir", type=Path, default=Path("."), help="where the 128k cache file is written")
    args = parser.parse_args()
    llm = LLM("synthetic:llama-3-8b", device="cuda", dtype="bfloat16")
    ask(llm, llm.random_prompt(1024, seed=99), 1024 + NEW)  # warm-up: kernel compilation, backend choice
    rows = []
    lengths = [131072] + ([524288] if args.with_512k else [])
    for n, length in enumerate(lengths):
        doc = llm.random_prompt(length, seed=n)
        questions = [llm.random_prompt(QUESTION, seed=100 + i) for i in range(3)]
        context = length + QUESTION + NEW
        llm.release_cache()  # each length starts from an empty cache of its own size
        first = ask(llm, doc + questions[0], context).stats
        second = ask(llm, doc + questions[1], context).stats
        assert second.reused_tokens == length, second
        k, ttft = f"{length // 1024}k", first.time_to_first_token
        rows.append(
            (f"{k} document, first question: TTFT", f"{first.prefilled_tokens:,} prefilled", ttft, "")
        )
        rows.append((
            f"{k} document, second question: TTFT",
            f"{second.prefilled_tokens:,} prefilled, {second.reused_tokens:,} reused",
            second.time_to_first_token,
            f"{ttft / second.time_to_first_token:.0f}x faster",
        ))  # fmt: skip
        print(f"{k}: TTFT {ttft:.3f} s, then {second.time_to_first_token:.3f} s", flush=True)
        if n:
            continue
        path = args.dir / "prefix_reuse_bench.cache"
        try:
            start = time.perf_counter()
            size = llm.save_cache(path)
            save_s = time.perf_counter() - start
            cold = drop_page_cache(path)
            llm.release_cache()
            start = time.perf_counter()
            held = llm.load_cache(path)
            check_ms = (time.perf_counter() - start) * 1e3
            third = ask(llm, doc + questions[2], context).stats
        finally:
            path.unlink(missing_ok=True)
        load_bytes = size * third.reused_tokens / held  # the part of the file that was read
        load_s = third.cache_load_seconds
        rows += [
            (f"{k} cache: save (safetensors, fsync)", f"{held:,} tokens, {size / 2**30:.2f} GiB", save_s,
             f"{size / save_s / 1e9:.2f} GB/s"),
            (f"{k} cache: load ({'from disk' if cold else 'page cache'})",
             f"{third.reused_tokens:,} tokens, header check {check_ms:.0f} ms", load_s,
             f"{load_bytes / load_s / 1e9:.2f} GB/s"),
            (f"{k} cache: third question after the load: TTFT", f"{third.prefilled_tokens:,} prefilled",
             third.time_to_first_token, "load and cache allocation included"),
        ]  # fmt: skip
    print(f"\n{torch.cuda.get_device_name()}, bf16, synthetic:llama-3-8b, {QUESTION}-token questions")
    print("| step | tokens | time | note |\n| --- | --- | --- | --- |")
    for step, tokens, seconds, note in rows:
        print(f"| {step} | {tokens} | {seconds:.3f} s | {note} |")


if __name__ == "__main__":
    main()

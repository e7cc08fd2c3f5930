"""What FP8 prefill attention (kernels/fp8_prefill.py) does to a model's predictions, against the
default bf16 SDPA prefill, at the model level (model.prefill with backend "fp8" vs the default).

    python -m bench.fp8_prefill_accuracy --out bench/results/prefill-fp8-accuracy
    python -m bench.fp8_prefill_accuracy --lengths 32768 131072 --no-needle

(from the repo root, as a module: the needle's haystack comes from training/stdlib_corpus.py)

1. Synthetic Llama-3-8B (random weights, bf16) at each length: the next-token distributions of
   the last 256 positions of one random prompt, FP8 against the default: KL(default || fp8) mean
   and max over those positions, and how often the top token agrees. Beside them, the same
   between SDPA's flash and cuDNN backends (two bf16 paths of the same math): the noise floor a
   bf16 runtime already has. Random weights make near-uniform attention, a mild case.
2. Needle in a haystack on the shipped model (a real, trained one: stdlib-tiny, head_dim 64):
   held-out standard-library source with one line `_NEEDLE = "<random word>"` inserted at a
   depth, and at the end `assert _NEEDLE == "` followed by the word, teacher-forced. Scored by the
   mean log-probability of the word's tokens at that second place (copying it from the needle is
   the only way to predict it) and whether greedy decoding would produce every one of them, for
   the default prefill and the FP8 one. Every attention call takes the FP8 kernel here (these
   prompts are too short to fill the GPU by the routing rule, which would send them to SDPA).
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from minidecode import LLM
from minidecode.kernels import prefill
from minidecode.models.cache import KVCache
from training.stdlib_corpus import load_split

K = 1024


def new_cache(llm: LLM, length: int) -> KVCache:
    c = llm.config
    return KVCache(c.num_layers, 1, c.num_kv_heads, length, c.head_dim, llm.dtype, llm.device)


@torch.inference_mode()
def tail_log_probs(llm: LLM, ids: torch.Tensor, backend: str | None, tail: int, chunk: int) -> torch.Tensor:
    """log-softmax of the logits of the last `tail` positions [tail, V] float32, one prefill."""
    cache = new_cache(llm, ids.shape[1])
    hidden = llm.model.prefill(ids, cache, chunk, backend, last_only=False)  # [1, T, hidden]
    return llm.model.logits(hidden[0, -tail:]).log_softmax(-1)


def compare(ref: torch.Tensor, other: torch.Tensor) -> dict:
    kl = (ref.exp() * (ref - other)).sum(-1)  # [tail]
    return {
        "kl_mean": kl.mean().item(),
        "kl_max": kl.max().item(),
        "top1_agreement": (ref.argmax(-1) == other.argmax(-1)).float().mean().item(),
    }


def synthetic(lengths: list[int], save: Callable[[list[dict]], object], tail: int = 256) -> list[dict]:
    """The synthetic 8B's rows, one per length (`save` gets the rows so far after each)."""
    llm = LLM("synthetic:llama-3-8b")
    cfg = llm.config
    chunk = getattr(llm.engine, "prefill_chunk", 8192)
    chosen = prefill.choose_backend(llm.device, cfg.head_dim, cfg.group_size, llm.dtype)
    other = "flash" if chosen == "cudnn" else "cudnn"
    rows = []
    for T in lengths:
        gen = torch.Generator().manual_seed(T)
        ids = torch.randint(1000, cfg.vocab_size - 1000, (1, T), generator=gen).to(llm.device)
        t0 = time.perf_counter()
        ref = tail_log_probs(llm, ids, chosen, tail, chunk)
        row = {"length": T, "default_backend": chosen}
        row["fp8"] = compare(ref, tail_log_probs(llm, ids, "fp8", tail, chunk))
        if T <= 32 * K:
            row[f"{other} (noise floor)"] = compare(ref, tail_log_probs(llm, ids, other, tail, chunk))
        row["seconds"] = time.perf_counter() - t0
        print("synthetic", json.dumps(row), flush=True)
        rows.append(row)
        save(rows)
        del ref
        torch.cuda.empty_cache()
    del llm
    torch.cuda.empty_cache()
    return rows


def needle_prompts(
    llm: LLM, length: int, depths: list[float], seed: int
) -> list[tuple[float, list[int], int]]:
    """(depth, token ids, where the answer's tokens start) for a haystack of about `length` tokens."""
    _, texts = load_split("heldout", max_chars=40 * length)
    lines = "\n".join(texts).splitlines(keepends=True)
    rng = random.Random(seed)
    word = "".join(rng.choice("bcdfghjkmnpqrstvwxz") for _ in range(4)) + str(rng.randint(10, 99))
    out = []
    for depth in depths:
        hay, n_tokens = [], 0
        for line in lines:  # lines up to about `length` tokens (4 characters a token is plenty)
            hay.append(line)
            n_tokens += max(1, len(line) // 3)
            if n_tokens >= length:
                break
        at = int(depth * len(hay))
        hay.insert(at, f'_NEEDLE = "{word}"\n')
        question = "".join(hay) + '\n\nassert _NEEDLE == "'
        asked, full = llm.tokenizer.encode(question), llm.tokenizer.encode(question + word + '"')
        start = next((i for i, (a, b) in enumerate(zip(asked, full, strict=False)) if a != b), len(asked))
        out.append((depth, full, start))  # the answer: full[start:] (the word, the closing quote)
    return out


@torch.inference_mode()
def answer_score(llm: LLM, ids: list[int], start: int, backend: str | None) -> dict:
    """Mean log-prob of the answer tokens ids[start:] and whether each is the argmax."""
    tokens = torch.tensor([ids], device=llm.device)
    cache = new_cache(llm, len(ids))
    hidden = llm.model.prefill(tokens, cache, 4096, backend, last_only=False)[0]  # [T, hidden]
    logp = llm.model.logits(hidden[start - 1 : -1]).log_softmax(-1)  # predicting ids[start:]
    target = tokens[0, start:]
    chosen = logp.gather(-1, target[:, None])[:, 0]
    return {"mean_logprob": chosen.mean().item(), "greedy_hit": bool((logp.argmax(-1) == target).all())}


def needle(lengths: list[int], depths: list[float], seeds: int) -> list[dict]:
    llm = LLM()  # the shipped model, on the GPU in bf16
    default = prefill.choose_backend(llm.device, llm.config.head_dim, llm.config.group_size, llm.dtype)
    applies = prefill.fp8_kernel_applies
    prefill.fp8_kernel_applies = lambda q, k: True  # every call through the kernel (see the docstring)
    rows = []
    try:
        for length in lengths:
            for seed in range(seeds):
                for depth, ids, start in needle_prompts(llm, length, depths, seed):
                    row = {"length": len(ids), "depth": depth, "seed": seed}
                    row["default"] = answer_score(llm, ids, start, default)
                    row["fp8"] = answer_score(llm, ids, start, "fp8")
                    rows.append(row)
                    print("needle", json.dumps(row), flush=True)
    finally:
        prefill.fp8_kernel_applies = applies
    return rows


def markdown(env: dict, synth: list[dict], needles: list[dict]) -> str:
    lines = [
        "# FP8 prefill attention: model-level accuracy against the default bf16 prefill",
        "",
        f"Device: {env['device']} · date {env['date']} · commit {env['commit']} · torch {env['torch']}",
        "",
        f"Command: `{env['command']}`",
        "",
        "## Synthetic Llama-3-8B (random weights): the last 256 positions' next-token distributions",
        "",
        "| prompt | FP8 vs default: KL mean | KL max | top-1 agreement | bf16 noise floor (other SDPA "
        "backend): KL mean | KL max | top-1 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in synth:
        f = r["fp8"]
        floor = next((v for k, v in r.items() if k.endswith("(noise floor)")), None)
        floor_cells = (
            f"{floor['kl_mean']:.2e} | {floor['kl_max']:.2e} | {floor['top1_agreement']:.3f}"
            if floor
            else "- | - | -"
        )
        lines.append(
            f"| {r['length'] // K}k | {f['kl_mean']:.2e} | {f['kl_max']:.2e} | {f['top1_agreement']:.3f} | "
            f"{floor_cells} |"
        )
    if needles:
        lines += [
            "",
            "## Needle in a haystack, shipped model (stdlib-tiny)",
            "",
            "Mean log-probability of the needle's tokens where the prompt asks for it (teacher-forced), "
            "and greedy hits (every token the argmax), default bf16 prefill vs FP8 prefill.",
            "",
            "| prompt tokens | depth | prompts | default: mean log-prob | greedy hits | FP8: mean log-prob | "
            "greedy hits | largest |log-prob change| |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        groups: dict = {}
        for r in needles:
            groups.setdefault((r["length"] // 256 * 256, r["depth"]), []).append(r)
        for (length, depth), rs in sorted(groups.items()):
            d = [r["default"]["mean_logprob"] for r in rs]
            f = [r["fp8"]["mean_logprob"] for r in rs]
            lines.append(
                f"| ~{length} | {depth:.0%} | {len(rs)} | {statistics.mean(d):.3f} | "
                f"{sum(r['default']['greedy_hit'] for r in rs)}/{len(rs)} | {statistics.mean(f):.3f} | "
                f"{sum(r['fp8']['greedy_hit'] for r in rs)}/{len(rs)} | "
                f"{max(abs(a - b) for a, b in zip(d, f, strict=True)):.3f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="*", default=[32 * K], help="synthetic 8B prompt lengths")
    ap.add_argument("--needle-lengths", type=int, nargs="*", default=[900, 3000])
    ap.add_argument("--depths", type=float, nargs="*", default=[0.1, 0.5, 0.9])
    ap.add_argument("--seeds", type=int, default=4, help="needle words per (length, depth)")
    ap.add_argument("--no-needle", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        commit = commit.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    env = {
        "device": torch.cuda.get_device_name(0),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "torch": torch.__version__,
        "command": "python3 -m bench.fp8_prefill_accuracy " + " ".join(sys.argv[1:]),
    }
    synth, needles = [], []

    def save(synth_so_far: list[dict] | None = None) -> str:  # after each part: a timeout keeps the rest
        done = synth if synth_so_far is None else synth_so_far
        text = markdown(env, done, needles)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            results = {"env": env, "synthetic": done, "needle": needles}
            args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
            args.out.with_suffix(".md").write_text(text)
        return text

    if not args.no_needle:  # first: quick, and on a trained model
        needles += needle(args.needle_lengths, args.depths, args.seeds)
        save()
    if args.lengths:
        synth += synthetic(args.lengths, save)
    print(save())


if __name__ == "__main__":
    main()

"""Decode speed on several GPUs (torchrun, NCCL): tensor parallel on a 70B, context parallel on an 8B.

    python bench/distributed.py --out bench/results/distributed

runs the three benchmarks below, each under torchrun with one process per GPU (tp 4, cp 2, cp 4;
about 6 minutes on 4 H200s), writing OUT-tp4.{md,json}, OUT-cp2.*, OUT-cp4.*; one of them alone:
`torchrun --nproc-per-node 4 bench/distributed.py --mode tp --out bench/results/distributed-tp4`.
- `--mode tp`: synthetic llama-3-70b, bf16, tp = the number of processes, decode at 1k, 128k and
  512k: tok/s, % of the per-GPU read roofline, and the all-reduce time per step (the 2 x layers
  all-reduces of a step, [1, hidden] bf16 each, replayed alone in a CUDA graph);
- `--mode cp`: synthetic llama-3-8b, FP8 cache, cp = the number of processes, decode at 2M and 4M
  (4M needs cp 4: at cp 2 a rank's 2M-position FP8 cache is 132 GiB): tok/s and the merge's share
  of the step (per layer: pack o and lse, all-gather B x Hq x (D + 1) float32, merge; alone in a graph).

FILLED CACHES, NOT GENERATIONS: no prefill runs (a 512k prefill of a 70B takes minutes); every
rank's cache is filled with random values up to the context and timed decode steps (CUDA graph
replays, greedy) start there, like bench/fp8_accuracy.py --fill. The roofline of a rank is its own
bytes per step (its weight shard: the embedding table counted as one row, the lm_head's vocabulary
rows in full; plus the KV rows it holds at that context) over the read ceiling measured on its GPU
(minidecode.bench.measure_ceilings); the table shows the slowest rank's figure. NVLink multicast
stays off (minidecode/distributed.py forces NCCL_NVLS_ENABLE=0 and the others in every process).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist

from minidecode import LLM
from minidecode.bench import measure_ceilings
from minidecode.cache import FP8
from minidecode.distributed import merge_partials
from minidecode.engine import capture, kv_dtype_name

MODES = {
    "tp": dict(model="synthetic:llama-3-70b", kv="auto", contexts=[1024, 131072, 524288]),
    "cp": dict(model="synthetic:llama-3-8b", kv="fp8", contexts=[2 * 2**20, 4 * 2**20]),
}
STEPS = 64
RUNS = [(4, "tp"), (2, "cp"), (4, "cp")]  # (processes, mode) of the one command


def launch_all(out: Path | None) -> None:
    """The one command: each run under torchrun, one after the other."""
    for processes, mode in RUNS:
        command = ["torchrun", "--nproc-per-node", str(processes), __file__, "--mode", mode]
        if out is not None:
            command += ["--out", f"{out}-{mode}{processes}"]
        print("$", " ".join(command), flush=True)
        subprocess.run(command, check=True)


def fill(llm: LLM, context: int) -> None:
    """The rank's cache, sized for `context` + the timed steps, filled with random values."""
    cache = llm.engine.ensure_cache(context + 2 * STEPS)
    for t in (cache.k, cache.v):
        for layer in t:  # a layer at a time: no cache-sized temporary
            if cache.dtype == FP8:
                layer.view(torch.uint8).random_(0, 0x7E)  # finite positive e4m3 values (0x7F is NaN)
            else:
                layer.normal_()
    if cache.dtype == FP8:
        cache.kv_scale.fill_(0.01)


@torch.inference_mode()
def decode_seconds(llm: LLM, context: int) -> float:
    """Seconds per decode step (graph replays) from position `context` of a filled cache."""
    engine = llm.engine
    fill(llm, context)
    engine.prepare_decode(llm.sampling_params(0, None, None, None), want_logprobs=False)
    engine.state.positions.fill_(context)
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / STEPS


def graph_seconds(fn, replays: int = 20) -> float:
    """Seconds per call of fn (collectives included) replayed in a CUDA graph."""
    graph = capture(fn, fn)
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / replays


def collective_seconds(llm: LLM) -> float:
    """One step's collectives alone: tp, the 2 x layers all-reduces of [1, hidden]; cp, per layer
    the pack, the all-gather of [1, Hq, D + 1] float32 and the merge."""
    cfg, par = llm.model.config, llm.parallel
    if par.tp > 1:
        x = torch.randn(1, cfg.hidden_size, dtype=llm.dtype, device=llm.device)

        def step() -> None:
            for _ in range(2 * cfg.num_layers):
                par.all_reduce_tp(x)
    else:
        o = torch.randn(1, cfg.num_heads, cfg.head_dim, dtype=llm.dtype, device=llm.device)
        lse = torch.randn(1, cfg.num_heads, device=llm.device)

        def step() -> None:
            for _ in range(cfg.num_layers):
                parts = par.all_gather_cp(torch.cat([o.float(), lse[..., None]], dim=-1))
                merge_partials(parts[..., :-1], parts[..., -1])

    return graph_seconds(step)


def rank_step_bytes(llm: LLM, context: int) -> int:
    """What this rank's decode step reads at `context`: its weights (one embedding row; a tied
    lm_head's vocabulary rows) and the KV rows it holds."""
    cfg, par, model = llm.config, llm.parallel, llm.model
    params = sum(p.numel() for p in model.parameters())
    table = cfg.vocab_size * cfg.hidden_size
    read = params - table + cfg.hidden_size
    if cfg.tie_word_embeddings:
        read += model.plan.vocab_rows * cfg.hidden_size
    span = llm.engine.cache.max_len - 1 if par.cp > 1 else context
    held = min(max(context - par.cp_rank * span, 0), span)
    return read * llm.dtype.itemsize + held * llm.engine.kv_bytes_per_token


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=MODES, help="one run (under torchrun); default: all runs")
    parser.add_argument("--contexts", type=int, nargs="*", help="override the mode's contexts")
    parser.add_argument("--out", type=Path, help="write OUT.md and OUT.json (rank 0)")
    args = parser.parse_args()
    if args.mode is None:
        return launch_all(args.out)
    mode = MODES[args.mode]
    world = int(os.environ["WORLD_SIZE"])
    split = {"tp": world} if args.mode == "tp" else {"cp": world}
    llm = LLM(mode["model"], device="cuda", dtype="bfloat16", kv_cache_dtype=mode["kv"], **split)
    par = llm.parallel
    ceiling = measure_ceilings(llm.device).read_bytes_per_s
    collectives = collective_seconds(llm)
    rows = []
    for context in args.contexts or mode["contexts"]:
        if args.mode == "cp" and context > world * 2**20:
            continue  # a rank's FP8 cache beyond 1M positions does not fit one H200 next to the weights
        seconds = decode_seconds(llm, context)
        roofline = ceiling / rank_step_bytes(llm, context)
        mine = [context, seconds, 1 / seconds / roofline, collectives / seconds]
        every = [None] * par.world_size
        dist.all_gather_object(every, mine)
        slowest = max(every, key=lambda r: r[1])
        lowest_share = min(r[2] for r in every)
        rows.append(dict(context=context, decode_tok_s=1 / slowest[1], roofline_pct=100 * lowest_share,
                         collective_us=1e6 * collectives, collective_share_pct=100 * slowest[3]))  # fmt: skip
        llm.engine.release()
        torch.cuda.empty_cache()
    if par.rank != 0:
        return
    what = "all-reduce" if args.mode == "tp" else "lse merge (all-gather + merge)"
    header = (
        f"{llm.name}, {args.mode} {world} on {world} x {torch.cuda.get_device_name()}, bf16, KV cache "
        f"{kv_dtype_name(llm.engine.kv_dtype)}, batch 1; FILLED caches (no prefill), {STEPS} steps; "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, commit {commit()}; "
        f"read ceiling {ceiling / 1e9:,.0f} GB/s per GPU"
    )
    table = [
        f"| context | decode tok/s | % of per-GPU read roofline (lowest rank) | {what} us/step | its share |",
        "| --- | --- | --- | --- | --- |",
    ] + [
        f"| {r['context']:,} | {r['decode_tok_s']:.1f} | {r['roofline_pct']:.0f}% | "
        f"{r['collective_us']:.0f} | {r['collective_share_pct']:.1f}% |"
        for r in rows
    ]
    text = header + "\n\n" + "\n".join(table)
    print(text)
    if args.out is not None:
        args.out.with_suffix(".md").write_text(f"# Several GPUs: {args.mode} {world}\n\n{text}\n")
        args.out.with_suffix(".json").write_text(json.dumps(dict(header=header, rows=rows), indent=2) + "\n")


if __name__ == "__main__":
    main()

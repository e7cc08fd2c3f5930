"""Decode on several GPUs against one GPU, measured in one run: tensor and context parallel, with
the decode step's small collectives as one-shot kernels over symmetric memory and through NCCL.

    python bench/distributed.py --out bench/results/distributed     # ~5 minutes on 2 x H100

counts the GPUs (2 or 4) and their memory, runs the parts below one after the other, each in its
own process(es) under its own time limit (a part that fails or runs out of time is reported and
the others go on), and writes OUT-{N}gpu-{card}.md and .json: device, count, date, commit, and
every parallel figure next to the one-GPU baseline measured in the same run.
- one GPU (a plain process), the baseline: synthetic Llama-3-8B, bf16 cache at 1k, 128k and 512k,
  FP8 cache at 32k, 128k, 512k and 1M (a context that does not fit one GPU is reported as such);
- tp N (torchrun, N = every GPU): the 8B with the bf16 cache at 1k, 128k and 512k; on 4 GPUs of
  80 GB or more also Llama-3-70B at 1k and 128k (it fits no single GPU: per-GPU roofline only);
- cp N: the 8B with the FP8 cache at 32k, 128k, 512k and 1M (and 2M on 4 GPUs).
Each parallel context is timed twice in the same processes, the collectives as one-shot kernels
(minidecode/distributed.py's OneShot; at tp 2 with the residual folded into rank 0's part) and
all through NCCL (Parallel.use_one_shot = False), the decode graph captured afresh for each.

FILLED CACHES, NOT GENERATIONS: no prefill runs; every rank's cache is filled with random values
up to the context, then CUDA-graph decode steps (greedy) run from there: 8 warm-up steps, then
WINDOWS windows of STEPS steps, each window timed with CUDA events on every rank; a window's step
time is the slowest rank's. Figures: median (min-max) tok/s over the windows. Roofline: a rank's
bytes per step (its weights, the embedding table counted as one row; the KV rows it holds at that
context) over the read ceiling measured on its GPU in the same part (minidecode.benchmarks.e2e's
measure_ceilings); the lowest rank's share is shown. The collectives alone: one step's worth
(tp: 2 x layers all-reduces of [1, hidden], as the one-shot kernel, where the step's one-shot
variant sums them in the projections' GEMV launches, and the logits' all-gather; cp: per layer, the pack,
the all-gather of [1, heads, head_dim + 1] float32 and the merge) replayed in a CUDA graph, with
their share of the step. NVLink multicast stays off (minidecode/distributed.py forces
NCCL_NVLS_ENABLE=0 and the others in every process).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from timing import fill_cache, start_filled  # bench/timing.py (a script: bench/ is on the import path)

from minidecode import LLM
from minidecode.benchmarks.e2e import measure_ceilings, provenance
from minidecode.cache import kv_dtype_name
from minidecode.plan import DecodeKind
from minidecode.sampling import GREEDY

EIGHT_B, SEVENTY_B = "synthetic:llama-3-8b", "synthetic:llama-3-70b"
K, M = 1024, 1024 * 1024
WARMUP, WINDOWS, STEPS = 8, 5, 32
MARGIN = 256  # cache positions beyond the context: the warm-up and timed steps write there
REPLAYS = 10  # of the collectives' graph


@dataclass
class Part:
    """One process (one GPU) or one torchrun launch (tp or cp over every GPU)."""

    mode: str  # "one", "tp" or "cp"
    processes: int
    model: str
    contexts: dict[str, list[int]]  # KV cache dtype ("auto" or "fp8") -> contexts, in that order
    timeout: int = 150  # seconds, startup and Triton compilation included

    @property
    def name(self) -> str:
        return "one GPU" if self.mode == "one" else f"{self.mode} {self.processes}"


def parts_for(gpus: int, gib_per_gpu: float) -> list[Part]:
    """What fits this machine: the 70B only on 4 GPUs of 80 GB or more (35 GB of weights a rank)."""
    parts = [
        Part(
            "one",
            1,
            EIGHT_B,
            {"auto": [K, 128 * K, 512 * K], "fp8": [32 * K, 128 * K, 512 * K, M]},
            timeout=180,
        ),
        Part("tp", gpus, EIGHT_B, {"auto": [K, 128 * K, 512 * K]}),
        Part("cp", gpus, EIGHT_B, {"fp8": [32 * K, 128 * K, 512 * K, M] + ([2 * M] if gpus >= 4 else [])}),
    ]
    if gpus >= 4 and gib_per_gpu >= 75:
        parts.append(Part("tp", gpus, SEVENTY_B, {"auto": [K, 128 * K]}, timeout=200))
    return parts


# ---- the launcher ----------------------------------------------------------------------------------


class Stopped(Exception):
    """SIGTERM (an outer time limit): the running part is ended and the report written."""


def stop(signum: int, frame: object) -> None:
    raise Stopped()


def launch(out: Path | None, budget: float) -> None:
    gpus = torch.cuda.device_count()  # no CUDA context here: the parts need every GPU's memory
    if gpus < 2:
        sys.exit(f"bench/distributed.py needs 2 or more GPUs; this machine has {gpus}")
    gpus = 4 if gpus >= 4 else 2
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    signal.signal(signal.SIGTERM, stop)
    results, failures = [], []
    started = time.monotonic()
    for part in parts_for(gpus, gib):
        left = budget - (time.monotonic() - started)
        if left < 30:
            failures.append(f"{part.name} ({part.model}): not run, the {budget:.0f} s budget is spent")
            continue
        try:
            result, problem = run_part(part, min(part.timeout, left))
        except Stopped:
            failures.append(f"{part.name} ({part.model}): stopped by SIGTERM")
            break
        if result is not None:
            results.append(result)
        if problem is not None:
            failures.append(f"{part.name} ({part.model}): {problem}")
            print(f"!! {failures[-1]}", flush=True)
    report = compose(results, failures, gpus, time.monotonic() - started)
    print(report)
    if out is not None:
        card = torch.cuda.get_device_name(0).removeprefix("NVIDIA ").split()[0].lower()  # "h100", "h200"
        stem = out.with_name(f"{out.name}-{gpus}gpu-{card}")
        stem.with_suffix(".md").write_text(report + "\n")
        document = dict(results=results, failures=failures, commit=commit())
        stem.with_suffix(".json").write_text(json.dumps(document, indent=1) + "\n")
        print(f"wrote {stem}.md and .json")
    if failures:
        sys.exit(1)


def run_part(part: Part, timeout: float) -> tuple[dict | None, str | None]:
    """Run one part within `timeout` seconds; -> (its rank 0's result, complete or as far as it
    got, or None; the problem or None)."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        args = [__file__, "--part", part.mode, "--model", part.model, "--result", str(result_path)]
        for kv, contexts in part.contexts.items():
            args += ["--kv", f"{kv}={','.join(map(str, contexts))}"]
        if part.mode == "one":
            command = [sys.executable, *args]
        else:
            torchrun = [sys.executable, "-m", "torch.distributed.run"]  # torchrun, whatever the PATH
            command = [*torchrun, "--standalone", "--nproc-per-node", str(part.processes), *args]
        print("$", " ".join(command), flush=True)
        # a session of its own: on timeout the launcher, its ranks and their children all end
        process = subprocess.Popen(command, start_new_session=True)
        code = None
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if code is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        result = json.loads(result_path.read_text()) if result_path.exists() else None
    if code is None:
        return result, f"did not finish within {timeout:.0f} s"
    return result, None if code == 0 and result is not None else f"exit code {code}"


# ---- one part, on every rank ---------------------------------------------------------------------


@dataclass
class Row:
    context: int
    variant: str  # "one GPU", "nccl" or "one-shot"
    fits: bool = True
    tok_s: list[float] = field(default_factory=list)  # per window
    roofline_pct: float = 0.0  # of the per-GPU read roofline, lowest rank


def part_main(args: argparse.Namespace) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    split = {"tp": world} if args.part == "tp" else {"cp": world} if args.part == "cp" else {}
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    rank0 = int(os.environ.get("RANK", "0")) == 0
    torch.cuda.set_device(device)
    ceiling = measure_ceilings(device).read_bytes_per_s  # before the weights take the memory
    torch.cuda.empty_cache()
    result = dict(
        mode=args.part, world=world, model=args.model, device=torch.cuda.get_device_name(device),
        torch=torch.__version__, commit=commit(), ceiling_gb_s=ceiling / 1e9, caches=[],
    )  # fmt: skip
    for kv, contexts in args.kv:
        llm = LLM(args.model, device="cuda", dtype="bfloat16", kv_cache_dtype=kv, **split)
        par = llm.parallel
        if par is not None:
            result["one_shot_problem"] = par.one_shot_problem
            result["ceiling_gb_s"] = min(every_rank(llm, ceiling)) / 1e9  # the slowest GPU's
        engine = llm.engine
        fits = [engine.planner.plan(engine.region_size(c + MARGIN), 1).fits for c in contexts]
        fitting = [c for c, ok in zip(contexts, fits, strict=True) if all(every_rank(llm, ok))]
        rows = [
            Row(c, "nccl" if par is not None else "one GPU", fits=False) for c in contexts if c not in fitting
        ]
        entry = dict(kv=kv_dtype_name(llm.engine.kv_dtype), rows=[])
        result["caches"].append(entry)
        # every context with NCCL first: should the one-shot kernels hang, the part's time limit
        # ends it with the NCCL figures saved
        for variant in ["nccl", "one-shot"] if par is not None else ["one GPU"]:
            if par is not None:
                par.use_one_shot = variant == "one-shot"  # each graph below is captured afresh
            for context in fitting:
                seconds = window_seconds(llm, context)
                # this rank's bytes per step at the median step time, over its GPU's read ceiling
                fraction = rank_step_bytes(llm, context) / statistics.median(seconds) / ceiling
                rows.append(Row(context, variant, tok_s=[1 / s for s in seconds]))
                rows[-1].roofline_pct = 100 * min(every_rank(llm, fraction))
                llm.engine.release()  # (every rank's, directly: this script drives the engines in step)
                entry["rows"] = [r.__dict__ for r in sorted(rows, key=lambda r: r.context)]
                if rank0:
                    args.result.write_text(json.dumps(result))
                    print(f"{args.model} {kv} {context:,} {variant}: {median(rows[-1].__dict__):.1f} tok/s")
            if par is not None:
                entry.setdefault("collectives_us", {})[variant] = collectives_us(llm, variant == "one-shot")
        entry["rows"] = [r.__dict__ for r in sorted(rows, key=lambda r: r.context)]
        del llm, par
        gc.collect()
        torch.cuda.empty_cache()
    if rank0:
        args.result.write_text(json.dumps(result))


def every_rank(llm: LLM, value):
    """[value of every rank] (one process: [value])."""
    if llm.parallel is None:
        return [value]
    every = [None] * llm.parallel.world_size
    dist.all_gather_object(every, value)
    return every


def fill(llm: LLM, context: int) -> None:
    """The rank's cache, sized for `context` + MARGIN, filled with random values."""
    fill_cache(start_filled(llm.engine, context, MARGIN))  # row 0 decodes from `context`, no prefill


@torch.inference_mode()
def window_seconds(llm: LLM, context: int) -> list[float]:
    """Seconds per decode step (graph replays) from position `context` of a filled cache, per
    window: the slowest rank's."""
    engine = llm.engine
    fill(llm, context)
    for _ in range(WARMUP):  # the first captures the step's graph
        engine.step(1, DecodeKind(GREEDY))
    torch.cuda.synchronize()
    if llm.parallel is not None:
        dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    mine = []
    for _ in range(WINDOWS):
        start.record()
        for _ in range(STEPS):
            engine.step(1, DecodeKind(GREEDY))
        end.record()
        end.synchronize()
        mine.append(start.elapsed_time(end) / 1e3 / STEPS)
    return [max(window) for window in zip(*every_rank(llm, mine), strict=True)]


def rank_step_bytes(llm: LLM, context: int) -> int:
    """What this rank's decode step reads at `context`: its weights (one embedding row; a tied
    lm_head's vocabulary rows) and the KV rows it holds."""
    cfg, par, model = llm.config, llm.parallel, llm.model
    params = sum(p.numel() for p in model.parameters())
    read = params - cfg.vocab_size * cfg.hidden_size + cfg.hidden_size
    if cfg.tie_word_embeddings:
        read += (model.plan.vocab_rows if par is not None else cfg.vocab_size) * cfg.hidden_size
    held = model.held_positions(context + 1)  # the positions 0..context it holds (models/sharding.py)
    return read * llm.dtype.itemsize + held * llm.engine.planner.kv_bytes_per_token


@torch.inference_mode()
def collectives_us(llm: LLM, one_shot: bool) -> list[float]:
    """One decode step's collectives alone, replayed in a CUDA graph: us per replay (slowest
    rank), REPLAYS of them. tp: the 2 x layers all-reduces of [1, hidden] (each on its own row of
    a buffer refilled before every replay: a sum in place grows) and the logits' all-gather; cp:
    per layer, the merge of [1, heads, head_dim] partials (pack, all-gather, merge)."""
    par, cfg, dtype, device = llm.parallel, llm.model.config, llm.dtype, llm.device
    par.use_one_shot = one_shot
    if par.tp > 1:
        sums = torch.empty(2 * cfg.num_layers, 1, cfg.hidden_size, dtype=dtype, device=device)
        logits = torch.randn(1, llm.model.plan.vocab_rows, dtype=dtype, device=device)

        def step() -> None:
            for row in sums:
                par.all_reduce_tp(row)
            par.all_gather_tp(logits)

        def refill() -> None:
            sums.normal_()
    else:
        attend = llm.model.model.layers[0].self_attn.attend
        o = torch.randn(1, cfg.num_heads, cfg.head_dim, dtype=dtype, device=device)
        lse = torch.randn(1, cfg.num_heads, device=device)
        lengths = torch.ones(1, dtype=torch.int32, device=device)

        def step() -> None:
            for _ in range(cfg.num_layers):
                attend.merge(o, lse, lengths, dtype, pdl=True)  # as the decode step does

        def refill() -> None:
            pass

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: communicators, staging buffers
        refill()
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    mine = []
    for _ in range(REPLAYS):
        refill()
        torch.cuda.synchronize()
        dist.barrier()  # the ranks start each replay together: their skew is not the collectives'
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        mine.append(start.elapsed_time(end) * 1e3)
    del graph
    return [max(replay) for replay in zip(*every_rank(llm, mine), strict=True)]


# ---- the report ------------------------------------------------------------------------------------


def compose(results: list[dict], failures: list[str], gpus: int, seconds: float) -> str:
    first = results[0] if results else {}
    lines = [
        f"# Several GPUs: {gpus} x {first.get('device', '?')}",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, commit {commit()}, "
        f"torch {first.get('torch', '?')}; `python bench/distributed.py` ({seconds / 60:.1f} min). "
        "Synthetic models (random weights), bf16 weights, batch 1; decode on FILLED caches (no "
        f"prefill): {WINDOWS} windows of {STEPS} CUDA-graph steps after {WARMUP} warm-up steps, "
        "each window's step time the slowest rank's; median (min-max) tok/s over the windows. "
        "Read ceiling per GPU (the slowest, this run): "
        + ", ".join(f"{part_name(r)}: {r['ceiling_gb_s']:,.0f} GB/s" for r in results)
        + ". NVLink multicast off.",
    ]
    baseline = {  # the one-GPU rows, by model (a model no GPU holds alone, the 70B, has none)
        (r["model"], c["kv"], row["context"]): row
        for r in results
        if r["mode"] == "one"
        for c in r["caches"]
        for row in c["rows"]
    }
    for result in (r for r in results if r["mode"] != "one"):
        lines += ["", *parallel_section(result, baseline)]
    lines += ["", *summary(results, baseline)]
    if failures:
        lines += ["", "Parts that failed: " + "; ".join(failures)]
    return "\n".join(lines)


def parallel_section(result: dict, baseline: dict) -> list[str]:
    """A parallel part's table, against the one-GPU rows of the same cache dtype, and its
    collectives' time alone with their share of the step."""
    name = part_name(result)
    what = (
        "the 2 x layers all-reduces as the one-shot kernel, which the step runs in the GEMVs' own "
        "launches, and the logits' all-gather"
        if result["mode"] == "tp"
        else "per layer: pack, all-gather, merge"
    )
    lines = []
    for cache in result["caches"]:
        kv, rows = cache["kv"], {(r["context"], r["variant"]): r for r in cache["rows"]}
        contexts = list(dict.fromkeys(r["context"] for r in cache["rows"]))
        lines += [
            f"## {name}: {result['model']}, KV cache {kv}",
            "",
            f"| context | one GPU | {name}, NCCL | x one GPU | {name}, one-shot | x one GPU "
            "| one-shot / NCCL | % of per-GPU read roofline (one-shot, lowest rank) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for context in contexts:
            one = baseline.get((result["model"], kv, context))
            nccl, shot = rows.get((context, "nccl")), rows.get((context, "one-shot"))
            if nccl is None or not nccl["fits"]:
                lines.append(f"| {context:,} | {tok_s(one)} | does not fit | - | - | - | - | - |")
                continue
            lines.append(
                f"| {context:,} | {tok_s(one)} | {tok_s(nccl)} | {ratio(nccl, one)} | {tok_s(shot)} | "
                f"{ratio(shot, one)} | {ratio(shot, nccl)} | {shot['roofline_pct']:.0f}% |"
            )
        lines += ["", f"The collectives alone ({what}), one step's worth replayed in a CUDA graph:"]
        for variant, times in cache.get("collectives_us", {}).items():
            step_share = {c: statistics.median(times) * median(rows[c, variant]) / 1e4 for c in contexts
                          if (c, variant) in rows and rows[c, variant]["fits"]}  # fmt: skip
            shares = [f"{share:.1f}% of the step at {short(c)}" for c, share in step_share.items()]
            lines.append(f"- {variant}: {spread(times, ',.0f')} us a step; " + ", ".join(shares))
        if result.get("one_shot_problem"):
            lines.append(
                f"- one-shot kernels unavailable ({result['one_shot_problem']}): both variants ran NCCL"
            )
        lines.append("")
    return lines


def summary(results: list[dict], baseline: dict) -> list[str]:
    """Sentences for the README and `info`, from this run's figures (each context's faster variant)."""
    lines = ["## In short", ""]
    for result in (r for r in results if r["mode"] != "one"):
        name = part_name(result)
        for cache in result["caches"]:
            best: dict[int, dict] = {}
            for row in cache["rows"]:
                if row["fits"] and (row["context"] not in best or median(row) > median(best[row["context"]])):
                    best[row["context"]] = row
            said, faster, slower = [], [], []
            for context, row in best.items():
                one = baseline.get((result["model"], cache["kv"], context))
                if one is None or not one["fits"]:
                    said.append(f"{short(context)} {median(row):.1f} tok/s (beyond one GPU)")
                    continue
                said.append(
                    f"{short(context)} {median(row):.1f} tok/s ({ratio(row, one)} one GPU, {row['variant']})"
                )
                (faster if median(row) > median(one) else slower).append(context)
            verdict = ""
            if result["mode"] == "cp" and faster:
                verdict = f" It beats one GPU from {short(min(faster))} on."
            elif result["mode"] == "cp" and slower:
                verdict = (
                    f" Slower than one GPU up to {short(max(slower))}: it pays by holding longer contexts."
                )
            model = result["model"].removeprefix("synthetic:")
            lines.append(f"- {name}, {model}, {cache['kv']} cache: " + "; ".join(said) + "." + verdict)
    return lines


def part_name(result: dict) -> str:
    return "one GPU" if result["mode"] == "one" else f"{result['mode']} {result['world']}"


def median(row: dict) -> float:
    return statistics.median(row["tok_s"])


def tok_s(row: dict | None) -> str:
    if row is None:
        return "-"
    return spread(row["tok_s"], ".1f") if row["fits"] else "does not fit"


def spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def ratio(row: dict | None, peer: dict | None) -> str:
    if row is None or peer is None or not row["fits"] or not peer["fits"]:
        return "-"
    return f"{median(row) / median(peer):.2f}x"


def short(context: int) -> str:
    if context % M == 0:
        return f"{context // M}M"
    return f"{context // K}k" if context % K == 0 else f"{context:,}"


def commit() -> str:
    return provenance()["commit"] or "none"  # minidecode's own commit


def kv_contexts(text: str) -> tuple[str, list[int]]:
    kv, _, contexts = text.partition("=")
    return kv, [int(c) for c in contexts.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write OUT-{N}gpu-{card}.md and .json")
    parser.add_argument("--budget", type=float, default=420, help="seconds for all parts (default 420)")
    parser.add_argument("--part", choices=["one", "tp", "cp"], help=argparse.SUPPRESS)  # the launcher's
    parser.add_argument("--model", default=EIGHT_B, help=argparse.SUPPRESS)
    parser.add_argument("--kv", type=kv_contexts, action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part is None:
        launch(args.out, args.budget)
    else:
        part_main(args)


if __name__ == "__main__":
    main()

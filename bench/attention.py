"""Decode-attention benchmark: lean attention against PyTorch's SDPA flash and cuDNN paths and
flex_attention, all timed under CUDA graphs in the same run.

One decode step of attention per call: one new query per sequence over its cached context,
K/V in the runtime's `[B, Hkv, S, D]` layout. Bytes = K + V read once. Each path is checked
against an fp32 reference (and lean against flash) before it is timed; small cases rotate over
several input sets so that repeated calls do not measure the L2 cache.

    python bench/attention.py                 # all cases, writes bench/results/attention.{md,json,png}
    python bench/attention.py --quick         # a few batch-1 lengths, prints only
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from minidecode.kernels.lean_attention import DEFAULT_CONFIGS, LeanConfig, lean_attention, lean_schedule
from minidecode.kernels.reference import decode_attention_reference

CEILING_GBS = 4400.0  # practical K/V read ceiling of the H200 (shared/docs/baselines.md)
HEAD_DIM = 128
DTYPE = torch.bfloat16
ROTATE_BYTES = 256 << 20  # rotate input sets until ~4x the 60 MB L2 is touched per round
RESULTS = Path(__file__).resolve().parent / "results"
K = 1024


@dataclass(frozen=True)
class Case:
    name: str
    hq: int
    hkv: int
    lengths: tuple[int, ...]

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def kv_bytes(self) -> int:
        return 2 * sum(self.lengths) * self.hkv * HEAD_DIM * DTYPE.itemsize

    @property
    def uniform(self) -> bool:
        return len(set(self.lengths)) == 1


def _ragged_lengths() -> tuple[int, ...]:
    # 8 sequences between 1k and 256k, log-spaced, fixed so every run measures the same case
    return tuple(int(round(K * 256 ** (i / 7))) for i in range(8))


CASES = [
    *[Case(f"B1 32/8 {n}k", 32, 8, (n * K,)) for n in (1, 4, 16, 64, 128, 256, 512, 1024)],
    Case("B1 64/8 8k", 64, 8, (8 * K,)),
    Case("B1 64/8 512k", 64, 8, (512 * K,)),
    Case("B1 32/32 64k", 32, 32, (64 * K,)),
    Case("B1 32/32 256k", 32, 32, (256 * K,)),
    Case("B4 32/8 128k", 32, 8, (128 * K,) * 4),
    Case("B16 32/8 32k", 32, 8, (32 * K,) * 16),
    Case("B8 32/8 ragged 1k-256k", 32, 8, _ragged_lengths()),
]
BATCH1_GQA = [c.name for c in CASES[:8]]


# ---- timing ---------------------------------------------------------------------------------


def time_graph(calls: list[Callable[[], object]], target_us: float = 3000.0, replays: int = 15) -> float:
    """Median microseconds per call: `calls` (one per input set) cycled inside one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: compilation, workspaces, plans
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for fn in calls[:4]:
        fn()
    end.record()
    end.synchronize()
    estimate_us = start.elapsed_time(end) * 1e3 / min(4, len(calls))
    n_calls = max(len(calls), min(1000, math.ceil(target_us / max(estimate_us, 1.0))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n_calls):
            calls[i % len(calls)]()
    graph.replay()
    graph.replay()
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n_calls)
    del graph
    return statistics.median(times)


# ---- inputs and paths -----------------------------------------------------------------------


@dataclass
class InputSet:
    q: torch.Tensor  # [B, Hq, D]
    k: torch.Tensor  # [B, Hkv, S, D], S = max(lengths)
    v: torch.Tensor
    lengths: torch.Tensor  # [B] int32
    out: torch.Tensor  # [B, Hq, D] lean's output buffer


def make_sets(case: Case, gen: torch.Generator) -> list[InputSet]:
    n_sets = max(1, min(64, ROTATE_BYTES // case.kv_bytes))
    s = max(case.lengths)
    sets = []
    for _ in range(n_sets):
        q = torch.randn(case.batch, case.hq, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE)
        k = torch.randn(case.batch, case.hkv, s, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE)
        v = torch.randn(case.batch, case.hkv, s, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE)
        lengths = torch.tensor(case.lengths, dtype=torch.int32, device="cuda")
        sets.append(InputSet(q, k, v, lengths, torch.empty_like(q)))
    return sets


def lean_call(x: InputSet, scale: float, config: LeanConfig | None = None) -> Callable[[], torch.Tensor]:
    return lambda: lean_attention(x.q, x.k, x.v, x.lengths, scale, config=config, out=x.out)


def sdpa_call(case: Case, x: InputSet, scale: float, backend: SDPBackend) -> Callable[[], torch.Tensor]:
    """SDPA with the GQA group packed into the query axis: [B, Hkv, G, D] against [B, Hkv, L, D]."""
    g = case.hq // case.hkv
    if case.uniform:
        qg = x.q.view(case.batch, case.hkv, g, HEAD_DIM)

        def call() -> torch.Tensor:
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qg, x.k, x.v, scale=scale).view(x.q.shape)

        return call

    # Ragged: one call per sequence (their loop is captured in the same graph).
    views = [
        (x.q[b].view(1, case.hkv, g, HEAD_DIM), x.k[b : b + 1, :, :n], x.v[b : b + 1, :, :n])
        for b, n in enumerate(case.lengths)
    ]

    def call_each() -> torch.Tensor:
        with sdpa_kernel([backend]):
            outs = [F.scaled_dot_product_attention(q, k, v, scale=scale) for q, k, v in views]
        return torch.cat([o.view(1, case.hq, HEAD_DIM) for o in outs])

    return call_each


def varlen_flash_call(case: Case, x: InputSet) -> Callable[[], torch.Tensor]:
    """Ragged batch through flash's varlen entry, one launch: the group packed into the query axis
    (G query tokens per sequence), K/V repacked at setup into the [total, Hkv, D] layout it wants."""
    from torch.nn.attention.varlen import varlen_attn

    g, b = case.hq // case.hkv, case.batch
    q = x.q.view(b, case.hkv, g, HEAD_DIM).transpose(1, 2).reshape(b * g, case.hkv, HEAD_DIM)
    k = torch.cat([x.k[i, :, :n].transpose(0, 1) for i, n in enumerate(case.lengths)]).contiguous()
    v = torch.cat([x.v[i, :, :n].transpose(0, 1) for i, n in enumerate(case.lengths)]).contiguous()
    cu_q = torch.arange(0, b + 1, device="cuda", dtype=torch.int32) * g
    cu_k = torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    max_k = max(case.lengths)

    def call() -> torch.Tensor:
        o = varlen_attn(q, k, v, cu_q, cu_k, g, max_k)  # [B * G, Hkv, D]; default scale = D^-0.5
        return o.view(b, g, case.hkv, HEAD_DIM).transpose(1, 2).reshape(b, case.hq, HEAD_DIM)

    return call


_FLEX = None


def flex_call(case: Case, x: InputSet, scale: float) -> Callable[[], torch.Tensor]:
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=False)
    q4 = x.q.unsqueeze(2)  # [B, Hq, 1, D]
    return lambda: _FLEX(q4, x.k, x.v, scale=scale, enable_gqa=True).view(x.q.shape)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


# ---- one case -------------------------------------------------------------------------------


def bench_case(case: Case, args: argparse.Namespace, flex_state: dict) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(case.name.encode()))
    sets = make_sets(case, gen)
    scale = HEAD_DIM**-0.5
    config = args.config
    sched = lean_schedule(case.lengths, case.hkv, HEAD_DIM, config=config)
    row: dict = {
        "case": case.name,
        "batch": case.batch,
        "hq": case.hq,
        "hkv": case.hkv,
        "lengths": list(case.lengths),
        "kv_bytes": case.kv_bytes,
        "input_sets": len(sets),
        "schedule": {
            "grid": sched.grid,
            "block_n": sched.block_n,
            "total_tiles": sched.total_tiles,
            "tiles_per_cta": sched.tiles_per_cta,
            "max_splits_per_head": sched.max_splits_per_head,
        },
        "paths": {},
    }

    paths: dict[str, Callable[[InputSet], Callable[[], torch.Tensor]]] = {
        "lean": lambda x: lean_call(x, scale, config),
    }
    notes = {}
    if case.uniform:
        paths["flash"] = lambda x: sdpa_call(case, x, scale, SDPBackend.FLASH_ATTENTION)
    else:
        # Ragged: flash as one call per sequence, and through its varlen entry (one launch);
        # lean is compared with the faster of the two.
        paths["flash"] = lambda x: sdpa_call(case, x, scale, SDPBackend.FLASH_ATTENTION)
        paths["flash_varlen"] = lambda x: varlen_flash_call(case, x)
        notes["flash"] = "one call per sequence"
        notes["flash_varlen"] = "varlen entry, one launch"
    paths["cudnn"] = lambda x: sdpa_call(case, x, scale, SDPBackend.CUDNN_ATTENTION)
    if not case.uniform:
        notes["cudnn"] = "one call per sequence"
    flex_ok = (
        not args.no_flex
        and case.uniform
        and case.batch == 1
        and max(case.lengths) <= args.flex_max_len
        and flex_state["compile_s"] < args.flex_budget_s
    )
    if flex_ok:
        paths["flex"] = lambda x: flex_call(case, x, scale)

    # Build every path and check it on input set 0 against an fp32 reference before timing it.
    x0 = sets[0]
    ref = decode_attention_reference(x0.q, x0.k, x0.v, x0.lengths, scale).float()
    outs = {}
    for name in ["lean", "flash", "flash_varlen", "cudnn", "flex"]:
        if name not in paths:
            continue
        try:
            t0 = time.perf_counter()
            calls = [paths[name](x) for x in sets]
            outs[name] = calls[0]()
            torch.cuda.synchronize()
            if name == "flex":
                flex_state["compile_s"] += time.perf_counter() - t0
        except Exception as e:  # a peer path that does not run here is reported, not fatal
            if name == "lean":
                raise
            row["paths"][name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
            continue
        entry = {"rel_err": rel_err(outs[name], ref)}
        if name == "lean" and not entry["rel_err"] < args.max_err:
            raise SystemExit(
                f"{case.name}: lean differs from the reference, relative error {entry['rel_err']:.2e}"
            )
        if name == "flash":
            row["paths"]["lean"]["rel_err_vs_flash"] = rel_err(outs["lean"], outs["flash"])
        try:
            us = time_graph(calls)
            entry.update(us=us, gbs=case.kv_bytes / us / 1e3)
            entry["pct_ceiling"] = 100 * entry["gbs"] / CEILING_GBS
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        if name in notes:
            entry["note"] = notes[name]
        row["paths"][name] = entry
    if "us" in row["paths"].get("lean", {}):  # time lean twice: the spread is the noise floor
        row["paths"]["lean"]["us_repeat"] = time_graph([lean_call(x, scale, config) for x in sets])
    flash_times = [row["paths"].get(n, {}).get("us") for n in ("flash", "flash_varlen")]
    flash_us = min((t for t in flash_times if t), default=None)
    row["flash_us"] = flash_us
    for entry in row["paths"].values():
        if flash_us and "us" in entry:
            entry["speedup_vs_flash"] = flash_us / entry["us"]
    del sets
    torch.cuda.empty_cache()
    return row


# ---- reports --------------------------------------------------------------------------------


def environment(commit: str | None) -> dict:
    props = torch.cuda.get_device_properties(0)
    if commit is None:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return {
        "device": torch.cuda.get_device_name(0),
        "sms": props.multi_processor_count,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(DTYPE).removeprefix("torch."),
        "head_dim": HEAD_DIM,
    }


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summary(rows: list[dict]) -> dict:
    def speedups(path: str, names: list[str] | None = None) -> list[float]:
        return [
            r["paths"][path]["speedup_vs_flash"]
            for r in rows
            if (names is None or r["case"] in names) and "speedup_vs_flash" in r["paths"].get(path, {})
        ]

    lean_gbs_long = [
        r["paths"]["lean"]["gbs"]
        for r in rows
        if r["case"] in BATCH1_GQA and r["lengths"][0] >= 256 * K and "gbs" in r["paths"]["lean"]
    ]
    at_512k = [r for r in rows if r["case"] == "B1 32/8 512k"]
    vs_slow = {}
    for r in at_512k:
        for peer in ("cudnn", "flex"):
            if "us" in r["paths"].get(peer, {}):
                vs_slow[peer] = r["paths"][peer]["us"] / r["paths"]["lean"]["us"]
    return {
        "geomean_speedup_batch1": geomean(speedups("lean", BATCH1_GQA)),
        "min_speedup_any_case": min(speedups("lean"), default=float("nan")),
        "min_lean_gbs_256k_up": min(lean_gbs_long, default=float("nan")),
        "lean_speedup_at_512k_over": vs_slow,
    }


def fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def markdown(env: dict, rows: list[dict], summ: dict) -> str:
    lines = [
        "# Decode attention: lean vs PyTorch peers",
        "",
        f"Device: {env['device']} ({env['sms']} SMs) · date {env['date']} · commit {env['commit']} · "
        f"torch {env['torch']} · triton {env['triton']} · {env['dtype']}, head_dim {env['head_dim']} · "
        f"lean config {env['lean_config']}",
        "",
        "Each path timed under a CUDA graph (many calls per replay, median of 15 replays), fresh random "
        "inputs, rotated over several input sets when they would fit in L2. GB/s counts K + V read once; "
        f"% of {CEILING_GBS / 1000:.1f} TB/s. Flash and cuDNN get the GQA group packed into the query axis. "
        "lean (repeat) is a second timing of lean in the same run: its spread is the noise floor.",
        "",
        "| case | lean us | lean GB/s | % of 4.4 TB/s | flash us | lean vs flash | cuDNN us | flex us "
        "| lean (repeat) us | grid | tiles/CTA | max splits/head |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        p, s = r["paths"], r["schedule"]
        lean = p.get("lean", {})
        lines.append(
            f"| {r['case']} | {fmt(lean.get('us'), '.1f')} | {fmt(lean.get('gbs'), '.0f')} "
            f"| {fmt(lean.get('pct_ceiling'), '.0f')}% | {fmt(r.get('flash_us'), '.1f')} "
            f"| {fmt(lean.get('speedup_vs_flash'), '.2f')}x | {fmt(p.get('cudnn', {}).get('us'), '.1f')} "
            f"| {fmt(p.get('flex', {}).get('us'), '.1f')} | {fmt(lean.get('us_repeat'), '.1f')} "
            f"| {s['grid']} | {s['tiles_per_cta']} | {s['max_splits_per_head']} |"
        )
    lines += [
        "",
        f"- Geometric-mean speedup over SDPA flash, batch-1 32/8 at 1k-1M: "
        f"**{summ['geomean_speedup_batch1']:.2f}x**",
        f"- Slowest case relative to flash: {summ['min_speedup_any_case']:.2f}x",
        f"- Lowest lean bandwidth at 256k and above (batch 1, 32/8): {summ['min_lean_gbs_256k_up']:.0f} GB/s",
        "- Lean speedup at 512k over "
        + ", ".join(f"{k}: {v:.1f}x" for k, v in summ["lean_speedup_at_512k_over"].items()),
    ]
    notes = sorted({f"{n}: {e['note']}" for r in rows for n, e in r["paths"].items() if "note" in e})
    errors = [f"{r['case']} {n}: {e['error']}" for r in rows for n, e in r["paths"].items() if "error" in e]
    skipped = [r["case"] for r in rows if "flex" not in r["paths"]]
    lines += [f"- Ragged batch, {n}" for n in notes]
    for r in rows:
        if "flash_varlen" in r["paths"]:
            p = r["paths"]
            lines.append(
                f"- {r['case']}: flash per sequence {fmt(p['flash'].get('us'), '.1f')} us, flash varlen "
                f"{fmt(p['flash_varlen'].get('us'), '.1f')} us; the table's flash is the faster"
            )
    if skipped:
        lines.append(
            "- flex_attention not run for: " + ", ".join(skipped) + " (compile time / decode path limits)"
        )
    lines += [f"- Failed: {e}" for e in errors]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    series = [r for r in rows if r["case"] in BATCH1_GQA]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, label in [
        ("lean", "lean (Triton)"),
        ("flash", "SDPA flash"),
        ("cudnn", "SDPA cuDNN"),
        ("flex", "flex"),
    ]:
        pts = [
            (r["lengths"][0], r["paths"][name]["gbs"]) for r in series if "gbs" in r["paths"].get(name, {})
        ]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=label)
    ax.axhline(CEILING_GBS, color="gray", linestyle="--", linewidth=1, label="4.4 TB/s read ceiling")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (positions)")
    ax.set_ylabel("K+V read GB/s")
    ax.set_title("Decode attention, batch 1, 32 q / 8 KV heads, head_dim 128, bf16")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def short_table(rows: list[dict], summ: dict) -> str:
    head = ("case", "lean us", "flash us", "x flash", "GB/s", "%4.4", "grid/tpc/split")
    out = ["{:<24} {:>9} {:>9} {:>8} {:>6} {:>5} {:>15}".format(*head)]
    for r in rows:
        lean, s = r["paths"]["lean"], r["schedule"]
        sched = f"{s['grid']}/{s['tiles_per_cta']}/{s['max_splits_per_head']}"
        out.append(
            f"{r['case']:<24} {fmt(lean.get('us'), '9.1f')} {fmt(r.get('flash_us'), '9.1f')} "
            f"{fmt(lean.get('speedup_vs_flash'), '8.2f')} {fmt(lean.get('gbs'), '6.0f')} "
            f"{fmt(lean.get('pct_ceiling'), '5.0f')} {sched:>15}"
        )
    out.append(
        f"geomean x flash (batch 1): {summ['geomean_speedup_batch1']:.2f}   min x flash: "
        f"{summ['min_speedup_any_case']:.2f}   min GB/s >=256k: {summ['min_lean_gbs_256k_up']:.0f}   "
        f"512k: {summ['lean_speedup_at_512k_over']}"
    )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="batch-1 1k, 64k, 512k only; write nothing")
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder for attention.{md,json,png}")
    ap.add_argument("--no-flex", action="store_true", help="skip flex_attention")
    ap.add_argument("--flex-max-len", type=int, default=64 * K, help="longest context flex is run at")
    ap.add_argument("--flex-budget-s", type=float, default=150.0, help="stop compiling flex after this")
    ap.add_argument("--max-err", type=float, default=2e-2, help="lean vs flash relative error allowed")
    ap.add_argument("--commit", default=os.environ.get("MINIDECODE_COMMIT"), help="commit to record")
    ap.add_argument("--config-json", type=Path, help="tune_attention.py's tune.json: time its best config")
    args = ap.parse_args()

    cases = (
        [c for c in CASES if c.name in ("B1 32/8 1k", "B1 32/8 64k", "B1 32/8 512k")] if args.quick else CASES
    )
    args.config = DEFAULT_CONFIGS[HEAD_DIM]
    if args.config_json:
        args.config = LeanConfig(*json.loads(args.config_json.read_text())["best_config"])
    env = environment(args.commit)
    env["lean_config"] = vars(args.config) if hasattr(args.config, "__dict__") else str(args.config)
    print(json.dumps(env))
    rows, flex_state = [], {"compile_s": 0.0}
    for case in cases:
        t0 = time.perf_counter()
        row = bench_case(case, args, flex_state)
        rows.append(row)
        brief = {n: round(e["us"], 1) for n, e in row["paths"].items() if "us" in e}
        print(f"{case.name}: {brief} ({time.perf_counter() - t0:.0f} s)", flush=True)
    summ = summary(rows)
    if not args.quick:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "attention.json").write_text(
            json.dumps({"env": env, "summary": summ, "rows": rows}, indent=1)
        )
        (args.out / "attention.md").write_text(markdown(env, rows, summ))
        plot(rows, args.out / "attention.png")
    print(short_table(rows, summ))


if __name__ == "__main__":
    main()

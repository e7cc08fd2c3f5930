"""Decode-attention benchmark: lean attention (bf16 cache and FP8 e4m3 cache) against PyTorch's
SDPA flash and cuDNN paths and flex_attention, all timed under CUDA graphs in the same run.

One decode step of attention per call: one new query per sequence over its cached context,
K/V in the runtime's `[B, Hkv, S, D]` layout. Bytes = K + V read once (FP8: e4m3 K + V plus
their float32 per-(token, head) scales). Each path is checked against a reference before it is
timed; small cases rotate over several input sets so that repeated calls do not measure the L2
cache. The read ceiling is measured in the same run: a read-only reduction over 2 GiB, and the
fastest stream any path reached.

    python bench/attention.py --out bench/results/attention   # all cases, .md/.json/.png
    python bench/attention.py --quick                         # a few batch-1 lengths, prints only
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from timing import time_graph  # bench/timing.py
from torch.nn.attention import SDPBackend, sdpa_kernel

from minidecode.benchmarks.e2e import provenance
from minidecode.kernels import lean_attention as la
from minidecode.kernels.lean_attention import LeanConfig, default_config, lean_attention, lean_schedule
from minidecode.kernels.quant import SCALE_DTYPE, dequantize_fp8, quantize_fp8
from minidecode.kernels.reference import decode_attention_reference

HEAD_DIM = 128
DTYPE = torch.bfloat16
ROTATE_BYTES = 256 << 20  # rotate input sets until ~4x the 60 MB L2 is touched per round
RESULTS = Path(__file__).resolve().parent / "results" / "attention"
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
    def fp8_bytes(self) -> int:
        """e4m3 K + V and their bfloat16 scales, one per (position, KV head) each."""
        return 2 * sum(self.lengths) * self.hkv * (HEAD_DIM + SCALE_DTYPE.itemsize)

    @property
    def uniform(self) -> bool:
        return len(set(self.lengths)) == 1


# Every path a case can time, in the order of the tables; the first two are ours.
PATHS = ["lean", "lean_fp8", "flash", "flash_varlen", "cudnn", "flex"]


def _ragged_lengths() -> tuple[int, ...]:
    # 8 sequences between 1k and 256k, log-spaced, fixed so every run measures the same case
    return tuple(int(round(K * 256 ** (i / 7))) for i in range(8))


CASES = [
    *[Case(f"B1 32/8 {n}k", 32, 8, (n * K,)) for n in (1, 4, 16, 64, 128, 256, 512, 1024)],
    Case("B1 64/8 8k", 64, 8, (8 * K,)),
    Case("B1 64/8 512k", 64, 8, (512 * K,)),
    Case("B1 32/32 64k", 32, 32, (64 * K,)),
    Case("B1 32/32 256k", 32, 32, (256 * K,)),
    Case("B4 32/8 32k", 32, 8, (32 * K,) * 4),
    Case("B4 32/8 128k", 32, 8, (128 * K,) * 4),
    Case("B16 32/8 32k", 32, 8, (32 * K,) * 16),
    Case("B8 32/8 ragged 1k-256k", 32, 8, _ragged_lengths()),
]
BATCH1_GQA = [c.name for c in CASES[:8]]


# ---- timing (bench/timing.py) ---------------------------------------------------------------


def read_ceiling_gbs(n_bytes: int = 2 << 30) -> float:
    """A read-only reduction (torch.sum) over n_bytes of bf16, GB/s: the in-run read ceiling."""
    buf = [torch.randn(n_bytes // 2, device="cuda", dtype=torch.bfloat16)]
    out = torch.empty((), device="cuda", dtype=torch.float32)
    t = time_graph([lambda: torch.sum(buf[0], dim=0, dtype=torch.float32, out=out)], target_us=20000.0)
    buf.clear()
    torch.cuda.empty_cache()
    return n_bytes / t.median / 1e3


# ---- inputs and paths -----------------------------------------------------------------------


@dataclass
class InputSet:
    q: torch.Tensor  # [B, Hq, D]
    k: torch.Tensor  # [B, Hkv, S, D], S = max(lengths)
    v: torch.Tensor
    lengths: torch.Tensor  # [B] int32
    out: torch.Tensor  # [B, Hq, D] lean's output buffer
    fp8: tuple | None = None  # (k_e4m3, v_e4m3, kv_scale [B, Hkv, S, 2]), the FP8 cache of the same K/V
    v_blocked_t: torch.Tensor | None = None  # v_e4m3 in the "blocked_t" layout the kernel reads


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


def add_fp8(sets: list[InputSet]) -> None:
    for x in sets:
        (k8, ks), (v8, vs) = quantize_fp8(x.k), quantize_fp8(x.v)
        x.fp8, x.v_blocked_t = (k8, v8, torch.stack((ks, vs), -1)), la.to_v_blocked_t(v8)


def fp8_call(x: InputSet, scale: float) -> Callable[[], torch.Tensor]:
    k8, _, kv_scale = x.fp8
    return lambda: lean_attention(x.q, k8, x.v_blocked_t, x.lengths, scale, kv_scale=kv_scale, out=x.out)


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
    if not args.no_fp8:
        add_fp8(sets)
        paths["lean_fp8"] = lambda x: fp8_call(x, scale)
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
    ref_dequant = None
    if x0.fp8 is not None:
        k8, v8, kv_scale = x0.fp8
        kd, vd = dequantize_fp8(k8, kv_scale[..., 0]), dequantize_fp8(v8, kv_scale[..., 1])
        ref_dequant = decode_attention_reference(x0.q.float(), kd, vd, x0.lengths, scale).float()
        del kd, vd
    outs = {}
    for name in PATHS:
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
        if name == "lean_fp8":
            # rel_err: against the unquantized cache; rel_err_dequant: the kernel's own error
            entry["rel_err_dequant"] = rel_err(outs[name], ref_dequant)
            if not entry["rel_err_dequant"] < args.max_err:
                raise SystemExit(f"{case.name}: {name} differs from the dequantized reference: {entry}")
        if name == "flash":
            row["paths"]["lean"]["rel_err_vs_flash"] = rel_err(outs["lean"], outs["flash"])
        try:
            t = time_graph(calls)
            n_bytes = case.fp8_bytes if name == "lean_fp8" else case.kv_bytes
            entry.update(
                us=t.median, us_min=t.low, us_max=t.high, bytes=n_bytes, gbs=n_bytes / t.median / 1e3
            )
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        if name in notes:
            entry["note"] = notes[name]
        row["paths"][name] = entry
    if "us" in row["paths"].get("lean", {}):  # time lean twice: the spread is the noise floor
        row["paths"]["lean"]["us_repeat"] = time_graph([lean_call(x, scale, config) for x in sets]).median
    fp8 = row["paths"].get("lean_fp8", {})
    if "us" in fp8 and "us" in row["paths"]["lean"]:
        fp8["speedup_vs_bf16_lean"] = row["paths"]["lean"]["us"] / fp8["us"]
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
        commit = provenance()["commit"] or "none"  # minidecode's own, whatever the current folder
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
    fp8 = {}
    ups = [
        (r, r["paths"]["lean_fp8"]["speedup_vs_bf16_lean"])
        for r in rows
        if "speedup_vs_bf16_lean" in r["paths"].get("lean_fp8", {})
    ]
    if ups:
        long = [(r, x) for r, x in ups if min(r["lengths"]) >= 128 * K]
        fp8["lean_fp8"] = {
            "min_speedup_vs_bf16_lean": min(x for _, x in ups),
            "min_speedup_vs_bf16_lean_128k_up": min((x for _, x in long), default=float("nan")),
            "min_gbs_128k_up": min((r["paths"]["lean_fp8"]["gbs"] for r, _ in long), default=float("nan")),
            "max_rel_err_vs_unquantized": max(r["paths"]["lean_fp8"]["rel_err"] for r, _ in ups),
        }
    return {
        "geomean_speedup_batch1": geomean(speedups("lean", BATCH1_GQA)),
        "min_speedup_any_case": min(speedups("lean"), default=float("nan")),
        "min_lean_gbs_256k_up": min(lean_gbs_long, default=float("nan")),
        "lean_speedup_at_512k_over": vs_slow,
        "fp8": fp8,
    }


def fmt(x: float | None, spec: str) -> str:
    if x is None:
        return format("—", ">" + spec.split(".")[0]) if spec[:1].isdigit() else "—"
    return format(x, spec)


def path_names(rows: list[dict]) -> list[str]:
    return [n for n in PATHS if any(n in r["paths"] for r in rows)]


def cell(entry: dict) -> str:
    """`median [min-max]` microseconds, or why there is none."""
    if "us" in entry:
        return f"{entry['us']:.1f} [{entry['us_min']:.1f}-{entry['us_max']:.1f}]"
    return "error" if "error" in entry else "—"


def markdown(env: dict, rows: list[dict], summ: dict) -> str:
    ceiling = env["ceiling_gbs"]
    names = path_names(rows)
    has_fp8 = "lean_fp8" in names
    lines = [
        "# Decode attention: lean (bf16 and FP8 cache) vs PyTorch peers",
        "",
        f"Device: {env['device']} ({env['sms']} SMs) · date {env['date']} · commit {env['commit']} · "
        f"torch {env['torch']} · triton {env['triton']} · {env['dtype']} q, head_dim {env['head_dim']} · "
        f"lean config {env['lean_config']} · FP8 {env.get('lean_fp8_config')}",
        "",
        f"Command: `{env['command']}`",
        "",
        "Each path timed under a CUDA graph (many calls per replay), fresh random inputs, rotated over "
        "several input sets when they would fit in L2; times are the median [min-max] of 15 replays, "
        "in microseconds. GB/s counts the bytes a call reads: K + V once (bf16), or e4m3 K + V plus "
        "their bfloat16 scales (FP8). Read ceiling, measured in this run: a read-only reduction over "
        f"2 GiB reads {env['reduction_gbs']:.0f} GB/s, the fastest path of any case "
        f"{env['best_stream_gbs']:.0f} GB/s; % is of the higher, {ceiling:.0f} GB/s. Flash and cuDNN get "
        "the GQA group packed into the query axis. lean (repeat) is a second timing of lean in the same "
        "run: its spread is the noise floor. FP8 error: relative L2 error against the reference on the "
        "unquantized bf16 cache (and, in the JSON, against the dequantized cache).",
        "",
        "| case | "
        + " | ".join(f"{n} us" for n in names)
        + " | lean GB/s (%) | lean vs flash | "
        + ("lean_fp8 GB/s (%) · x bf16 lean · err | " if has_fp8 else "")
        + "lean (repeat) us | grid | tiles/CTA | max splits/head |",
        "| --- " * (len(names) + 7 + has_fp8) + "|",
    ]
    for r in rows:
        p, sch = r["paths"], r["schedule"]
        lean, e = p.get("lean", {}), p.get("lean_fp8", {})
        fp8_cell = (
            f"{fmt(e.get('gbs'), '.0f')} ({fmt(e.get('gbs', 0) * 100 / ceiling, '.0f')}%) · "
            f"{fmt(e.get('speedup_vs_bf16_lean'), '.2f')}x · {fmt(e.get('rel_err'), '.1e')} | "
        )
        lines.append(
            f"| {r['case']} | "
            + " | ".join(cell(p.get(n, {})) for n in names)
            + f" | {fmt(lean.get('gbs'), '.0f')} ({fmt(lean.get('gbs', 0) * 100 / ceiling, '.0f')}%)"
            + f" | {fmt(lean.get('speedup_vs_flash'), '.2f')}x | "
            + (fp8_cell if has_fp8 else "")
            + f"{fmt(lean.get('us_repeat'), '.1f')} | {sch['grid']} | {sch['tiles_per_cta']} | "
            f"{sch['max_splits_per_head']} |"
        )
    lines += [
        "",
        f"- Geometric-mean speedup of lean over SDPA flash, batch-1 32/8 at 1k-1M: "
        f"**{summ['geomean_speedup_batch1']:.2f}x**",
        f"- Slowest case of lean relative to flash: {summ['min_speedup_any_case']:.2f}x",
        f"- Lowest lean bandwidth at 256k and above (batch 1, 32/8): {summ['min_lean_gbs_256k_up']:.0f} GB/s",
        "- Lean speedup at 512k over "
        + ", ".join(f"{k}: {v:.1f}x" for k, v in summ["lean_speedup_at_512k_over"].items()),
    ]
    for name, f in summ["fp8"].items():
        lines.append(
            f"- {name}: over the bf16-cache lean {f['min_speedup_vs_bf16_lean_128k_up']:.2f}x at least "
            f"from 128k up ({f['min_gbs_128k_up']:.0f} GB/s at least), "
            f"{f['min_speedup_vs_bf16_lean']:.2f}x at least in any case; largest error against the "
            f"unquantized cache {f['max_rel_err_vs_unquantized']:.1e}"
        )
    beaten = [
        f"{r['case']}: {n} {r['paths'][n]['us']:.1f} us against lean {r['paths']['lean']['us']:.1f}"
        for r in rows
        for n in ("flash", "flash_varlen", "cudnn", "flex")
        if r["paths"].get(n, {}).get("us", math.inf) < r["paths"]["lean"].get("us", 0.0)
    ]
    lines += [f"- A peer is faster than lean (bf16 cache): {b}" for b in beaten] or [
        "- No peer is faster than lean (bf16 cache) in any case of this run"
    ]
    notes = sorted({f"{n}: {e['note']}" for r in rows for n, e in r["paths"].items() if "note" in e})
    errors = [f"{r['case']} {n}: {e['error']}" for r in rows for n, e in r["paths"].items() if "error" in e]
    skipped = [r["case"] for r in rows if "flex" not in r["paths"]]
    lines += [f"- Ragged batch, {n}" for n in notes]
    if skipped:
        lines.append(
            "- flex_attention not run for: " + ", ".join(skipped) + " (compile time / decode path limits)"
        )
    lines += [f"- Failed: {e}" for e in errors]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], env: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    series = [r for r in rows if r["case"] in BATCH1_GQA]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in path_names(rows):
        pts = [
            (r["lengths"][0], r["paths"][name]["gbs"]) for r in series if "gbs" in r["paths"].get(name, {})
        ]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=name)
    ax.axhline(env["ceiling_gbs"], color="gray", linestyle="--", linewidth=1, label="read ceiling (this run)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (positions)")
    ax.set_ylabel("cache GB/s read")
    ax.set_title("Decode attention, batch 1, 32 q / 8 KV heads, head_dim 128")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def short_table(rows: list[dict], summ: dict, env: dict) -> str:
    names = path_names(rows)
    out = [f"read ceiling: reduction {env['reduction_gbs']:.0f} GB/s, best {env['best_stream_gbs']:.0f} GB/s"]
    heads = "".join(f"{n.removeprefix('lean_')[:14]:>15}" for n in names)
    out.append(f"{'case':<24}{heads}  fp8: x bf16-lean/GB/s/err")
    for r in rows:
        p = r["paths"]
        fp8 = ""
        if (e := p.get("lean_fp8")) is not None:
            fp8 = f"{fmt(e.get('speedup_vs_bf16_lean'), '.2f')}x/{fmt(e.get('gbs'), '.0f')}/"
            fp8 += fmt(e.get("rel_err"), ".1e")
        out.append(
            f"{r['case']:<24}"
            + "".join(f"{fmt(p.get(n, {}).get('us'), '15.1f')}" for n in names)
            + "  "
            + fp8
        )
    out.append(
        f"geomean lean x flash (batch 1): {summ['geomean_speedup_batch1']:.2f}   min x flash: "
        f"{summ['min_speedup_any_case']:.2f}   min GB/s >=256k: {summ['min_lean_gbs_256k_up']:.0f}"
    )
    for name, f in summ["fp8"].items():
        out.append(f"{name}: {f}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick", action="store_true", help="batch-1 4k-1M and batch-4 32k only; write nothing without --out"
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="prefix of the .md/.json/.png results (default: results/attention)",
    )
    ap.add_argument("--no-flex", action="store_true", help="skip flex_attention")
    ap.add_argument("--no-fp8", action="store_true", help="skip the FP8-cache lean column")
    ap.add_argument("--flex-max-len", type=int, default=64 * K, help="longest context flex is run at")
    ap.add_argument("--flex-budget-s", type=float, default=150.0, help="stop compiling flex after this")
    ap.add_argument("--max-err", type=float, default=2e-2, help="lean vs reference relative error allowed")
    ap.add_argument("--commit", default=os.environ.get("MINIDECODE_COMMIT"), help="commit to record")
    args = ap.parse_args()

    quick = (
        "B1 32/8 1k",
        "B1 32/8 4k",
        "B1 32/8 16k",
        "B1 32/8 128k",
        "B1 32/8 512k",
        "B1 32/8 1024k",
        "B4 32/8 32k",
    )
    cases = [c for c in CASES if c.name in quick] if args.quick else CASES
    args.config = default_config(HEAD_DIM, DTYPE)
    env = environment(args.commit)
    env["lean_config"] = dataclasses.asdict(args.config)
    env["lean_fp8_config"] = {
        f"up to {la.FP8_TINY_HEAD_POSITIONS} positions x KV heads": dataclasses.asdict(la.FP8_TINY_CONFIG),
        f"below {la.FP8_SHORT_POSITIONS} positions": dataclasses.asdict(la.FP8_SHORT_CONFIG),
        "from there": dataclasses.asdict(la.FP8_CONFIG),
    }
    env["command"] = "python3 bench/attention.py " + " ".join(sys.argv[1:])
    env["reduction_gbs"] = read_ceiling_gbs()
    print(json.dumps(env), flush=True)
    rows, flex_state = [], {"compile_s": 0.0}
    for case in cases:
        t0 = time.perf_counter()
        row = bench_case(case, args, flex_state)
        rows.append(row)
        brief = {n: round(e["us"], 1) for n, e in row["paths"].items() if "us" in e}
        print(f"{case.name}: {brief} ({time.perf_counter() - t0:.0f} s)", flush=True)
    env["best_stream_gbs"] = max(e["gbs"] for r in rows for e in r["paths"].values() if "gbs" in e)
    env["ceiling_gbs"] = max(env["reduction_gbs"], env["best_stream_gbs"])
    summ = summary(rows)
    if args.out is None and not args.quick:
        args.out = RESULTS
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(
            json.dumps({"env": env, "summary": summ, "rows": rows}, indent=1)
        )
        args.out.with_suffix(".md").write_text(markdown(env, rows, summ))
        plot(rows, env, args.out.with_suffix(".png"))
    print(short_table(rows, summ, env))


if __name__ == "__main__":
    main()

"""Sweep the decode GEMV's launch parameters on the GPU, for the 8B shapes: bf16 weights against
cuBLAS, or (--fp8) FP8 weights' launch configs against the default one.

Each case cycles 32 distinct weight matrices inside one CUDA graph (each read cold from HBM, as
in a decode step) and reports microseconds per call and GB/s. Peers in the same run:
- cuBLAS: `F.linear` for qkv and gate/up, `F.linear` + the residual add for o_proj / down_proj
  (what the step ran before);
- the Triton GEMV (adding into the residual for o_proj / down_proj), with and without
  programmatic dependent launch (PDL lets each call start while the previous one drains, as the
  step's kernels do).

    python bench/tune_gemv.py [--rows 1 16] [--out DIR]
    python bench/tune_gemv.py --fp8 [--check-rows 8 32] [--out DIR]
    python bench/tune_gemv.py --fp8 --smoke    # CPU, Triton interpreter: tiny shapes, no timing

--rows: the rows of x (a batched decode step multiplies B tokens' activations), up to the
GEMV's MAX_ROWS.

--fp8: per projection of bench/fp8_weights.py (one row, e4m3 weights with a float32 scale a
row, x rounded to e4m3 per token, calls chained with PDL as the step chains them), the default
config (default_fp8_config) and the candidates of fp8_candidates: us per call, GB/s and % of a
read ceiling measured in the same run (bench/fp8_weights.py's bytes), the speedup against the
default, and each candidate's relative error against the default's output and float64 (a wrong
candidate is flagged and never picked; one that fails to compile or launch is reported and
skipped). Then the default and the best config of each projection at --check-rows rows (the
config applies to every batch up to MAX_ROWS: a regression there shows). On 132 SMs: 26 configs
at one row and 16 row checks, each a compile and 15 graph replays: ~60-100 s on an H100.
Writes tune-gemv-fp8.{md,json} into --out. Every config it may time is checked on the CPU's
interpreter (tests/test_fp8_weights.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from fp8_weights import COPIES, fp8_exact, fp8_gemv_bytes  # bench/fp8_weights.py, a sibling as timing.py
from fp8_weights import SHAPES as FP8_SHAPES
from timing import Timing, time_graph  # bench/timing.py (run as a script: bench/ is on the import path)

from minidecode.benchmarks.e2e import measure_ceilings
from minidecode.kernels.device import INTERPRETER_CTAS
from minidecode.kernels.fp8_weights import FP8Weight, quantize_rows, quantize_weight
from minidecode.kernels.gemv import GemvConfig, default_fp8_config, gemv

LAYERS = 32
SHAPES = {  # name: (N, K, fusion) for Llama-3-8B
    "qkv": (6144, 4096, "plain"),
    "o_proj + residual": (4096, 4096, "residual"),
    "gate_up": (28672, 4096, "plain"),
    "down + residual": (4096, 14336, "residual"),
}
CONFIGS = [
    GemvConfig(),
    GemvConfig(32, 256, 4, 5),
    GemvConfig(32, 128, 4, 6),
    GemvConfig(32, 128, 4, 8),
    GemvConfig(64, 128, 4, 6),
    GemvConfig(64, 256, 8, 4),
    GemvConfig(32, 256, 8, 4),
    GemvConfig(16, 256, 4, 6),
    GemvConfig(128, 128, 8, 4),
]


def name(c: GemvConfig) -> str:
    return f"N{c.block_n} K{c.block_k} w{c.num_warps} s{c.num_stages}"


def tune_shape(N: int, K: int, fusion: str, rows: int) -> dict[str, float]:
    """Microseconds per call of cuBLAS and of every config (checked first) on one shape."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    weights = [torch.randn(N, K, device=dev, dtype=dt) / K**0.5 for _ in range(LAYERS)]
    x = torch.randn(rows, K, device=dev, dtype=dt)
    res = torch.randn(rows, N, device=dev, dtype=dt)

    def triton_calls(config: GemvConfig, pdl: bool):
        residual = res if fusion == "residual" else None
        return [lambda w=w: gemv(x, w, residual=residual, use_pdl=pdl, config=config) for w in weights]

    if fusion == "plain":
        cublas = [lambda w=w: F.linear(x, w) for w in weights]
    else:
        cublas = [lambda w=w: res.add_(F.linear(x, w)) for w in weights]
    exact = x.double() @ weights[0].double().T
    row = {"cublas": time_graph(cublas).median}
    for c in CONFIGS:  # check, then time
        zeros = torch.zeros_like(res) if fusion == "residual" else None
        got = gemv(x, weights[0], residual=zeros, config=c).double()
        err = ((got - exact).norm() / exact.norm()).item()
        assert err < 2e-2, f"{N}x{K} {name(c)}: rel err {err}"
        row[name(c)] = time_graph(triton_calls(c, True)).median
    row["default no pdl"] = time_graph(triton_calls(CONFIGS[0], False)).median
    return row


# ---- FP8 weights -----------------------------------------------------------------------------------------
# Tiles swept: (block_n, block_k, num_warps, num_stages, how many K splits, weight rows on M). Weight
# rows on M: warpgroup e4m3 dots (M = block_n >= 64, a warpgroup of 4 warps a 64-row tile), each
# chunk's sums promoted to float32; x's rows on M: mma.sync e4m3 dots, float32 sums across chunks.
# The defaults' tiles get the two best-balanced K splits (fp8_candidates), the others the best
# one. 512-column chunks at 4 stages keep 96-144 KiB of tiles in flight at 16-32 rows (one CTA
# an SM); 64 x 128 s13 ~130 / ~156 KiB, 64 x 256 s7 ~140 / ~170.
FP8_TILES = [
    (64, 512, 4, 4, 2, True),
    (64, 512, 4, 4, 2, False),
    (64, 128, 4, 13, 1, True),
    (64, 256, 4, 7, 1, True),
    (32, 512, 4, 6, 1, False),
    (128, 256, 8, 4, 1, True),
]
FP8_SPLITS = (1, 2, 3, 4, 6, 8)  # K split over CTAs (GemvConfig.split_k)
MAX_REL_ERR = 5e-3  # against the default's output (both bf16: a sum order moves a last bit or so)
DTYPE = {"cuda": torch.bfloat16, "cpu": torch.float32}  # the interpreter has no bf16 arithmetic
# Tiny shapes for --smoke (CPU, interpreter): several blocks, K parts and items a CTA on its 4 CTAs
SMOKE_SHAPES = {
    "qkv": (384, 256, "plain"),
    "o_proj + residual": (256, 256, "residual"),
    "gate_up + silu*up": (512, 256, "gated"),
    "down + residual": (256, 640, "residual"),
}


def fp8_name(c: GemvConfig) -> str:
    return f"{name(c)} split{c.split_k} " + ("W on M" if c.w_on_m else "x on M")


def busiest_cta_bytes(c: GemvConfig, out_features: int, K: int, gated: bool, ctas: int) -> int:
    """Weight bytes the busiest CTA streams: its work items (blocks x K parts, dealt round-robin
    to at most `ctas` CTAs) times a part's K chunks times a tile's bytes. 8B qkv on 132 SMs: 96
    blocks of 64 rows, 1 a CTA on 96 CTAs (73% of an even share); K split in four, 384 items, 3 a
    CTA on 128 CTAs (99%)."""
    blocks = triton.cdiv(out_features, c.block_n // 2 if gated else c.block_n)
    part_chunks = triton.cdiv(triton.cdiv(K, c.block_k), c.split_k)
    return triton.cdiv(blocks * c.split_k, ctas) * part_chunks * c.block_n * c.block_k


def fp8_candidates(out_features: int, K: int, gated: bool, ctas: int) -> list[GemvConfig]:
    """The default config first, then for each tile (FP8_TILES) the K splits whose busiest CTA
    streams the fewest bytes (fewer parts first on a tie: each part adds a partial and a ticket)."""
    configs = [default_fp8_config(out_features, gated, ctas)]
    for block_n, block_k, warps, stages, n_splits, w_on_m in FP8_TILES:
        tile = GemvConfig(block_n, block_k, warps, stages, w_on_m=w_on_m)
        splits = [dataclasses.replace(tile, split_k=s) for s in FP8_SPLITS]
        splits.sort(key=lambda c: (busiest_cta_bytes(c, out_features, K, gated, ctas), c.split_k))
        configs += [c for c in splits[:n_splits] if c not in configs]
    return configs


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm()).item()


def graph_timer(fn: Callable[[FP8Weight], object], weights: list[FP8Weight]) -> Timing:
    """us per call: fn(w) for each weight copy, cycled in one CUDA graph."""
    return time_graph([lambda w=w: fn(w) for w in weights])


def wall_timer(fn: Callable[[FP8Weight], object], weights: list[FP8Weight]) -> Timing:
    """--smoke (CPU): one call's wall time, in us; it only shows the sweep runs."""
    start = time.perf_counter()
    fn(weights[0])
    us = (time.perf_counter() - start) * 1e6
    return Timing(us, us, us)


def fp8_case(x, weights, mode: str, config: GemvConfig, default_out, timer, ceiling: float | None) -> dict:
    """One config on one shape and row count: its output (on a zero residual) checked against
    float64 and the default's (`default_out`; None: this is the default), then timed. A compile
    or launch failure (too much shared memory for the device, a layout Triton refuses) is
    reported, not raised."""
    gated, (N, K), rows = mode == "gated", weights[0].shape, x.values.shape[0]
    device = x.values.device
    zeros = torch.zeros(rows, N, dtype=x.dtype, device=device) if mode == "residual" else None
    try:  # any error of this config's compile or launch: reported, and the sweep goes on
        got = gemv(x, weights[0], residual=zeros, gated=gated, config=config)
    except Exception as e:  # noqa: BLE001
        return dict(config=fp8_name(config), error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    case = dict(config=fp8_name(config), repr=repr(config), out=got)
    case["rel_err_exact"] = rel_err(got, fp8_exact(x, weights[0], gated))
    case["rel_err_default"] = 0.0 if default_out is None else rel_err(got, default_out)
    case["ok"] = case["rel_err_default"] <= MAX_REL_ERR and case["rel_err_exact"] <= 2 * MAX_REL_ERR
    residual = torch.randn(rows, N, dtype=x.dtype, device=device) if mode == "residual" else None
    pdl = device.type == "cuda"  # as the decode step chains its kernels

    def call(w: FP8Weight) -> torch.Tensor:
        return gemv(x, w, residual=residual, gated=gated, use_pdl=pdl, config=config)

    t = timer(call, weights)
    case["us"] = dataclasses.asdict(t)
    case["gbs"] = fp8_gemv_bytes(N, K, rows, mode == "residual") / t.median / 1e3
    if ceiling is not None:
        case["roofline"] = case["gbs"] * 1e9 / ceiling
    return case


def fp8_cases(weights, mode: str, rows: int, configs: list[GemvConfig], timer, ceiling) -> list[dict]:
    """configs[0] (the default) and the others at `rows` rows of x, each with its speedup against
    the default (when both ran)."""
    K, device = weights[0].shape[1], weights[0].values.device
    x = quantize_rows(torch.randn(rows, K, device=device, dtype=DTYPE[device.type]), weights[0])
    cases, default_out = [], None
    for c in configs:
        case = fp8_case(x, weights, mode, c, default_out, timer, ceiling)
        out = case.pop("out", None)
        if c is configs[0]:
            default_out = out
        cases.append(case)
    for case in cases:
        if "us" in case and "us" in cases[0]:
            case["speedup"] = cases[0]["us"]["median"] / case["us"]["median"]
    return cases


def fp8_shape(label: str, N: int, K: int, mode: str, args, ceiling: float | None) -> dict:
    """The candidates on one projection at one row, then the default and the best at each of
    --check-rows."""
    device = torch.device("cpu" if args.smoke else "cuda")
    timer = wall_timer if args.smoke else graph_timer
    ctas = INTERPRETER_CTAS if args.smoke else torch.cuda.get_device_properties(device).multi_processor_count
    gated = mode == "gated"
    torch.manual_seed(0)
    weights = []
    for _ in range(1 if args.smoke else COPIES):
        w = torch.randn(N, K, device=device, dtype=DTYPE[device.type]) / K**0.5
        weights.append(FP8Weight(*quantize_weight(w), 1, K))
    configs = fp8_candidates(N // 2 if gated else N, K, gated, ctas)
    result = dict(matrix=label, N=N, K=K, mode=mode, ctas=ctas)
    result["rows1"] = fp8_cases(weights, mode, 1, configs, timer, ceiling)
    good = [c for c in result["rows1"] if c.get("ok")]
    best = min(good, key=lambda c: c["us"]["median"]) if good else None
    result["best"], result["best_repr"] = (best["config"], best["repr"]) if best else (None, None)
    chosen = [configs[0]] + [c for c in configs[1:] if best and fp8_name(c) == best["config"]]
    result["check_rows"] = {
        rows: fp8_cases(weights, mode, rows, chosen, timer, ceiling) for rows in args.check_rows
    }
    return result


def us_text(case: dict) -> str:
    t = case["us"]
    return f"{t['median']:.2f} ({t['low']:.2f}-{t['high']:.2f})"


def fp8_tables(results: list[dict]) -> str:
    lines = []
    for r in results:
        lines += [
            f"## {r['matrix']} ({r['N']} x {r['K']}), 1 row, {r['ctas']} CTAs at most (us per call: median "
            "(min-max) of the replays)",
            "| config | us | GB/s | % of read ceiling | vs default | rel err vs default | vs float64 | |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for i, c in enumerate(r["rows1"]):
            if "error" in c:
                lines.append(f"| {c['config']} | failed: {c['error']} | | | | | | |")
                continue
            roof = f"{100 * c['roofline']:.1f}%" if "roofline" in c else "-"
            speed = f"{c['speedup']:.3f}x" if c.get("speedup") else "-"
            mark = ("default " if i == 0 else "") + ("best" if c["config"] == r["best"] else "")
            mark += "" if c["ok"] else "WRONG"
            lines.append(
                f"| {c['config']} | {us_text(c)} | {c['gbs']:,.0f} | {roof} | {speed} "
                f"| {c['rel_err_default']:.1e} | {c['rel_err_exact']:.1e} | {mark.strip()} |"
            )
        lines.append("")
    lines += [
        "## The best against the default at more rows",
        "| matrix | rows | default us | best | best us | change |",
    ]
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        for rows, cases in r["check_rows"].items():
            if len(cases) < 2 or any("us" not in c for c in cases):
                lines.append(
                    f"| {r['matrix']} | {rows} | {'; '.join(c.get('error', '') for c in cases)} | | | |"
                )
                continue
            d, b = cases
            flag = "" if b["ok"] else " WRONG"
            change = f"{d['us']['median'] / b['us']['median']:.3f}x{flag}"
            lines.append(
                f"| {r['matrix']} | {rows} | {us_text(d)} | {b['config']} | {us_text(b)} | {change} |"
            )
    lines.append("")
    picks = []
    for r in results:
        best = next((c for c in r["rows1"] if c["config"] == r["best"]), None)
        picks.append(
            f"{r['matrix']}: {r['best']} ({best['speedup']:.3f}x)"
            if best and best.get("speedup")
            else f"{r['matrix']}: none correct"
        )
    lines.append("best per shape (1 row): " + "; ".join(picks))
    return "\n".join(lines)


def fp8_main(args) -> None:
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit(
            "tune_gemv --fp8 needs a CUDA GPU (or --smoke: tiny shapes on the CPU's interpreter)"
        )
    ceiling = None if args.smoke else measure_ceilings(torch.device("cuda")).read_bytes_per_s
    device = "CPU (interpreter)" if args.smoke else torch.cuda.get_device_name()
    if ceiling is not None:
        print(f"read ceiling {ceiling / 1e9:,.0f} GB/s on {device}", flush=True)
    shapes = SMOKE_SHAPES if args.smoke else FP8_SHAPES
    results = []
    for label, shape in shapes.items():
        start = time.perf_counter()
        results.append(fp8_shape(label, *shape, args, ceiling))
        if not args.smoke:
            torch.cuda.empty_cache()  # the shape's 32 weight copies
        r = results[-1]
        print(
            f"  {label}: {len(r['rows1'])} configs, best {r['best']} ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    text = fp8_tables(results)
    print(text)
    report = dict(device=device, ceiling_gbs=ceiling and ceiling / 1e9, shapes=results)
    (args.out / "tune-gemv-fp8.json").write_text(json.dumps(report, indent=1))
    (args.out / "tune-gemv-fp8.md").write_text(f"# FP8 GEMV launch configs, {device}\n\n{text}\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1], help="rows of x (batch size)")
    parser.add_argument("--out", type=Path, default=Path("bench/logs"))
    parser.add_argument("--fp8", action="store_true", help="FP8 weights: launch configs against the default")
    parser.add_argument(
        "--check-rows", type=int, nargs="*", default=[8, 32], help="--fp8: rows to check the best at"
    )
    parser.add_argument("--smoke", action="store_true", help="--fp8 on the CPU's interpreter: tiny shapes")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.fp8:
        fp8_main(args)
        return
    results = {}
    print("| rows | matrix | cuBLAS us (GB/s) | default | no PDL | best config | best us | GB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for rows in args.rows:
        for label, (N, K, fusion) in SHAPES.items():
            row = tune_shape(N, K, fusion, rows)
            torch.cuda.empty_cache()
            best = min((k for k in row if k.startswith("N")), key=row.get)
            results[f"{rows} x {label}"] = {"rows": rows, "N": N, "K": K, "us": row, "best": best}
            gbs = N * K * 2 / 1e3
            print(
                f"| {rows} | {label} | {row['cublas']:.1f} ({gbs / row['cublas']:.0f}) "
                f"| {row[name(CONFIGS[0])]:.1f} | {row['default no pdl']:.1f} | {best} | {row[best]:.1f} "
                f"| {gbs / row[best]:.0f} |"
            )
    (args.out / "tune-gemv.json").write_text(json.dumps(results, indent=1))
    for label, r in results.items():
        print(label, " ".join(f"{k}={v:.1f}" for k, v in r["us"].items()))


if __name__ == "__main__":
    with torch.inference_mode():
        main()

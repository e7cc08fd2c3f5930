"""Prefill attention: the FP8 kernel (kernels/fp8_prefill.py) against PyTorch SDPA's flash and
cuDNN backends, on one layer's causal attention of Llama-3-8B shapes (32 query / 8 KV heads,
head_dim 128, bf16, the whole prompt), 4k to 1M tokens; its accuracy against float64; and the
kernel's candidate configs.

    python bench/prefill_attention.py --out bench/results/prefill-attention
    python bench/prefill_attention.py --quick            # 8k, 32k, 128k only

Paths, each on the same inputs:
- fp8: one call over all heads (GQA in the kernel), including its K/V quantization pre-pass;
- fp8 per KV head: eight calls of one KV head and its 4 query heads, as the model's prefill
  calls attention today (kernels/prefill.py: fp8 only where a call fills the GPU);
- flash, cudnn: one SDPA call over all heads with enable_gqa (cuDNN on K/V repeated to 32 heads
  if this PyTorch's cuDNN path refuses GQA); flash is not run past 128k (half cuDNN's speed there);
- minidecode SDPA: the default prefill path, one kernels/prefill.causal_attention call per KV head
  with the backend choose_backend measured (blocked cuDNN past 64k queries).
"SDPA best" is the fastest of flash, cudnn and minidecode SDPA.

Timing: CUDA events around each call after one warm-up call (compilation, cuDNN plans); median
[min-max] of n calls on fresh random inputs. From 256k, fewer heads (16, 8 and 4 query heads at
256k, 512k and 1M, the 4:1 grouping kept) keep each call near a second, so the run takes 2-3 minutes
on an H100. TFLOP/s counts causal FLOPs: 4 x head_dim per visible (query, key) pair. % of peak is
against the dense tensor-core peak of the card's datasheet (H100/H200 SXM: 989 bf16, 1979 FP8
TFLOP/s), where the device name is known.

Accuracy (32k, one KV head and its 4 query heads, 512 of the last rows and 512 random rows):
relative L2 error of fp8 against float64 attention over its own e4m3 operands (the kernel's own
error: P's rounding) and over the unquantized inputs (what FP8 costs), with cuDNN's bf16 error
against the latter for scale; on N(0, 1) inputs (flat scores) and on inputs scaled by 2 (score
std ~4: peaked attention).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from timing import event_ms  # bench/timing.py
from torch.nn.attention import SDPBackend, sdpa_kernel

from minidecode.benchmarks.e2e import provenance
from minidecode.kernels import fp8_prefill as fp
from minidecode.kernels.prefill import causal_attention, choose_backend

K = 1024
DEVICE = "cuda"
HEAD_DIM, GROUP = 128, 4
SCALE = HEAD_DIM**-0.5
DTYPE = torch.bfloat16
LENGTHS = [4 * K, 8 * K, 16 * K, 32 * K, 64 * K, 128 * K, 256 * K, 512 * K, 1024 * K]
QUICK = [8 * K, 32 * K, 128 * K]
HEADS = {256 * K: 16, 512 * K: 8, 1024 * K: 4}  # query heads timed at the longest lengths (else 32)
FLASH_MAX = 128 * K
PEAK_TFLOPS = {"H100": (989.0, 1979.0), "H200": (989.0, 1979.0)}  # dense bf16, FP8 (SXM datasheet)


def repeats(length: int) -> int:
    return 10 if length <= 16 * K else 5 if length <= 128 * K else 3


def causal_flops(heads: int, t: int) -> float:
    return fp.flops(1, heads, t, t, HEAD_DIM)


def spread(times: list[float]) -> dict:
    return {"ms": statistics.median(times), "min": min(times), "max": max(times), "n": len(times)}


def make_inputs(heads: int, t: int, seed: int, scale: float = 1.0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = (torch.randn(1, heads, t, HEAD_DIM, generator=gen, device=DEVICE) * scale).to(DTYPE)
    k = (torch.randn(1, heads // GROUP, t, HEAD_DIM, generator=gen, device=DEVICE) * scale).to(DTYPE)
    v = torch.randn(1, heads // GROUP, t, HEAD_DIM, generator=gen, device=DEVICE).to(DTYPE)
    return q, k, v


def sdpa(q, k, v, backend: SDPBackend):
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE, enable_gqa=True)


def cudnn_call(q, k, v):
    """One cuDNN SDPA call over all heads: with enable_gqa where this PyTorch takes it, else on
    K/V repeated to the query heads (made here, outside the timed call)."""
    try:
        sdpa(q[:, :, :256], k[:, :, :256], v[:, :, :256], SDPBackend.CUDNN_ATTENTION)
        return lambda: sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION), "enable_gqa"
    except RuntimeError:
        kr, vr = k.repeat_interleave(GROUP, 1), v.repeat_interleave(GROUP, 1)
        return lambda: sdpa(q, kr, vr, SDPBackend.CUDNN_ATTENTION), "K/V repeated"


def per_kv_head(q, k, v, backend):
    """The model's form: one causal_attention call per KV head."""

    def call():
        return [
            causal_attention(
                q[:, h * GROUP : (h + 1) * GROUP], k[:, h : h + 1], v[:, h : h + 1], SCALE, backend
            )
            for h in range(k.shape[1])
        ]

    return call


def bench_length(t: int, chosen: str | None) -> dict:
    heads = HEADS.get(t, 32)
    q, k, v = make_inputs(heads, t, seed=t)
    n = repeats(t)
    flops = causal_flops(heads, t)
    paths = {
        "fp8": lambda: fp.fp8_causal_attention(q, k, v, SCALE),
        "fp8 per KV head": per_kv_head(q, k, v, "fp8") if t <= 128 * K else None,
        "minidecode SDPA": per_kv_head(q, k, v, chosen),
        "flash": (lambda: sdpa(q, k, v, SDPBackend.FLASH_ATTENTION)) if t <= FLASH_MAX else None,
    }
    cudnn, cudnn_form = cudnn_call(q, k, v)
    paths["cudnn"] = cudnn
    row = {"length": t, "heads": heads, "kv_heads": heads // GROUP, "flops": flops, "cudnn_form": cudnn_form}
    row["paths"] = {}
    for name, fn in paths.items():
        if fn is None:
            row["paths"][name] = {"skipped": True}
            continue
        try:
            entry = spread(event_ms(fn, n))
            entry["tflops"] = flops / (entry["ms"] * 1e-3) / 1e12
        except RuntimeError as error:  # out of memory, or a backend without this shape
            entry = {"error": str(error).splitlines()[0][:120]}
            torch.cuda.empty_cache()
        row["paths"][name] = entry
    sdpa_ms = [
        row["paths"][p]["ms"] for p in ("flash", "cudnn", "minidecode SDPA") if "ms" in row["paths"][p]
    ]
    if sdpa_ms and "ms" in row["paths"]["fp8"]:
        row["sdpa_best_ms"] = min(sdpa_ms)
        row["fp8_vs_best"] = row["sdpa_best_ms"] / row["paths"]["fp8"]["ms"]
    return row  # (the inputs are freed with this frame; the caller empties the cache)


def sweep_configs(t: int) -> list[dict]:
    """Each candidate config at length t (32 / 8 heads): time and agreement with the default's output."""
    q, k, v = make_inputs(32, t, seed=t + 1)
    ref = fp.fp8_causal_attention(q, k, v, SCALE)
    out = []
    for config in fp.CANDIDATE_CONFIGS:
        entry = {"length": t, "config": dataclasses.asdict(config)}
        try:
            got = fp.fp8_causal_attention(q, k, v, SCALE, config)
            entry["diff_vs_default"] = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
            entry.update(
                spread(event_ms(lambda c=config: fp.fp8_causal_attention(q, k, v, SCALE, c), repeats(t)))
            )
            entry["tflops"] = causal_flops(32, t) / (entry["ms"] * 1e-3) / 1e12
        except Exception as error:  # a config that fails to compile or run is reported, not fatal
            entry["error"] = repr(error)[:200]
        out.append(entry)
    return out


def rows_reference(q, k, v, rows: torch.Tensor) -> torch.Tensor:
    """float64 causal attention of the selected query rows (positions `rows`) over k/v: [B, H, r, D]."""
    G = q.shape[1] // k.shape[1]
    qd = q[:, :, rows].double()
    kd, vd = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    scores = (qd @ kd.transpose(-1, -2)) * SCALE  # [B, H, r, N]
    hidden = torch.arange(k.shape[2], device=q.device)[None, :] > rows[:, None]
    return torch.softmax(scores.masked_fill(hidden, float("-inf")), -1) @ vd


def accuracy(t: int = 32 * K) -> list[dict]:
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    rows = torch.cat(
        [
            torch.arange(t - 512, t, device=DEVICE),
            torch.randint(0, t - 512, (512,), generator=gen, device=DEVICE),
        ]
    )
    out = []
    for name, scale in (("N(0,1) inputs (flat scores)", 1.0), ("inputs x2 (peaked scores)", 2.0)):
        q, k, v = make_inputs(GROUP, t, seed=11, scale=scale)
        config = fp.default_config(HEAD_DIM, q.device)
        got = fp.fp8_causal_attention(q, k, v, SCALE)[:, :, rows].double()
        own = rows_reference(*dequantized(q, k, v, config.block_n), rows)
        exact = rows_reference(q, k, v, rows)
        cudnn = cudnn_call(q, k, v)[0]()[:, :, rows].double()

        def err(a, b):
            return ((a - b).norm() / b.norm()).item()

        out.append(
            {
                "inputs": name,
                "length": t,
                "fp8_vs_own_operands": err(got, own),
                "fp8_vs_unquantized": err(got, exact),
                "cudnn_bf16_vs_unquantized": err(cudnn, exact),
                "fp8_max_abs_vs_unquantized": (got - exact).abs().max().item(),
            }
        )
    return out


def dequantized(q, k, v, block_n):
    return fp.dequantized_inputs(q, k, v, block_n)


def environment(commit: str | None) -> dict:
    if commit is None:
        commit = provenance()["commit"] or "none"  # minidecode's own, whatever the current folder
    name = torch.cuda.get_device_name(0)
    peak = next((p for key, p in PEAK_TFLOPS.items() if key in name), None)
    return {
        "device": name,
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "peak_tflops_bf16_fp8": peak,
        "fp8_config": dataclasses.asdict(fp.default_config(HEAD_DIM, torch.device("cuda"))),
        "command": "python3 bench/prefill_attention.py " + " ".join(sys.argv[1:]),
    }


def cell(entry: dict, peak: float | None = None) -> str:
    if entry.get("skipped"):
        return "not run"
    if "error" in entry:
        return f"error: {entry['error'][:40]}"
    pct = f", {100 * entry['tflops'] / peak:.0f}%" if peak else ""
    return f"{entry['ms']:.2f} [{entry['min']:.2f}-{entry['max']:.2f}] ({entry['tflops']:.0f}{pct})"


def markdown(env: dict, rows: list[dict], configs: list[dict], acc: list[dict]) -> str:
    bf16_peak, fp8_peak = env["peak_tflops_bf16_fp8"] or (None, None)
    lines = [
        "# Prefill attention: the FP8 kernel against PyTorch SDPA",
        "",
        f"Device: {env['device']} ({env['sms']} SMs) · date {env['date']} · commit {env['commit']} · "
        f"torch {env['torch']} · triton {env['triton']} · FP8 config {env['fp8_config']}",
        "",
        f"Command: `{env['command']}`",
        "",
        "One layer's causal attention, Llama-3-8B shapes (4 query heads per KV head, head_dim 128, bf16, "
        "the whole prompt), 32 query heads up to 128k and fewer beyond (the heads column). Each cell: "
        "median [min-max] ms of n calls between CUDA events after a warm-up, (TFLOP/s, % of the "
        "dense datasheet peak: FP8 for fp8, bf16 for the SDPA paths). fp8 includes its K/V "
        "quantization pre-pass. See the script's docstring for each path.",
        "",
        "| length | heads | fp8 | fp8 per KV head | flash | cudnn | minidecode SDPA | fp8 vs SDPA best |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        p = r["paths"]
        ratio = f"{r['fp8_vs_best']:.2f}x" if "fp8_vs_best" in r else "-"
        lines.append(
            f"| {r['length'] // K}k | {r['heads']}/{r['kv_heads']} | {cell(p['fp8'], fp8_peak)} | "
            f"{cell(p['fp8 per KV head'], fp8_peak)} | {cell(p['flash'], bf16_peak)} | "
            f"{cell(p['cudnn'], bf16_peak)} | {cell(p['minidecode SDPA'], bf16_peak)} | {ratio} |"
        )
    forms = sorted({r["cudnn_form"] for r in rows})
    lines += ["", f"cuDNN ran with {', '.join(forms)}.", "", "## Candidate configs (32 / 8 heads)", ""]
    lines += [
        "| length | config | ms [min-max] | TFLOP/s | rel. diff vs default |",
        "| --- | --- | --- | --- | --- |",
    ]
    for c in configs:
        cfg = c["config"]
        name = f"m{cfg['block_m']} n{cfg['block_n']} w{cfg['num_warps']} s{cfg['num_stages']}"
        if "error" in c:
            lines.append(f"| {c['length'] // K}k | {name} | error: {c['error'][:60]} | - | - |")
        else:
            lines.append(
                f"| {c['length'] // K}k | {name} | {c['ms']:.2f} [{c['min']:.2f}-{c['max']:.2f}] | "
                f"{c['tflops']:.0f} | {c['diff_vs_default']:.1e} |"
            )
    lines += [
        "",
        "## Accuracy (32k, 1 KV head / 4 query heads, 1024 rows)",
        "",
        "| inputs | fp8 vs float64 on its e4m3 operands | fp8 vs float64 unquantized | cuDNN bf16 vs float64 "
        "unquantized | fp8 max abs error |",
        "| --- | --- | --- | --- | --- |",
    ]
    for a in acc:
        lines.append(
            f"| {a['inputs']} | {a['fp8_vs_own_operands']:.1e} | {a['fp8_vs_unquantized']:.1e} | "
            f"{a['cudnn_bf16_vs_unquantized']:.1e} | {a['fp8_max_abs_vs_unquantized']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="prefix of the .md/.json results")
    ap.add_argument("--quick", action="store_true", help="8k, 32k and 128k only")
    ap.add_argument("--max-length", type=int, default=1024 * K, help="longest prompt timed")
    ap.add_argument("--no-sweep", action="store_true", help="skip the candidate configs")
    ap.add_argument("--commit", default=os.environ.get("MINIDECODE_COMMIT"), help="commit to record")
    args = ap.parse_args()
    env = environment(args.commit)
    print(json.dumps(env), flush=True)
    chosen = choose_backend(torch.device("cuda"), HEAD_DIM, GROUP, DTYPE)
    env["chosen_sdpa_backend"] = chosen
    print(f"minidecode's measured SDPA backend: {chosen}", flush=True)
    rows, configs, acc = [], [], []

    def save() -> str:  # after every part: a timeout keeps what was measured
        text = markdown(env, rows, configs, acc)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            results = {"env": env, "rows": rows, "configs": configs, "accuracy": acc}
            args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
            args.out.with_suffix(".md").write_text(text)
        return text

    def bench(t: int) -> None:
        t0 = time.perf_counter()
        rows.append(bench_length(t, chosen))
        rows.sort(key=lambda r: r["length"])
        torch.cuda.empty_cache()
        save()
        row = next(r for r in rows if r["length"] == t)
        brief = {n: round(e["ms"], 2) for n, e in row["paths"].items() if "ms" in e}
        print(f"{t // K}k: {brief} fp8 vs SDPA best {row.get('fp8_vs_best', 0):.2f}x "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip

    # Up to 128k, then accuracy and the configs, then the longest lengths (the slowest part last,
    # where a time limit would cut it).
    lengths = QUICK if args.quick else [t for t in LENGTHS if t <= args.max_length]
    for t in [t for t in lengths if t <= 128 * K]:
        bench(t)
    try:
        acc += accuracy()
    except Exception:  # a failed part is reported; the rest still runs
        traceback.print_exc()
    for a in acc:
        print("accuracy", a, flush=True)
    save()
    for t in () if args.no_sweep else (32 * K, 128 * K):
        try:
            configs += sweep_configs(t)
        except Exception:
            traceback.print_exc()
        torch.cuda.empty_cache()
        save()
    for c in configs:
        print("config", c, flush=True)
    for t in [t for t in lengths if t > 128 * K]:
        bench(t)
    text = save()
    print(text)


if __name__ == "__main__":
    main()

"""FP8 weights on the GPU: the decode GEMV against its read roofline and the bf16 GEMV, alone and
inside the decode step, end-to-end decode and prefill with FP8 weights against bf16 weights
(synthetic Llama-3-8B, same process), and the FP8-weight logits against bf16's.

    python bench/fp8_weights.py [--out DIR] [--lengths 1024 32768] [--filled 131072 524288 1048576]
                                [--skip gemv,step,e2e,filled,accuracy]

GEMV (one decode row): Llama-3-8B's four projections, 32 distinct weight copies cycled inside
one CUDA graph (each read cold from HBM, as in a decode step), calls chained with PDL as the
step chains them. Bytes = what a call must read: the weights (1 byte an e4m3 weight plus its
float32 scale; 2 bytes a bf16 weight), x and the residual. Read ceiling: a read-only reduction
over 2 GiB measured in the same run. Peers: the bf16 GEMV (the step's kernel for bf16 weights);
"op" is what the step launches for the projection: the RMSNorm in front (qkv, gate/up; FP8: the
norm and the input's e4m3 rounding in one launch), or the input's rounding (FP8 o_proj, down),
and the GEMV. Median of 15 replays (min-max).

In the step: the decode step at 1k positions of a filled cache, bf16 then FP8 weights, 20 graph
replays under the torch profiler, each kernel charged the time it adds (from the later of its
start and the previous kernel's end to its end); the GEMVs' time against their bytes (every
layer's four projections, counted as the GEMV table counts them), and the step's other parts.

End to end: `LLM("synthetic:llama-3-8b", quantization=...)`, bf16 weights then FP8 weights, no
prefix reuse; per length, 3 requests of a random prompt + 128 new tokens (greedy, eos ignored):
decode tok/s (the engine's stats: first to last new token) and prefill seconds, median (min-max).
Roofline: read ceiling / (the weight bytes a step reads + the KV bytes at the window's context).

Filled-cache decode (FP8 weights + FP8 cache, no prefill): row 0 of a cache filled with random
e4m3 values decodes from each context the memory plan allows (a refused one gets the plan's line),
tok/s per window of 32 graph-replayed steps (CUDA events), 10 windows after a warm-up one; the
plan's longest prompt on this GPU is reported too.

Accuracy: a 4096-token random prompt prefilled by both models (every position's logits), then 64
decode steps fed the bf16 model's greedy tokens (teacher-forced): KL(bf16 || fp8) mean and max,
top-1 agreement, and the logits' relative error. The synthetic model's weights are random, its
distributions flat: the figures say how far the runtime's FP8 path moves the logits, not a
trained model's quality (tests/test_fp8_weights.py measures the shipped model's perplexity).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time
from pathlib import Path

import torch
from timing import event_ms, fill_cache, start_filled, time_graph  # bench/timing.py (bench/ on the path)

from minidecode import LLM, UserError
from minidecode.benchmarks.e2e import measure_ceilings, provenance
from minidecode.kernels import ops
from minidecode.kernels.fp8_weights import FP8Weight, QuantizedRows, quantize_rows, quantize_weight
from minidecode.kernels.gemv import default_fp8_config, gemv
from minidecode.models.llama import step_weight_bytes, weights_description
from minidecode.plan import DecodeKind
from minidecode.sampling import GREEDY

MODEL = "synthetic:llama-3-8b"
COPIES = 32
SHAPES = {  # name: (N, K, mode) for Llama-3-8B
    "qkv": (6144, 4096, "plain"),
    "o_proj + residual": (4096, 4096, "residual"),
    "gate_up + silu*up": (28672, 4096, "gated"),
    "down + residual": (4096, 14336, "residual"),
}


def spread(t: dict) -> str:
    return f"{t['median']:.2f} ({t['low']:.2f}-{t['high']:.2f})"


# ---- GEMV ----------------------------------------------------------------------------------------------
def fp8_gemv_bytes(N: int, K: int, rows: int, residual: bool) -> int:
    """What an FP8 GEMV call must read: the e4m3 weight [N, K] and its float32 scale a row, the
    e4m3 rows [rows, K] and their float32 scales, and the residual [rows, N] bf16 (read and
    written in place: counted once, as a read)."""
    return N * K + N * 4 + rows * (K + 4) + (rows * N * 2 if residual else 0)


def bf16_gemv_bytes(N: int, K: int, rows: int, residual: bool) -> int:
    """What a bf16 GEMV call must read: the weight [N, K], the rows [rows, K] and the residual."""
    return N * K * 2 + rows * K * 2 + (rows * N * 2 if residual else 0)


def fp8_exact(rows: QuantizedRows, w: FP8Weight, gated: bool) -> torch.Tensor:
    """float64 rows [R, K] @ w^T from the e4m3 values and their scales ([R, N]; gated: silu(gate)
    * up of the fused gate/up halves, [R, N / 2])."""
    exact = rows.dequantize().double() @ w.dequantize(torch.float64).T
    if gated:
        gate, up = exact.chunk(2, -1)
        exact = gate * torch.sigmoid(gate) * up
    return exact


def timed(fn, weights: list) -> dict:
    """us per call (median, min-max of the replays): fn(w) for each weight copy, cycled in a graph."""
    return dataclasses.asdict(time_graph([lambda w=w: fn(w) for w in weights]))


def gemv_row(name: str, N: int, K: int, mode: str, ceiling: float) -> dict:
    """One projection: the bf16 GEMV, the FP8 GEMV on rounded rows (checked against float64
    first), and the step's op for each: the RMSNorm in front (qkv, gate/up; FP8: with the input's
    e4m3 rounding, one launch) or the input's rounding (o_proj, down) and the GEMV (other launch
    configs: bench/tune_gemv.py --fp8)."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    norm = (torch.randn(K, device=dev, dtype=torch.bfloat16), 1e-5) if mode in ("plain", "gated") else None
    residual = torch.randn(1, N, device=dev, dtype=torch.bfloat16) if mode == "residual" else None
    kw = dict(residual=residual, gated=mode == "gated", use_pdl=True)
    bf16 = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K**0.5 for _ in range(COPIES)]
    t_bf16 = timed(lambda w: gemv(x, w, **kw), bf16)
    if norm is None:
        t_bf16_op = t_bf16
    else:
        t_bf16_op = timed(lambda w: gemv(ops.rms_norm(x, *norm, pdl=True), w, **kw), bf16)
    fp8 = [FP8Weight(*quantize_weight(w), 1, K) for w in bf16]
    del bf16
    torch.cuda.empty_cache()
    rows = quantize_rows(x, fp8[0])
    got = gemv(
        rows, fp8[0], residual=None if residual is None else torch.zeros_like(residual), gated=kw["gated"]
    )
    exact = fp8_exact(rows, fp8[0], kw["gated"])
    err = ((got.double() - exact).norm() / exact.norm()).item()
    assert err < 1e-2, f"{name}: FP8 GEMV relative error {err}"
    t_fp8 = timed(lambda w: gemv(rows, w, **kw), fp8)
    if norm is None:
        t_op = timed(lambda w: gemv(ops.quantize_input(x, w, pdl=True), w, **kw), fp8)
    else:
        t_op = timed(lambda w: gemv(ops.rms_norm(x, *norm, pdl=True, quantize_for=w), w, **kw), fp8)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    default = default_fp8_config(N // 2 if kw["gated"] else N, kw["gated"], sms)
    bytes_bf16 = bf16_gemv_bytes(N, K, 1, residual is not None)
    bytes_fp8 = fp8_gemv_bytes(N, K, 1, residual is not None)
    row = dict(
        matrix=name, N=N, K=K, rel_err=err, default_config=str(default), bf16_us=t_bf16, fp8_us=t_fp8,
        norm=norm is not None, bf16_op_us=t_bf16_op, fp8_op_us=t_op,
        bf16_gbs=bytes_bf16 / t_bf16["median"] / 1e3, fp8_gbs=bytes_fp8 / t_fp8["median"] / 1e3,
        speedup=t_bf16["median"] / t_fp8["median"], op_speedup=t_bf16_op["median"] / t_op["median"],
    )  # fmt: skip
    row["bf16_roofline"], row["fp8_roofline"] = (
        row["bf16_gbs"] * 1e9 / ceiling,
        row["fp8_gbs"] * 1e9 / ceiling,
    )
    print(
        f"  {name}: bf16 {spread(t_bf16)} us, fp8 {spread(t_fp8)} us ({100 * row['fp8_roofline']:.1f}% of "
        f"the read roofline); op: bf16 {spread(t_bf16_op)}, fp8 {spread(t_op)} us",
        flush=True,
    )
    return row


# ---- the GEMVs inside the decode step -------------------------------------------------------------------
STEP_CONTEXT, TRACED_STEPS = 1024, 20


def kernel_class(name: str) -> str:
    """A kernel's part of the step, by its name."""
    parts = {
        "_gemv_kernel": "GEMVs",
        "_lean_decode_kernel": "attention",
        "_rms_norm_kernel": "norms and roundings",
        "_quantize_rows_kernel": "norms and roundings",
    }
    for prefix, part in parts.items():
        if name.startswith(prefix):
            return part
    return "lm_head" if "nvjet" in name or "gemm" in name.lower() else "the rest"  # cuBLAS: the logits


def step_parts(events: list[dict]) -> dict[str, float]:
    """One step's kernels (trace events in start order) -> us a part ("step": its span): each
    kernel charged the time from the later of its start and the previous kernel's end to its end."""
    parts: dict[str, float] = {}
    end = events[0]["ts"]
    for e in events:
        finish = e["ts"] + e["dur"]
        part = kernel_class(e["name"])
        parts[part] = parts.get(part, 0.0) + max(0.0, finish - max(e["ts"], end))
        end = max(end, finish)
    parts["step"] = end - events[0]["ts"]
    return parts


def median_spread(xs: list[float]) -> dict:
    return dict(median=statistics.median(xs), low=min(xs), high=max(xs))


@torch.inference_mode()
def in_step(ceiling: float, out_dir: Path) -> list[dict]:
    """The decode step at STEP_CONTEXT from a filled cache, bf16 then FP8 weights: TRACED_STEPS
    graph replays under the torch profiler; each kernel owns the time from the later of its start
    and the previous kernel's end to its own end (under PDL a kernel starts before its predecessor
    ends; this charges it only for the time it adds). Per step (the replays launch the same
    kernels), then the median and min-max over the steps. The GEMVs' share against their bytes:
    every layer's four projections as the GEMV table counts them."""
    results = []
    for quantization in (None, "fp8"):
        llm = LLM(MODEL, quantization=quantization, prefix_reuse=False)
        engine = llm.engine
        fill_cache(start_filled(engine, STEP_CONTEXT, 16 + TRACED_STEPS))
        for _ in range(8):  # the first captures the step's graph
            engine.step(1, DecodeKind(GREEDY))
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(TRACED_STEPS):
                engine.step(1, DecodeKind(GREEDY))
            torch.cuda.synchronize()
        trace = out_dir / f"step-trace-{quantization or 'bf16'}.json"
        prof.export_chrome_trace(str(trace))
        events = sorted((e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "kernel"),
                        key=lambda e: e["ts"])  # fmt: skip
        trace.unlink()
        if len(events) % TRACED_STEPS:
            raise RuntimeError(f"{len(events)} kernels over {TRACED_STEPS} steps: not the same each step")
        per_step = len(events) // TRACED_STEPS
        steps = [step_parts(events[i : i + per_step]) for i in range(0, len(events), per_step)]
        count = fp8_gemv_bytes if quantization else bf16_gemv_bytes
        per_layer = sum(count(N, K, 1, mode == "residual") for N, K, mode in SHAPES.values())
        gemv_bytes = llm.config.num_layers * per_layer
        gemv_us = [s["GEMVs"] for s in steps]
        row = dict(
            weights=weights_description(llm.model), quantization=quantization or "none", n=TRACED_STEPS,
            step_us=median_spread([s["step"] for s in steps]), gemv_us=median_spread(gemv_us),
            parts_us={k: statistics.median(s.get(k, 0.0) for s in steps) for k in steps[0] if k != "step"},
            gemv_bytes=gemv_bytes,
            gemv_roofline=median_spread([gemv_bytes / us * 1e6 / ceiling for us in gemv_us]),
        )  # fmt: skip
        results.append(row)
        step, gemv, share = row["step_us"]["median"], row["gemv_us"]["median"], row["gemv_roofline"]["median"]
        print(f"  {row['quantization']}: step {step:.0f} us, GEMVs {gemv:.0f} us ({100 * share:.1f}% of the "
              "read roofline)", flush=True)  # fmt: skip
        del llm, engine
        gc.collect()
        torch.cuda.empty_cache()
    return results


# ---- filled-cache decode: FP8 weights + FP8 cache -----------------------------------------------------
FILLED_WINDOWS, FILLED_STEPS = 10, 32


@torch.inference_mode()
def filled(contexts: list[int], ceiling: float) -> dict:
    """Decode from position `context` of a cache filled with random e4m3 values (no prefill), FP8
    weights + FP8 cache: tok/s per window of graph replays, against the read roofline; a context
    the memory plan refuses is reported with its one line. Also the plan's longest prompt."""
    llm = LLM(MODEL, quantization="fp8", kv_cache_dtype="fp8", prefix_reuse=False)
    engine = llm.engine
    weights, kv = step_weight_bytes(llm.model), engine.planner.kv_bytes_per_token
    report = dict(weights=weights_description(llm.model), step_weight_bytes=weights, kv_bytes_per_token=kv)
    report["fit_tokens"] = engine.planner.fit_tokens(engine.free_bytes() + engine.cache_bytes)
    print(f"  the memory plan fits a prompt of {report['fit_tokens']:,} tokens", flush=True)
    rows = []
    margin = (1 + FILLED_WINDOWS) * FILLED_STEPS  # the warm-up window and the timed ones
    for context in sorted(contexts, reverse=True):  # the longest first, on a device nothing else has used
        try:
            llm.check_fits(context + margin, 1)
        except UserError as refusal:
            rows.append(dict(context=context, refused=str(refusal)))
            print(f"  {context:,}: {refusal}", flush=True)
            continue
        fill_cache(start_filled(engine, context, margin))
        window = lambda e=engine: [e.step(1, GREEDY, False) for _ in range(FILLED_STEPS)]  # noqa: E731
        # a warm-up window (its first step captures the graph), then the timed ones
        tok_s = [FILLED_STEPS * 1e3 / ms for ms in event_ms(window, FILLED_WINDOWS)]
        roofline = ceiling / (weights + kv * (context + margin - FILLED_WINDOWS * FILLED_STEPS / 2))
        row = dict(
            context=context, decode_tok_s=statistics.median(tok_s), decode_min=min(tok_s),
            decode_max=max(tok_s), roofline_tok_s=roofline, n=FILLED_WINDOWS,
        )  # fmt: skip
        rows.append(row)
        print(f"  {context:,}: {row['decode_tok_s']:.1f} tok/s ({min(tok_s):.1f}-{max(tok_s):.1f}), "
              f"{100 * row['decode_tok_s'] / roofline:.1f}% of {roofline:.1f}", flush=True)  # fmt: skip
        llm.release_cache()  # the cache and its graphs: the device's free memory is what the next plan counts
        gc.collect()
        torch.cuda.empty_cache()
    report["rows"] = sorted(rows, key=lambda r: r["context"])
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return report


# ---- end to end --------------------------------------------------------------------------------------
def e2e(lengths: list[int], new: int, repeats: int, ceiling: float) -> list[dict]:
    results = []
    for quantization in (None, "fp8"):
        llm = LLM(MODEL, quantization=quantization, prefix_reuse=False)
        weights = step_weight_bytes(llm.model)
        kv = llm.engine.planner.kv_bytes_per_token
        warm_up = llm.random_prompt(256, seed=99)  # compiles the kernels, captures the step's graph
        llm.generate(token_ids=warm_up, max_new_tokens=8, temperature=0, ignore_eos=True)
        for length in lengths:
            decode, prefill = [], []
            for r in range(repeats):
                prompt = llm.random_prompt(length, seed=r)
                result = llm.generate(token_ids=prompt, max_new_tokens=new, temperature=0, ignore_eos=True)
                decode.append(result.stats.decode_tokens_per_s)
                prefill.append(result.stats.prefill_seconds)
            roofline = ceiling / (weights + kv * (length + new / 2))
            row = dict(
                weights=weights_description(llm.model), quantization=quantization or "none", length=length,
                step_weight_bytes=weights, decode_tok_s=statistics.median(decode), decode_min=min(decode),
                decode_max=max(decode), prefill_s=statistics.median(prefill), prefill_min=min(prefill),
                prefill_max=max(prefill), roofline_tok_s=roofline, n=repeats,
            )  # fmt: skip
            results.append(row)
            print(f"  {row['weights']} @ {length:,}: decode {row['decode_tok_s']:.1f} tok/s "
                  f"({min(decode):.1f}-{max(decode):.1f}, {100 * row['decode_tok_s'] / roofline:.1f}% of "
                  f"{roofline:.0f}), prefill {row['prefill_s']:.3f} s", flush=True)  # fmt: skip
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return results


# ---- accuracy ----------------------------------------------------------------------------------------
@torch.inference_mode()
def logits_of(llm: LLM, prompt: list[int], feed: list[int] | None, steps: int):
    """Every prompt position's logits [T, V] (prefill) and `steps` decode steps' [steps, V] (fed
    greedily when feed is None, else `feed`), float32, and the tokens fed."""
    from minidecode.models.cache import KVCache

    cfg, device, model = llm.config, llm.device, llm.model
    cache = KVCache(cfg.num_layers, 1, cfg.num_kv_heads, len(prompt) + steps, cfg.head_dim, llm.dtype, device)
    hidden = model.prefill(torch.tensor([prompt], device=device), cache, 8192, last_only=False)
    prefill = model.logits(hidden[0])  # [T, V]
    token, decode, fed = int(prefill[-1].argmax()), [], []
    for i in range(steps):
        token = token if feed is None else feed[i]
        fed.append(token)
        position = torch.tensor([len(prompt) + i], device=device)
        out = model.logits(model.decode(torch.tensor([token], device=device), position, cache))[0]
        decode.append(out)
        token = int(out.argmax())
    return prefill, torch.stack(decode), fed


def compare(ref: torch.Tensor, got: torch.Tensor, rows: int = 256) -> dict:
    """KL(ref || got) per position (nats), top-1 agreement and the relative error of logits
    [T, V], in float64, `rows` positions at a time (bounded temporaries)."""
    kl, agree, diff, norm = [], 0, 0.0, 0.0
    for s in range(0, ref.shape[0], rows):
        r, g = ref[s : s + rows].double(), got[s : s + rows].double()
        log_p, log_q = r.log_softmax(-1), g.log_softmax(-1)
        kl.append((log_p.exp() * (log_p - log_q)).sum(-1))
        agree += int((r.argmax(-1) == g.argmax(-1)).sum())
        diff, norm = diff + float((g - r).square().sum()), norm + float(r.square().sum())
    kl = torch.cat(kl)
    return dict(
        kl_mean=kl.mean().item(), kl_max=kl.max().item(), top1=agree / ref.shape[0],
        rel_err=(diff / norm) ** 0.5, positions=ref.shape[0],
    )  # fmt: skip


def accuracy(context: int, steps: int) -> dict:
    out = {}
    llm = LLM(MODEL, prefix_reuse=False)
    prompt = llm.random_prompt(context, seed=7)
    ref_prefill, ref_decode, fed = logits_of(llm, prompt, None, steps)  # kept on the GPU (2 GiB at 4k)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(MODEL, quantization="fp8", prefix_reuse=False)
    prefill, decode, _ = logits_of(llm, prompt, fed, steps)
    out["prefill"] = compare(ref_prefill, prefill)
    out["decode"] = compare(ref_decode, decode)
    out["weights"] = weights_description(llm.model)
    for part in ("prefill", "decode"):
        r = out[part]
        kl = f"KL mean {r['kl_mean']:.2e} max {r['kl_max']:.2e} nats"
        top1 = f"top-1 {100 * r['top1']:.1f}%"
        print(f"  {part}: {kl}, {top1}, logits rel err {r['rel_err']:.2e}, {r['positions']} positions")
    return out


# ---- report --------------------------------------------------------------------------------------------
def table(title: str, header: list[str], rows: list[list[str]]) -> list[str]:
    return (
        [title, "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        + ["| " + " | ".join(r) + " |" for r in rows]
        + [""]
    )


def markdown(report: dict) -> str:
    lines = [f"# FP8 weights, {report['device']} ({report['date']})", ""]
    made = f"Commit {report.get('commit')} · torch {report.get('torch')} · `python bench/fp8_weights.py`"
    lines += [made, ""]
    lines += [f"Read ceiling (read-only reduction, same run): {report['ceiling_gbs']:,.0f} GB/s.", ""]
    if report.get("gemv"):
        header = ["matrix", "bf16 GEMV us", "GB/s", "FP8 GEMV us", "GB/s", "% of read roofline", "speedup"]
        header += ["op: bf16 us", "op: FP8 us"]
        rows = [
            [r["matrix"], spread(r["bf16_us"]), f"{r['bf16_gbs']:,.0f}", spread(r["fp8_us"]),
             f"{r['fp8_gbs']:,.0f}", f"{100 * r['fp8_roofline']:.1f}%", f"{r['speedup']:.2f}x",
             spread(r["bf16_op_us"]), f"{spread(r['fp8_op_us'])} ({r['op_speedup']:.2f}x)"]
            for r in report["gemv"]
        ]  # fmt: skip
        title = "## Decode GEMV, 1 row, Llama-3-8B shapes (us per call: median (min-max) of 15 graph replays)"
        lines += table(title, header, rows)
        lines += [
            "op: what the decode step launches for the projection: the RMSNorm in front (qkv, gate_up;"
            " FP8: normalised and rounded to e4m3 in one launch), or the input's rounding (FP8 o_proj,"
            " down), then the GEMV. (x): bf16 op / FP8 op.",
            "",
        ]
    if report.get("step"):
        names = ["lm_head", "attention", "norms and roundings", "the rest"]

        def pct(t: dict) -> str:
            return f"{100 * t['median']:.1f}% ({100 * t['low']:.1f}-{100 * t['high']:.1f})"

        rows = [
            [r["weights"], spread(r["step_us"]), spread(r["gemv_us"])]
            + [f"{r['parts_us'].get(n, 0.0):,.1f}" for n in names] + [pct(r["gemv_roofline"])]
            for r in report["step"]
        ]  # fmt: skip
        header = ["weights", "step us", "GEMVs us", *(f"{n} us" for n in names), "GEMVs % of read roofline"]
        n = report["step"][0]["n"]
        title = (f"## The decode step at {STEP_CONTEXT} positions (a filled cache; torch profiler over {n} "
                 "graph-replayed steps; us a step: median (min-max) over the steps, the other parts' "
                 "medians)")  # fmt: skip
        lines += table(title, header, rows)
        lines += [
            "Each kernel is charged the time from the later of its start and the previous kernel's end to"
            " its own end (under PDL a kernel starts before its predecessor ends). GEMV bytes: every"
            " layer's four projections as the GEMV table counts them.",
            "",
        ]
    if report.get("e2e"):
        base = {r["length"]: r for r in report["e2e"] if r["quantization"] == "none"}
        rows = []
        for r in report["e2e"]:
            b = base[r["length"]]
            rows.append([
                f"{r['length']:,}", r["weights"],
                f"{r['decode_tok_s']:.1f} ({r['decode_min']:.1f}-{r['decode_max']:.1f})",
                f"{100 * r['decode_tok_s'] / r['roofline_tok_s']:.1f}%",
                f"{r['prefill_s']:.3f} ({r['prefill_min']:.3f}-{r['prefill_max']:.3f})",
                f"{r['decode_tok_s'] / b['decode_tok_s']:.2f}x", f"{b['prefill_s'] / r['prefill_s']:.2f}x",
            ])  # fmt: skip
        header = ["prompt", "weights", "decode tok/s", "% of roofline", "prefill s", "decode vs bf16"]
        header.append("prefill speed vs bf16")
        n = report["e2e"][0]["n"]
        lines += table(f"## End to end, {MODEL}, batch 1 (median (min-max) of {n})", header, rows)
    if report.get("filled"):
        f = report["filled"]
        rows = [
            [f"{r['context']:,}", "refused: " + r["refused"]] + [""] * 2 if "refused" in r else
            [f"{r['context']:,}", f"{r['decode_tok_s']:.1f} ({r['decode_min']:.1f}-{r['decode_max']:.1f})",
             f"{r['roofline_tok_s']:.1f}", f"{100 * r['decode_tok_s'] / r['roofline_tok_s']:.1f}%"]
            for r in f["rows"]
        ]  # fmt: skip
        title = (
            f"## Filled-cache decode, {MODEL}, FP8 weights + FP8 cache, batch 1 (median (min-max) of"
            f" {FILLED_WINDOWS} windows of {FILLED_STEPS} steps)"
        )
        lines += table(title, ["context", "decode tok/s", "read roofline tok/s", "% of read roofline"], rows)
        lines += [
            f"Weights: {f['weights']}; a step reads {f['step_weight_bytes'] / 1e9:.2f} GB of weights and"
            f" {f['kv_bytes_per_token']:,} bytes of cache a position. The memory plan fits a prompt of"
            f" {f['fit_tokens']:,} tokens on this GPU (its cache and prefill beside the weights).",
            "",
        ]
    if report.get("accuracy"):
        a = report["accuracy"]
        rows = [
            [part, str(a[part]["positions"]), f"{a[part]['kl_mean']:.2e}", f"{a[part]['kl_max']:.2e}",
             f"{100 * a[part]['top1']:.1f}%", f"{a[part]['rel_err']:.2e}"]
            for part in ("prefill", "decode")
        ]  # fmt: skip
        header = ["part", "positions", "KL mean (nats)", "KL max", "top-1 agreement", "logits rel err"]
        title = f"## FP8-weight logits against bf16's, {MODEL}, a {report['accuracy_context']:,}-token prompt"
        lines += table(title, header, rows)
    return "\n".join(lines)


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--out", type=Path, default=Path("bench/logs"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 32768])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--accuracy-context", type=int, default=4096)
    parser.add_argument("--filled", type=int, nargs="+", default=[131072, 524288, 1048576])
    parser.add_argument("--skip", default="", help="comma-separated: gemv, step, e2e, filled, accuracy")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    skip = set(filter(None, args.skip.split(",")))
    args.out.mkdir(parents=True, exist_ok=True)
    ceiling = measure_ceilings(torch.device("cuda")).read_bytes_per_s
    report = dict(
        device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), commit=provenance()["commit"],
        torch=torch.__version__,
    )  # fmt: skip
    report["ceiling_gbs"] = ceiling / 1e9
    print(f"read ceiling {ceiling / 1e9:,.0f} GB/s on {report['device']}", flush=True)
    if "gemv" not in skip:
        print("GEMV:", flush=True)
        with torch.inference_mode():
            report["gemv"] = [gemv_row(name, *shape, ceiling) for name, shape in SHAPES.items()]
    if "step" not in skip:
        print(f"the GEMVs in the decode step at {STEP_CONTEXT}:", flush=True)
        report["step"] = in_step(ceiling, args.out)
    if "e2e" not in skip:
        print("end to end:", flush=True)
        report["e2e"] = e2e(args.lengths, args.new_tokens, args.repeats, ceiling)
    if "filled" not in skip:
        print("filled-cache decode, FP8 weights + FP8 cache:", flush=True)
        report["filled"] = filled(args.filled, ceiling)
    if "accuracy" not in skip:
        print("accuracy:", flush=True)
        report["accuracy_context"] = args.accuracy_context
        report["accuracy"] = accuracy(args.accuracy_context, 64)
    (args.out / "fp8-weights.json").write_text(json.dumps(report, indent=1))
    text = markdown(report)
    (args.out / "fp8-weights.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

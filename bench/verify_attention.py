"""Verification-step attention (speculative decoding): k drafts plus the last token, k + 1 query
positions causal among themselves over the whole cache, one layer of 32 query / 8 KV heads at
head_dim 128, batch 1; the lean kernel with q_lens (bf16 and FP8 caches) against the plain
one-position decode step and against SDPA flash (GQA, the k + 1 queries with a lower-right
causal mask over the drafts), all timed under CUDA graphs in the same run (bench/timing.py).

The cache holds `length` positions, the k + 1 new ones last; the plain step is one query over
the same cache. Each path is checked before it is timed: lean (bf16) against flash, lean (FP8)
against float32 attention over the dequantized cache. Small cases rotate over several input sets,
as bench/attention.py does, so that repeated calls do not measure the L2 cache.

    python bench/verify_attention.py --out bench/results/verify-attention   # .md and .json
    python bench/verify_attention.py --warmup   # compile every kernel variant, time nothing
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from attention import ROTATE_BYTES, environment, rel_err  # bench/attention.py
from timing import time_graph  # bench/timing.py
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from minidecode.kernels import lean_attention as la
from minidecode.kernels.quant import dequantize_fp8, quantize_fp8
from minidecode.kernels.reference import multi_query_attention_reference

HQ, HKV, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
K = 1024
LENGTHS = (K, 32 * K, 128 * K, 512 * K)
DRAFTS = (0, 1, 3, 4, 7, 8, 15, 16)  # the runtime's draft sizes at G = 4 (1, 3, 7, 15), and one past each
RESULTS = Path(__file__).resolve().parent / "results" / "verify-attention"


@dataclass
class InputSet:
    q: torch.Tensor  # [1, Q, Hq, D], Q = max drafts + 1: the verify step's queries (first k + 1)
    k: torch.Tensor  # [1, Hkv, L, D] bf16 cache
    v: torch.Tensor
    lengths: torch.Tensor  # [1] int32 = L
    fp8: tuple  # (k e4m3 [1, Hkv, L, D], v blocked_t, kv_scale [1, Hkv, L, 2], k dequantized, v dequantized)


def make_sets(length: int, q_max: int, gen: torch.Generator, fp8: bool) -> list[InputSet]:
    kv_bytes = 2 * length * HKV * HEAD_DIM * DTYPE.itemsize
    sets = []
    for _ in range(max(1, min(64, ROTATE_BYTES // kv_bytes))):
        q = torch.randn(1, q_max, HQ, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE)
        k = torch.randn(1, HKV, length, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE)
        v = torch.randn(1, HKV, length, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE)
        lengths = torch.tensor([length], dtype=torch.int32, device="cuda")
        cache = ()
        if fp8:
            (k8, ks), (v8, vs) = quantize_fp8(k), quantize_fp8(v)
            cache = (k8, la.to_v_blocked_t(v8), torch.stack((ks, vs), -1), None, None)
            if not sets:  # the check's reference reads the dequantized cache of set 0 only
                cache = (*cache[:3], dequantize_fp8(k8, ks), dequantize_fp8(v8, vs))
        sets.append(InputSet(q, k, v, lengths, cache))
    return sets


# ---- the calls ----------------------------------------------------------------------------------


def plain_call(x: InputSet, scale: float, fp8: bool) -> Callable[[], torch.Tensor]:
    """The decode step: one query (position 0 of q, as its own [1, Hq, D] tensor)."""
    q, out = x.q[:, 0].contiguous(), torch.empty(1, HQ, HEAD_DIM, device="cuda", dtype=DTYPE)
    if fp8:
        k8, vt, kv_scale = x.fp8[:3]
        return lambda: la.lean_attention(q, k8, vt, x.lengths, scale, kv_scale=kv_scale, out=out)
    return lambda: la.lean_attention(q, x.k, x.v, x.lengths, scale, out=out)


def verify_call(x: InputSet, scale: float, drafts: int, fp8: bool) -> Callable[[], torch.Tensor]:
    """The verification step: drafts + 1 query positions ([1, Q, Hq, D] view of q, q_lens [1])."""
    q = x.q[:, : drafts + 1]
    q_lens = torch.tensor([drafts + 1], dtype=torch.int32, device="cuda")
    out = torch.empty(q.shape, device="cuda", dtype=DTYPE)
    if fp8:
        k8, vt, kv_scale = x.fp8[:3]
        kw = {"kv_scale": kv_scale, "out": out, "q_lens": q_lens}
        return lambda: la.lean_attention(q, k8, vt, x.lengths, scale, **kw)
    return lambda: la.lean_attention(q, x.k, x.v, x.lengths, scale, out=out, q_lens=q_lens)


def flash_call(x: InputSet, scale: float, drafts: int) -> Callable[[], torch.Tensor]:
    """SDPA flash, GQA: q [1, Hq, k + 1, D] over [1, Hkv, L, D], causal aligned to the cache's end
    (query j sees the first L - k + j positions). No drafts: the GQA group packed into the query
    axis instead, [1, Hkv, G, D] (bench/attention.py's fastest flash call for the plain step)."""
    n = x.k.shape[2]
    if drafts == 0:
        qg = x.q[:, 0].reshape(1, HKV, HQ // HKV, HEAD_DIM)

        def plain() -> torch.Tensor:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(qg, x.k, x.v, scale=scale).reshape(1, 1, HQ, HEAD_DIM)

        return plain
    q = x.q[:, : drafts + 1].transpose(1, 2)  # [1, Hq, k + 1, D]
    mask = causal_lower_right(drafts + 1, n)

    def call() -> torch.Tensor:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out = F.scaled_dot_product_attention(q, x.k, x.v, attn_mask=mask, scale=scale, enable_gqa=True)
        return out.transpose(1, 2)  # [1, k + 1, Hq, D]

    return call


# ---- one length -----------------------------------------------------------------------------------


def bench_length(length: int, args: argparse.Namespace) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(length)
    sets = make_sets(length, max(args.drafts) + 1, gen, args.fp8)
    scale = HEAD_DIM**-0.5
    x0 = sets[0]
    rows = []

    def timed(make: Callable[[InputSet], Callable[[], torch.Tensor]]) -> dict:
        try:
            if args.warmup:
                make(x0)()
                torch.cuda.synchronize()
                return {}
            t = time_graph([make(x) for x in sets])
            return {"us": t.median, "low": t.low, "high": t.high}
        except Exception as e:  # a path that fails on this device is reported, not fatal
            return {"error": f"{type(e).__name__}: {e}"[:300]}

    plain = {"lean": timed(lambda x: plain_call(x, scale, False))}
    if args.fp8:
        plain["lean_fp8"] = timed(lambda x: plain_call(x, scale, True))
    for k in args.drafts:
        row = {"length": length, "drafts": k, "paths": {}}
        ql = torch.tensor([k + 1], dtype=torch.int32)
        errs = {}
        if not args.warmup:  # checks on set 0: lean vs flash (bf16), lean FP8 vs the dequantized cache
            try:
                flash_out = flash_call(x0, scale, k)().float()
                errs["lean_vs_flash"] = rel_err(verify_call(x0, scale, k, False)(), flash_out)
            except Exception as e:
                errs["lean_vs_flash"] = f"{type(e).__name__}: {e}"[:300]
            if args.fp8:
                k_deq, v_deq = x0.fp8[3:]
                ref = multi_query_attention_reference(
                    x0.q[:, : k + 1].float(), k_deq, v_deq, x0.lengths.cpu(), ql, scale
                )
                errs["lean_fp8_vs_dequantized"] = rel_err(verify_call(x0, scale, k, True)(), ref)
        row["check"] = errs
        row["paths"]["lean"] = timed(lambda x, k=k: verify_call(x, scale, k, False))
        if args.fp8:
            row["paths"]["lean_fp8"] = timed(lambda x, k=k: verify_call(x, scale, k, True))
        if not args.no_flash:
            row["paths"]["flash"] = timed(lambda x, k=k: flash_call(x, scale, k))
        for name, entry in row["paths"].items():
            base = plain.get(name) or (plain["lean"] if name == "flash" else {})
            if "us" in entry and "us" in base:
                entry["x_plain"] = entry["us"] / base["us"]  # flash: over the plain lean step
        lean, flash = row["paths"]["lean"], row["paths"].get("flash", {})
        if "us" in lean and "us" in flash:
            lean["speedup_vs_flash"] = flash["us"] / lean["us"]
        row["plain"] = plain
        rows.append(row)
    sets.clear()  # this length's caches freed before the next one's
    x0 = None
    torch.cuda.empty_cache()
    return rows


# ---- output -----------------------------------------------------------------------------------------


def us(entry: dict) -> str:
    if "us" in entry:
        return f"{entry['us']:.1f}"
    return "error" if "error" in entry else "—"


def ratio(entry: dict, key: str) -> str:
    return f"{entry[key]:.2f}x" if key in entry else "—"


def error_cell(err: float | str | None) -> str:
    """A check's relative error, or what stopped it (the path's error: listed below the table)."""
    if err is None:
        return "—"
    return "error" if isinstance(err, str) else f"{err:.1e}"


def markdown(env: dict, rows: list[dict]) -> str:
    lines = [
        "# Verification-step attention: k drafts + 1 query positions, lean vs the plain step and flash",
        "",
        f"Device: {env['device']} ({env['sms']} SMs) · date {env['date']} · commit {env['commit']} · "
        f"torch {env['torch']} · triton {env['triton']} · bfloat16 q, 32 query / 8 KV heads, head_dim 128, "
        "batch 1",
        "",
        f"Command: `{env['command']}`",
        "",
        "Times in microseconds (median of 15 CUDA-graph replays). x plain: over the plain one-position "
        "lean step on the same cache (FP8: the FP8 plain step; flash: the bf16 plain lean step). "
        "Flash: SDPA's flash backend, GQA, a lower-right causal mask over the k + 1 queries "
        "(k = 0: the group packed into the query axis). Errors: lean (bf16) against flash, lean FP8 "
        "against float32 attention over the dequantized cache.",
        "",
        "| context | k | plain lean | verify lean (x plain) | plain FP8 | verify FP8 (x plain FP8) "
        "| flash (x plain lean) | lean vs flash | err vs flash | FP8 err |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        p, plain = r["paths"], r["plain"]
        fp8, flash = p.get("lean_fp8", {}), p.get("flash", {})
        err = r["check"].get("lean_vs_flash")
        ferr = r["check"].get("lean_fp8_vs_dequantized")
        lines.append(
            f"| {r['length'] // K}k | {r['drafts']} | {us(plain['lean'])} | {us(p['lean'])} "
            f"({ratio(p['lean'], 'x_plain')}) | {us(plain.get('lean_fp8', {}))} | {us(fp8)} "
            f"({ratio(fp8, 'x_plain')}) | {us(flash)} ({ratio(flash, 'x_plain')}) "
            f"| {ratio(p['lean'], 'speedup_vs_flash')} "
            f"| {error_cell(err)} | {error_cell(ferr)} |"
        )
    errors = sorted(
        {f"{name}: {e['error']}" for r in rows for name, e in r["paths"].items() if "error" in e}
        | {f"{name}: {e['error']}" for r in rows for name, e in r["plain"].items() if "error" in e}
    )
    lines += ["", *[f"- error, {e}" for e in errors]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="cache lengths, comma-separated")
    ap.add_argument("--drafts", default=",".join(map(str, DRAFTS)), help="draft counts k, comma-separated")
    ap.add_argument("--out", type=Path, default=None, help="prefix of the .md/.json results")
    ap.add_argument("--no-fp8", dest="fp8", action="store_false", help="skip the FP8 cache")
    ap.add_argument("--no-flash", action="store_true", help="skip SDPA flash")
    ap.add_argument("--warmup", action="store_true", help="run each path once (compiles), time nothing")
    ap.add_argument("--commit", default=os.environ.get("MINIDECODE_COMMIT"), help="commit to record")
    args = ap.parse_args()
    args.drafts = [int(s) for s in args.drafts.split(",")]
    lengths = [int(s) for s in args.lengths.split(",")]
    env = environment(args.commit)
    env["command"] = "python3 bench/verify_attention.py " + " ".join(sys.argv[1:])
    print(json.dumps(env), flush=True)
    rows = []
    for length in lengths:
        t0 = time.perf_counter()
        got = bench_length(length, args)
        rows += got
        for r in got:
            brief = {n: round(e["us"], 1) for n, e in r["paths"].items() if "us" in e}
            print(f"{length // K}k k={r['drafts']}: {brief} {r['check']}", flush=True)
        print(f"{length // K}k: {time.perf_counter() - t0:.0f} s", flush=True)
    if args.warmup:
        return
    if args.out is None:
        args.out = RESULTS
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    table = markdown(env, rows)
    args.out.with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()

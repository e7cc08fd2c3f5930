"""A mixed step's chunk attention: C prompt rows after a past of P positions, one layer of 32 query /
8 KV heads at head_dim 128, bf16. kernels/chunk_attention.py (bounds on the device, what the
mixed step's CUDA graph runs), each launch config given, against SDPA's flash forward in one call
(FlashAttention-2 with its own key split, bounds on the host: what the eager mixed step runs), both
timed under CUDA graphs in the same run (bench/timing.py), each checked against float64 on a few
rows before it is timed. TFLOP/s count the causal work only: 4 D Hq per (query, key it sees).

    python bench/chunk_attention.py --out bench/results/chunk-attention   # .md and .json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from attention import environment  # bench/attention.py
from timing import time_graph  # bench/timing.py

from minidecode.kernels.chunk_attention import DEFAULT_CONFIG, ChunkConfig, chunk_attention, chunk_splits
from minidecode.kernels.prefill import flash_suffix_attention

HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
K = 1024
PASTS = (0, 8 * K, 32 * K, 128 * K, 512 * K)
ROWS = (64, 128, 384)
CONFIGS = {
    "128x64 w8 s3": DEFAULT_CONFIG,
    "128x128 w8 s2": ChunkConfig(128, 128, 8, 2),
    "64x64 w4 s3": ChunkConfig(64, 64, 4, 3),
}


def flops(past: int, rows: int) -> float:
    return 4.0 * D * HQ * (rows * past + rows * (rows + 1) / 2)


def check(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> float:
    """Relative error of out [C, Hq, D] against float64 on 8 of its rows."""
    C, G = q.shape[0], HQ // HKV
    picks = sorted({0, 1, C // 3, C // 2, C - 3, C - 2, C - 1, 2 * C // 3} & set(range(C)))
    errs = []
    keys, values = k.double(), v.double()  # [Hkv, n, D]
    for i in picks:
        seen = past + i + 1
        scores = torch.einsum("hgd,hnd->hgn", q[i].double().view(HKV, G, D), keys[:, :seen]) * D**-0.5
        ref = torch.einsum("hgn,hnd->hgd", scores.softmax(-1), values[:, :seen]).reshape(HQ, D)
        errs.append(((out[i].double() - ref).norm() / ref.norm()).item())
    return max(errs)


def run_case(past: int, rows: int, k: torch.Tensor, v: torch.Tensor, sms: int) -> dict:
    """Every path on `rows` random queries after `past` positions of the cache row k/v."""
    q = torch.randn(rows, HQ, D, device="cuda", dtype=DTYPE)
    where = torch.tensor([past, rows, 0, 0], device="cuda")
    row = {"past": past, "rows": rows, "tflop": flops(past, rows) / 1e12, "paths": {}}
    for name, config in CONFIGS.items():
        splits = chunk_splits(rows, HQ, HKV, sms, config)

        def ours(config=config, splits=splits):
            return chunk_attention(q, k, v, where, splits, D**-0.5, config)

        t = time_graph([ours])
        err = check(ours(), q, k, v, past)
        row["paths"][name] = {"us": t.median, "low": t.low, "high": t.high, "err": err, "splits": splits}
    q4 = q.transpose(0, 1)[None]  # [1, Hq, C, D]
    k4, v4 = (t[None, :, : past + rows] for t in (k, v))  # [1, Hkv, P + C, D], views of the row

    def flash():
        return flash_suffix_attention(q4, k4, v4, D**-0.5)

    t = time_graph([flash])
    err = check(flash()[0].transpose(0, 1), q, k, v, past)
    row["paths"]["flash"] = {"us": t.median, "low": t.low, "high": t.high, "err": err}
    for path in row["paths"].values():
        path["tflops"] = row["tflop"] / (path["us"] * 1e-6)
        path["x_flash"] = row["paths"]["flash"]["us"] / path["us"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write OUT.md and OUT.json")
    parser.add_argument("--commit", help="the commit to record (default: this checkout's)")
    parser.add_argument("--pasts", type=int, nargs="+", default=list(PASTS))
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/chunk_attention.py times a CUDA GPU")
    env = environment(args.commit)
    results = []
    for past in args.pasts:
        torch.manual_seed(past)
        n = past + max(args.rows)
        k, v = (torch.randn(HKV, n, D, device="cuda", dtype=DTYPE) for _ in "kv")  # a cache row [Hkv, P, D]
        for rows in args.rows:
            row = run_case(past, rows, k, v, env["sms"])
            results.append(row)
            cells = ", ".join(
                f"{p}: {r['us']:.1f} us {r['tflops']:.0f} TF/s" for p, r in row["paths"].items()
            )
            print(f"past {past:>7} rows {rows:>4}: {cells}", flush=True)
        del k, v
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {"environment": env, "results": results}
        args.out.with_suffix(".json").write_text(json.dumps(record, indent=1))
        args.out.with_suffix(".md").write_text(table(env, results))
    print(table(env, results))


def table(env: dict, results: list[dict]) -> str:
    names = list(CONFIGS) + ["flash"]
    lines = [
        "# A mixed step's chunk attention: C rows after a past of P positions",
        "",
        f"{env['device']} ({env['sms']} SMs) · {env['date']} · commit {env['commit']} · "
        f"torch {env['torch']} · triton {env['triton']} · bf16, 32 query / 8 KV heads, head_dim 128, "
        "one layer",
        "",
        "Microseconds (median of 15 CUDA-graph replays; min-max in the .json), TFLOP/s of the causal work, "
        "and x flash: SDPA's flash forward in one call over the same rows. Ours: kernels/chunk_attention.py, "
        "by launch config (packed rows x keys a tile, warps, stages); the first is the default.",
        "",
        "| past | rows | " + " | ".join(names) + " |",
        "| --- | --- | " + " | ".join("---" for _ in names) + " |",
    ]
    for r in results:
        cells = []
        for name in names:
            p = r["paths"][name]
            ratio = "" if name == "flash" else f", {p['x_flash']:.2f}x"
            cells.append(f"{p['us']:.1f} ({p['tflops']:.0f}{ratio})")
        lines.append(f"| {r['past']:,} | {r['rows']} | " + " | ".join(cells) + " |")
    worst = max(p["err"] for r in results for p in r["paths"].values())
    lines += ["", f"Largest relative error against float64 (8 rows a case, every path): {worst:.1e}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

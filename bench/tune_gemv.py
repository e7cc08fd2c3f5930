"""Sweep the decode GEMV's launch parameters on the GPU against cuBLAS, for the 8B shapes.

Each case cycles 32 distinct weight matrices inside one CUDA graph (each read cold from HBM, as
in a decode step) and reports microseconds per call and GB/s. Peers in the same run:
- cuBLAS: `F.linear` for qkv and gate/up, `F.linear` + the residual add for o_proj / down_proj
  (what the step ran before);
- the Triton GEMV (adding into the residual for o_proj / down_proj), with and without
  programmatic dependent launch (PDL lets each call start while the previous one drains, as the
  step's kernels do).

    python bench/tune_gemv.py [--rows 1 16] [--out DIR]

--rows: the rows of x (a batched decode step multiplies B tokens' activations), up to the
GEMV's MAX_ROWS.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from timing import time_graph  # bench/timing.py (run as a script: bench/ is on the import path)

from minidecode.kernels.gemv import GemvConfig, gemv

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1], help="rows of x (batch size)")
    parser.add_argument("--out", type=Path, default=Path("bench/logs"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
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

"""Sweep lean attention's schedule knobs against SDPA flash, in one run under CUDA graphs.

- `min_tiles` (fewest tiles a working CTA takes): hypothesis, fewer and longer ranges at short
  context shorten the merge. Refuted on an H200 (bench/NOTES-attention.md, version 3).
- `merge_chunk` (partials merged per round): hypothesis, the merge after the last contributor
  is a chain of dependent L2 round trips, one per chunk of 8 partials (18-20 partials a head at
  132 CTAs); 16 or 32 per round should cut it from 3 rounds to 2 or 1.

    python bench/tune_schedule.py
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import HEAD_DIM, Case, K, lean_call, make_sets, rel_err, sdpa_call, time_graph  # noqa: E402

from minidecode.kernels import lean_attention as la  # noqa: E402

CASES = [Case(f"B1 32/8 {n // K}k", 32, 8, (n,)) for n in (1 * K, 4 * K, 16 * K, 64 * K, 128 * K, 512 * K)]
CASES += [Case("B1 64/8 8k", 64, 8, (8 * K,)), Case("B16 32/8 32k", 32, 8, (32 * K,) * 16)]
BASE = la.default_config(HEAD_DIM, torch.bfloat16)
VARIANTS = {"default": BASE}
VARIANTS |= {f"merge {c}": dataclasses.replace(BASE, merge_chunk=c) for c in (16, 32)}
VARIANTS |= {f"min_tiles {t}": dataclasses.replace(BASE, min_tiles=t) for t in (2, 4)}


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = HEAD_DIM**-0.5
    rows = []
    for case in CASES:
        sets = make_sets(case, gen)
        flash = time_graph([sdpa_call(case, x, scale, SDPBackend.FLASH_ATTENTION) for x in sets])
        ref = sdpa_call(case, sets[0], scale, SDPBackend.FLASH_ATTENTION)()
        times = {}
        for name, config in VARIANTS.items():
            err = rel_err(lean_call(sets[0], scale, config)(), ref)
            assert err < 2e-2, (case.name, name, err)
            times[name] = time_graph([lean_call(x, scale, config) for x in sets])
        rows.append((case.name, flash, times))
        print(case.name, f"flash {flash:.1f}", " ".join(f"{k}={t:.1f}" for k, t in times.items()), flush=True)
        del sets
        torch.cuda.empty_cache()
    print("| case | flash us | " + " | ".join(VARIANTS) + " |")
    print("|" + " --- |" * (len(VARIANTS) + 2))
    for name, flash, times in rows:
        print(
            f"| {name} | {flash:.1f} | "
            + " | ".join(f"{t:.1f} ({flash / t:.2f}x)" for t in times.values())
            + " |"
        )
    batch1 = [r for r in rows if r[0].startswith("B1 32/8")]
    for variant in VARIANTS:
        gm = math.exp(sum(math.log(flash / times[variant]) for _, flash, times in batch1) / len(batch1))
        worst = min(flash / times[variant] for _, flash, times in rows)
        print(f"{variant}: geomean over flash (B1 32/8) {gm:.3f}x, worst case {worst:.2f}x")


if __name__ == "__main__":
    main()

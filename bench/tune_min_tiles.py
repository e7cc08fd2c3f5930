"""Sweep lean attention's `min_tiles` (fewest tiles a working CTA takes) against SDPA flash.

Hypothesis: at short context the even deal splits each head over ~8-16 CTAs, and the merge
of that many partials (plus each CTA's fixed cost) dominates; fewer, longer ranges should cut
1k-16k time without touching long contexts (where every CTA has many tiles anyway).

    python bench/tune_min_tiles.py
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

LENGTHS = [1 * K, 4 * K, 16 * K, 64 * K, 128 * K, 512 * K]
MIN_TILES = [1, 2, 3, 4, 6, 8]


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = HEAD_DIM**-0.5
    base = la.default_config(HEAD_DIM, torch.bfloat16)
    rows = []
    for n in LENGTHS:
        case = Case(f"B1 32/8 {n // K}k", 32, 8, (n,))
        sets = make_sets(case, gen)
        flash = time_graph([sdpa_call(case, x, scale, SDPBackend.FLASH_ATTENTION) for x in sets])
        ref = sdpa_call(case, sets[0], scale, SDPBackend.FLASH_ATTENTION)()
        times = {}
        for mt in MIN_TILES:
            config = dataclasses.replace(base, min_tiles=mt)
            err = rel_err(lean_call(sets[0], scale, config)(), ref)
            assert err < 2e-2, (n, mt, err)
            times[mt] = time_graph([lean_call(x, scale, config) for x in sets])
        rows.append((n, flash, times))
        print(
            case.name,
            f"flash {flash:.1f} us",
            " ".join(f"mt{mt}={t:.1f}" for mt, t in times.items()),
            flush=True,
        )
        del sets
        torch.cuda.empty_cache()
    print("| context | flash us | " + " | ".join(f"min_tiles {mt}" for mt in MIN_TILES) + " |")
    for n, flash, times in rows:
        print(
            f"| {n // K}k | {flash:.1f} | "
            + " | ".join(f"{t:.1f} ({flash / t:.2f}x)" for t in times.values())
            + " |"
        )
    for mt in MIN_TILES:
        gm = math.exp(sum(math.log(flash / times[mt]) for _, flash, times in rows) / len(rows))
        print(f"min_tiles {mt}: geomean speedup over flash {gm:.3f}x")


if __name__ == "__main__":
    main()

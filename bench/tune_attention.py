"""Sweep lean attention's launch parameters on the GPU, and attribute its time.

1. Configs (BLOCK_N, warps, stages, CTAs per SM): each timed under CUDA graphs on a few decode
   cases, checked against SDPA flash first; registers / shared memory / resident CTAs per SM of
   each compiled variant are read from Triton's cache.
2. Attribution (timing only, outputs not checked): copies of the kernel with one step removed --
   no merge; neither merge nor ticket atomic. Their differences from the real kernel are what the
   merge and the ticket cost. `--baseline FILE` times an earlier kernels/lean_attention.py (with
   the first config) alongside, in the same run.

Prints a table last and writes tune.json (with the best config) to --out.

    python bench/tune_attention.py [--out DIR] [--baseline OLD_KERNEL.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import tempfile
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import HEAD_DIM, Case, InputSet, K, make_sets, rel_err, sdpa_call, time_graph  # noqa: E402

from minidecode.kernels import lean_attention as la  # noqa: E402
from minidecode.kernels.lean_attention import LeanConfig  # noqa: E402

CASES = [Case(f"B1 32/8 {n // K}k", 32, 8, (n,)) for n in (1 * K, 4 * K, 16 * K, 64 * K, 128 * K, 512 * K)]
CASES += [Case("B1 64/8 8k", 64, 8, (8 * K,)), Case("B16 32/8 32k", 32, 8, (32 * K,) * 16)]
CONFIGS = [
    LeanConfig(128, 8, 3, 1, merge_chunk=4),
    LeanConfig(128, 8, 3, 1, merge_chunk=2),
    LeanConfig(128, 8, 3, 1, merge_chunk=1),
    LeanConfig(128, 8, 4, 1, merge_chunk=4),
    LeanConfig(128, 8, 3, 1),
    LeanConfig(128, 4, 3, 1, merge_chunk=2),
]
ATOMIC = 'ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")'
MERGE_IF = "if ticket == last - first:"
VARIANTS = {  # name: source replacements of kernels/lean_attention.py
    "no merge": [(MERGE_IF, "if ticket == last - first + 1000000000:")],
    "no atomic, no merge": [(ATOMIC, "ticket = 0"), (MERGE_IF, "if ticket == 1000000000:")],
}


def config_name(c: LeanConfig) -> str:
    merge = f" m{c.merge_chunk}" if c.merge_chunk else ""
    return f"N{c.block_n} w{c.num_warps} s{c.num_stages} x{c.ctas_per_sm}{merge}"


def variant_module(name: str, replacements: list[tuple[str, str]], folder: Path, source: Path | None = None):
    """A copy of the kernel module (or of `source`) with `replacements` applied, imported under
    its own name."""
    src = Path(source or la.__file__).read_text()
    for old, new in replacements:
        assert old in src, f"{name}: {old!r} not in the kernel source"
        src = src.replace(old, new)
    mod_name = "lean_variant_" + "".join(ch if ch.isalnum() else "_" for ch in name)
    path = folder / f"{mod_name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(mod_name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    spec.loader.exec_module(mod)
    return mod


def compiled_kernels() -> dict[int, object]:
    """Triton's cache of compiled lean kernels (an internal structure: best effort)."""
    found = {}
    try:
        for cache in la._lean_decode_kernel.device_caches.values():
            for kernel in cache[0].values():
                found[id(kernel)] = kernel
    except Exception:
        pass
    return found


def residency(kernel) -> str:
    """Registers, shared memory and resident CTAs per SM of one compiled variant."""
    try:
        props = torch.cuda.get_device_properties(0)
        regs_per_sm = getattr(props, "regs_per_multiprocessor", 65536)
        smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
        kernel._init_handles()
        md, regs = kernel.metadata, kernel.n_regs
        by_regs = regs_per_sm // (math.ceil(regs / 8) * 8 * 32 * md.num_warps)
        by_smem = smem_per_sm // (md.shared + 1024)
        return f"{regs} regs {md.shared // 1024} KiB smem -> {min(by_regs, by_smem)} CTA/SM"
    except Exception as e:  # internals differ between Triton versions
        return f"? ({type(e).__name__})"


def call(fn, x: InputSet, scale: float, config: LeanConfig):
    return lambda: fn(x.q, x.k, x.v, x.lengths, scale, config=config, out=x.out)


def gm(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--baseline", type=Path, help="an earlier kernels/lean_attention.py to time alongside")
    args = ap.parse_args()
    scale = HEAD_DIM**-0.5
    folder = Path(tempfile.mkdtemp())
    variants = {n: variant_module(n, r, folder) for n, r in VARIANTS.items()}
    if args.baseline:
        variants["baseline"] = variant_module("baseline", [], folder, args.baseline)
    diag_config = CONFIGS[0]
    results: dict[str, dict[str, float]] = {}
    diag: dict[str, dict[str, float]] = {}
    flash: dict[str, float] = {}
    occupancy: dict[str, str] = {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for case in CASES:
        sets = make_sets(case, gen)
        ref = sdpa_call(case, sets[0], scale, SDPBackend.FLASH_ATTENTION)()
        flash[case.name] = time_graph([sdpa_call(case, x, scale, SDPBackend.FLASH_ATTENTION) for x in sets])
        for config in CONFIGS:
            name = config_name(config)
            try:
                before = compiled_kernels()
                err = rel_err(call(la.lean_attention, sets[0], scale, config)(), ref)
                new = [k for i, k in compiled_kernels().items() if i not in before]
                if new:
                    occupancy.setdefault(name, residency(new[0]))
                assert err < 2e-2, f"relative error {err:.2e}"
                us = time_graph([call(la.lean_attention, x, scale, config) for x in sets])
            except Exception as e:
                print(f"{case.name} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                us = float("nan")
            results.setdefault(name, {})[case.name] = us
            print(f"{case.name:<14} {name:<18} {us:9.1f} us   flash {flash[case.name]:9.1f} us", flush=True)
        for vname, mod in variants.items():
            try:
                us = time_graph([call(mod.lean_attention, x, scale, diag_config) for x in sets])
            except Exception as e:
                print(f"{case.name} {vname}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                us = float("nan")
            diag.setdefault(vname, {})[case.name] = us
            print(f"{case.name:<14} {vname:<18} {us:9.1f} us", flush=True)
        del sets
        torch.cuda.empty_cache()

    best_us = {c.name: min(r[c.name] for r in results.values() if r[c.name] == r[c.name]) for c in CASES}
    score = {
        n: gm([r[c] / best_us[c] for c in r]) for n, r in results.items() if all(v == v for v in r.values())
    }
    best = min(score, key=score.get)
    best_config = next(c for c in CONFIGS if config_name(c) == best)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        summary = {
            "flash_us": flash,
            "lean_us": results,
            "occupancy": occupancy,
            "attribution_config": config_name(diag_config),
            "attribution_us": diag,
            "best": best,
            "best_config": [
                best_config.block_n,
                best_config.num_warps,
                best_config.num_stages,
                best_config.ctas_per_sm,
            ],
        }
        (args.out / "tune.json").write_text(json.dumps(summary, indent=1))
    print(
        "\nconfig / variant        " + " ".join(f"{c.name[3:]:>12}" for c in CASES) + "  vs best  occupancy"
    )
    print(f"{'flash':<24}" + " ".join(f"{flash[c.name]:12.1f}" for c in CASES))
    for name in sorted(results, key=lambda n: score.get(n, float("inf"))):
        cells = " ".join(f"{results[name][c.name]:12.1f}" for c in CASES)
        print(f"{name:<23} {cells}  {score.get(name, float('nan')):7.3f}  {occupancy.get(name, '?')}")
    for vname, row in diag.items():
        cells = " ".join(f"{row[c.name]:12.1f}" for c in CASES)
        print(f"{config_name(diag_config) + ' ' + vname:<23.23} {cells}")
    print(f"best: {best}")


if __name__ == "__main__":
    main()

"""Compiles fp8_prefill_hopper's Gluon kernel for sm_90 without a GPU and prints, per head_dim, what
the PTX holds. Run by tests/test_prefill_fp8.py in a process of its own: Gluon's library functions
are wrapped by the Triton interpreter wherever TRITON_INTERPRET=1 was set before they were imported.

    python tests/sm90_compile.py     # one JSON line per head_dim
"""

from __future__ import annotations

import json
import re

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

from minidecode.kernels import fp8_prefill as fp
from minidecode.kernels import fp8_prefill_hopper as hopper


def compile_ptx(head_dim: int, config: fp.Fp8PrefillConfig = fp.HOPPER_CONFIG) -> str:
    n_pad = 2 * config.block_n
    kv = fp.QuantizedKV(
        torch.zeros(1, n_pad, head_dim, dtype=torch.float8_e4m3fn),
        torch.zeros(1, head_dim, n_pad, dtype=torch.float8_e4m3fn),
        torch.ones(1, 2), torch.ones(1, 2), n_pad, config.block_n,
    )  # fmt: skip
    k_desc, v_desc = hopper.kv_descriptors(kv)
    signature = {"Q": "*bf16", "k_desc": mangle_type(k_desc), "v_desc": mangle_type(v_desc)}
    signature |= {"KS": "*fp32", "VS": "*fp32", "Out": "*bf16"}
    ints = "T PAST N N_PAD NB HQ GROUP HKV Q_BLOCKS BH"
    ints += " stride_qb stride_qh stride_qt stride_ob stride_oh stride_ot"
    signature |= {name: "i32" for name in ints.split()} | {"qk_scale": "fp32"}
    signature |= {"BLOCK_M": "constexpr", "STAGES": "constexpr"}
    constants = {(len(signature) - 2,): config.block_m // 2, (len(signature) - 1,): config.num_stages}
    source = GluonASTSource(hopper._fp8_attention_kernel, signature, constants)
    options = {"num_warps": config.num_warps, "maxnreg": hopper.MAX_REGISTERS}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


if __name__ == "__main__":
    for head_dim in fp.WARP_SPECIALIZED_HEAD_DIMS:
        ptx = compile_ptx(head_dim)
        print(json.dumps({
            "head_dim": head_dim,
            "setmaxnreg": sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx))),
            "wgmma": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\w+)\.f32\.e4m3\.e4m3", ptx))),
            "local_memory": ".local" in ptx,
            "tma_loads": len(re.findall(r"cp\.async\.bulk\.tensor\.2d", ptx)),
        }))  # fmt: skip

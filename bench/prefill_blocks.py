"""Prefill attention at long prompts: one cuDNN causal call against the blocked form
(kernels/prefill.py: square causal diagonal blocks + one full call over the past keys, merged by
log-sum-exp), same run, one KV head with its 4 query heads (Llama-3-8B), bf16.

    python bench/prefill_blocks.py
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from minidecode.kernels.prefill import blocked_causal_attention, cudnn_with_lse

SCALE = 128**-0.5


def seconds(fn) -> float:
    fn()  # warm-up (plans, workspaces)
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def one_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE, enable_gqa=True)


def compare(T: int) -> None:
    q = torch.randn(1, 4, T, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 1, T, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    flop = 4 * 4 * 128 * T * T / 2
    attend = functools.partial(cudnn_with_lse, scale=SCALE)
    ref = one_call(q, k, v).float()
    single = seconds(lambda: one_call(q, k, v))
    print(f"| {T // 1024}k | one causal call | {single:.3f} | {flop / single / 1e12:.0f} | 1.00x | - |")
    for block in (16384, 32768, 65536, 131072):
        if block >= T:
            continue
        out = blocked_causal_attention(q, k, v, block, attend).float()
        err = ((out - ref).norm() / ref.norm()).item()
        t = seconds(lambda b=block: blocked_causal_attention(q, k, v, b, attend))
        cells = [f"{T // 1024}k", f"blocks of {block // 1024}k", f"{t:.3f}", f"{flop / t / 1e12:.0f}"]
        print("| " + " | ".join([*cells, f"{single / t:.2f}x", f"{err:.1e}"]) + " |")


if __name__ == "__main__":
    print("| prompt | form | seconds | TFLOP/s | speed-up | rel. diff |")
    print("| --- | --- | --- | --- | --- | --- |")
    with torch.inference_mode():
        for T in (131072, 524288):
            compare(T)
            torch.cuda.empty_cache()

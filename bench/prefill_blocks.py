"""Prefill attention at long prompts: one cuDNN causal call against the blocked form
(kernels/prefill.py: square causal diagonal blocks + one full call over the past keys, merged by
log-sum-exp), same run, one KV head with its 4 query heads (Llama-3-8B), bf16.

    python bench/prefill_blocks.py            # whole prompts of 128k and 512k
    python bench/prefill_blocks.py --suffix   # 100 and 2048 new tokens after a 128k / 512k past

--suffix: a suffix prefilled after a cached prefix, the past attended as one full call against
the past split into chunks on the batch axis of one call (past_attention); median of CUDA-event
timings after a warm-up, new random inputs per case (K/V of 64 MiB and more, beyond L2).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from timing import event_ms  # bench/timing.py
from torch.nn.attention import SDPBackend, sdpa_kernel

from minidecode.kernels.prefill import BLOCK, blocked_causal_attention, cudnn_with_lse, past_chunks

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


def compare_suffix(past: int, T: int, sms: int) -> None:
    """T queries after `past` cached keys, one KV head and its 4 query heads: the past as one full
    call (sms None) against the split call, both merged with the causal diagonal call; per call
    and for a prefill's 32 layers x 8 KV heads (Llama-3-8B)."""
    q = torch.randn(1, 4, T, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 1, past + T, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    attend = functools.partial(cudnn_with_lse, scale=SCALE)
    one = blocked_causal_attention(q, k, v, BLOCK, attend).float()
    split = blocked_causal_attention(q, k, v, BLOCK, attend, sms).float()
    diff = ((split - one).abs().max() / one.abs().max()).item()
    t_one = statistics.median(event_ms(lambda: blocked_causal_attention(q, k, v, BLOCK, attend), 10))
    t_split = statistics.median(event_ms(lambda: blocked_causal_attention(q, k, v, BLOCK, attend, sms), 10))
    cells = [
        f"{past // 1024}k",
        str(T),
        str(past_chunks(1, 4, T, past, sms)),
        f"{t_one:.3f}",
        f"{t_split:.3f}",
    ]
    cells += [
        f"{t_one / t_split:.2f}x",
        f"{t_one * 256 / 1e3:.2f} -> {t_split * 256 / 1e3:.2f}",
        f"{diff:.1e}",
    ]
    print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suffix", action="store_true", help="a short suffix after a long cached past")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench/prefill_blocks.py times cuDNN attention and needs a CUDA GPU")
    with torch.inference_mode():
        if args.suffix:
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            print(f"{torch.cuda.get_device_name()}, {sms} SMs, bf16, G = 4, D = 128, milliseconds")
            print()
            print("| past | suffix | chunks | one full call | split | speed-up | x 256 (s) | max rel. diff |")
            print("| --- | --- | --- | --- | --- | --- | --- | --- |")
            for past in (131072, 524288):
                for T in (100, 2048):
                    compare_suffix(past, T, sms)
                    torch.cuda.empty_cache()
            return
        print("| prompt | form | seconds | TFLOP/s | speed-up | rel. diff |")
        print("| --- | --- | --- | --- | --- | --- |")
        for T in (131072, 524288):
            compare(T)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

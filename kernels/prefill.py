"""Prefill attention: PyTorch SDPA over the whole prompt, with the backend chosen by measurement.

On Hopper, cuDNN's square causal attention runs ~1.7x faster than the flash backend, but not
everywhere (other GPUs, head sizes, versions): time both once per (device, head_dim, group) on
a short causal problem and keep the faster.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

CANDIDATES = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, backend: str | None = None
) -> torch.Tensor:
    """q [B, G, T, D] (G query heads sharing one KV head), k/v [B, 1, T, D] -> [B, G, T, D].

    Square causal attention over the whole prompt; backend None lets PyTorch choose (CPU)."""
    gqa = q.shape[1] != k.shape[1]
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    with sdpa_kernel([CANDIDATES[backend]]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)


@functools.cache
def choose_backend(device: torch.device, head_dim: int, group: int, dtype: torch.dtype) -> str | None:
    """The fastest SDPA backend for causal prefill on `device`, by timing each on a 16k-token
    problem (~0.1 s, once per process); None on the CPU."""
    if device.type != "cuda":
        return None
    T = 16384
    q = torch.randn(1, group, T, head_dim, device=device, dtype=dtype)
    k = torch.randn(1, 1, T, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    times = {}
    for name in CANDIDATES:
        try:
            causal_attention(q, k, v, head_dim**-0.5, name)  # warm-up; raises if unsupported
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(3):
                causal_attention(q, k, v, head_dim**-0.5, name)
            end.record()
            end.synchronize()
            times[name] = start.elapsed_time(end)
        except RuntimeError:
            continue
    return min(times, key=times.get) if times else None

"""Prefill attention: PyTorch SDPA over the whole prompt, with the backend chosen by measurement.

On Hopper, cuDNN's square causal attention runs ~1.7x faster than the flash backend, but not
everywhere (other GPUs, head sizes, versions): time both once per (device, head_dim, group) on
a short causal problem and keep the faster.

Long prompts on cuDNN go through in blocks of BLOCK queries: block i is a square causal call
over its own BLOCK keys plus one full (non-causal) call over every earlier key, and the two are
merged by their log-sum-exp. cuDNN's single causal call slows down past ~128k (472 TFLOP/s at
512k against 598 at 128k); the blocked form keeps 593 at 512k, 20% less time
(bench/NOTES-attention.md). Same FLOPs, same result up to rounding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

CANDIDATES = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
BLOCK = 65536  # query rows per block of the blocked cuDNN path (best of 16k-256k at 128k and 512k)
# Query rows per block on the CPU: one block of a long prompt takes about a second on two cores,
# and Ctrl-C (raised between Python steps) takes effect between blocks, not after a whole layer.
CPU_BLOCK = 4096

# attend(q, k, v, causal) -> (out [B, G, t, D], lse [B, G, t, 1] float32, natural log)
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]]


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, backend: str | None = None
) -> torch.Tensor:
    """q [B, G, T, D] (G query heads sharing one KV head), k/v [B, 1, P + T, D] -> [B, G, T, D].

    The queries are the last T of the P + T positions (P: a cached prefix, 0 for a whole prompt):
    causal, aligned bottom-right, so query i sees keys 0..P+i. backend None lets PyTorch choose (CPU)."""
    gqa = q.shape[1] != k.shape[1]
    past = k.shape[2] - q.shape[2]
    if backend == "cudnn" and (past or q.shape[2] > BLOCK):
        return blocked_causal_attention(q, k, v, BLOCK, functools.partial(cudnn_with_lse, scale=scale))
    if q.device.type == "cpu" and (past or q.shape[2] > CPU_BLOCK):
        attend = functools.partial(cpu_flash_with_lse, scale=scale)
        return blocked_causal_attention(q, k, v, CPU_BLOCK, attend)
    if past:  # SDPA's is_causal aligns top-left; the lower-right bias aligns the new rows with the end
        from torch.nn.attention.bias import causal_lower_right  # imports torch._dynamo: ~1.5 s

        mask = causal_lower_right(q.shape[2], k.shape[2])
        k, v = k.expand(-1, q.shape[1], -1, -1), v.expand(-1, q.shape[1], -1, -1)  # stride-0 views
        attend = functools.partial(F.scaled_dot_product_attention, attn_mask=mask, scale=scale)
    else:
        attend = functools.partial(
            F.scaled_dot_product_attention, is_causal=True, scale=scale, enable_gqa=gqa
        )
    if backend is None:
        return attend(q, k, v)
    with sdpa_kernel([CANDIDATES[backend]]):
        return attend(q, k, v)


def blocked_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int, attend: Attend):
    """Causal attention as, per block of queries [s, e): causal over keys [P+s, P+e), full over keys
    [0, P+s), merged by log-sum-exp. q [B, G, T, D] are the last T of the P + T positions of
    k/v [B, 1, P + T, D] (P > 0: a suffix prefilled after a cached prefix) -> [B, G, T, D]."""
    out = torch.empty_like(q)
    past = k.shape[2] - q.shape[2]
    for s in range(0, q.shape[2], block):
        e = min(s + block, q.shape[2])
        o_diag, lse_diag = attend(
            q[:, :, s:e], k[:, :, past + s : past + e], v[:, :, past + s : past + e], True
        )
        if past + s == 0:
            out[:, :, s:e] = o_diag
            continue
        o_past, lse_past = attend(q[:, :, s:e], k[:, :, : past + s], v[:, :, : past + s], False)
        lse = torch.logaddexp(lse_diag, lse_past)  # [B, G, e - s, 1]
        merged = (
            o_diag.float()
            .mul_(torch.exp(lse_diag - lse))
            .add_(o_past.float().mul_(torch.exp(lse_past - lse)))
        )
        out[:, :, s:e] = merged
    return out


def cudnn_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """cuDNN attention that also returns the log-sum-exp (the public SDPA call does not); the
    one KV head is broadcast to the G query heads (a stride-0 view, no copy)."""
    group = q.shape[1]
    k, v = k.expand(-1, group, -1, -1), v.expand(-1, group, -1, -1)
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )[:2]
    return out, lse.reshape(*q.shape[:3], 1)


def cpu_flash_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """PyTorch's CPU flash attention, which also returns the log-sum-exp; the one KV head is
    broadcast to the G query heads (a stride-0 view, no copy)."""
    group = q.shape[1]
    k, v = k.expand(-1, group, -1, -1), v.expand(-1, group, -1, -1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse.reshape(*q.shape[:3], 1)


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

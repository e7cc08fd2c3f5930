"""Prefill attention: PyTorch SDPA over the whole prompt, with the backend chosen by measurement.

On Hopper, cuDNN's square causal attention runs much faster than the flash backend, but not
everywhere (other GPUs, head sizes, versions): time both once per (device, head_dim, group) on
a short causal problem and keep the faster.

Long prompts on cuDNN go through in blocks of BLOCK queries: block i is a square causal call
over its own BLOCK keys plus one full (non-causal) call over every earlier key, and the two are
merged by their log-sum-exp. cuDNN's single causal call slows down past ~128k positions; the
blocked form keeps its 128k rate at 512k (bench/NOTES-attention.md). Same FLOPs, same result up
to rounding.

A mixed step's chunk after its past, run eagerly, goes to FlashAttention-2's forward in one call
(flash_suffix_attention); where the step is a CUDA graph replayed for every chunk of its size, to
kernels/chunk_attention.py, which reads where the chunk is from a device tensor.

A short block after a long past (a question after a cached 512k-token document) is the opposite
case: its full call over the past runs G x ceil(t / 128) CTAs (4 for 100 queries of Llama-3-8B),
each streaming every past key while the rest of the GPU idles. There the past keys are cut into
chunks stacked on the batch axis of one call, and the chunks' outputs merged by log-sum-exp too
(`past_attention`, bench/prefill_blocks.py --suffix).

Backend "fp8" (opt-in: `check_prefill_attention`) runs the FP8 flash-attention kernel
(kernels/fp8_prefill.py, on Hopper kernels/fp8_prefill_hopper.py: Q, K, V and P rounded to e4m3,
float32 softmax and accumulation) where it beats SDPA: a call over at least FP8_MIN_KEYS keys with
enough query blocks to fill the GPU once (`fp8_kernel_applies`); elsewhere SDPA's measured backend
(a short prompt, where cuDNN is faster, or a short suffix after a cached prefix, where the kernel
would leave most SMs idle).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .choices import PREFILL_ATTENTION
from .device import sm_count

CANDIDATES = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
BLOCK = 65536  # query rows per block of the blocked cuDNN path (best of 16k-256k at 128k and 512k)
# Query rows per block on the CPU: one block of a long prompt takes about a second on two cores,
# and Ctrl-C (raised between Python steps) takes effect between blocks, not after a whole layer.
CPU_BLOCK = 4096
# The split of a long past (past_attention): query rows per CTA of the GPU's flash forward
# kernels (cuDNN's and FlashAttention's tile), and the shortest chunk of past keys worth a CTA:
# 4096 keys are 32 key tiles, so loading the CTA's queries and writing its [128, D] partial
# output and log-sum-exp stay a few percent of streaming its 2 x 4096 x D keys and values.
ROW_TILE = 128
SPLIT_MIN_KEYS = 4096
CHOICE_ROUNDS = 5  # choose_backend's interleaved timing rounds

# attend(q, k, v, causal) -> (out [B, G, t, D], lse [B, G, t, 1] float32, natural log)
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]]


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    backend: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, T, D], k/v [B, Hkv, P + T, D] (Hq a multiple of Hkv: query head h reads KV head
    h // (Hq / Hkv)) -> [B, Hq, T, D]: the model calls it for a whole layer's heads, or for some of
    its KV heads with their query heads (models/temporaries.py's prefill_attention_kv_heads).

    The queries are the last T of the P + T positions (P: a cached prefix, 0 for a whole prompt):
    causal, aligned bottom-right, so query i sees keys 0..P+i. backend None lets PyTorch choose (CPU);
    "fp8": the FP8 kernel where it applies (fp8_kernel_applies), else SDPA's measured backend.
    Every KV head goes in one SDPA call where the path takes GQA (a whole prompt, one call), else
    one call per KV head. out: where the result goes (it may be q itself: a head group's queries
    are read before its rows are written); None: a new tensor."""
    if backend == "fp8":
        if fp8_kernel_applies(q, k):
            from .fp8_prefill import fp8_causal_attention  # (imports triton: on first use only)

            return fp8_causal_attention(q, k, v, scale, out=out)
        backend = choose_backend(q.device, q.shape[-1], q.shape[1] // k.shape[1], q.dtype)
    T, past, kv_heads = q.shape[2], k.shape[2] - q.shape[2], k.shape[1]
    if backend == "flash" and past:  # a mixed step's chunk: one call, whatever the heads
        result = flash_suffix_attention(q, k, v, scale)
        return result if out is None else out.copy_(result)
    blocked = (backend == "cudnn" and (past or T > BLOCK)) or (
        q.device.type == "cpu" and (past or T > CPU_BLOCK)
    )
    if kv_heads > 1 and (past or blocked or k.shape[2] == 1):  # these paths take one KV head a call
        out = torch.empty_like(q) if out is None else out
        group = q.shape[1] // kv_heads
        for h in range(kv_heads):
            g = slice(h * group, (h + 1) * group)
            causal_attention(q[:, g], k[:, h : h + 1], v[:, h : h + 1], scale, backend, out=out[:, g])
        return out
    result = _causal_attention(q, k, v, scale, backend)
    return result if out is None else out.copy_(result)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, backend: str | None):
    """causal_attention in one call: one KV head, or every KV head of a whole prompt (GQA)."""
    gqa = q.shape[1] != k.shape[1]
    past = k.shape[2] - q.shape[2]
    if k.shape[2] == 1:  # one key: its softmax weight is 1 (and cuDNN has no kernel for this shape)
        return v.expand_as(q).clone()
    if backend == "cudnn" and (past or q.shape[2] > BLOCK):
        attend = functools.partial(cudnn_with_lse, scale=scale)
        return blocked_causal_attention(q, k, v, BLOCK, attend, sm_count(q.device))
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


def flash_suffix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, t, D], the last t of the P + t positions of k/v [B, Hkv, P + t, D] -> [B, Hq, t, D]
    in one call of SDPA's flash forward (a mixed step's chunk, run eagerly every step: one launch
    a layer, where a call per KV head merged by log-sum-exp would be dozens, and the host would
    pace the step). Called directly, as torch.nn.attention.bias's lower-right causal mask calls it:
    its causal mask aligns the queries with the keys' end (query i sees keys 0..P+i); its query
    heads share KV heads natively (GQA); it splits a long key axis over the SMs itself when few
    query rows leave the grid small."""
    return torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, is_causal=True, return_debug_mask=False, scale=scale
    )[0]


def blocked_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int, attend: Attend, sms: int | None = None
) -> torch.Tensor:
    """Causal attention as, per block of queries [s, e): causal over keys [P+s, P+e), full over keys
    [0, P+s), merged by log-sum-exp. q [B, G, T, D] are the last T of the P + T positions of
    k/v [B, 1, P + T, D] (P > 0: a suffix prefilled after a cached prefix) -> [B, G, T, D].
    sms: the GPU's SM count, which lets a short block split its long past (past_attention);
    None never splits (the CPU)."""
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
        o_past, lse_past = past_attention(q[:, :, s:e], k[:, :, : past + s], v[:, :, : past + s], attend, sms)
        out[:, :, s:e] = merge(o_diag, lse_diag, o_past, lse_past)[0]
    return out


def merge(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over two disjoint key sets -> attention over their union, exactly: each out
    [..., t, D] weighted by its share exp(lse_x - lse) of the union's softmax mass, in float32.
    -> (out float32 [..., t, D], lse float32 [..., t, 1])."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = o_a.float().mul_(torch.exp(lse_a - lse)).add_(o_b.float().mul_(torch.exp(lse_b - lse)))
    return out, lse


def past_chunks(batch: int, group: int, t: int, past: int, sms: int | None) -> int:
    """How many chunks `past_attention` cuts `past` keys into for t queries of `group` heads per
    sequence; 1: one full call.

    One full call runs batch x group x ceil(t / ROW_TILE) CTAs. When they fill at most half the
    SMs (at G = 4 and 132 SMs: t <= 2048 queries, one sequence), each sequence's past is cut into
    n chunks with n x group x ceil(t / ROW_TILE) <= 2 x sms: the split call fits in two waves
    and keeps >= 75% of the SMs busy (a ceil would spill a third, mostly idle, wave). Chunks are
    kept >= SPLIT_MIN_KEYS keys, so a past shorter than 2 x SPLIT_MIN_KEYS is never split."""
    ctas = group * -(-t // ROW_TILE)  # one sequence's CTAs in the full call
    if sms is None or 2 * batch * ctas > sms:
        return 1
    return max(1, min(2 * sms // ctas, past // SPLIT_MIN_KEYS))


def past_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: Attend, sms: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full (non-causal) attention of q [B, G, t, D] over all P keys of k/v [B, 1, P, D] ->
    (out [B, G, t, D], lse [B, G, t, 1] float32): one attend call, or (past_chunks > 1) per
    sequence one call over its past cut into n chunks of c = P // n keys, stacked on the batch
    axis, plus one over the P - n c < n remaining keys, all merged by log-sum-exp.

    The chunks of one sequence are a view: k[b] is one run of P rows of D (stride D, the cache's
    heads-major layout), so [1, n c, D] -> [n, 1, c, D] moves no data. Stacking the B sequences
    on one axis too would need a copy (their batch stride is the cache's, not n c rows), hence a
    call per sequence, each sized to fill the GPU by itself. Temporaries per call: q expanded to
    [n, G, t, D] (made contiguous: a stride-0 batch is not a layout every backend takes), the
    [n, G, t, D] partial outputs and their float32 weighting, where n x G x ceil(t / 128) <= 2 x sms
    bounds n G t by 2 x sms x 128 rows: 17 MB of float32 at D = 128 on 132 SMs, whatever P."""
    B, G, t, D = q.shape
    P = k.shape[2]
    n = past_chunks(B, G, t, P, sms)
    if n == 1:
        return attend(q, k, v, False)
    c = P // n
    out = q.new_empty(B, G, t, D, dtype=torch.float32)
    lse = q.new_empty(B, G, t, 1, dtype=torch.float32)
    for b in range(B):
        q_n = q[b : b + 1].expand(n, G, t, D).contiguous()  # [n, G, t, D]: each chunk's queries
        k_n = k[b, :, : n * c].view(n, 1, c, D)  # [n, 1, c, D]: chunk j is keys [j c, (j + 1) c)
        v_n = v[b, :, : n * c].view(n, 1, c, D)
        o_n, lse_n = attend(q_n, k_n, v_n, False)  # [n, G, t, D], [n, G, t, 1]
        lse_b = torch.logsumexp(lse_n, 0, keepdim=True)  # [1, G, t, 1]: over the n chunks' union
        o_b = o_n.float().mul_(torch.exp(lse_n - lse_b)).sum(0, keepdim=True)  # [1, G, t, D]
        if n * c < P:  # the remainder: fewer than n keys, one small call
            o_r, lse_r = attend(q[b : b + 1], k[b : b + 1, :, n * c :], v[b : b + 1, :, n * c :], False)
            o_b, lse_b = merge(o_b, lse_b, o_r, lse_r)
        out[b : b + 1], lse[b : b + 1] = o_b, lse_b
    return out, lse


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
    problem (once per process, ~30 ms); None on the CPU.

    The candidates are timed in CHOICE_ROUNDS interleaved rounds, each keeping its fastest: timed
    once each right after start-up, the first candidate ran while the GPU was still raising its
    clocks, a bias against it (cuDNN, the faster one on Hopper)."""
    if device.type != "cuda":
        return None
    T = 16384
    q = torch.randn(1, group, T, head_dim, device=device, dtype=dtype)
    k = torch.randn(1, 1, T, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    usable = []
    for name in CANDIDATES:
        try:
            causal_attention(q, k, v, head_dim**-0.5, name)  # warm-up (plans); raises if unsupported
            usable.append(name)
        except RuntimeError:
            continue
    best = dict.fromkeys(usable, float("inf"))
    for _ in range(CHOICE_ROUNDS):
        for name in usable:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(3):
                causal_attention(q, k, v, head_dim**-0.5, name)
            end.record()
            end.synchronize()
            best[name] = min(best[name], start.elapsed_time(end))
    return min(best, key=best.get) if best else None


def fp8_prefill_problem(device: torch.device, head_dim: int) -> str | None:
    """Why the FP8 prefill kernel cannot run for this device and head size; None if it can."""
    if device.type != "cuda":
        return (
            f"FP8 prefill attention runs on a CUDA GPU's e4m3 tensor cores, not on the {device.type} "
            "(use --prefill-attention auto)"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (
            "FP8 prefill attention needs a GPU with e4m3 tensor cores (compute capability 8.9 or newer); "
            f"{torch.cuda.get_device_name(device)} has {major}.{minor} (use --prefill-attention auto)"
        )
    from .fp8_prefill import SUPPORTED_HEAD_DIMS

    if head_dim not in SUPPORTED_HEAD_DIMS:
        dims = ", ".join(map(str, SUPPORTED_HEAD_DIMS))
        return f"FP8 prefill attention takes head_dim {dims}, not {head_dim} (use --prefill-attention auto)"
    return None


def check_prefill_attention(name: str, device: torch.device, head_dim: int) -> str:
    """The user's prefill attention (`auto` or `fp8`), checked against the device and model: the
    name, or one clear ValueError (the runtime's caller makes it the user's message)."""
    if not isinstance(name, str) or name not in PREFILL_ATTENTION:
        raise ValueError(f"unknown prefill attention {name!r}; use one of {', '.join(PREFILL_ATTENTION)}")
    if name == "fp8" and (problem := fp8_prefill_problem(device, head_dim)) is not None:
        raise ValueError(problem)
    return name


# Keys from which the FP8 kernel clearly beats SDPA's best bf16 attention on a whole layer of
# Llama-3-8B (bench/results/prefill-attention-h100.md and -h200.md, the warp-specialized kernel;
# below, it loses or ties: bench/NOTES-prefill.md).
FP8_MIN_KEYS = 16384


def fp8_kernel_applies(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether backend "fp8" runs the FP8 kernel for q [B, Hq, T, D] against k [B, Hkv, P + T, D]
    (else SDPA): from FP8_MIN_KEYS keys, when its query blocks (B x Hq x ceil(T / block_m) CTAs)
    fill the GPU's SMs at least once (a short suffix after a long prefix leaves them idle). On CPU
    tensors only under the Triton interpreter (tests)."""
    if not q.is_cuda:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(fp8_prefill_problem(q.device, q.shape[-1]))
        return True
    from .fp8_prefill import default_config

    B, Hq, T, D = q.shape
    fills = B * Hq * -(-T // default_config(D, q.device).block_m) >= sm_count(q.device)
    return fills and k.shape[2] >= FP8_MIN_KEYS

"""The decode step's ops: for each, its contract (shapes), its Triton path and its PyTorch twin.

A decode step of an 8B model reads 16 GB in ~4 ms; PyTorch's plain ops would spend ~27 tiny
launches per layer on norms, RoPE and the cache write. Here a layer is eight launches for up to
MAX_ROWS (32) sequences, nine above (gate/up through cuBLAS, then silu_mul):

op                contract (B sequences, one new token each)             Triton path     PyTorch twin
rms_norm          x [..., N], weight [N] -> [..., N]                     fused_triton    float32 math
linear            x [B, K], weight [N, K], bias [N] -> [B, N]            gemv / cuBLAS   F.linear
                  (also x [..., K]: prefill's projections)
linear_residual   residual [B, N] += linear(x [B, K]), in place          gemv            F.linear, +=
rope_and_cache    qkv [B, (Hq + 2 Hkv) D] -> q [B, Hq, D]; k, v cached   fused_triton    rotate, index_put
rope_into         prefill: qkv [B, T, (Hq + 2 Hkv) D] -> q, k, v written  fused_triton    rotate, copy_
                  into heads-major [B, H, T, D] views
decode_attention  q [B, Hq, D], cache [B or 1, Hkv, S, D], lengths [B]   lean_attention  reference.py
                  (also q [B, Q_MAX, Hq, D] with q_lens [B]: verifying drafts)
gate_up_silu      x [B, K], gate/up [2 I, K] -> silu(gate) * up [B, I]   gemv / cuBLAS   F.linear, silu_mul
silu_mul          gate_up [B, 2 I] -> silu(gate) * up [B, I]             fused_triton    F.silu * up

Context parallel (models/parallel.py), once a layer around the all-gather of the ranks' rows:
pack_partials     o [B, Hq, D], lse [B, Hq], lengths [B] -> [B, Hq, D + 1]  cp_merge        cat, where
merge_ranks       rows [R, B, Hq, D + 1] -> o [B, Hq, D]                    cp_merge        merge_partials

Speculative decoding, once a step (prompt lookup's drafts made on the device):
prompt_lookup     history [H], offsets/lengths/tokens/want [B] -> drafts    prompt_lookup   host loop
                  [B, K], draft_lens [B]: what followed the last tokens' latest longest earlier match

Tensor parallel over one-shot buffers (kernels/collectives.py), a rank's o_proj and down:
linear_summed     out [B, N] := the ranks' linear(x) (+ residual) summed    gemv, summing    linear, then
                  (and its RMSNorm), each rank's columns of the weight      in its launch    one_shot

FP8 weights: `weight` may be an FP8Weight (kernels/fp8_weights.py: e4m3 values and float32 scales),
whose layer computes W8A8: its input is rounded to e4m3 first (QuantizedRows: per token, per token
and group, or a static scale; fp8_activations, fused with rms_norm where the norm's output is that
input: `quantize_for`), then the GEMV multiplies e4m3 tiles (gemv) up to MAX_ROWS rows, and larger
inputs (prefill) go through torch._scaled_mm on Hopper (per-channel weights, per-token inputs) or a
dequantized GEMM. The twin dequantizes both operands to float32 (fp8_weights.fp8_linear_reference).

An FP8 (float8_e4m3fn) cache stores V blocked, [C, Hkv, ceil(S / V_BLOCK), D, V_BLOCK]
(kernels/quant.py's layout; K as usual), and the K and V scales of each (token, head) side by
side, kv_scale [C, Hkv, S, 2] bfloat16.

The twins round as transformers does and run on the CPU (and serve as the tests' reference).
`triton=None` picks the Triton path for CUDA tensors; tests pass triton=True to run it on CPU
tensors under TRITON_INTERPRET=1. `pdl=True` chains the Triton kernels with programmatic
dependent launch, so each starts while the previous one drains; it applies only where the device
supports it (compute capability 9.0+), and the caller (the engine) decides.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from . import fp8_weights
from .fp8_weights import FP8Weight, QuantizedRows, fp8_linear_reference
from .quant import FP8_DTYPE, V_BLOCK, dequantize_fp8, quantize_fp8, read_v_rows
from .reference import decode_attention_reference, multi_query_attention_reference, prompt_lookup_reference

if TYPE_CHECKING:
    from .collectives import SumAfter


def _triton(x: torch.Tensor, triton: bool | None) -> bool:
    return x.is_cuda if triton is None else triton


def _pdl(x: torch.Tensor, pdl: bool) -> bool:
    return pdl and x.is_cuda and _capability(x.device) >= 9


@functools.cache
def _capability(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    triton: bool | None = None,
    pdl: bool = False,
    quantize_for: torch.Tensor | FP8Weight | None = None,
) -> torch.Tensor | QuantizedRows:
    """RMSNorm over the last dim as transformers does it: normalise in float32, round to x's
    dtype, then scale (the model's norms and Qwen3's per-head q_norm / k_norm). quantize_for: the
    weight the result feeds; an FP8Weight makes the result its e4m3 input rows (one launch)."""
    fp8 = isinstance(quantize_for, FP8Weight)
    if _triton(x, triton):  # the Triton kernels are imported on first use: the CPU never needs triton
        if fp8:
            from . import fp8_activations

            return fp8_activations.quantize_rows(x, quantize_for, (weight, eps), _pdl(x, pdl))
        from . import fused_triton

        return fused_triton.rms_norm(x, weight, eps, _pdl(x, pdl))
    xf = x.float()
    out = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return fp8_weights.quantize_rows(out, quantize_for) if fp8 else out


def quantize_input(
    x: torch.Tensor | QuantizedRows, weight: FP8Weight, triton: bool | None = None, pdl: bool = False
) -> QuantizedRows:
    """x [..., K] -> its rows [R, K] rounded to e4m3 as the FP8 `weight`'s input (as they are if
    already rounded)."""
    if isinstance(x, QuantizedRows):
        return x
    if _triton(x, triton):
        from . import fp8_activations

        return fp8_activations.quantize_rows(x, weight, use_pdl=_pdl(x, pdl))
    return fp8_weights.quantize_rows(x, weight)


def _fp8_gemv_fits(x: torch.Tensor | QuantizedRows, triton: bool | None) -> bool:
    """The FP8 GEMV for a decode step's rows: x [B, K] (or its rounded rows), B <= MAX_ROWS."""
    values = x.values if isinstance(x, QuantizedRows) else x
    if not _triton(values, triton):
        return False
    from .gemv import MAX_ROWS

    return values.dim() == 2 and values.shape[0] <= MAX_ROWS


def _fp8_matmul(rows: QuantizedRows, weight: FP8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """Rounded rows [R, K] (many: prefill) times an FP8 weight -> [R, N] in the rows' dtype on a
    GPU: torch._scaled_mm (e4m3 tensor cores, float32 sums) where it takes the scales (Hopper,
    per-channel weights, per-token rows, bf16 results), else both dequantized to the model dtype
    and multiplied (block checkpoints). The bias is added after the rounding."""
    (N, K), dtype = weight.shape, rows.dtype
    scaled_mm = (
        weight.per_channel
        and rows.group == K
        and dtype == torch.bfloat16  # row-wise scales: bf16 results only
        and K % 16 == 0
        and N % 16 == 0
        and _capability(rows.values.device) >= 9
    )
    if scaled_mm:
        w_t, w_scale = weight.values.t(), weight.scale.view(1, N)  # [K, N] column-major, [1, N]
        y = torch._scaled_mm(rows.values, w_t, scale_a=rows.scale, scale_b=w_scale, out_dtype=dtype)
    else:
        y = F.linear(rows.dequantize().to(dtype), weight.dequantize(dtype))
    return y if bias is None else y + bias


def _fp8_linear(
    x: torch.Tensor | QuantizedRows,
    weight: FP8Weight,
    bias: torch.Tensor | None,
    triton: bool | None,
    pdl: bool,
    residual: torch.Tensor | None = None,
    gated: bool = False,
) -> torch.Tensor | None:
    """linear / linear_residual / gate_up_silu with an FP8 weight: x [..., K] -> [..., N] (gated:
    silu(gate) * up, [..., N / 2]; residual: added into it in place, None returned)."""
    values = x.values if isinstance(x, QuantizedRows) else x
    lead = values.shape[:-1]
    if _fp8_gemv_fits(x, triton) and (residual is None or residual.stride(-1) == 1):
        from .gemv import gemv

        rows = quantize_input(x, weight, triton, pdl)
        out = gemv(rows, weight, bias, residual=residual, gated=gated, use_pdl=_pdl(values, pdl))
        return None if residual is not None else out
    if _triton(values, triton) and values.is_cuda:
        y = _fp8_matmul(quantize_input(x, weight, triton), weight, bias).view(*lead, -1)
    else:  # the CPU (and the interpreter's larger inputs): float32 math, rounded once
        y = fp8_linear_reference(x, weight, bias).view(*lead, -1)
    if gated:
        y = silu_mul(y, triton, pdl)
    if residual is None:
        return y
    residual += y
    return None


def _use_gemv(x: torch.Tensor, weight: torch.Tensor, triton: bool | None, gated: bool = False) -> bool:
    """The Triton GEMV for up to MAX_ROWS rows and outputs up to MAX_OUTPUTS wide (wider ones,
    lm_head, stream as fast through cuBLAS); gated (gate/up with silu * up fused) whatever the
    width. cuBLAS otherwise."""
    if not _triton(x, triton):
        return False  # before the import: the CPU runtime never loads triton
    from .gemv import MAX_OUTPUTS, MAX_ROWS

    fits = x.dim() == 2 and x.shape[0] <= MAX_ROWS and (gated or weight.shape[0] <= MAX_OUTPUTS)
    return fits and x.stride(-1) == 1 and weight.stride(-1) == 1


def linear(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor | FP8Weight,
    bias: torch.Tensor | None,
    triton: bool | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """F.linear: x [B, K] (a decode step; or [..., K]: prefill), weight [N, K], bias [N] ->
    [..., N]. An FP8 weight takes x, or x already rounded to its input (QuantizedRows)."""
    if isinstance(weight, FP8Weight):
        return _fp8_linear(x, weight, bias, triton, pdl)
    if _use_gemv(x, weight, triton):
        from .gemv import gemv

        return gemv(x, weight, bias, use_pdl=_pdl(x, pdl))
    return F.linear(x, weight, bias)


def linear_residual(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor | FP8Weight,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    triton: bool | None = None,
    pdl: bool = False,
) -> None:
    """residual += linear(x) in place, rounded as transformers' `h + proj(...)`: x [B, K],
    weight [N, K], bias [N], residual [B, N]."""
    if isinstance(weight, FP8Weight):
        _fp8_linear(x, weight, bias, triton, pdl, residual=residual)
    elif _use_gemv(x, weight, triton) and residual.stride(-1) == 1:
        from .gemv import gemv

        gemv(x, weight, bias, residual=residual, use_pdl=_pdl(x, pdl))
    else:
        residual += F.linear(x, weight, bias)


def linear_summed(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor | FP8Weight,
    bias: torch.Tensor | None,
    summed: SumAfter,
    residual: torch.Tensor | None = None,
    triton: bool | None = None,
    pdl: bool = False,
) -> None:
    """summed.out := the sum over summed's group of every rank's linear(x) (+ residual: added into
    it in place first, as linear_residual), in rank order in float32; with summed.norm also the
    sum's RMSNorm (kernels/collectives.py). x [B, K], weight [N, K] (this rank's columns), bias [N],
    residual and summed.out [B, N]. One launch where the GEMV takes x and [B, N] is one chunk of a
    message (the sum in the GEMV's launch); else the product, then the one-shot kernel."""
    from . import collectives  # here: the CPU runtime never loads triton

    values = x.values if isinstance(x, QuantizedRows) else x
    in_one = collectives.fits_one_chunk(summed.out) and (residual is None or residual.stride(-1) == 1)
    if in_one and isinstance(weight, FP8Weight):
        in_one = _fp8_gemv_fits(x, triton)
    elif in_one:
        in_one = _use_gemv(x, weight, triton)
    if in_one:
        from .gemv import gemv

        if isinstance(weight, FP8Weight):
            x = quantize_input(x, weight, triton, pdl)
        gemv(x, weight, bias, residual=residual, use_pdl=_pdl(values, pdl), sum_after=summed)
        return
    if residual is not None:
        linear_residual(x, weight, bias, residual, triton, pdl)
        part = residual
    else:
        part = linear(x, weight, bias, triton, pdl)
    collectives.one_shot(part, summed.out, summed.ends, False, _pdl(part, pdl), summed.norm)


def rope_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    triton: bool | None = None,
    pdl: bool = False,
    kv_scale: torch.Tensor | None = None,
    static_scales: tuple[float, float] | None = None,
) -> torch.Tensor:
    """One new token per sequence.

    qkv [B, (Hq + 2 Hkv) * D] (the fused projection); cos/sin [B, D] float32; positions [B] int64,
    where each sequence's k and v are written; k_cache/v_cache [C, Hkv, S, D], C = B (a row per
    sequence) or 1 (one row that a batch's sequences share, each at its own positions).
    Optionally RMS-normalises each q/k head first (Qwen3), rotates q and k (rotate-half layout,
    float32 math), writes k and v at each sequence's position, and returns q [B, Hq, D].

    FP8 cache (float8_e4m3fn): the rows written are quantize_fp8 of the model-dtype k and v, their
    scales go to kv_scale [C, Hkv, S, 2] bfloat16 (K's, V's); `static_scales` (k, v) are a
    checkpoint's calibrated scales, used instead of each row's own. v_cache is blocked there,
    [C, Hkv, ceil(S / V_BLOCK), D, V_BLOCK]: position p's row goes to block p // V_BLOCK, slot
    p % V_BLOCK of each head_dim element (kernels/quant.py).
    """
    if _triton(qkv, triton):
        from . import fused_triton

        return fused_triton.rope_and_cache(
            qkv, cos, sin, positions, k_cache, v_cache, num_heads, q_norm, k_norm, eps, _pdl(qkv, pdl),
            kv_scale, static_scales,
        )  # fmt: skip
    B = qkv.shape[0]
    Hkv, D = k_cache.shape[1], k_cache.shape[3]
    q, k, v = qkv.view(B, num_heads + 2 * Hkv, D).split([num_heads, Hkv, Hkv], dim=1)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps, triton=False), rms_norm(k, k_norm, eps, triton=False)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    batch = torch.arange(B, device=qkv.device) if k_cache.shape[0] == B else torch.zeros_like(positions)
    # index_put with device-side positions: no host sync, safe inside a CUDA graph.
    if k_cache.dtype == FP8_DTYPE:
        k_static, v_static = static_scales or (None, None)
        k, k_row_scale = quantize_fp8(k, k_static)  # [B, Hkv, D] e4m3, [B, Hkv] bfloat16
        v, v_row_scale = quantize_fp8(v, v_static)
        kv_scale[batch, :, positions] = torch.stack((k_row_scale, v_row_scale), -1)  # [B, Hkv, 2]
        k_cache, v_cache, k, v = (t.view(torch.uint8) for t in (k_cache, v_cache, k, v))  # index_put: no fp8
        v_cache[batch, :, positions // V_BLOCK, :, positions % V_BLOCK] = v  # [B, Hkv, D] into the blocks
    else:
        v_cache[batch, :, positions] = v
    k_cache[batch, :, positions] = k
    return q


def rope_into(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    triton: bool | None = None,
) -> None:
    """A prefill chunk's rows: qkv [B, T, (Hq + 2 Hkv) * D] (the fused projection), cos/sin
    [B, T, D] float32. Optionally RMS-normalises each q/k head first (Qwen3), rotates q and k
    (rotate-half layout, float32 math) and writes q into q_out [B, Hq, T, D], k into k_out and v into
    v_out [B, Hkv, T, D]: heads-major views (prefill's query buffer, the cache), any strides."""
    if _triton(qkv, triton):
        from . import fused_triton

        fused_triton.rope_into(qkv, cos, sin, q_out, k_out, v_out, q_norm, k_norm, eps)
        return
    B, T = qkv.shape[:2]
    Hq, Hkv, D = q_out.shape[1], k_out.shape[1], q_out.shape[3]
    q, k, v = qkv.view(B, T, Hq + 2 * Hkv, D).split([Hq, Hkv, Hkv], dim=2)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps, triton=False), rms_norm(k, k_norm, eps, triton=False)
    q_out.copy_(rotate(q, cos, sin).transpose(1, 2))
    k_out.copy_(rotate(k, cos, sin).transpose(1, 2))
    v_out.copy_(v.transpose(1, 2))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., H, D] rotated by cos/sin [..., D] (shared by the H heads), rotate-half layout as
    Hugging Face checkpoints store q/k; computed in float32, returned in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return (xf * cos + rotated * sin).to(x.dtype)


def decode_attention_problem(device: torch.device, head_dim: int) -> str | None:
    """Why decode attention cannot run for this device and head size (the lean kernel's head
    sizes on CUDA; the PyTorch twin takes any on the CPU); None if it can."""
    if device.type != "cuda":
        return None
    from .lean_attention import SUPPORTED_HEAD_DIMS

    if head_dim in SUPPORTED_HEAD_DIMS:
        return None
    sizes = " or ".join(map(str, SUPPORTED_HEAD_DIMS))
    return (
        f"the GPU decode kernel takes head_dim {sizes}; this model's is {head_dim}: run it with --device cpu"
    )


def decode_cache_sizes(head_dim: int, dtype: torch.dtype, fp8: bool, kv_heads: int) -> list[int]:
    """The smallest cache size (positions, all rows) of each launch config the decode kernel takes
    for a cache of this kind (its shape decides: lean_attention.config_sizes)."""
    from .lean_attention import config_sizes

    return config_sizes(head_dim, dtype, fp8, kv_heads)


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]; with q_lens: [B, Q_MAX, Hq, D]
    k_cache: torch.Tensor,  # [C, Hkv, S, D], C = B or 1 (one row shared by the batch)
    v_cache: torch.Tensor,  # [C, Hkv, S, D]; FP8: blocked [C, Hkv, ceil(S / V_BLOCK), D, V_BLOCK]
    lengths: torch.Tensor,  # [B] int32 on q's device: valid positions per sequence (0: idle)
    scale: float,
    triton: bool | None = None,
    pdl: bool = False,
    kv_scale: torch.Tensor | None = None,  # [C, Hkv, S, 2] bfloat16 (K, V), with an FP8 cache
    starts: torch.Tensor | None = None,  # [B] int64: first position of each sequence (default 0)
    return_lse: bool = False,
    q_lens: torch.Tensor | None = None,  # [B] int32 on q's device: query positions per sequence
    row_limits: torch.Tensor | None = None,  # [B, Q_MAX] int32 with q_lens: positions each query sees
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [B, Hq, D] (, lse [B, Hq] float32)
    """One decode step of attention: each sequence's single new query over its cached context,
    positions starts[b] .. starts[b] + lengths[b] - 1 of its cache row (the lean stream-K kernel,
    which reads an FP8 cache with e4m3 tensor-core dots, or on short caches decodes it to fp16;
    the twin dequantizes the valid positions to float32 first, and loops over the batch on the
    host, so it is not graph-safe). An FP8 cache's V is blocked (the kernel's "blocked_t"
    layout): starts must be multiples of V_BLOCK. An idle
    sequence (length 0) gets no output: the kernel leaves its row unwritten, the twin zeros it.

    return_lse also returns each query head's log-sum-exp of the scaled scores (natural log),
    which weighs partial results over disjoint ranges of the context in an exact merge (context
    parallelism: minidecode/distributed.py); a sequence of length 0 has none (the kernel leaves
    it unwritten, the twin gives -inf): the caller masks it.

    q_lens: several new query positions a sequence (speculative decoding's verification step), q
    [B, Q_MAX, Hq, D], 1 <= q_lens[b] <= Q_MAX. Their K/V are already cached as the last q_lens[b]
    of the sequence's lengths[b] positions; query position j sees positions
    starts[b] .. starts[b] + lengths[b] - q_lens[b] + j. The result is [B, Q_MAX, Hq, D] (lse
    [B, Q_MAX, Hq]); rows j >= q_lens[b] are unwritten by the kernel, 0 (lse -inf) in the twin.
    One launch whatever the q_lens (a device tensor: graph-safe), reading K/V once for all of them.
    row_limits instead gives each query's limit, the first row_limits[b, j] positions (a
    context-parallel rank's share of a step with drafts; 0: o 0, lse -inf)."""
    if _triton(q, triton):
        from .lean_attention import lean_attention

        # lse [B, Hq] or [B, Q_MAX, Hq]: q's shape without head_dim
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device) if return_lse else None
        out = lean_attention(
            q, k_cache, v_cache, lengths, scale, kv_scale=kv_scale, starts=starts,
            use_pdl=_pdl(q, pdl), lse=lse, q_lens=q_lens, row_limits=row_limits,
        )  # fmt: skip
        return (out, lse) if return_lse else out
    out = torch.zeros_like(q)
    lse = None
    if return_lse:
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    tails = [1] * q.shape[0] if q_lens is None else q_lens.tolist()
    firsts = [0] * q.shape[0] if starts is None else starts.tolist()
    for b, (first, n, t) in enumerate(zip(firsts, lengths.tolist(), tails, strict=True)):
        if n == 0:
            continue
        row, span = b if k_cache.shape[0] > 1 else 0, slice(first, first + n)
        k = k_cache[row : row + 1, :, span]  # [1, Hkv, n, D]
        if k_cache.dtype == FP8_DTYPE:  # float32 values of the valid positions, V from its blocks
            scales = kv_scale[row : row + 1, :, span]  # [1, Hkv, n, 2]
            k = dequantize_fp8(k, scales[..., 0])
            v = read_v_rows(v_cache[row : row + 1], first, first + n)  # [1, Hkv, n, D] e4m3
            v = dequantize_fp8(v, scales[..., 1])
        else:
            v = v_cache[row : row + 1, :, span]
        length = torch.tensor([n], device=lengths.device)
        if q_lens is not None:
            limits = None if row_limits is None else row_limits[b : b + 1].cpu()
            got = multi_query_attention_reference(
                q[b : b + 1], k, v, length, torch.tensor([t]), scale, return_lse=return_lse, limits=limits
            )
            if return_lse:
                out[b : b + 1], lse[b : b + 1] = got
            else:
                out[b : b + 1] = got
        elif return_lse:
            out[b : b + 1], lse[b : b + 1] = decode_attention_reference(
                q[b : b + 1], k, v, length, scale, return_lse=True
            )
        else:
            out[b : b + 1] = decode_attention_reference(q[b : b + 1], k, v, length, scale)
    return (out, lse) if return_lse else out


def gate_up_silu(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor | FP8Weight,
    bias: torch.Tensor | None,
    triton: bool | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """The MLP's inner activation: x [B, K], weight [2 I, K] (gate rows, then up rows), bias [2 I]
    -> silu(gate) * up [B, I], rounded as transformers does. Up to MAX_ROWS rows it is one GEMV
    launch with silu * up in its epilogue; above, cuBLAS then silu_mul."""
    if isinstance(weight, FP8Weight):
        return _fp8_linear(x, weight, bias, triton, pdl, gated=True)
    if _use_gemv(x, weight, triton, gated=True):
        from .gemv import gemv

        return gemv(x, weight, bias, gated=True, use_pdl=_pdl(x, pdl))
    return silu_mul(linear(x, weight, bias, triton, pdl), triton, pdl)


def silu_mul(gate_up: torch.Tensor, triton: bool | None = None, pdl: bool = False) -> torch.Tensor:
    """gate_up [B, 2 I] (the fused projection) -> silu(gate) * up [B, I], rounded as transformers
    does (silu's result in the model dtype, then the product)."""
    if _triton(gate_up, triton):
        from . import fused_triton

        return fused_triton.silu_mul(gate_up, _pdl(gate_up, pdl))
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- context parallel: attention over disjoint ranges of the context, merged exactly ----------------
def merge_partials(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Exact softmax attention over the union of disjoint key ranges from each range's result:
    o [n, ..., D] (each range's normalised output; finite, zeros for an empty range) and lse
    [n, ...] (its log-sum-exp of the scaled scores, natural log; -inf for an empty range, and at
    least one range not empty) -> o [..., D] in float32 or wider.

    softmax over all keys = sum_i exp(lse_i - lse) softmax_i, lse = log sum_i exp(lse_i): the weights
    are a softmax of the lse over the ranges (the rule the lean kernel applies inside, in log2
    units, to its CTAs' partials)."""
    dtype = torch.promote_types(lse.dtype, torch.float32)
    weight = torch.softmax(lse.to(dtype), dim=0).unsqueeze(-1)  # [n, ..., 1]; 0 for an empty range
    return (o * weight).sum(dim=0)


def pack_partials(
    o: torch.Tensor,  # [B, Hq, D]: this range's attention output (any float dtype)
    lse: torch.Tensor,  # [B, Hq] float32
    lengths: torch.Tensor,  # [B]: this range's positions per sequence (0: none; o and lse unset there)
    triton: bool | None = None,
    pdl: bool = False,
) -> torch.Tensor:  # [B, Hq, D + 1] float32
    """Each (sequence, query head)'s [o, lse] in one float32 row, [0, -inf] where the sequence has
    no position in this range: what a rank sends to be merged."""
    if _triton(o, triton):
        from . import cp_merge

        return cp_merge.pack_partials(o, lse, lengths, _pdl(o, pdl))
    valid = (lengths > 0)[:, None]  # [B, 1]
    o = torch.where(valid[..., None], o.float(), 0.0)
    return torch.cat([o, torch.where(valid, lse, float("-inf"))[..., None]], dim=-1)


def merge_ranks(
    parts: torch.Tensor,  # [R, B, Hq, D + 1] float32: every rank's pack_partials, in rank order
    dtype: torch.dtype,
    triton: bool | None = None,
    pdl: bool = False,
) -> torch.Tensor:  # [B, Hq, D] of dtype
    """The ranks' packed rows merged by merge_partials' rule, in dtype."""
    if _triton(parts, triton):
        from . import cp_merge

        return cp_merge.merge_ranks(parts, dtype, _pdl(parts, pdl))
    return merge_partials(parts[..., :-1], parts[..., -1]).to(dtype)


def prompt_lookup(
    history: torch.Tensor,  # [H] int32 or int64: row b's tokens at offsets[b] .. offsets[b] + lengths[b] - 1
    offsets: torch.Tensor,  # [B] int64
    lengths: torch.Tensor,  # [B] int64, P_b >= 0: how many of row b's tokens history holds
    tokens: torch.Tensor,  # [B] int64: row b's current token, the one after those P_b (not in history)
    want: torch.Tensor,  # [B] int64: drafts row b asks for (<= 0: none; more than K: K)
    drafts: torch.Tensor,  # [B, K] int64, out
    draft_lens: torch.Tensor,  # [B] int64, out
    min_ngram: int = 2,
    max_ngram: int = 4,
    triton: bool | None = None,
) -> None:
    """Prompt-lookup drafts of each row, on the device (no host sync: a CUDA graph's step).

    Row b's sequence S is its P tokens in history, then tokens[b] (length L = P + 1). Its match is
    the longest n (max_ngram down to min_ngram, n <= L - 1) whose last n tokens occurred before,
    at the latest such end e (n <= e <= L - 1, S[e-n : e] == S[L-n : L]). Then drafts[b, i] =
    S[e + i % (L - e)] for i < w = min(want[b], K): what followed, repeating its period where the
    occurrence overlaps the end; draft_lens[b] = w, or 0 without a match (or w <= 0). drafts past
    draft_lens are unspecified (the twin writes 0). max_ngram <= 8 on the Triton path."""
    args = (history, offsets, lengths, tokens, want, drafts, draft_lens, min_ngram, max_ngram)
    if _triton(history, triton):
        from .prompt_lookup import prompt_lookup_triton

        prompt_lookup_triton(*args)
    else:
        prompt_lookup_reference(*args)

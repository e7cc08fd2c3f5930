"""FP8 (e4m3) weights in PyTorch: the container the ops take, and the rounding of weights and
activations (the reference of the Triton kernels, and the CPU's computation).

A Linear layer with FP8 weights computes W8A8, as the checkpoints declare and as transformers'
compressed-tensors forward and vLLM on Hopper do:

    y = (e4m3(x / s_x) * s_x) @ (w8 * s_w)^T (+ bias),  rounded once to the model dtype

- w8 [N, K] float8_e4m3fn with float32 scales s_w, one per block of (block_n, block_k) weight
  elements: per output channel (1, K), or a checkpoint's blocks (e.g. 128 x 128, the last ones
  partial). A checkpoint's per-tensor scale is held per channel (each row its tensor's scale), so
  fused q/k/v whose parts carry different scales stay one matrix.
- x is rounded to e4m3 with a scale per token (s_x = its largest |x| / 448: the largest value
  lands on e4m3's largest, nothing overflows), per token and group of `act_group` columns (block
  checkpoints: the group is the block's columns), or the checkpoint's static per-tensor scale
  (values beyond 448 s_x saturate); the values are e4m3(x * (1 / s_x)), as vLLM rounds them.
  e4m3 x e4m3 products are exact; the sums are float32.

The CPU dequantizes both operands to float32 and multiplies; the GPU's decode GEMV multiplies the
e4m3 values on tensor cores and applies the scales to the float32 sums (kernels/gemv.py); its
prefill runs torch._scaled_mm (kernels/ops.py). All compute the same sums up to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_FLOOR = 1e-30  # smallest activation / weight scale: an all-zero row divides by this, not by zero
ROWS_AT_ONCE = 4096  # weight rows converted per step: bounded float32 temporaries


@dataclass
class FP8Weight:
    """A Linear layer's FP8 weight: values [N, K] float8_e4m3fn (rows contiguous) times the float32
    scale of each (block_n, block_k) block, scale [ceil(N / block_n), ceil(K / block_k)]; per
    output channel: block (1, K), scale [N, 1]. The layer's input is rounded to e4m3 per token
    (act_group None), per token and group of act_group columns, or with input_scale [1] float32
    (a checkpoint's static activation scale)."""

    values: torch.Tensor
    scale: torch.Tensor
    block_n: int
    block_k: int
    act_group: int | None = None
    input_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        N, K = self.values.shape
        want = (-(-N // self.block_n), -(-K // self.block_k))
        if self.values.dtype != FP8_DTYPE or self.scale.dtype != torch.float32 or self.scale.shape != want:
            raise ValueError(
                f"FP8Weight: values must be float8_e4m3fn and scale {list(want)} float32 for blocks of "
                f"({self.block_n}, {self.block_k}); got {self.values.dtype}, {self.scale.dtype} "
                f"{list(self.scale.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def per_channel(self) -> bool:
        return self.block_n == 1 and self.block_k >= self.values.shape[1]

    def row_scales(self, start: int, stop: int) -> torch.Tensor:
        """The scales of weight rows start..stop-1, [stop - start, ceil(K / block_k)]."""
        first, last = start // self.block_n, -(-stop // self.block_n)
        rows = self.scale[first:last].repeat_interleave(self.block_n, dim=0)
        return rows[start - first * self.block_n : stop - first * self.block_n]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] in `dtype`: each value times its block's scale in float32, rounded once."""
        N, K = self.values.shape
        out = torch.empty(N, K, dtype=dtype, device=self.values.device)
        for start in range(0, N, ROWS_AT_ONCE):
            stop = min(start + ROWS_AT_ONCE, N)
            scale = self.row_scales(start, stop).repeat_interleave(self.block_k, dim=1)[:, :K]
            out[start:stop] = (self.values[start:stop].float() * scale).to(dtype)
        return out


def fuse_fp8(parts: list[FP8Weight]) -> FP8Weight:
    """The parts' rows stacked into one weight (q/k/v, gate/up). Per-channel scales stack as they
    are; block scales stack where every part but the last ends on a block boundary, else each row
    gets its own row of block scales (block (1, block_k)). A static input scale becomes the parts'
    largest (the fused layer rounds its input once; the largest saturates nothing the others keep)."""
    first = parts[0]
    K = first.shape[1]
    scheme = (K, first.act_group, first.input_scale is None)
    if any((p.shape[1], p.act_group, p.input_scale is None) != scheme for p in parts):
        raise ValueError("fuse_fp8: the parts must share K and their activation scheme")
    values = torch.cat([p.values.view(torch.uint8) for p in parts]).view(FP8_DTYPE)  # as bytes: torch < 2.6
    input_scale = None if first.input_scale is None else torch.stack([p.input_scale for p in parts]).amax(0)
    if all(p.per_channel for p in parts):
        return FP8Weight(values, torch.cat([p.scale for p in parts]), 1, K, first.act_group, input_scale)
    if any(p.per_channel or p.block_k != first.block_k for p in parts):
        raise ValueError("fuse_fp8: the parts must share their weight blocks")
    aligned = all(p.shape[0] % p.block_n == 0 for p in parts[:-1])  # each part's blocks its own
    if aligned and all(p.block_n == first.block_n for p in parts):
        scale = torch.cat([p.scale for p in parts])
        return FP8Weight(values, scale, first.block_n, first.block_k, first.act_group, input_scale)
    scale = torch.cat([p.row_scales(0, p.shape[0]) for p in parts])
    return FP8Weight(values, scale, 1, first.block_k, first.act_group, input_scale)


def quantize_weight(
    weight: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (any float dtype) -> (values [N, K] float8_e4m3fn, scale [N, 1] float32), per
    output channel: scale = the row's largest |w| / 448 (the FP8-dynamic scheme's weights), or the
    given `scale` [N, 1] (channel_scale of whole rows, where `weight` holds some of their columns)."""
    N, K = weight.shape
    values = torch.empty(N, K, dtype=FP8_DTYPE, device=weight.device)
    scales = torch.empty(N, 1, dtype=torch.float32, device=weight.device) if scale is None else scale
    for start in range(0, N, ROWS_AT_ONCE):
        rows = weight[start : start + ROWS_AT_ONCE].float()
        if scale is None:
            scales[start : start + ROWS_AT_ONCE] = channel_scale(rows.abs().amax(dim=1))
        s = scales[start : start + ROWS_AT_ONCE]
        values[start : start + ROWS_AT_ONCE] = (rows / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return values, scales


def channel_scale(amax: torch.Tensor) -> torch.Tensor:
    """Each row's largest |w|, [N] -> its per-channel weight scale [N, 1] float32: amax / 448."""
    return (amax.float().reshape(-1, 1) / FP8_MAX).clamp_min(SCALE_FLOOR)


class QuantizedRows(NamedTuple):
    """A Linear layer's input rounded to e4m3: values [R, K] float8_e4m3fn, scale [R, ceil(K / group)]
    float32 (x ~= values * scale of each group of `group` columns; group K: one scale a row), and
    the dtype of the rows before (the layer's result dtype)."""

    values: torch.Tensor
    scale: torch.Tensor
    group: int
    dtype: torch.dtype

    def dequantize(self) -> torch.Tensor:
        """float32 [R, K]: each value times its group's scale."""
        K = self.values.shape[1]
        return self.values.float() * self.scale.repeat_interleave(self.group, dim=1)[:, :K]


def quantize_rows(x: torch.Tensor, weight: FP8Weight) -> QuantizedRows:
    """x [..., K] -> its rows [R, K] rounded to e4m3 as `weight`'s input: per token, per token and
    group, or with the static scale. Each value is x times the scale's reciprocal, as vLLM's
    quantization kernels compute it (one multiply a value, where a division costs the rounding
    kernels several times more); the reciprocal and scale = amax / 448 are IEEE divisions, the
    cast rounds to nearest even: the Triton kernel's bits (kernels/fp8_activations.py)."""
    K = x.shape[-1]
    xf = x.reshape(-1, K).float()
    R = xf.shape[0]
    if weight.input_scale is not None:
        scale = weight.input_scale.float().reshape(1, 1).expand(R, 1).contiguous()
        values = (xf * scale.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return QuantizedRows(values, scale, K, x.dtype)
    group = min(weight.act_group or K, K)
    groups = -(-K // group)
    padded = torch.nn.functional.pad(xf, (0, groups * group - K)).view(R, groups, group)
    # amax / 448 as a true division: PyTorch's CUDA kernel multiplies by the reciprocal of a Python
    # number instead (one ulp off now and then), so 448 goes in as a device tensor.
    amax = padded.abs().amax(dim=2)
    scale = (amax / amax.new_full((), FP8_MAX)).clamp_min(SCALE_FLOOR)  # [R, groups]
    values = (padded * scale.reciprocal()[..., None]).clamp(-FP8_MAX, FP8_MAX)
    values = values.view(R, -1)[:, :K].to(FP8_DTYPE)
    return QuantizedRows(values, scale, group, x.dtype)


def fp8_linear_reference(
    x: torch.Tensor | QuantizedRows, weight: FP8Weight, bias: torch.Tensor | None
) -> torch.Tensor:
    """W8A8 in float32 (the CPU's FP8 linear, and the tests' reference): x [..., K] (or its
    quantized rows) -> [..., N] in x's dtype, rounded once after the bias."""
    rows = x if isinstance(x, QuantizedRows) else quantize_rows(x, weight)
    y = rows.dequantize() @ weight.dequantize(torch.float32).T  # [R, N] float32
    if bias is not None:
        y = y + bias.float()
    lead = (rows.values.shape[0],) if isinstance(x, QuantizedRows) else x.shape[:-1]
    return y.to(rows.dtype).view(*lead, -1)

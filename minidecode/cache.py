"""One contiguous, preallocated KV cache for all layers, sized to the request: in the model's
dtype, or FP8 (e4m3) with a float32 scale per (token, KV head) (kernels/quant.py's scheme)."""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8 = torch.float8_e4m3fn
SCALE_BYTES = 4  # one float32 scale per (token, KV head), for K and for V


class LayerKV(NamedTuple):
    """One layer's cache, as the ops take it: k, v [B, Hkv, S, D]; with an FP8 cache k_scale and
    v_scale [B, Hkv, S] float32 (row = e4m3 row * scale), else None."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


class KVCache:
    """K and V for every layer in two allocations, `[layers, B, Hkv, S, D]` each (plus, for an
    FP8 cache, k_scale / v_scale `[layers, B, Hkv, S]` float32).

    Heads-major per sequence, so the positions of one (sequence, KV head) are one contiguous
    run of S x D elements: the decode kernel streams them with no gather, and prefill's SDPA
    reads `[B, Hkv, S, D]` views directly.
    """

    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.k_scale = self.v_scale = None
        if dtype == FP8:
            self.k_scale = torch.empty(shape[:-1], dtype=torch.float32, device=device)
            self.v_scale = torch.empty(shape[:-1], dtype=torch.float32, device=device)
        self.max_len = max_len

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one position takes in every layer: K and V rows, and their scales when FP8."""
        row = head_dim * dtype.itemsize + (SCALE_BYTES if dtype == FP8 else 0)
        return 2 * num_layers * num_kv_heads * row

    @staticmethod
    def bytes_needed(
        num_layers: int, num_kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes of a one-sequence cache (scales included)."""
        return max_len * KVCache.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors().values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by name, each with positions on dim 3 (save/load walk these): k, v,
        and k_scale, v_scale for an FP8 cache."""
        named = {"k": self.k, "v": self.v}
        if self.k_scale is not None:
            named |= {"k_scale": self.k_scale, "v_scale": self.v_scale}
        return named

    def layer(self, i: int) -> LayerKV:
        if self.k_scale is None:
            return LayerKV(self.k[i], self.v[i])  # each [B, Hkv, S, D]
        return LayerKV(self.k[i], self.v[i], self.k_scale[i], self.v_scale[i])

    def region(self, start: int, length: int) -> KVCache:
        """Positions start..start+length-1 as a cache of their own (views, no copy): a batch's
        sequence is prefilled into its region of the shared cache row exactly as into a cache."""
        view = object.__new__(KVCache)
        for name, t in self.tensors().items():
            setattr(view, name, t[:, :, :, start : start + length])
        if self.k_scale is None:
            view.k_scale = view.v_scale = None
        view.max_len = length
        return view

    def fits(self, max_len: int, dtype: torch.dtype, device: torch.device) -> bool:
        return self.max_len >= max_len and self.k.dtype == dtype and self.k.device == device

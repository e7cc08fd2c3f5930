"""One contiguous, preallocated KV cache for all layers, sized to the request: in the model's
dtype, or FP8 (e4m3) with a bfloat16 scale per (token, KV head) for K and for V (kernels/quant.py's
scheme), its V stored blocked (kernels/quant.py's layout, the one the lean decode kernel reads
fastest). The runtime's bookkeeping of a cache's positions (Regions) is minidecode/cache.py."""

from __future__ import annotations

from typing import NamedTuple

import torch

from minidecode.kernels.quant import SCALE_DTYPE, V_BLOCK, v_blocks

FP8 = torch.float8_e4m3fn
SCALE_BYTES = SCALE_DTYPE.itemsize  # one bfloat16 scale per (token, KV head), for K and for V


class LayerKV(NamedTuple):
    """One layer's cache, as the ops take it: k, v [B, Hkv, S, D]; with an FP8 cache v is blocked,
    [B, Hkv, ceil(S / V_BLOCK), D, V_BLOCK], and kv_scale is [B, Hkv, S, 2] bfloat16, K's scale then
    V's (row = e4m3 row * scale), else None."""

    k: torch.Tensor
    v: torch.Tensor
    kv_scale: torch.Tensor | None = None


class KVCache:
    """K and V for every layer in two allocations, `[layers, B, Hkv, S, D]` each (plus, for an
    FP8 cache, kv_scale `[layers, B, Hkv, S, 2]` bfloat16: each position's K and V scales side by
    side, which the decode kernel loads as one 32-bit word).

    Heads-major per sequence, so the positions of one (sequence, KV head) are one contiguous
    run of S x D elements: the decode kernel streams them with no gather, and prefill's SDPA
    reads `[B, Hkv, S, D]` views directly.

    An FP8 cache stores V blocked, `[layers, B, Hkv, ceil(S / V_BLOCK), D, V_BLOCK]` (positions
    contiguous inside a block of 64: the decode kernel's P.V operand then needs no transpose), and
    still one contiguous run per (sequence, KV head). It is allocated zero-filled: the kernel reads
    a sequence's last block whole, and the bytes past its length must be finite e4m3 (zeros are;
    0x7F / 0xFF, NaN, never are). Runs of positions go in and out through kernels/quant.py's
    write_v_rows / read_v_rows.
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
        self.kv_scale = None
        if dtype == FP8:
            v_shape = (*shape[:3], v_blocks(max_len), head_dim, V_BLOCK)
            self.v = torch.zeros(v_shape, dtype=dtype, device=device)
            self.kv_scale = torch.empty((*shape[:-1], 2), dtype=SCALE_DTYPE, device=device)
        else:
            self.v = torch.empty(shape, dtype=dtype, device=device)
        self.max_len = max_len

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one position takes in every layer: K and V rows, and their scales when FP8 (an FP8
        cache adds its V padding once: bytes_needed)."""
        row = head_dim * dtype.itemsize + (SCALE_BYTES if dtype == FP8 else 0)
        return 2 * num_layers * num_kv_heads * row

    @staticmethod
    def bytes_needed(
        num_layers: int, num_kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes of a one-sequence cache (scales included; FP8: V padded to whole blocks, at most
        V_BLOCK - 1 positions of V rows more)."""
        total = max_len * KVCache.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
        if dtype == FP8:
            total += (v_blocks(max_len) * V_BLOCK - max_len) * num_layers * num_kv_heads * head_dim
        return total

    @staticmethod
    def region_granule(dtype: torch.dtype) -> int:
        """What region starts (region()) must be multiples of: V_BLOCK for an FP8 cache (the decode
        kernel finds a region's V blocks from its start), else 1."""
        return V_BLOCK if dtype == FP8 else 1

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors().values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by name, each with positions on dim 3 (save/load walk these): k, v,
        and kv_scale for an FP8 cache, whose v has blocks of V_BLOCK positions on dim 3
        (entries(): how many hold a given count of positions)."""
        named = {"k": self.k, "v": self.v}
        if self.kv_scale is not None:
            named["kv_scale"] = self.kv_scale
        return named

    def entries(self, length: int) -> dict[str, int]:
        """How many of each stored tensor's dim-3 entries hold positions 0..length-1: `length`, or
        for an FP8 cache's v its ceil(length / V_BLOCK) blocks."""
        blocked = self.kv_scale is not None
        return {name: v_blocks(length) if blocked and name == "v" else length for name in self.tensors()}

    def layer(self, i: int) -> LayerKV:
        if self.kv_scale is None:
            return LayerKV(self.k[i], self.v[i])  # each [B, Hkv, S, D]
        return LayerKV(self.k[i], self.v[i], self.kv_scale[i])  # v blocked

    def region(self, start: int, length: int) -> KVCache:
        """Positions start..start+length-1 as a cache of their own (views, no copy): a batch's
        sequence is prefilled into its region of the shared cache row exactly as into a cache.
        FP8: start must be a multiple of V_BLOCK (region_granule), and the region's V is its
        ceil(length / V_BLOCK) blocks (with a length that is no multiple, the last one is shared
        with what follows the region)."""
        if start % self.region_granule(self.dtype):
            raise ValueError(f"an FP8 cache's regions start at multiples of {V_BLOCK}, got {start}")
        view = object.__new__(KVCache)
        first, count = self.entries(start), self.entries(length)  # start: whole blocks, exact
        for name, t in self.tensors().items():
            setattr(view, name, t[:, :, :, first[name] : first[name] + count[name]])
        if self.kv_scale is None:
            view.kv_scale = None
        view.max_len = length
        return view

    def fits(self, max_len: int, dtype: torch.dtype, device: torch.device) -> bool:
        return self.max_len >= max_len and self.k.dtype == dtype and self.k.device == device

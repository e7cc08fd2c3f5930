"""One contiguous, preallocated KV cache for all layers, sized to the request."""

from __future__ import annotations

import torch


class KVCache:
    """K and V for every layer in two allocations, `[layers, B, Hkv, S, D]` each.

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
        self.max_len = max_len

    @staticmethod
    def bytes_needed(
        num_layers: int, num_kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes of a one-sequence cache."""
        return 2 * num_layers * num_kv_heads * max_len * head_dim * dtype.itemsize

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]  # each [B, Hkv, S, D]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by name, each with positions on dim 3 (save/load walk these)."""
        return {"k": self.k, "v": self.v}

    def fits(self, max_len: int, dtype: torch.dtype, device: torch.device) -> bool:
        return self.max_len >= max_len and self.k.dtype == dtype and self.k.device == device

"""The runtime's side of the KV cache (the cache's tensors are models/cache.py's KVCache): the
position ranges of its shared row that the scheduler hands to sequences (Regions), and the name
plans, stats and results give a cache dtype."""

from __future__ import annotations

import torch

from minidecode.models.cache import FP8


def kv_dtype_name(dtype: torch.dtype) -> str:
    """How plans, stats and results name a cache dtype: "bfloat16", ..., or "fp8_e4m3"."""
    return "fp8_e4m3" if dtype == FP8 else str(dtype).removeprefix("torch.")


class Regions:
    """First-fit allocation of contiguous position ranges in [0, capacity) of a cache's one
    shared row: each running sequence (and each cached prefix) owns one range."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.free: list[tuple[int, int]] = [(0, capacity)] if capacity > 0 else []  # (start, size), sorted

    def take(self, size: int) -> int | None:
        """The start of a free range of `size` positions, now taken; None if none is that long."""
        for i, (start, length) in enumerate(self.free):
            if length >= size:
                self.free[i : i + 1] = [(start + size, length - size)] if length > size else []
                return start
        return None

    def take_at(self, start: int, size: int) -> bool:
        """Take [start, start + size) if it is all free (a region grown in place)."""
        for i, (s, length) in enumerate(self.free):
            if s <= start and start + size <= s + length:
                parts = [(s, start - s), (start + size, s + length - start - size)]
                self.free[i : i + 1] = [(a, n) for a, n in parts if n > 0]
                return True
        return False

    def give(self, start: int, size: int) -> None:
        """Return a taken range, merging it with free neighbours."""
        self.free.append((start, size))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for s, n in self.free:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        self.free = merged

    def grow(self, capacity: int) -> None:
        """The row grew to `capacity` positions: the new ones are free."""
        if capacity > self.capacity:
            self.give(self.capacity, capacity - self.capacity)
            self.capacity = capacity

"""The lean decode kernel's tile height (kernels/lean_attention.py), importable without Triton: the
runtime sizes its speculation steps by it on every device (speculation.draft_sizes)."""

from __future__ import annotations


def tile_rows(rows: int) -> int:
    """The rows of the tile that holds `rows` query rows of one KV head (G heads x the query
    positions): a power of two, 16 at least (tl.dot needs M >= 16). A step costs its tile's rows
    more than its own (bench/NOTES-attention.md), which is why speculation sizes its steps to fill
    one."""
    return max(16, 1 << (rows - 1).bit_length())

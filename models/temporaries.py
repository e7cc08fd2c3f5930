"""The model's own prefill temporaries, which both sides size: the model splits its prefill
attention calls by them (models/llama.py), and the runtime's memory planner (minidecode/memory.py's
activation_bytes) counts them."""

from __future__ import annotations

import torch

from .config import ModelConfig


def chunk_row_elements(cfg: ModelConfig) -> int:
    """Model-dtype elements of one prompt row's temporaries while a prefill chunk runs its
    projections, or its o_proj and MLP (normed rows, q/k/v and their rotated copies, gate/up and
    its product, the outputs): alive only then, never during attention."""
    return (
        4 * cfg.hidden_size
        + 3 * cfg.intermediate_size
        + 2 * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    )


def rope_bytes(cfg: ModelConfig, rows: int) -> int:
    """The float64 RoPE angles of `rows` prompt rows while their cos/sin are made (two [rows, D])."""
    return rows * cfg.head_dim * 8 * 2


def prefill_attention_kv_heads(
    cfg: ModelConfig, batch: int, rows: int, keys: int, chunk: int, dtype: torch.dtype, fp8: bool
) -> int:
    """KV heads per prefill attention call of `rows` query rows (the whole prompt) against `keys`
    keys: as many as the call's temporaries fit in one chunk's projection / MLP temporaries
    (min(chunk, rows) x chunk_row_elements), which activation_bytes counts and which are not
    alive during attention; at least 1 (one head group's call, which it counts on its own).

    Per KV head a call makes its G query heads' output [B, G, rows, D] in the model dtype and their
    float32 log-sum-exp [B, G, rows] (a whole-prompt SDPA call; the result is then copied over the
    queries), and with the FP8 backend its e4m3 K and V [B, 1, keys, D] (the kernel's pre-pass).
    Paths that go per KV head inside causal_attention (a cached prefix, blocked long prompts) make
    less. For Llama-3-8B with 8192-row chunks that is a whole layer a call up to ~140k rows."""
    per_head = batch * cfg.group_size * rows * (cfg.head_dim * dtype.itemsize + 4)
    if fp8:
        per_head += batch * 2 * keys * cfg.head_dim
    budget = min(chunk, rows) * chunk_row_elements(cfg) * dtype.itemsize
    return max(1, min(cfg.num_kv_heads, budget // per_head))

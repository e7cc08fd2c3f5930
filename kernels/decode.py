"""Decode attention entry point: the lean (stream-K) Triton kernel on CUDA, the reference elsewhere."""

import torch

from .reference import decode_attention_reference


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [B, Hkv, S, D] contiguous
    v_cache: torch.Tensor,  # [B, Hkv, S, D] contiguous
    lengths: torch.Tensor,  # [B] int32 on q's device: valid positions per sequence
    scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    """One decode step of attention: each sequence's single new query over its cached context."""
    if q.is_cuda:
        from .fused import use_pdl
        from .lean_attention import lean_attention

        return lean_attention(q, k_cache, v_cache, lengths, scale, use_pdl=use_pdl(q))
    return decode_attention_reference(q, k_cache, v_cache, lengths, scale)

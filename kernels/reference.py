"""Reference decode attention in plain PyTorch: the CPU path and the ground truth for tests."""

import torch


def decode_attention_reference(
    q: torch.Tensor,  # [B, Hq, D] one new query per sequence
    k_cache: torch.Tensor,  # [B, Hkv, S, D] keys of positions 0..S-1 (only the first lengths[b] are valid)
    v_cache: torch.Tensor,  # [B, Hkv, S, D]
    lengths: torch.Tensor,  # [B] int, valid positions per sequence, 1 <= lengths[b] <= S
    scale: float,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [B, Hq, D] in q.dtype
    """softmax(q k^T * scale) v over each sequence's first lengths[b] positions.

    Loops over the batch on the host (it reads `lengths`), so it is for CPU runs and tests,
    not for CUDA graphs. compute_dtype=torch.float64 gives the tests' ground truth.
    """
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    out = torch.empty_like(q)
    for b, n in enumerate(lengths.tolist()):
        qb = q[b].view(Hkv, G, D).to(compute_dtype)  # [Hkv, G, D]: the group shares one KV head
        kb = k_cache[b, :, :n].to(compute_dtype)  # [Hkv, n, D]
        vb = v_cache[b, :, :n].to(compute_dtype)
        p = torch.softmax(qb @ kb.transpose(1, 2) * scale, dim=-1)  # [Hkv, G, n]
        out[b] = (p @ vb).reshape(Hq, D).to(q.dtype)
    return out

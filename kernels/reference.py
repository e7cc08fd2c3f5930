"""Reference decode attention (and prompt-lookup drafting) in plain PyTorch: the CPU path and the
ground truth for tests."""

import torch


def decode_attention_reference(
    q: torch.Tensor,  # [B, Hq, D] one new query per sequence
    k_cache: torch.Tensor,  # [B, Hkv, S, D] keys of positions 0..S-1 (only the first lengths[b] are valid)
    v_cache: torch.Tensor,  # [B, Hkv, S, D]
    lengths: torch.Tensor,  # [B] int, valid positions per sequence, 1 <= lengths[b] <= S
    scale: float,
    compute_dtype: torch.dtype = torch.float32,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [B, Hq, D] in q.dtype (, lse [B, Hq])
    """softmax(q k^T * scale) v over each sequence's first lengths[b] positions.

    Loops over the batch on the host (it reads `lengths`), so it is for CPU runs and tests,
    not for CUDA graphs. compute_dtype=torch.float64 gives the tests' ground truth. return_lse
    also returns each query head's log-sum-exp of the scaled scores (natural log, float32 or
    float64 with that compute_dtype; -inf where
    lengths[b] is 0, whose output is 0): what a context-parallel merge weighs partials by.
    """
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, dtype=torch.promote_types(compute_dtype, torch.float32), device=q.device)
    for b, n in enumerate(lengths.tolist()):
        qb = q[b].view(Hkv, G, D).to(compute_dtype)  # [Hkv, G, D]: the group shares one KV head
        kb = k_cache[b, :, :n].to(compute_dtype)  # [Hkv, n, D]
        vb = v_cache[b, :, :n].to(compute_dtype)
        scores = qb @ kb.transpose(1, 2) * scale  # [Hkv, G, n]
        out[b] = (torch.softmax(scores, dim=-1) @ vb).reshape(Hq, D).to(q.dtype)
        if return_lse:
            lse[b] = torch.logsumexp(scores, dim=-1).reshape(Hq)
    return (out, lse) if return_lse else out


def multi_query_attention_reference(
    q: torch.Tensor,  # [B, Q_MAX, Hq, D]: q_lens[b] new query positions of sequence b
    k_cache: torch.Tensor,  # [B, Hkv, S, D]: the first lengths[b] positions valid, the new ones last
    v_cache: torch.Tensor,  # [B, Hkv, S, D]
    lengths: torch.Tensor,  # [B] int, valid positions per sequence (0: idle, else >= q_lens[b])
    q_lens: torch.Tensor,  # [B] int, 1 <= q_lens[b] <= Q_MAX
    scale: float,
    compute_dtype: torch.dtype = torch.float32,
    return_lse: bool = False,
    limits: torch.Tensor | None = None,  # [B, Q_MAX] int: the positions each query sees (0..lengths[b])
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [B, Q_MAX, Hq, D] (, lse [B, Q_MAX, Hq])
    """Attention of several new query positions a sequence (verifying speculative drafts): query
    position j of sequence b sees its first lengths[b] - q_lens[b] + j + 1 positions (the whole
    context before the new tokens, and the new tokens causally), or its first limits[b, j] where
    given (a query that sees none is 0, lse -inf). Rows j >= q_lens[b] and idle sequences are 0
    (lse -inf). Host loops: for CPU runs and tests."""
    B, q_max, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    out = torch.zeros_like(q)
    lse_dtype = torch.promote_types(compute_dtype, torch.float32)
    lse = torch.full((B, q_max, Hq), float("-inf"), dtype=lse_dtype, device=q.device)
    for b, (n, t) in enumerate(zip(lengths.tolist(), q_lens.tolist(), strict=True)):
        if n == 0:
            continue
        qb = q[b, :t].to(compute_dtype).view(t, Hkv, G, D).permute(1, 0, 2, 3).reshape(Hkv, t * G, D)
        kb = k_cache[b, :, :n].to(compute_dtype)  # [Hkv, n, D]
        vb = v_cache[b, :, :n].to(compute_dtype)
        scores = qb @ kb.transpose(1, 2) * scale  # [Hkv, t * G, n], row j * G + g
        if limits is None:
            limit = n - t + 1 + torch.arange(t, device=q.device)  # [t] positions query j sees
        else:
            limit = limits[b, :t].to(q.device)
        seen = torch.arange(n, device=q.device)[None, :] < limit[:, None]  # [t, n]
        scores = scores.masked_fill(~seen.repeat_interleave(G, 0)[None], float("-inf"))  # [t, n] -> rows
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees nothing: all 0
        o = (weights @ vb).view(Hkv, t, G, D).permute(1, 0, 2, 3)  # [t, Hkv, G, D]
        out[b, :t] = o.reshape(t, Hq, D).to(q.dtype)
        if return_lse:
            lse[b, :t] = torch.logsumexp(scores, dim=-1).view(Hkv, t, G).permute(1, 0, 2).reshape(t, Hq)
    return (out, lse) if return_lse else out


def prompt_lookup_reference(
    history: torch.Tensor,  # [H] int: token ids, row b's at offsets[b] .. offsets[b] + lengths[b] - 1
    offsets: torch.Tensor,  # [B] int
    lengths: torch.Tensor,  # [B] int, P_b >= 0
    tokens: torch.Tensor,  # [B] int: row b's current token (after its P_b, not in history)
    want: torch.Tensor,  # [B] int: drafts asked for (<= 0: none; capped at K)
    drafts: torch.Tensor,  # [B, K] int64, out (0 past draft_lens)
    draft_lens: torch.Tensor,  # [B] int64, out
    min_ngram: int = 2,
    max_ngram: int = 4,
) -> None:
    """kernels/ops.py's prompt_lookup: a host loop over the rows (it reads their bounds), each
    row's ends compared at once; for CPU runs and tests."""
    K = drafts.shape[1]
    out = torch.zeros(drafts.shape, dtype=torch.int64)
    lens = [0] * len(lengths)
    rows = zip(offsets.tolist(), lengths.tolist(), tokens.tolist(), want.tolist(), strict=True)
    for b, (o, P, tok, w) in enumerate(rows):
        w = min(w, K)
        if w <= 0 or P == 0:
            continue
        seq = torch.cat([history[o : o + P].cpu().long(), torch.tensor([tok])])  # S [L], L = P + 1
        # m[e - 1] for the ends e = 1..P: how many of S[e-1], S[e-2], ... equal S[P], S[P-1], ... in a row
        m = torch.zeros(P, dtype=torch.int64)
        alive = torch.ones(P, dtype=torch.bool)
        for j in range(min(max_ngram, P)):
            same = torch.zeros(P, dtype=torch.bool)
            same[j:] = seq[: P - j] == seq[P - j]  # S[e-1-j] == S[L-1-j], where e - 1 - j >= 0
            alive &= same
            m += alive
        if m.max() < min_ngram:
            continue
        ends = torch.arange(1, P + 1)
        e = int(torch.where(m >= min_ngram, m * (P + 1) + ends, -1).argmax()) + 1  # largest (m, e)
        out[b, :w] = seq[e + torch.arange(w) % (P + 1 - e)]  # past the end: the period L - e repeats
        lens[b] = w
    drafts.copy_(out)
    draft_lens.copy_(torch.tensor(lens, dtype=torch.int64))

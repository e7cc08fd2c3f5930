"""Speculative decoding by prompt lookup: the rule that verifies drafts against the model's
distributions, and how many drafts a row's next lookup asks for.

A request's text often repeats itself (code edits, quotes, summaries of the prompt): where the
last few tokens occurred before, the tokens that followed them then are a likely continuation
now. Each decode step finds them for the next on the device (ops.prompt_lookup over the token
history: decode.py), the model scores all drafts in one step (decode attention with q_lens,
kernels/ops.py), and `accept` keeps the longest verified prefix plus one token of the model's
own: the output is exactly what decoding one token at a time gives, greedy or seeded sampling,
whatever the drafts.

Pure torch, on the device (no host sync); nothing here knows the engine.
"""

from __future__ import annotations

import torch


def next_draft_counts(
    counts: torch.Tensor,  # [B] int64: the drafts each row's lookup asked for
    proposed: torch.Tensor,  # [B] int64: the drafts its step verified (0: none)
    accepted: torch.Tensor,  # [B] int64: those kept
    most: torch.Tensor,  # [B] int64: the row's limit (its speculate setting)
) -> torch.Tensor:  # [B] int64
    """How many drafts each row's next lookup asks for: doubled (up to `most`) when every draft
    was kept, one more than the kept ones otherwise; unchanged where none were verified."""
    grown = torch.minimum(torch.maximum(counts, proposed) * 2, most)
    cut = torch.where(accepted >= proposed, grown, accepted + 1)
    return torch.where(proposed > 0, cut, counts)


# ---- verification ---------------------------------------------------------------------------


def accept(
    drafts: torch.Tensor,  # [B, K] int64, sequence b's first draft_lens[b] are its drafts
    chosen: torch.Tensor,  # [B, K + 1] int64: the model's own token after draft i - 1 (0: after the sequence)
    draft_lens: torch.Tensor,  # [B] int64, 0 <= draft_lens[b] <= K
) -> tuple[torch.Tensor, torch.Tensor]:  # accepted [B] int64, next [B] int64
    """Verification: sequence b's drafts agree with the tokens its own step would emit at their
    positions (`chosen`: the argmax, or what the sampler draws there from its counter-based stream,
    sampling.sample) up to accepted[b], and next[b] is the model's token after them (its correction
    at the first disagreement, or its bonus token after the last draft). Emitting drafts[b,
    :accepted[b]] then next[b] is therefore token for token what decoding one token at a time
    emits, greedy or seeded sampling alike, in any batch and whatever the drafts; with sampling a
    fixed draft x is kept with probability p(x), and otherwise the token is p's draw given it is
    not x (p with x removed, renormalised), the rule of speculative sampling. No host sync."""
    K = drafts.shape[1]
    in_draft = torch.arange(K, device=drafts.device)[None, :] < draft_lens[:, None]
    accepted = ((chosen[:, :K] == drafts) & in_draft).long().cumprod(1).sum(1)  # [B]
    return accepted, chosen.gather(1, accepted[:, None])[:, 0]

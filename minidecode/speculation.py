"""Speculative decoding by prompt lookup: the rule that verifies drafts against the model's
distributions, and how many drafts a row's next lookup asks for.

A request's text often repeats itself (code edits, quotes, summaries of the prompt): where the
last few tokens occurred before, the tokens that followed them then are a likely continuation
now. Each decode step finds them for the next on the device (ops.prompt_lookup over the token
history: decode.py), the model scores all drafts in one step (decode attention with q_lens,
kernels/ops.py), and `accept` keeps the longest verified prefix plus one token of the model's
own: the output is exactly what decoding one token at a time gives, greedy or seeded sampling,
whatever the drafts.

A lookup asks for one of the model's draft sizes (`draft_sizes`): the counts whose query rows
fill the decode kernel's tile, since a step costs its tile, not its rows.

The rules are plain Python on the host (the scheduler's and the engine's) and torch on the device
(the step's, no host sync); nothing here knows the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minidecode.kernels.tiles import tile_rows

from .request import MAX_SPECULATE

FIRST_DRAFTS = 4  # a row's first lookup asks for the draft size that holds this many


def draft_sizes(group: int) -> tuple[int, ...]:
    """The draft counts a step is built for, smallest first, for a model with `group` query heads
    a KV head: each k <= MAX_SPECULATE whose k + 1 query positions fill their tile
    (kernels/tiles.tile_rows of group * (k + 1) rows: one more position would need the next),
    and below the first of those, where every k runs in the smallest tile, 1, 3, 7, 15. A step's
    cost jumps where its rows pass a tile (G = 4, 32k, an H100: k = 7, 32 rows, 1.33x a plain
    step; k = 8, 36 rows in a 64-row tile, 1.51x: bench/results/verify-attention-tiles-h100.md),
    so a count between two sizes would pay the larger tile for fewer drafts than it holds."""
    rows = [tile_rows(group * q) for q in range(MAX_SPECULATE + 3)]  # the tile of q positions' rows
    fills = [k for k in range(1, MAX_SPECULATE + 1) if rows[k + 2] > rows[k + 1]]
    below = [k for k in (1, 3, 7, 15) if k < (fills or [MAX_SPECULATE + 1])[0]]
    return tuple(sorted({1, *below, *fills}))


def most_drafts(speculate: int, sizes: Sequence[int]) -> int:
    """The most drafts a step verifies for a row whose setting is `speculate` (0: none): the
    largest draft size <= speculate."""
    return max((s for s in sizes if s <= speculate), default=0)


def size_up(n: int, sizes: Sequence[int]) -> int:
    """The smallest draft size >= n (the largest where none is)."""
    return next((s for s in sizes if s >= n), sizes[-1])


def first_draft_count(most: int, sizes: Sequence[int]) -> int:
    """What a row's first lookup asks for, where its steps verify at most `most` drafts."""
    return min(size_up(FIRST_DRAFTS, sizes), most)


def next_draft_count(count: int, proposed: int, accepted: int, sizes: Sequence[int]) -> int:
    """How many drafts a row's next lookup asks for after its lookup asked for `count`, its step
    verified `proposed` and kept `accepted` (before its limit: DraftCounts.next): the size that
    holds twice as many when every draft was kept, else the largest size up to one more than the
    kept ones; unchanged where none were verified."""
    if proposed == 0:
        return count
    if accepted >= proposed:
        return size_up(2 * max(count, proposed), sizes)
    return most_drafts(accepted + 1, sizes)


def grown_draft_count(ready: int, most: int, sizes: Sequence[int]) -> int:
    """The most drafts a row's next lookup can ask for after a step that verified `ready` and
    kept them all (the scheduler sizes the next step by it)."""
    return min(next_draft_count(ready, ready, ready, sizes), most)


@dataclass(frozen=True)
class DraftCounts:
    """next_draft_count on the device, for every row of a step at once: the rule tabulated over
    (count, proposed, accepted), each in 0..MAX_SPECULATE, so a step with drafts pays a handful of
    element-wise kernels for it whatever the sizes (the graph's work, not a host sync)."""

    # [(M + 1) ** 3] int64, M = MAX_SPECULATE: the rule's answer for (count, proposed, accepted)
    # at (count * (M + 1) + proposed) * (M + 1) + accepted
    table: torch.Tensor

    @classmethod
    def make(cls, sizes: Sequence[int], device: torch.device | str) -> DraftCounts:
        n = range(MAX_SPECULATE + 1)
        rule = [next_draft_count(c, p, a, sizes) for c in n for p in n for a in n]
        return cls(torch.tensor(rule, dtype=torch.long, device=device))

    def next(
        self,
        counts: torch.Tensor,  # [B] int64: the drafts each row's lookup asked for (a draft size, or 0)
        proposed: torch.Tensor,  # [B] int64: the drafts its step verified (0: none)
        accepted: torch.Tensor,  # [B] int64: those kept
        most: torch.Tensor,  # [B] int64: the row's limit (most_drafts of its setting: a size, or 0)
    ) -> torch.Tensor:  # [B] int64: what each row's next lookup asks for, a draft size up to most
        side = MAX_SPECULATE + 1
        return torch.minimum(self.table[(counts * side + proposed) * side + accepted], most)


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

"""Speculative decoding by prompt lookup: drafts copied from earlier in the sequence, and the rule
that verifies them against the model's distributions.

A request's text often repeats itself (code edits, quotes, summaries of the prompt): where the
last few tokens occurred before, the tokens that followed them then are a likely continuation
now. `PromptLookup` indexes every n-gram of the sequence (prompt, then the generated tokens as
they come) by its latest end, so a proposal is a few dict lookups, never a scan of the prompt.
The model then scores all drafts in one step (decode attention with q_lens, kernels/ops.py), and
`accept_greedy` / `accept_sampled` keep the longest verified prefix plus one token of the
model's own: the output is exactly what decoding one token at a time gives (greedy), or is
distributed exactly as it (sampling), whatever the drafts.

Pure Python and torch; nothing here knows the engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from .sampling import _uniform, argmax

_M64 = (1 << 64) - 1
_MUL = 0x9E3779B97F4A7C15  # odd 64-bit multiplier (golden ratio): the n-gram hash's mixing step
_ACCEPT_SALT = 0x6A09E667F3BCC909  # xor-ed into the seed: the accept draws' own random stream


def _ngram_key(tokens: Sequence[int]) -> int:
    """The 64-bit hash of an n-gram (what _ngram_keys computes for every window at once)."""
    h = 0
    for t in tokens:
        h = ((h ^ t) * _MUL) & _M64
    return h


def _ngram_keys(tokens: np.ndarray, n: int) -> np.ndarray:
    """uint64 [len - n + 1]: _ngram_key of each window tokens[i : i + n] (uint64 wraps like & _M64)."""
    count = len(tokens) - n + 1
    h = np.zeros(max(count, 0), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = (h ^ tokens[j : j + count]) * np.uint64(_MUL)
    return h


class PromptLookup:
    """Drafts for one request from its own tokens (prompt lookup decoding).

    For each n (min_ngram <= n <= max_ngram), every n-gram that has a token after it is indexed
    by a 64-bit hash, mapping to the latest position just past it. The prompt's n-grams are one
    sorted array of hashes a size (binary search: O(log L) a lookup, built with numpy in a few
    sort passes), the generated ones a dict that takes precedence (they are later). The
    sequence's final n-gram is added once a token follows, so a lookup of the last n tokens finds
    an earlier occurrence. A hash collision can only hide a match (every hit is compared with
    the tokens), never give a wrong one.

    k, the drafts a proposal may hold, follows the acceptance (`record`): doubled (up to
    max_draft) when every draft was accepted, cut to one more than the accepted ones otherwise.
    """

    def __init__(
        self,
        prompt: Sequence[int] | torch.Tensor,
        *,
        max_ngram: int = 4,
        min_ngram: int = 2,
        max_draft: int = 15,
        initial_draft: int = 4,
    ):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {max_draft}")
        self.min_ngram, self.max_ngram, self.max_draft = min_ngram, max_ngram, max_draft
        self.k = max(1, min(initial_draft, max_draft))
        ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        self.tokens: list[int] = ids
        arr = np.asarray(ids, dtype=np.uint64)
        # n -> (sorted unique hashes [U] uint64, the latest end of each [U] int64): the prompt's
        self._prompt_index: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._recent: dict[int, dict[int, int]] = {}  # n -> {hash: latest end}: generated n-grams
        for n in range(min_ngram, max_ngram + 1):
            # windows ending before the last token (each has a continuation)
            keys = _ngram_keys(arr[:-1], n) if len(ids) > n else np.zeros(0, dtype=np.uint64)
            order = np.argsort(keys, kind="stable")  # equal hashes stay in position order
            sorted_keys = keys[order]
            last = np.ones(len(keys), dtype=bool)  # the last (latest) of each run of equal hashes
            last[:-1] = sorted_keys[1:] != sorted_keys[:-1]
            self._prompt_index[n] = (sorted_keys[last], order[last] + n)
            self._recent[n] = {}

    def _latest_end(self, n: int, key: int) -> int | None:
        """The latest end of an n-gram with hash `key` that has a token after it, if any."""
        end = self._recent[n].get(key)
        if end is not None:
            return end
        keys, ends = self._prompt_index[n]
        i = int(np.searchsorted(keys, np.uint64(key)))
        return int(ends[i]) if i < len(keys) and int(keys[i]) == key else None

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append generated (accepted) tokens; each makes the n-grams ending just before it
        findable, with it as their continuation."""
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens) - 1  # the n-grams ending here now have a token after them
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._recent[n][_ngram_key(self.tokens[end - n : end])] = end

    def match(self) -> tuple[int, int]:
        """(n, end) of the longest n-gram of the last tokens seen before, n from max_ngram down to
        min_ngram: its latest earlier occurrence ends at `end` (< len). (0, 0) if none."""
        toks, length = self.tokens, len(self.tokens)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            suffix = toks[length - n :]
            end = self._latest_end(n, _ngram_key(suffix))
            if end is not None and toks[end - n : end] == suffix:
                return n, end
        return 0, 0

    def propose(self, max_tokens: int | None = None) -> list[int]:
        """Up to min(k, max_tokens) draft tokens: what followed the longest match of the last
        tokens ([] when nothing matches). A match close to the end overlaps its own
        continuation (a repeating pattern): the copy then runs on through the drafts it made,
        continuing the period."""
        want = self.k if max_tokens is None else min(self.k, max_tokens)
        n, end = self.match()
        if n == 0 or want <= 0:
            return []
        toks, length = self.tokens, len(self.tokens)
        drafts: list[int] = []
        for i in range(want):
            at = end + i  # < length + i: the sequence so far, then the drafts already made
            drafts.append(toks[at] if at < length else drafts[at - length])
        return drafts

    def record(self, proposed: int, accepted: int) -> None:
        """Adapt k to a verification: `accepted` of `proposed` drafts were kept."""
        if proposed <= 0:
            return
        if accepted >= proposed:
            self.k = min(self.max_draft, max(self.k, proposed) * 2)
        else:
            self.k = max(1, accepted + 1)


# ---- verification ---------------------------------------------------------------------------


def _accepted(ok: torch.Tensor, draft_lens: torch.Tensor) -> torch.Tensor:
    """ok [B, K] bool per draft -> [B] int64: how many of the first draft_lens[b] hold in a row."""
    in_draft = torch.arange(ok.shape[1], device=ok.device)[None, :] < draft_lens[:, None]
    return (ok & in_draft).long().cumprod(1).sum(1)


def accept_greedy(
    drafts: torch.Tensor,  # [B, K] int64, sequence b's first draft_lens[b] are its drafts
    logits: torch.Tensor,  # [B, K + 1, V]: row i scores the token after draft i - 1 (0: after the sequence)
    draft_lens: torch.Tensor,  # [B] int64, 0 <= draft_lens[b] <= K
) -> tuple[torch.Tensor, torch.Tensor]:  # accepted [B] int64, next [B] int64
    """Greedy verification: sequence b's drafts agree with the argmax up to accepted[b], and
    next[b] is the argmax after them (the model's correction, or its bonus token when all were
    accepted). Emitting drafts[b, :accepted[b]] then next[b] is exactly greedy decoding, one
    token at a time. On the device, no host sync."""
    B, K1, V = logits.shape
    best = argmax(logits.reshape(B * K1, V).float()).view(B, K1)  # [B, K + 1]
    accepted = _accepted(best[:, : K1 - 1] == drafts, draft_lens)
    return accepted, best.gather(1, accepted[:, None])[:, 0]


def accept_sampled(
    drafts: torch.Tensor,  # [B, K] int64, sequence b's first draft_lens[b] are its drafts
    probs: torch.Tensor,  # [B, K + 1, V] float32: the distribution sampled after draft i - 1
    draft_lens: torch.Tensor,  # [B] int64, 0 <= draft_lens[b] <= K
    seeds: torch.Tensor,  # [B] int64: each request's seed
    positions: torch.Tensor,  # [B] int64: where draft 0 (or the token drawn instead) goes
) -> tuple[torch.Tensor, torch.Tensor]:  # accepted [B] int64, next [B] int64
    """Exact sampling verification for fixed (deterministic) drafts. probs are what the model
    samples from (after temperature, top-k/top-p and the logits processors, as sampling.sample
    uses them); draft i of sequence b is the token at positions[b] + i.

    Draft i is accepted with probability p_i(x_i); at the first rejection the token is drawn from
    p_i with x_i removed and renormalised, and verification stops; when all are accepted, a bonus
    token is drawn from the next row. So each emitted token is distributed exactly as p_i:
    P(x) = p(x), P(y != x) = (1 - p(x)) p(y) / (1 - p(x)) = p(y). Returns (accepted, next) as
    accept_greedy.

    The draws come from the counter-based hash of (seed, position): the accept draw of position
    t from a salted seed, the replacement or bonus token from the exponential race over the same
    uniforms sampling.sample uses at t. A seeded request verifies reproducibly in any batch, and
    its bonus token is the one plain decoding would have sampled there. No host sync."""
    B, K1, V = probs.shape
    K = K1 - 1
    at = positions[:, None] + torch.arange(K, device=probs.device)  # [B, K]
    u = _uniform((seeds[:, None] ^ _ACCEPT_SALT).expand(B, K).reshape(-1), at.reshape(-1), 1).view(B, K)
    p_draft = probs[:, :K].gather(-1, drafts[..., None])[..., 0]  # [B, K] p_i(x_i)
    accepted = _accepted(u < p_draft, draft_lens)
    row = probs.gather(1, accepted[:, None, None].expand(B, 1, V))[:, 0].float()  # [B, V]
    rejected = accepted < draft_lens
    # the rejected draft's token removed (the renormalisation cancels in the race's argmax)
    x = drafts.gather(1, accepted.clamp(max=max(K - 1, 0))[:, None]) if K else accepted[:, None]
    row = torch.where(rejected[:, None] & (torch.arange(V, device=row.device) == x), 0.0, row)
    noise = -torch.log(_uniform(seeds, positions + accepted, V))  # [B, V]
    return accepted, argmax(row / noise)

"""Next-token choice: greedy, temperature, top-k, top-p; all on the device with no host sync."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import UserError


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1: no nucleus cut
    seed: int | None = None

    def validate(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise UserError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise UserError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] float32 -> next token ids [B] int64."""
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1)  # ascending
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - params.top_p
        drop[:, -1] = False  # always keep the most likely token
        logits = logits.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    probs = logits.softmax(dim=-1)
    # Gumbel-style draw: argmax(p / E) with E ~ Exponential(1) picks index i with probability p_i,
    # and unlike torch.multinomial it needs no synchronisation with the host.
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)

"""Each rank's share of a model split over tp x cp ranks, and the collectives the split model
calls (models/parallel.py). The process group, the agreement between ranks and torchrun are the
runtime's (minidecode/distributed.py, whose Parallel is the Collectives here).

A split the model cannot take raises ConfigError with the user's message (the runtime makes it
a UserError)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

from minidecode.kernels.fp8_weights import FP8Weight, QuantizedRows

from .config import ConfigError, ModelConfig


class OneShotSum(Protocol):
    """A group's one-shot sum in the GEMV's own launch (minidecode/distributed.py's OneShot)."""

    def can_norm(self, x: torch.Tensor, weight: torch.Tensor) -> bool: ...

    def sum_of_linear(
        self,
        x: torch.Tensor | QuantizedRows,
        weight: torch.Tensor | FP8Weight,
        bias: torch.Tensor | None,
        out: torch.Tensor,
        residual: torch.Tensor | None = None,
        norm: tuple[torch.Tensor, float, torch.Tensor] | None = None,
        pdl: bool = False,
    ) -> None: ...


class Collectives(Protocol):
    """This rank's place among tp x cp ranks (global rank = cp_rank * tp + tp_rank) and the
    collectives over model tensors that the split model calls, ordered on the current stream."""

    tp: int
    cp: int

    @property
    def tp_rank(self) -> int: ...

    @property
    def cp_rank(self) -> int: ...

    def one_shot_tp(self, x: torch.Tensor) -> OneShotSum | None: ...

    def all_reduce_tp(self, x: torch.Tensor) -> None: ...

    def all_gather_tp(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather_cp(self, x: torch.Tensor) -> torch.Tensor: ...

    def broadcast_cp(self, x: torch.Tensor, cp_rank: int) -> None: ...


@dataclass(frozen=True)
class ShardPlan:
    """One tensor-parallel rank's share of a model (checkpoint rows, half-open ranges).

    Query heads [q_lo, q_hi) and the KV heads they read, [kv_lo, kv_hi): a contiguous block of
    whole GQA groups when tp divides the KV heads, else the one KV head of this rank's query
    heads, replicated on the tp / Hkv ranks that share it. MLP intermediate rows [mlp_lo, mlp_hi).
    Vocabulary rows [vocab_lo, vocab_lo + vocab_rows) of the lm_head, padded past the vocabulary
    so that every rank's logits have the same width (an all-gather needs equal parts)."""

    q_lo: int
    q_hi: int
    kv_lo: int
    kv_hi: int
    mlp_lo: int
    mlp_hi: int
    vocab_lo: int
    vocab_rows: int


def shard_plan(cfg: ModelConfig, tp: int, tp_rank: int) -> ShardPlan:
    """Rank tp_rank's share; a model that does not split tp ways is refused with what would."""
    Hq, Hkv, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    ways = [n for n in range(1, Hq + 1) if Hq % n == 0 and (Hkv % n == 0 or n % Hkv == 0)]
    if Hq % tp or (Hkv % tp and tp % Hkv):
        raise ConfigError(
            f"--tp {tp} does not split this model's {Hq} query / {Hkv} KV heads (tp must divide the "
            f"query heads, and divide or be a multiple of the KV heads); use --tp "
            + " or ".join(map(str, ways))
        )
    if inter % tp:
        raise ConfigError(f"--tp {tp} does not divide the MLP's intermediate size {inter}")
    q_per = Hq // tp
    q_lo = tp_rank * q_per
    kv_lo = q_lo // cfg.group_size
    kv_hi = kv_lo + max(Hkv // tp, 1)
    vocab_rows = -(-cfg.vocab_size // tp)
    mlp_per = inter // tp
    return ShardPlan(
        q_lo, q_lo + q_per, kv_lo, kv_hi, tp_rank * mlp_per, (tp_rank + 1) * mlp_per,
        tp_rank * vocab_rows, vocab_rows,
    )  # fmt: skip


def rank_config(cfg: ModelConfig, plan: ShardPlan) -> ModelConfig:
    """The config of one tensor-parallel rank's modules: its heads and MLP rows (the vocabulary,
    hidden size and everything else stay whole)."""
    return dataclasses.replace(
        cfg,
        num_heads=plan.q_hi - plan.q_lo,
        num_kv_heads=plan.kv_hi - plan.kv_lo,
        intermediate_size=plan.mlp_hi - plan.mlp_lo,
    )


def rank_positions(context: int, cp: int) -> int:
    """Cache positions each context-parallel rank holds for a context: its ceil(context / cp) share
    of the positions (`deal`: no rank ever holds more)."""
    return -(-context // cp)


def deal(prompt_len: int, cp: int) -> list[list[tuple[int, int]]]:
    """Each context-parallel rank's prompt positions: runs [lo, hi) of consecutive positions, in the
    order the rank holds them (its cache positions 0, 1, ...).

    The first 2 cp q positions (q = prompt_len // (2 cp)) are cut into 2 cp chunks of q; rank i
    takes chunks i and 2 cp - 1 - i, so every rank has the same causal work: q rows after i q
    earlier keys, and q rows after (2 cp - 1 - i) q. The last prompt_len mod 2 cp positions, and
    every generated position after them, are dealt round robin: position p to rank p mod cp, at
    its cache position p // cp. The two halves agree on that: each rank's chunks hold 2 q = 2 cp q
    / cp positions, so past them position p is rank p mod cp's (p // cp)-th whatever the prompt's
    length, and a decode step needs only the position (models/parallel.py). Ranks' counts differ
    by at most one at every length. Adjacent runs are joined (cp 1: one run of the whole prompt)."""
    q = prompt_len // (2 * cp)
    shares: list[list[tuple[int, int]]] = [[] for _ in range(cp)]
    for i in range(cp if q else 0):
        for chunk in (i, 2 * cp - 1 - i):
            _append_run(shares[i], chunk * q, (chunk + 1) * q)
    for p in range(2 * cp * q, prompt_len):
        _append_run(shares[p % cp], p, p + 1)
    return shares


def _append_run(runs: list[tuple[int, int]], lo: int, hi: int) -> None:
    if runs and runs[-1][1] == lo:
        runs[-1] = (runs[-1][0], hi)
    else:
        runs.append((lo, hi))

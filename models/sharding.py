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


# Context parallelism deals a sequence's positions over the cp ranks in chunks of CP_CHUNK, by
# rounds: round r holds chunks r cp .. r cp + cp - 1, dealt to ranks 0 .. cp - 1 in even rounds and
# cp - 1 .. 0 in odd ones, so that over each two rounds every rank's two chunks start, summed, at the
# same place: the same causal work (a prompt's ranks differ by at most about one chunk's rows over
# its whole context: 2 cp CP_CHUNK / T of a rank's work at T positions, 1.6% at 512k on 4 ranks).
# Where a position goes depends on the position alone, never on the prompt's length, so a prefix
# lies on every rank where any longer prompt would put it (prefix reuse, cache files) and a
# generated position goes where the prompt's dealing would put it. Each rank holds its positions in
# order, compactly (round r's chunk at its cache positions r CP_CHUNK ..). A chunk of 1024 rows
# keeps a prefill attention call of one run over a layer's query heads at 8k-32k rows (a GPU's
# worth of query blocks; models/parallel.py).
CP_CHUNK = 1024


def owner(position: int | torch.Tensor, cp: int, chunk: int = CP_CHUNK) -> tuple:
    """(the rank that holds `position`, its cache position there): ints, or int64 tensors of a
    tensor of positions (the decode step's, in its graph)."""
    rnd, j = position // chunk // cp, position // chunk % cp
    return j + rnd % 2 * (cp - 1 - 2 * j), rnd * chunk + position % chunk


def held(count: int | torch.Tensor, cp: int, rank: int, chunk: int = CP_CHUNK) -> int | torch.Tensor:
    """How many of positions 0..count-1 `rank` holds (its cache positions 0..held-1 hold them): an
    int, or an int64 tensor of a tensor of counts."""
    rounds, rest = count // (cp * chunk), count % (cp * chunk)
    j = rank + rounds % 2 * (cp - 1 - 2 * rank)  # the rank's chunk in the last, partial round
    part = rest - j * chunk
    part = part.clamp(0, chunk) if isinstance(part, torch.Tensor) else min(max(part, 0), chunk)
    return rounds * chunk + part


def rank_positions(context: int, cp: int, chunk: int = CP_CHUNK) -> int:
    """Cache positions each context-parallel rank holds room for in a context: the most any rank
    holds of positions 0..context-1 (the first rank of the last, partial round)."""
    rounds, rest = divmod(context, cp * chunk)
    return rounds * chunk + min(rest, chunk)


def deal(lo: int, end: int, cp: int, chunk: int = CP_CHUNK) -> list[list[tuple[int, int]]]:
    """Each rank's positions among lo..end-1: runs [a, b) of consecutive positions, in the order
    the rank holds them (its cache positions held(lo), held(lo) + 1, ...). Adjacent runs are
    joined (cp 1: one run)."""
    shares: list[list[tuple[int, int]]] = [[] for _ in range(cp)]
    for c in range(lo // chunk, -(-end // chunk)):
        a, b = max(lo, c * chunk), min(end, (c + 1) * chunk)
        if a < b:
            _append_run(shares[owner(a, cp, chunk)[0]], a, b)
    return shares


def _append_run(runs: list[tuple[int, int]], lo: int, hi: int) -> None:
    if runs and runs[-1][1] == lo:
        runs[-1] = (runs[-1][0], hi)
    else:
        runs.append((lo, hi))

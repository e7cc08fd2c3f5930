"""The step plan: what one turn of the engine does, decided by the scheduler (scheduler.py) and run
by the engine (Engine.run), on every rank alike.

A plan is plain data (picklable: under torchrun rank 0 sends each plan to the other ranks, which
run it on their shards of the weights and of the cache). Its parts run in this order:

1. `moves`, `clears`: rows of sequences that ended (the last row moves into each: rows stay packed);
2. `cancel`: drop the prefill in progress (its caller has gone);
3. `cache`: the admitted sequence's cache work: a resize, a prefix copied between regions, a saved
   cache file read into its region, a release (a failure here fails that sequence only);
4. `prepare`: decode graphs captured ahead of the step that needs them (a step with drafts' too);
5. `decode` and `prefill`: one decode step of rows 0..n-1, with the graph kind of those rows (and
   speculation's query rows: several tokens a row), and the one prefill in progress: either a chunk of
   its prompt (`Prefill.chunk`) run with the decode rows as one mixed step (one forward: their
   projections and MLP in one matmul per weight; a step with drafts runs on its own first, the
   chunk alone after it), or, with no decode rows, units of work of its prompt's rest as a whole
   prefill; when its last position has run, its row starts (`RowStart`: region, position, sampling
   and logits-processor settings, prompt ids) and its first token is sampled;
6. `score`: logits of every position of some token ids (`LLM.logits`);
7. `file`: a cache file saved or opened, each rank its own part (`LLM.save_cache` / `load_cache`).

What the engine returns is a `StepOutput`: the decode step's tokens (of the step before it: each
step's tokens are copied to the host while the next one runs, a step with drafts' kept drafts with
them; its next drafts are made on the device, so it is not waited for either), the first
token of a prefill that ended, the failure of the admitted or prefilling sequence, if any (the
decode rows step all the same), and each rank's answer to `file`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .sampling import SamplingParams


@dataclass(frozen=True)
class DecodeKind:
    """What a decode step of some rows must do (its graph's key, less the bucket): the sampling
    mode, log-probs, logits processors, top log-probs, the next step's drafts looked up (some row
    speculates); each on if any row needs it."""

    mode: str
    logprobs: bool = False
    adjust: bool = False
    top: bool = False
    lookup: bool = False


@dataclass
class Resize:
    """A cache of `capacity` region positions; positions 0..keep-1 of the old one copied across
    (keep 0: the old one freed first)."""

    capacity: int
    keep: int = 0


@dataclass
class Copy:
    """Cache positions src..src+count-1 to dst.. (region starts): a prefix reused in a new region."""

    src: int
    dst: int
    count: int


@dataclass
class FileRead:
    """A saved cache file's first `count` positions into the region starting at `start` (under
    torchrun each rank reads its own part, the one FileOpen opened: `file` is rank 0's)."""

    file: Any  # cache_file.CacheFile
    start: int
    count: int


@dataclass
class FileSave:
    """Every rank writes its part of the cache positions start..start + len(ids) - 1 (a finished
    sequence's prefix) to its part of `path` (cache_file.part_path); `metadata`: what every part
    records (the config hash, the cache dtype, the rope length, the save's id). Each rank adds its
    weights' fingerprint and its place (tp, cp, rank, world size)."""

    path: Path
    start: int
    ids: list[int]
    metadata: dict[str, str]


@dataclass
class FileOpen:
    """Every rank opens and checks its part of the cache file at `path` against `identity` (the
    config hash and the cache dtype; each rank adds its weights' fingerprint) and its place, and
    keeps it for the FileRead that reads it."""

    path: Path
    identity: dict[str, str]


@dataclass
class Release:
    """Free the cache and the graphs captured on it."""


@dataclass
class RowStart:
    """Row `row` decodes a sequence whose region starts at `start`, its next token at `position`
    (its prompt's length), with these sampling and logits-processor settings (a repetition
    penalty's prompt ids: the prefill's, sent once, in its first plan); `speculate`: the most
    drafts a step of it verifies (0: none), none at positions past `draft_end`."""

    row: int
    start: int
    position: int
    params: SamplingParams
    speculate: int = 0
    draft_end: int = 0


@dataclass
class Prefill:
    """This plan's part of one sequence's prefill into its region [start, start + size), whose
    first `reused` positions already hold its prompt's K/V. The first plan of a prefill carries
    the prompt (`begin`). `chunk` (lo, hi): prompt positions lo..hi-1, run in this plan's mixed
    step with its decode rows (the chunks follow one another from `reused`); None: `units` units of
    work (None: to the end) of a whole prefill of the positions not yet run (begun by the first
    such plan, continued by the next: a prefill beside no decode rows, or under context
    parallelism beside them, after their decode step)."""

    seq: int  # Sequence.id
    start: int
    size: int
    reused: int
    row: RowStart
    logprobs: bool = False  # the first token's log-prob (and `top`: its top log-probs)
    top: bool = False
    chunk: tuple[int, int] | None = None
    units: int | None = 1
    begin: list[int] | None = None  # the prompt ids, in the prefill's first plan


@dataclass
class Decode:
    """A decode step of rows 0..rows-1. With drafts (speculation): `queries` = 1 + a draft size
    (speculation.draft_sizes), the most query rows a row takes: its token, then up to queries - 1 of
    the drafts the step before made for it on the device (each rank alike, from the same tokens)."""

    rows: int
    kind: DecodeKind
    queries: int = 1


@dataclass
class StepPlan:
    moves: list[tuple[int, int]] = field(default_factory=list)  # (src row, dst row), in order
    clears: list[int] = field(default_factory=list)
    cancel: bool = False
    admit: int | None = None  # the Sequence.id whose cache work `cache` is
    cache: list[Resize | Copy | FileRead | Release] = field(default_factory=list)
    prepare: list[tuple[int, DecodeKind, int]] = field(default_factory=list)  # (rows, kind, queries)
    decode: Decode | None = None
    prefill: Prefill | None = None
    score: list[int] | None = None
    file: FileSave | FileOpen | None = None
    stop: bool = False  # the other ranks leave their plan loop

    @property
    def empty(self) -> bool:
        return not (
            self.moves or self.clears or self.cancel or self.cache or self.prepare or self.decode
            or self.prefill or self.score is not None or self.file is not None or self.stop
        )  # fmt: skip


@dataclass
class StepOutput:
    """What running a plan gave (rank 0 reads it; the other ranks' outputs stay with them)."""

    # What the decode step before this plan's gave, of rows 0..n-1, on the host (each step's results
    # are copied while the next one runs): the token each row holds now (its log p and top ids /
    # log-probs where asked for); where that step verified drafts, `verdicts`, a row each: its drafts
    # verified, those kept, then the drafts (the kept ones first, handed out before the token); where
    # rows speculate, `draft_lens`: the drafts each row had ready then (the scheduler's guess of the
    # next step's)
    tokens: list[int] = field(default_factory=list)
    verdicts: list[list[int]] | None = None
    draft_lens: list[int] | None = None
    logprobs: list[float] | None = None
    top_ids: Any = None  # [n, 20] int64 (host)
    top_logprobs: Any = None  # [n, 20] float32 (host)
    prefill_began: float = 0.0  # host time the prefill's first unit was queued (its prefill_seconds)
    first: tuple[int, float | None, Any] | None = None  # a prefill that ended: (token, log p, top rows)
    file_seconds: float = 0.0  # reading a cache file (within the sequence's TTFT)
    failed: tuple[int, str] | None = None  # (Sequence.id, message): the admitted or prefilling sequence
    resized: bool = False  # the cache's size changed (a failed resize: see `capacity`)
    capacity: int = 0  # the cache's region positions after the plan
    logits: Any = None  # score's [T, V] float32
    # `file`'s answer, one per rank (rank 0's first): a save's bytes written, an open's (save id,
    # length); and the first failure of any rank (one UserError line)
    file_results: list[Any] = field(default_factory=list)
    file_error: str | None = None

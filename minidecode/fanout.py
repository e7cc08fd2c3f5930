"""Every rank runs the same plan: under torchrun, rank 0's engine loop sends each step plan
(plan.py) to the other ranks, which run it on their shards of the weights and of the cache.

Rank 0 runs the engine loop and whatever feeds it (the server, a batch, the Python API, the CLI).
For each plan it calls `Fanout.run`: the plan goes out by `broadcast_object_list` over a gloo group
of its own (host objects, beside the model's NCCL or gloo groups), every rank runs it
(Engine.run), and every rank's acknowledgement comes back by `gather_object`: its free memory (the
scheduler plans with the least), the tokens its step and its prefill sampled (checked against rank
0's: every rank samples the same tokens from the same gathered logits and seeds, so a difference
is a bug, and stops the loop), and its failure, if any. The other ranks sit in `serve_plans` until
rank 0 sends a stop plan (its LLM closed, or its process exiting).

A dead rank never leaves the others hanging: the plan group's collectives time out
(MINIDECODE_RANK_TIMEOUT seconds, default 600: longer than any one plan's host wait), a closed
connection fails them at once, and an idle rank 0 sends an empty plan every HEARTBEAT_S seconds, so
it notices a dead peer (its loop dies: every caller gets the error, and the server exits) and the
other ranks' waits stay short.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .plan import StepOutput, StepPlan

if TYPE_CHECKING:
    from .distributed import Parallel
    from .engine import Engine

HEARTBEAT_S = 2.0  # an idle rank 0 sends an empty plan this often


def plan_timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get("MINIDECODE_RANK_TIMEOUT", "600")))


class RankError(RuntimeError):
    """Another rank failed, died, or disagreed: the engine loop cannot go on."""


@dataclass
class Ack:
    """A rank's answer to a plan."""

    free_bytes: int
    tokens: list[int] = field(default_factory=list)
    first: int | None = None
    failed: tuple[int, str] | None = None
    fatal: str | None = None  # an error that ended this rank's plan loop
    file_result: Any = None  # its answer to the plan's `file` (its part saved or opened)
    file_error: str | None = None


def _ack(engine: Engine, out: StepOutput | None, fatal: str | None = None) -> Ack:
    if out is None:
        return Ack(engine.free_bytes(), fatal=fatal)
    first = None if out.first is None else out.first[0]
    result = out.file_results[0] if out.file_results else None
    return Ack(engine.free_bytes(), out.tokens, first, out.failed, fatal, result, out.file_error)


class Fanout:
    """Rank 0's side: runs each plan on every rank (the engine loop's thread only)."""

    heartbeat_s = HEARTBEAT_S

    def __init__(self, parallel: Parallel, engine: Engine):
        self.group, self.world, self.engine = parallel.plan_group, parallel.world_size, engine
        self.free = [engine.free_bytes()] * self.world  # each rank's, as of its last plan
        self.error: str | None = None  # why the ranks stopped (a dead or failed rank)
        self.stopped = False

    def free_bytes(self) -> int:
        """The least free memory of any rank (rank 0's now, the others' after their last plan)."""
        return min([self.engine.free_bytes(), *self.free[1:]])

    def run(self, plan: StepPlan, on_progress: Any = None) -> StepOutput:
        if self.stopped:
            raise RankError(f"the other ranks have stopped: {self.error or 'closed'}")
        self._send(plan)
        try:
            out = self.engine.run(plan, on_progress)
        except BaseException as e:
            self._gather(_ack(self.engine, None, f"{type(e).__name__}: {e}"))
            raise
        acks = self._gather(_ack(self.engine, out))
        for rank, ack in enumerate(acks[1:], start=1):
            if ack.fatal is not None:
                self._fail(f"rank {rank} failed: {ack.fatal}")
            if ack.tokens != out.tokens or (out.first is not None and ack.first != out.first[0]):
                self._fail(f"rank {rank} sampled other tokens than rank 0: the ranks' decode states differ")
            if out.failed is None and ack.failed is not None:
                out.failed = ack.failed  # one rank's failure of the sequence is every rank's
        if plan.file is not None:  # every rank's part; the first failure (by rank) is the plan's
            out.file_results = [ack.file_result for ack in acks]
            out.file_error = next((ack.file_error for ack in acks if ack.file_error is not None), None)
        self.free = [ack.free_bytes for ack in acks]
        return out

    def stop(self) -> None:
        """The other ranks leave serve_plans (best effort: some may be gone)."""
        if self.stopped:
            return
        self.stopped = True
        try:
            self._send(StepPlan(stop=True))
            self._gather(_ack(self.engine, None))
        except (RankError, RuntimeError):
            pass

    def _fail(self, message: str) -> None:
        self.error, self.stopped = message, True
        raise RankError(message)

    def _send(self, plan: StepPlan) -> None:
        try:
            dist.broadcast_object_list([plan], src=0, group=self.group)
        except RuntimeError as e:  # a dead peer: a closed connection, or the timeout
            self._fail(f"a rank stopped answering: {_first_line(e)}")

    def _gather(self, ack: Ack) -> list[Ack]:
        acks: list[Any] = [None] * self.world
        try:
            dist.gather_object(ack, acks, dst=0, group=self.group)
        except RuntimeError as e:
            self._fail(f"a rank stopped answering: {_first_line(e)}")
        return acks


def serve_plans(parallel: Parallel, engine: Engine) -> int:
    """A rank other than 0: run rank 0's plans until it sends a stop -> the plans run. Raises
    RankError when rank 0 is gone (or this rank's engine fails: rank 0 hears of it first)."""
    if engine.device.type == "cuda":
        torch.cuda.set_device(engine.device)
    group, count = parallel.plan_group, 0
    with torch.inference_mode():
        while True:
            box: list[Any] = [None]
            try:
                dist.broadcast_object_list(box, src=0, group=group)
            except RuntimeError as e:
                raise RankError(f"rank 0 stopped sending plans: {_first_line(e)}") from None
            plan: StepPlan = box[0]
            if plan.stop:
                dist.gather_object(_ack(engine, None), None, dst=0, group=group)
                return count
            try:
                out = engine.run(plan)
            except BaseException as e:
                dist.gather_object(_ack(engine, None, f"{type(e).__name__}: {e}"), None, dst=0, group=group)
                raise
            dist.gather_object(_ack(engine, out), None, dst=0, group=group)
            count += 1


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__

"""The engine loop: one worker thread owns the model and the device, and every caller (a single
`generate`, a stream, a prompt list, other threads, the server) submits sequences to it and reads
only its own events from its own queue.

Each turn of the loop takes what arrived (new sequences, aborts, calls), asks the scheduler for
the next step's plan (scheduler.py, plan.py), has the engine run it (under torchrun: every rank,
fanout.py) and hands out what it gave: each sequence's tokens as events with their
text (stop strings are matched here), its result and stats at its end. A prompt that prefills
beside running sequences goes a chunk a plan, each in one mixed step with their decode rows, so a
running stream gets a token every step; alone, a plan runs one unit of its prefill.

Each step's tokens are copied to pinned host memory and the next step is launched before the host
waits for that copy: the device never idles while the host detokenizes and hands out. A request's
error ends that request; an error of the loop itself reaches every waiting caller, and the next
submission starts a new loop.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .cache import kv_dtype_name
from .engine import Engine
from .errors import UserError
from .plan import StepOutput, StepPlan
from .scheduler import Scheduler
from .sequence import Event, GenerationResult, Sequence, TextStream


@dataclass
class LoopStats:
    """Counters and latency samples for monitoring (the server's /metrics reads them)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0
    decode_steps: int = 0  # each sequence's decode steps, summed (speculation: fewer than the tokens)
    proposed_tokens: int = 0  # speculation: draft tokens verified, and those kept
    accepted_tokens: int = 0
    observe: Callable[[str, float], None] | None = None  # (ttft | inter_token | e2e, seconds)


@dataclass
class _Call:
    run: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    error: BaseException | None = None


class EngineLoop:
    """Owns `engine` through one worker thread, started by the first submission (and again after
    the loop died). `tokenizer` turns each sequence's tokens into text pieces (stop strings are
    matched here, so a sequence ends at the step where its text does)."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        prefix_reuse: bool = True,
        ranks: Any = None,
    ):
        self.engine, self.tokenizer = engine, tokenizer
        # ranks: under torchrun, rank 0's channel to the other ranks (fanout.Fanout): every
        # plan runs on all of them, and the scheduler plans with the least free memory of any
        self.ranks = ranks
        self._free_bytes = None if ranks is None else ranks.free_bytes
        self.scheduler = Scheduler(engine, prefix_reuse, self._free_bytes)
        self._prefix_reuse = prefix_reuse
        self.stats = LoopStats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # what ended the last loop, if it died
        self._stopping = False
        self._at_exit = False

    # ---- the callers' side (any thread) --------------------------------------------------------
    def submit(self, seqs: list[Sequence]) -> None:
        """Queue sequences in order; their events go to each one's sink."""
        self._ensure_running()
        self._inbox.put(("add", seqs))

    def abort(self, seqs: list[Sequence]) -> None:
        """End these sequences at the next step boundary (their rows and regions are freed)."""
        self._inbox.put(("abort", seqs))

    def call(self, run: Callable[[], Any]) -> Any:
        """run() on the loop's thread between steps (work on the device or the cache); its value,
        or its exception raised here."""
        self._ensure_running()
        call = _Call(run)
        self._inbox.put(("call", call))
        while not call.done.wait(0.5):
            if not self.alive:  # the loop died before it got to this call
                raise RuntimeError(f"the engine loop stopped: {self.error!r}") from self.error
        if call.error is not None:
            raise call.error
        return call.value

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        """False once the loop has died (until a submission starts a new one). The error is set
        before the dying thread ends, so this never reads a dying loop as healthy."""
        return self.error is None

    def free_bytes(self) -> int:
        """Free device memory (under torchrun: the least of any rank's)."""
        return self.engine.free_bytes() if self._free_bytes is None else self._free_bytes()

    def counts(self) -> tuple[int, int]:
        """(running, waiting) sequences."""
        return len(self.scheduler.running), len(self.scheduler.waiting)

    def close(self) -> None:
        """Stop the loop once it is idle (waiting callers get an error)."""
        if self.alive:
            self._inbox.put(("stop", None))
            self._thread.join()

    def _ensure_running(self) -> None:
        with self._lock:
            if self.error is not None and self._thread is not None:
                self._thread.join()  # a dying loop: let it finish, then start a new one
            if self.alive:
                return
            if self.error is not None:  # a new loop after a failure: a clean scheduler and cache
                self.engine.release()
                self.scheduler = Scheduler(self.engine, self._prefix_reuse, self._free_bytes)
                self.error = None
            self._stopping = False
            self._thread = threading.Thread(target=self._main, name="minidecode-engine", daemon=True)
            self._thread.start()
            if not self._at_exit:  # stop the worker before the interpreter tears down under it
                atexit.register(_close_at_exit, weakref.ref(self))
                self._at_exit = True

    # ---- the loop (its thread only) -------------------------------------------------------------
    def _main(self) -> None:
        try:
            if self.engine.device.type == "cuda":
                torch.cuda.set_device(self.engine.device)
            with torch.inference_mode():
                while not self._stopping:
                    scheduler = self.scheduler
                    # (calls wait while a prefill is in progress: they may use the cache it fills)
                    idle = self._take_inbox(block=scheduler.idle, calls=scheduler.prefilling is None)
                    if self._stopping:
                        break
                    if idle:  # under torchrun: an empty plan, so that a dead rank is noticed
                        self.execute(StepPlan())
                    self._turn()
            if self.scheduler.prefilling is not None:
                self.scheduler.cancel_prefill()
                self._settle()
            self._die(RuntimeError("the engine loop was closed"))
        except BaseException as e:  # a device error, a bug, a dead rank: every caller hears of it
            self._die(e)
        finally:
            if self.ranks is not None:  # the other ranks leave their plan loops
                self.ranks.stop()

    def _take_inbox(self, block: bool, calls: bool = True) -> bool:
        """Take what arrived (waiting for something when `block`, under torchrun at most a
        heartbeat); calls wait while `calls` is off. -> True if a wait ended with nothing."""
        deferred, timeout = [], None if self.ranks is None else self.ranks.heartbeat_s
        while True:
            try:
                kind, item = self._inbox.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                if block:
                    return True
                break
            block = False
            if kind == "add":
                self.scheduler.waiting.extend(item)
            elif kind == "abort":
                for seq in item:
                    self._abort(seq)
            elif kind == "call" and calls:
                self._run_call(item)
            elif kind == "call":
                deferred.append((kind, item))
            else:
                self._stopping = True
        for message in deferred:
            self._inbox.put(message)
        return False

    def _run_call(self, call: _Call) -> None:
        try:
            call.value = call.run()
        except BaseException as e:  # the caller raises it
            call.error = e
        call.done.set()

    def _abort(self, seq: Sequence) -> None:
        seq.aborted = True  # a running or prefilling one ends at the next plan
        if seq in self.scheduler.waiting:
            self.scheduler.waiting.remove(seq)
            self._finish(seq, "abort")

    def execute(self, plan: StepPlan, on_progress: Callable[[int, int], None] | None = None) -> StepOutput:
        """Run a plan on the engine (under torchrun: on every rank, rank 0's answer returned)."""
        if self.ranks is not None:
            return self.ranks.run(plan, on_progress)
        return self.engine.run(plan, on_progress)

    def _turn(self) -> None:
        """One plan: asked for, run, and its results handed out."""
        scheduler = self.scheduler
        plan = scheduler.schedule()
        self._settle()
        if plan.empty:
            return
        seq = scheduler.prefilling if plan.prefill is not None else None
        decoded = scheduler.running[: plan.decode.rows] if plan.decode is not None else []
        if plan.prefill is not None and plan.prefill.begin is not None:
            self._begin(seq)
        out = self.execute(plan, seq.on_progress if seq is not None else None)
        if plan.prefill is not None and plan.prefill.begin is not None:
            seq.prefill_began = out.prefill_began
        started = scheduler.update(plan, out)
        self._settle()
        ended = []
        for row, running in enumerate(decoded):
            if self._hand_out_step(running, row, out):
                ended.append(running)
        if started is not None and self._started(started, out):
            ended.append(started)
        if ended:  # their rows freed now (the next plan would first), before their results go out
            scheduler.end(ended)
            self.execute(scheduler.pending())
        for done in ended:
            self._finish(done, done.finish_reason)

    def _hand_out_step(self, seq: Sequence, row: int, out: StepOutput) -> bool:
        """What the step before gave seq (row `row`), in order: the drafts it kept, if it verified
        any, then the token its row holds now; nothing where seq had no step before (its first
        token, which its row holds, was handed out at its prefill's end: seq.skip) -> True once seq
        has ended (an end-of-sequence token, a stop, max_new_tokens: the rest of the step's tokens
        are dropped)."""
        seq.stats.decode_steps += 1
        self.stats.decode_steps += 1
        if seq.skip:
            seq.skip = False
            return seq.aborted
        tokens = []
        if out.verdicts is not None and out.verdicts[row][0]:
            proposed, accepted, *drafts = out.verdicts[row]
            seq.stats.proposed_tokens += proposed
            seq.stats.accepted_tokens += accepted
            self.stats.proposed_tokens += proposed
            self.stats.accepted_tokens += accepted
            tokens += [(token, None, None) for token in drafts[:accepted]]
        logprob = out.logprobs[row] if seq.want_logprobs else None
        top = _top(seq, out.top_ids[row], out.top_logprobs[row]) if out.top_ids is not None else None
        tokens.append((out.tokens[row], logprob, top))
        return any(self._hand_out(seq, *token) for token in tokens)

    def _begin(self, seq: Sequence) -> None:
        """seq's prefill is about to start: its stats so far."""
        engine, stats = self.engine, seq.stats
        n = stats.prompt_tokens = len(seq.prompt_ids)
        stats.reused_tokens, stats.prefilled_tokens = seq.reused, n - seq.reused
        stats.kv_cache_dtype = kv_dtype_name(engine.kv_dtype)
        stats.weights, stats.prefill_attention = engine.weights, engine.prefill_backend
        self.stats.prompt_tokens += n
        if engine.device.type == "cuda" and not self.scheduler.running:
            torch.cuda.reset_peak_memory_stats(engine.device)

    def _started(self, seq: Sequence, out: StepOutput) -> bool:
        """seq's prefill ended with its first token: handed out -> whether seq has ended."""
        stats, n = seq.stats, len(seq.prompt_ids)
        stats.prefill_seconds = time.perf_counter() - seq.prefill_began
        stats.prefill_tokens_per_s = (n - seq.reused) / max(stats.prefill_seconds, 1e-9)
        seq.text = TextStream(self.tokenizer, seq.stops)
        seq.skip = True  # its first token, handed out now, is also what its row holds
        first, logprob, top = out.first
        top = _top(seq, *top) if top is not None else None
        return self._hand_out(seq, first, logprob, top)

    def _settle(self) -> None:
        """The scheduler's sequences that ended unrun: refused, failed in their prefill, aborted."""
        while self.scheduler.dropped:
            seq, error = self.scheduler.dropped.pop(0)
            if error is None:
                self._finish(seq, "abort", ran=False)
            else:
                self._fail(seq, error)

    def _hand_out(
        self, seq: Sequence, token: int, logprob: float | None, top: list[tuple[int, float]] | None = None
    ) -> bool:
        """A new token of seq: its event (with the text it completes); -> True once seq has ended."""
        if seq.aborted:
            seq.finish_reason = "abort"
            return True
        now = time.perf_counter()
        if not seq.sampled:
            seq.t_first = now
            seq.stats.time_to_first_token = now - seq.arrived
            self._observe("ttft", seq.stats.time_to_first_token)
        else:
            self._observe("inter_token", now - seq.t_last)
        seq.t_last = now
        seq.sampled.append(token)
        if token in seq.eos_ids:
            seq.finish_reason = "eos"
            return True
        if token in seq.stop_ids:  # like an end-of-sequence token: not returned
            seq.finish_reason = "stop"
            return True
        seq.token_ids.append(token)
        self.stats.generation_tokens += 1
        if logprob is not None:
            seq.logprobs.append(logprob)
        if top is not None:
            seq.top_logprobs.append(top)
        piece = seq.text.push(token)
        if seq.text.stopped:
            seq.finish_reason = "stop"
            return True
        seq.sink(Event(seq.index, token, piece, logprob, top_logprobs=top))
        if len(seq.token_ids) >= seq.max_new_tokens:
            seq.finish_reason = "length"
            return True
        return False

    def _finish(self, seq: Sequence, reason: str, ran: bool = True) -> None:
        """seq's result (its text flushed, its stats completed) to its caller."""
        stats = seq.stats
        stats.new_tokens = len(seq.token_ids)
        if seq.t_first:
            stats.decode_seconds = seq.t_last - seq.t_first
            steps = len(seq.sampled) - 1
            stats.decode_tokens_per_s = (
                steps / stats.decode_seconds if steps > 0 and stats.decode_seconds else 0.0
            )
        device = self.engine.device
        if ran and device.type == "cuda":
            stats.peak_memory_bytes = torch.cuda.max_memory_allocated(device)
        elif ran:
            stats.peak_memory_bytes = _host_peak_bytes()
        piece = seq.text.flush() if seq.text is not None else ""
        if piece:
            seq.sink(Event(seq.index, None, piece))
        if seq.text is not None and seq.text.stopped:
            reason = "stop"
        result = GenerationResult(
            text=seq.text.text if seq.text is not None else "",
            token_ids=seq.token_ids,
            prompt_token_ids=seq.prompt_ids,
            finish_reason=reason,
            stats=stats,
            logprobs=seq.logprobs if seq.want_logprobs else None,
            top_logprobs=seq.top_logprobs if seq.want_top else None,
        )
        self.stats.requests_finished += 1
        self._observe("e2e", time.perf_counter() - seq.arrived)
        seq.sink(Event(seq.index, result=result))

    def _fail(self, seq: Sequence, message: str, fatal: bool = False) -> None:
        """seq was refused or failed (fatal: the loop itself failed): its error to its caller."""
        result = GenerationResult("", [], seq.prompt_ids, "error", seq.stats, error=message)
        seq.sink(Event(seq.index, result=result, error=message, fatal=fatal))

    def _observe(self, what: str, seconds: float) -> None:
        if self.stats.observe is not None:
            self.stats.observe(what, seconds)

    def _die(self, error: BaseException) -> None:
        """The loop ends: every sequence it holds, and every message still queued, gets the error."""
        self.error = error
        message = f"the engine loop failed: {type(error).__name__}: {error}"
        if isinstance(error, UserError):
            message = str(error)
        scheduler = self.scheduler
        victims = [*scheduler.waiting, *scheduler.running]
        if scheduler.prefilling is not None:
            victims.append(scheduler.prefilling)
        scheduler.waiting.clear()
        scheduler.running.clear()
        scheduler.prefilling = None
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                victims.extend(item)
            elif kind == "call":
                item.error = RuntimeError(message)
                item.done.set()
        for seq in victims:
            self._fail(seq, message, fatal=not isinstance(error, UserError))


def _top(seq: Sequence, ids: torch.Tensor, logprobs: torch.Tensor) -> list[tuple[int, float]] | None:
    """seq's top log-probs at a token from its row of the top buffers (ids, logprobs [20], on the
    host or, for the first token, the device), most likely first; None unless it asked for them."""
    if not seq.want_top:
        return None
    return list(zip(ids[: seq.want_top].tolist(), logprobs[: seq.want_top].tolist(), strict=True))


def _close_at_exit(loop: weakref.ref) -> None:
    if (alive := loop()) is not None:
        alive.close()


def _host_peak_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

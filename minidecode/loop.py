"""The engine loop: one worker thread owns the model and the device, and every caller (a single
`generate`, a stream, a prompt list, other threads, the server) submits sequences to it and reads
only its own events from its own queue.

Each turn of the loop takes what arrived (new sequences, aborts, calls), admits waiting sequences
while a row and a region are free (scheduler.py) and prefills them, then runs one decode step of
every running sequence and hands out its tokens. While a prompt prefills, the running sequences
keep decoding: the prefill runs in units of work (a chunk of one layer's projections, an attention
call), and they step between units once the units since their last step have taken about a
step's time (pacer.py), so a running stream waits about two steps between tokens.

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
from .pacer import Pacer
from .sampling import batch_mode
from .scheduler import Scheduler
from .sequence import Event, GenerationResult, Sequence, TextStream


class _Aborted(Exception):
    """Raised between prefill units when the prefilling sequence's caller has gone."""


@dataclass
class LoopStats:
    """Counters and latency samples for monitoring (the server's /metrics reads them)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0
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
        min_over_ranks: Callable[[int], int] = int,
    ):
        self.engine, self.tokenizer = engine, tokenizer
        self._scheduler_args = (prefix_reuse, min_over_ranks)
        self.scheduler = Scheduler(engine, prefix_reuse, min_over_ranks)
        self.stats = LoopStats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # what ended the last loop, if it died
        self._prefilling: Sequence | None = None
        self._interleave = False  # the running sequences decode between the prefill's units
        # the running rows' step: (sampling mode, log-probs, logits processors, top log-probs)
        self._step_kind: tuple[str, bool, bool, bool] | None = None
        self._stopping = False
        self._at_exit = False
        cuda = engine.device.type == "cuda"
        self._host_tokens = torch.empty(engine.max_batch, dtype=torch.long, pin_memory=cuda)
        self._host_logprobs = torch.empty(engine.max_batch, dtype=torch.float32, pin_memory=cuda)
        top = engine.state.top_ids.shape[1]
        self._host_top_ids = torch.empty(engine.max_batch, top, dtype=torch.long, pin_memory=cuda)
        self._host_top_logprobs = torch.empty(engine.max_batch, top, dtype=torch.float32, pin_memory=cuda)
        self._pacer = Pacer(engine.device)

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
        """False once the loop has died (until a submission starts a new one)."""
        return self.error is None or self.alive

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
            if self.alive:
                return
            if self.error is not None:  # a new loop after a failure: a clean scheduler and cache
                self.engine.release()
                self.scheduler = Scheduler(self.engine, *self._scheduler_args)
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
                    self._take_inbox(block=not (self.scheduler.waiting or self.scheduler.running))
                    if self._stopping:
                        break
                    self._admit()
                    if self.scheduler.running:
                        self._decode_step()
            self._die(RuntimeError("the engine loop was closed"))
        except BaseException as e:  # a device error, a bug: every caller hears of it
            self._die(e)

    def _take_inbox(self, block: bool, calls: bool = True) -> None:
        """Take what arrived (waiting for something when `block`); calls wait while `calls` is off."""
        deferred = []
        while True:
            try:
                kind, item = self._inbox.get(block=block)
            except queue.Empty:
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

    def _run_call(self, call: _Call) -> None:
        try:
            call.value = call.run()
        except BaseException as e:  # the caller raises it
            call.error = e
        call.done.set()

    def _abort(self, seq: Sequence) -> None:
        seq.aborted = True
        if seq in self.scheduler.waiting:
            self.scheduler.waiting.remove(seq)
            self._finish(seq, "abort")

    def _admit(self) -> None:
        """Prefill waiting sequences, in order, while a row and a region are free. Sequences that
        were decoding before this admission keep decoding between the prefills' units; those that
        arrived together start together (their prefills run back to back)."""
        scheduler = self.scheduler
        self._interleave = bool(scheduler.running)
        while scheduler.waiting and len(scheduler.running) < self.engine.max_batch:
            seq = scheduler.waiting[0]
            try:
                placed = scheduler.place(seq)
            except UserError as e:  # it cannot fit the device even alone
                scheduler.waiting.popleft()
                self._fail(seq, str(e))
                continue
            except torch.OutOfMemoryError:
                scheduler.waiting.popleft()
                self._fail(seq, f"out of memory on {self.engine.device} while making room for its cache")
                continue
            if not placed:
                break  # in order: the head waits for room (no request overtakes it for ever)
            scheduler.waiting.popleft()
            self._prefill(seq)

    def _prefill(self, seq: Sequence) -> None:
        engine, scheduler, stats = self.engine, self.scheduler, seq.stats
        n = stats.prompt_tokens = len(seq.prompt_ids)
        stats.reused_tokens, stats.prefilled_tokens = seq.reused, n - seq.reused
        stats.kv_cache_dtype = kv_dtype_name(engine.kv_dtype)
        stats.weights, stats.prefill_attention = engine.weights, engine.prefill_backend
        self.stats.prompt_tokens += n
        if engine.device.type == "cuda" and not scheduler.running:
            torch.cuda.reset_peak_memory_stats(engine.device)
        # The step graph it will decode in, captured now (before its time to first token is taken:
        # prefill_seconds), not in the middle of its decoding.
        engine.prepare(len(scheduler.running) + 1, *step_kind([*scheduler.running, seq]))
        t0 = time.perf_counter()
        self._prefilling = seq  # (an error of the loop's own reaches it through _die)
        try:
            logits = engine.prefill(
                seq.prompt_ids, seq.start, seq.size, seq.reused, between=self._between,
                interleave=self._interleave, on_progress=seq.on_progress,
            )  # fmt: skip
            row = len(scheduler.running)
            engine.start_row(row, seq.start, n, seq.params, seq.prompt_ids)
            first = engine.sample_first(row, logits, seq.params, seq.want_logprobs, seq.want_top > 0)
        except (_Aborted, UserError, torch.OutOfMemoryError) as e:
            self._prefilling = None
            scheduler.free(seq)
            if isinstance(e, _Aborted):
                self._finish(seq, "abort", ran=False)
            elif isinstance(e, UserError):
                self._fail(seq, str(e))
            else:
                self._fail(seq, f"out of memory on {engine.device} in prefill: lower the prompt length")
            return
        self._prefilling = None
        stats.prefill_seconds = time.perf_counter() - t0 - stats.cache_load_seconds
        stats.prefill_tokens_per_s = (n - seq.reused) / max(stats.prefill_seconds, 1e-9)
        seq.text = TextStream(self.tokenizer, seq.stops)
        scheduler.running.append(seq)
        self._step_kind = None
        seq.skip = True  # its first token, handed out now, is also what its row holds
        logprob = float(engine.state.logprob[row]) if seq.want_logprobs else None
        top = _top(seq, engine.state.top_ids[row], engine.state.top_logprob[row])
        if self._hand_out(seq, first, logprob, top):
            self._end([seq])

    def _between(self, flops: float) -> None:
        """Between two units of a prefill (`flops` of work): take new arrivals and aborts, and run
        one decode step of the running sequences when the pacer says it is their turn."""
        self._take_inbox(block=False, calls=False)
        if self._stopping or (self._prefilling is not None and self._prefilling.aborted):
            raise _Aborted
        if self._interleave and self.scheduler.running and self._pacer.unit_done(flops):
            self._decode_step()

    def _decode_step(self) -> None:
        """One decode step of every running sequence, and the hand-out of the previous step's tokens."""
        engine, running = self.engine, self.scheduler.running
        n = len(running)
        if self._step_kind is None:  # changes only when a sequence starts or ends, not every step
            self._step_kind = step_kind(running)
        mode, logprobs, adjust, top = self._step_kind
        state = engine.state
        self._host_tokens[:n].copy_(state.tokens[:n], non_blocking=True)
        if logprobs:
            self._host_logprobs[:n].copy_(state.logprob[:n], non_blocking=True)
        if top:
            self._host_top_ids[:n].copy_(state.top_ids[:n], non_blocking=True)
            self._host_top_logprobs[:n].copy_(state.top_logprob[:n], non_blocking=True)
        pacer = self._pacer
        copied = pacer.step_started()
        engine.step(n, mode, logprobs, adjust, top)  # the next step runs while these tokens are handed out
        pacer.step_ended()
        for seq in running:
            seq.fed += 1  # the step writes the K/V of the token its row holds
        pacer.wait(copied)
        ended = []
        for row, seq in enumerate(running):
            if seq.skip:
                seq.skip = False
                if seq.aborted:
                    ended.append(seq)
                continue
            logprob = float(self._host_logprobs[row]) if seq.want_logprobs else None
            top = _top(seq, self._host_top_ids[row], self._host_top_logprobs[row])
            if self._hand_out(seq, int(self._host_tokens[row]), logprob, top):
                ended.append(seq)
        self._end(ended)

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

    def _end(self, ended: list[Sequence]) -> None:
        """Free the ended sequences' rows (the last row moves into each: rows stay packed) and keep
        their regions as cached prefixes; then their results go out."""
        engine, running = self.engine, self.scheduler.running
        for seq in ended:
            row, last = running.index(seq), len(running) - 1
            if row != last:
                engine.move_row(last, row)
                running[row] = running[last]
            running.pop()
            self._step_kind = None
            engine.clear_row(last)
            self.scheduler.keep(seq)
        for seq in ended:
            self._finish(seq, seq.finish_reason)

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
        if self._prefilling is not None:
            victims.append(self._prefilling)
        scheduler.waiting.clear()
        scheduler.running.clear()
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


def step_kind(seqs: list[Sequence]) -> tuple[str, bool, bool, bool]:
    """What a decode step of these sequences must do (its graph's key, less the bucket): the
    sampling mode, log-probs, logits processors, top log-probs; each on if any sequence needs it."""
    return (
        batch_mode([s.params for s in seqs]),
        any(s.want_logprobs for s in seqs),
        any(s.params.adjusts for s in seqs),
        any(s.want_top for s in seqs),
    )


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

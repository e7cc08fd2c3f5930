"""Many requests at once: continuous batching over regions of one contiguous KV cache.

The cache is one allocation with one shared position axis, `[layers, 1, Hkv, P, D]`. Each
running sequence owns a contiguous region of it, sized to its own prompt + max_new_tokens (not
to the longest in the batch), so the decode kernel still streams each (sequence, KV head) as one
contiguous run. Requests are admitted in order while a region and a batch slot are free; the
rest wait. A sequence that finishes gives its region and slot to the next waiting request at
once (continuous batching), and new requests are prefilled between decode steps.

The decode step runs every running sequence at once: one CUDA graph per batch-size bucket
(1, 2, 4, ...), the running sequences packed into its first rows and the rest idle (length 0:
the lean kernel gives them no work). Positions, region starts and sampling settings are device
tensors, so one graph serves every step of every mix of requests.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from minidecode.models.llama import weight_bytes

from .cache import KVCache
from .diagnose import nonfinite_logits_error
from .engine import (
    DecodeState,
    Engine,
    Generation,
    Request,
    _host_peak_bytes,
    activation_bytes,
    capture,
    decode_step,
    kv_dtype_name,
)
from .errors import UserError
from .memory import free_memory, gib
from .sampling import batch_mode, sample

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # batch sizes a decode graph is captured for
DEFAULT_MAX_BATCH = 32


def bucket(n: int) -> int:
    """The smallest bucket that holds n running sequences."""
    return next(b for b in BUCKETS if b >= n)


def check_max_batch(max_batch: int) -> None:
    if not 1 <= max_batch <= BUCKETS[-1]:
        raise UserError(f"max_batch must be in [1, {BUCKETS[-1]}], got {max_batch}")


class Regions:
    """First-fit allocation of contiguous position ranges in [0, capacity)."""

    def __init__(self, capacity: int):
        self.free: list[tuple[int, int]] = [(0, capacity)] if capacity > 0 else []  # (start, size), sorted

    def take(self, size: int) -> int | None:
        """The start of a free range of `size` positions, now taken; None if none is that long."""
        for i, (start, length) in enumerate(self.free):
            if length >= size:
                self.free[i : i + 1] = [(start + size, length - size)] if length > size else []
                return start
        return None

    def give(self, start: int, size: int) -> None:
        """Return a taken range, merging it with free neighbours."""
        self.free.append((start, size))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for s, n in self.free:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        self.free = merged


@dataclass
class BatchEvent:
    """What happened to request `index`: a new token, or its end (`done`, with `generation`'s
    final stats and finish reason), or its refusal (`error`: it never ran)."""

    index: int
    token: int | None = None
    logprob: float | None = None
    done: bool = False
    error: str | None = None
    generation: Generation | None = None


@dataclass
class BatchProgress:
    """Counts for a progress display; tokens are new tokens handed out."""

    total: int = 0
    done: int = 0
    failed: int = 0
    running: int = 0
    waiting: int = 0
    new_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(time.perf_counter() - self.started, 1e-9)


@dataclass
class _Sequence:
    index: int
    generation: Generation
    start: int  # its region in the cache row
    t_first: float = 0.0
    stop: bool = False  # ended by the caller (a stop string)


class Batch:
    """One run of many requests on an engine: it takes the engine (which must be idle) for the
    run, frees the single-request cache, and frees its own cache at the end. Requests may be
    added while it runs (`add`, from any thread); it ends when every request has ended."""

    def __init__(
        self, engine: Engine, requests: list[Request | UserError], max_batch: int = DEFAULT_MAX_BATCH
    ):
        check_max_batch(max_batch)
        self.engine, self.max_batch = engine, max_batch
        self.granule = KVCache.region_granule(engine.kv_dtype)  # region sizes and starts: multiples of it
        self.requests: list[Request | UserError] = []
        self.progress = BatchProgress()
        self._finish: set[int] = set()
        self._lock = threading.Lock()  # add() from other threads against the loop's look at the queue
        self._incoming: deque[int] = deque()  # added, not yet checked
        self._arrived: list[float] = []  # when each request was added (its time to first token starts)
        self.waiting: deque[int] = deque()  # checked, waiting for a row and a region
        self.capacity: int | None = None  # cache positions, once allocated
        self.closed = False  # the loop has ended: add() takes nothing more
        self.add(requests)

    def add(self, requests: list[Request | UserError]) -> list[int] | None:
        """Queue requests (also while the batch runs, from any thread); -> their indices, in order.

        The cache is allocated once, at the first step, for the requests added by then. A request
        added later waits, in order, for a row and a region large enough; one larger than the whole
        cache could never run in it: then none of the requests is taken and add returns None, as it
        does once the batch has ended, so the caller can run them in a batch of its own afterwards
        (whose cache is sized to them, refusing only what memory refuses)."""
        with self._lock:
            capacity = self.capacity
            if self.closed or (
                capacity is not None
                and any(isinstance(r, Request) and self._region_size(r) > capacity - 1 for r in requests)
            ):
                return None
            first = len(self.requests)
            self.requests.extend(requests)
            self._arrived.extend([time.perf_counter()] * len(requests))
            self._incoming.extend(range(first, len(self.requests)))
            self.progress.total += len(requests)
            return list(range(first, len(self.requests)))

    def finish(self, index: int) -> None:
        """End request `index` now (its caller saw a stop string or stopped reading): no further
        tokens are handed out; one still waiting ends without running (thread-safe)."""
        self._finish.add(index)

    @torch.inference_mode()
    def events(self) -> Iterator[BatchEvent]:
        """Run every request; yields each token and each end as it happens (requests interleave)."""
        engine = self.engine
        engine.check_idle()
        engine.busy = True
        try:
            engine.release()  # the batch's cache replaces the single-request one
            yield from self._run()
        finally:
            with self._lock:
                self.closed = True
            engine.busy = False
            self._cache = self._state = self._graphs = None

    # ---- setup ---------------------------------------------------------------------------
    def _region_size(self, request: Request) -> int:
        """The positions of a request's region: its context, rounded up to whole V blocks for an
        FP8 cache (so every region, and the spare position after them, starts on a block)."""
        return -(-request.context // self.granule) * self.granule

    def _refusals(self) -> Iterator[BatchEvent]:
        """Check the requests added since the last look; yields the refused ones' errors and
        queues the others."""
        while self._incoming:
            i = self._incoming.popleft()
            request = self.requests[i]
            try:
                if isinstance(request, UserError):
                    raise request
                self.engine.check_limits(request)
            except UserError as e:
                self.progress.failed += 1
                yield BatchEvent(i, done=True, error=str(e))
                continue
            self.waiting.append(i)

    def _allocate(self) -> Iterator[BatchEvent]:
        """The cache: room for the max_batch largest requests if memory allows, else what fits.
        A request larger than the whole cache is refused; the others go on."""
        engine, cfg = self.engine, self.engine.config
        longest_prompt = max((len(self.requests[i].prompt_ids) for i in self.waiting), default=1)
        per_token = engine.kv_bytes_per_token
        # The largest prefill's temporaries, and a decode step's [B, vocab] sampling temporaries.
        reserved = activation_bytes(
            cfg, longest_prompt, engine.prefill_chunk, engine.dtype, engine.device, engine.kv_dtype
        )
        reserved += self.max_batch * cfg.vocab_size * 32
        # FP8: the spare position's V block is padded to whole blocks (its other V_BLOCK - 1 positions)
        padding = KVCache.bytes_needed(cfg.num_layers, cfg.num_kv_heads, 1, cfg.head_dim, engine.kv_dtype)
        padding -= per_token
        fit = max(0, (free_memory(engine.device) - reserved - padding) // per_token)
        sizes = sorted((self._region_size(self.requests[i]) for i in self.waiting), reverse=True)
        capacity = min(sum(sizes[: self.max_batch]) + 1, fit)  # + 1: the idle slots' spare position
        # The regions fill [0, spare): FP8 region starts (and so spare) are multiples of V_BLOCK.
        spare = (capacity - 1) // self.granule * self.granule if capacity > 0 else -1
        for i in list(self.waiting):
            if self._region_size(self.requests[i]) > spare:
                self.waiting.remove(i)
                self.progress.failed += 1
                context, room = self.requests[i].context, max(spare, 0)
                yield BatchEvent(
                    i,
                    done=True,
                    error=f"a context of {context:,} tokens needs {gib(context * per_token)} of KV cache, "
                    f"but only {room:,} tokens ({gib(room * per_token)}) fit on {engine.device} beside the "
                    f"weights ({gib(weight_bytes(engine.model))}) and activations",
                )
        self.capacity = spare + 1 if self.waiting else 0
        self.spare = self.capacity - 1  # idle slots write their (ignored) K/V here
        self.regions = Regions(self.spare)
        self._cache = (
            KVCache(
                cfg.num_layers,
                1,
                cfg.num_kv_heads,
                self.capacity,
                cfg.head_dim,
                engine.kv_dtype,
                engine.device,
            )
            if self.waiting
            else None
        )
        self._state = DecodeState.zeros(self.max_batch, engine.device)
        self._state.starts.fill_(max(self.spare, 0))
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.running: list[_Sequence] = []  # row i of the state is running[i]
        self._running_key: tuple[str, bool] | None = None  # _sampling_key of the running rows

    # ---- the loop ------------------------------------------------------------------------
    def _run(self) -> Iterator[BatchEvent]:
        engine = self.engine
        cuda = engine.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(engine.device)
        self.t_start = time.perf_counter()
        with self._lock:  # the cache is sized to every request added so far; add() sees its capacity
            setup = [*self._refusals(), *self._allocate()]
        yield from setup
        host_tokens = torch.empty(self.max_batch, dtype=torch.long, pin_memory=cuda)
        host_logprob = torch.empty(self.max_batch, dtype=torch.float32, pin_memory=cuda)
        copied = torch.cuda.Event() if cuda else None
        while True:
            with self._lock:  # requests added meanwhile join the queue; none left: the batch ends
                refused = [*self._refusals()]
                self.closed = not (self.waiting or self.running)
            yield from refused
            if self.closed:
                break
            yield from self._admit()
            n = len(self.running)
            if n == 0:
                continue
            state = self._state
            host_tokens[:n].copy_(state.tokens[:n], non_blocking=True)
            if self._sampling_key()[1]:  # a running request wants log-probs
                host_logprob[:n].copy_(state.logprob[:n], non_blocking=True)
            if copied is not None:
                copied.record()
            self._step(n)  # the next step runs while these tokens are handed out
            if copied is not None:
                copied.synchronize()
            ended = []
            for row, seq in enumerate(self.running):
                yield from self._hand_out(seq, int(host_tokens[row]), float(host_logprob[row]), ended)
            for seq in ended:
                yield self._end(seq)
        self.progress.running = 0

    def _hand_out(
        self, seq: _Sequence, token: int, logprob: float, ended: list[_Sequence]
    ) -> Iterator[BatchEvent]:
        request, stats = seq.generation.request, seq.generation.stats
        if seq.index in self._finish:
            ended.append(seq)
            return
        if stats.new_tokens == 0:
            seq.t_first = time.perf_counter()
            stats.time_to_first_token = seq.t_first - max(self.t_start, self._arrived[seq.index])
        stats.new_tokens += 1
        if token in (frozenset() if request.ignore_eos else request.eos_ids):
            seq.generation.finish_reason = "eos"
            ended.append(seq)
            return
        self.progress.new_tokens += 1
        yield BatchEvent(seq.index, token, logprob if request.want_logprobs else None)
        if stats.new_tokens >= request.max_new_tokens or seq.index in self._finish:
            ended.append(seq)

    def _end(self, seq: _Sequence) -> BatchEvent:
        """Free the sequence's region and row (the last row moves into it: rows stay packed)."""
        row, last = self.running.index(seq), len(self.running) - 1
        state = self._state
        if row != last:
            state.move(last, row)
            self.running[row] = self.running[last]
        self.running.pop()
        self._running_key = None
        state.active[last] = 0
        state.starts[last] = self.spare
        state.positions[last] = 0
        state.tokens[last] = 0
        request, stats = seq.generation.request, seq.generation.stats
        self.regions.give(seq.start, self._region_size(request))
        stats.decode_seconds = time.perf_counter() - seq.t_first if seq.t_first else 0.0
        steps = stats.new_tokens - 1
        stats.decode_tokens_per_s = (
            steps / stats.decode_seconds if steps > 0 and stats.decode_seconds else 0.0
        )
        stats.peak_memory_bytes = self._peak()
        self.progress.done += 1
        self.progress.running = len(self.running)
        self._finish.discard(seq.index)
        return BatchEvent(seq.index, done=True, generation=seq.generation)

    def _peak(self) -> int:
        device = self.engine.device
        return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _host_peak_bytes()

    # ---- admission and prefill -----------------------------------------------------------
    def _admit(self) -> Iterator[BatchEvent]:
        """Prefill waiting requests, in order, while a row and a region are free."""
        while self.waiting and len(self.running) < self.max_batch:
            index = self.waiting[0]
            request = self.requests[index]
            if index in self._finish:  # its caller has gone before it started
                self.waiting.popleft()
                self._finish.discard(index)
                self.progress.done += 1
                yield BatchEvent(index, done=True, generation=Generation(request))
                continue
            start = self.regions.take(self._region_size(request))
            if start is None:
                break  # in order: the head waits for room (no request overtakes it for ever)
            self.waiting.popleft()
            try:
                self._prefill(index, request, start)
            except UserError as e:
                self.regions.give(start, self._region_size(request))
                self.progress.failed += 1
                yield BatchEvent(index, done=True, error=str(e))
        self.progress.waiting, self.progress.running = len(self.waiting), len(self.running)

    def _prefill(self, index: int, request: Request, start: int) -> None:
        engine, row = self.engine, len(self.running)
        generation = Generation(request)
        stats = generation.stats
        n = stats.prompt_tokens = stats.prefilled_tokens = len(request.prompt_ids)
        stats.kv_cache_dtype = kv_dtype_name(engine.kv_dtype)
        t0 = time.perf_counter()
        region = self._cache.region(start, self._region_size(request))
        prompt = torch.tensor([request.prompt_ids], device=engine.device)  # [1, T]

        def prefill() -> torch.Tensor:  # [1, V] float32 logits of the last position
            hidden = engine.model.prefill(prompt, region, engine.prefill_chunk, engine._backend())
            return engine.model.logits(hidden)

        logits = prefill()
        if not bool(torch.isfinite(logits).all()):
            raise nonfinite_logits_error(engine.model, prefill)
        one = self._state.rows(1, row)
        one.sampling.set(0, request.params)
        one.positions.fill_(n)
        one.starts.fill_(start)
        one.active.fill_(1)
        first = sample(logits, one.sampling, one.positions, request.params.mode)  # [1]
        one.tokens.copy_(first)
        if request.want_logprobs:
            one.logprob.copy_(logits.log_softmax(-1).gather(-1, first[:, None])[:, 0])
        first.item()  # waits for the prefill: its time is the request's
        stats.prefill_seconds = time.perf_counter() - t0
        stats.prefill_tokens_per_s = n / max(stats.prefill_seconds, 1e-9)
        self.running.append(_Sequence(index, generation, start))
        self._running_key = None

    # ---- the decode step -----------------------------------------------------------------
    def _sampling_key(self) -> tuple[str, bool]:
        """(sampling mode, log-probs wanted) of the running rows: recomputed only when a row
        starts or ends, not on every step."""
        if self._running_key is None:
            requests = [seq.generation.request for seq in self.running]
            mode = batch_mode([r.params for r in requests])
            self._running_key = mode, any(r.want_logprobs for r in requests)
        return self._running_key

    def _step(self, n: int) -> None:
        """One decode step of the n running sequences (rows 0..n-1)."""
        engine = self.engine
        mode, logprobs = self._sampling_key()
        if not engine.use_cuda_graph:
            decode_step(
                engine.model, self._cache, self._state.rows(n), mode, logprobs, engine.pdl, batch=True
            )
            return
        b = min(bucket(n), self.max_batch)
        key = (b, mode, logprobs)
        if key not in self._graphs:
            step = functools.partial(
                decode_step,
                engine.model,
                self._cache,
                self._state.rows(b),
                mode,
                logprobs,
                engine.pdl,
                batch=True,
            )
            idle = DecodeState.zeros(b, engine.device)  # the warm-up writes only the spare position
            idle.starts.fill_(self.spare)
            warm_up = functools.partial(
                decode_step, engine.model, self._cache, idle, mode, logprobs, engine.pdl, True
            )
            self._graphs[key] = capture(step, warm_up)
        self._graphs[key].replay()


def batch_stats_line(progress: BatchProgress, seconds: float) -> str:
    """The summary of a finished run."""
    rate = progress.new_tokens / max(seconds, 1e-9)
    return (
        f"{progress.done} done, {progress.failed} failed of {progress.total} requests | "
        f"{progress.new_tokens:,} new tok in {seconds:.2f} s ({rate:,.1f} tok/s)"
    )

"""Who gets which part of the cache: the waiting queue, the running sequences, and the prefix
cache of finished ones.

Requests are admitted in order while a decode row and a region of the cache are free. A finished
sequence's K/V stay in its region as a cached prefix (evicted least-recently-used, only when the
room is needed); a new request whose tokens start like a cached prefix (or a loaded cache file)
reuses the longest common part: in place where the prefix's region is large enough (or can grow
into free positions after it), else copied on the device into a new region (milliseconds, where
prefilling it again takes seconds at long context). A running sequence whose prefill has ended
is a source too (its prompt and the tokens fed back so far, never in place): several choices of
one prompt (the server's `n`) prefill it once. The cache grows when a request needs more
room than is free, keeping everything in place (one device copy); with nothing running it is
reallocated to the demand."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .cache import Regions
from .cache_file import CacheFile, read_cache_file
from .engine import Engine
from .errors import UserError
from .sequence import Sequence


@dataclass
class Prefix:
    """Token ids whose K/V a region holds at its positions 0..len-1 (or a cache file does)."""

    ids: list[int]
    start: int  # its region [start, start + size); -1 while it is still in a file
    size: int
    angles_len: int  # the longest pass (RoPE seq_len) under which any of its positions was computed
    used: int  # when it was last made or used (the scheduler's clock): the least recent goes first
    file: CacheFile | None = None
    running: Sequence | None = None  # a running sequence's positions (copied, never taken over)


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """The length of the longest common prefix of a and b, at most `limit`."""
    n = min(len(a), len(b), limit)
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


class Scheduler:
    """The queue, the rows and the regions of one engine (the engine loop's thread only).
    `min_over_ranks(value)` makes a memory figure the same on every rank (tensor / context parallelism:
    every rank must decide alike)."""

    def __init__(self, engine: Engine, prefix_reuse: bool, min_over_ranks: Callable[[int], int] = int):
        self.engine, self.min_over_ranks = engine, min_over_ranks
        # engine.one_sequence: one sequence at a time, in a cache of exactly its region (context
        # parallelism: every rank's share of the positions follows from the cache's length)
        self.one_sequence = engine.one_sequence
        self.prefix_reuse = prefix_reuse and not self.one_sequence
        self.regions = Regions(engine.capacity)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # row i of the decode state is running[i]
        self.prefixes: list[Prefix] = []
        self.clock = 0
        self.queries = self.hits = 0  # prefix-cache lookups and those that reused something

    # ---- prefixes ----------------------------------------------------------------------------
    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def best_prefix(self, seq: Sequence) -> tuple[Prefix | None, int]:
        """The cached prefix (or running sequence) sharing the most leading tokens with seq's
        prompt (leaving at least one to prefill: its logits give the first new token), and that
        count. At equal counts a cached prefix wins (it may be taken over in place), the most
        recently used first."""
        if not (self.prefix_reuse and seq.reuse_prefix):
            return None, 0
        self.queries += 1
        # Dynamic NTK / LongRoPE: angles depend on the pass's length; reuse positions only when they
        # and a fresh prefill of this prompt both ran below the length where they change.
        limit = self.engine.model.rope.length_free_up_to
        prompt, most = seq.prompt_ids, len(seq.prompt_ids) - 1
        best, shared = None, 0
        for prefix in sorted(self.prefixes, key=lambda p: -p.used):
            if limit is not None and max(prefix.angles_len, len(prompt)) > limit:
                continue
            n = common_prefix(prefix.ids, prompt, most)
            if n > shared:
                best, shared = prefix, n
        for other in self.running:  # (its ids are built only if it wins: a prompt may be long)
            angles = self._angles(other, len(other.prompt_ids) + other.fed)
            if limit is not None and max(angles, len(prompt)) > limit:
                continue
            n = common_prefix(other.prompt_ids, prompt, most)
            if n == len(other.prompt_ids) and n < most:  # then the tokens fed back
                n += common_prefix(other.sampled[: other.fed], prompt[n:], most - n)
            if n > shared:
                best, shared = other, n
        self.hits += shared > 0
        if isinstance(best, Sequence):
            ids = best.cached_ids
            best = Prefix(ids, best.start, best.size, self._angles(best, len(ids)), self.clock, running=best)
        return best, shared

    @staticmethod
    def _angles(seq: Sequence, written: int) -> int:
        """The longest pass under which any of seq's `written` positions was computed."""
        return max(written, seq.reused_angles if seq.reused else 0)

    def keep(self, seq: Sequence) -> None:
        """A sequence has ended: its region becomes a cached prefix (or is freed)."""
        ids = seq.cached_ids
        if not self.prefix_reuse or not ids:
            self.regions.give(seq.start, seq.size)
            return
        self.prefixes.append(Prefix(ids, seq.start, seq.size, self._angles(seq, len(ids)), self._tick()))

    def drop(self, prefix: Prefix, free: bool = True) -> None:
        self.prefixes.remove(prefix)
        if free and prefix.file is None:
            self.regions.give(prefix.start, prefix.size)

    def add_file(self, file: CacheFile, angles_len: int) -> None:
        """A loaded cache file: a prefix the next matching request reads from disk."""
        for prefix in [p for p in self.prefixes if p.file is not None]:
            self.drop(prefix)
        self.prefixes.append(Prefix(file.token_ids, -1, 0, angles_len, self._tick(), file))

    def latest(self) -> Prefix | None:
        """The most recently finished sequence's prefix in the cache (what save_cache writes)."""
        held = [p for p in self.prefixes if p.file is None]
        return max(held, key=lambda p: p.used, default=None)

    # ---- regions -----------------------------------------------------------------------------
    def place(self, seq: Sequence) -> bool:
        """Give seq (the head of the queue) its region and its reused prefix; False while it must
        wait for running sequences to end. A request that cannot fit the device even alone is a
        UserError."""
        engine = self.engine
        size = engine.region_size(seq.context)
        if self.one_sequence and engine.capacity != size:
            if self.running:
                return False
            self._reallocate(size, size, engine.planner.activations(self._longest_prompt), seq.context)
        prefix, shared = self.best_prefix(seq)
        if prefix is not None and prefix.running is not None:
            return self._place_from_running(seq, size, prefix, shared)
        if prefix is not None and prefix.file is None and shared:
            grow = size - prefix.size
            if grow <= 0 or self.regions.take_at(prefix.start + prefix.size, grow):  # in place
                self.drop(prefix, free=False)
                seq.start, seq.size = prefix.start, max(size, prefix.size)
                self._reuse(seq, shared, prefix)
                return True
        start = self._take(
            size, seq.context, keep=prefix if prefix is not None and prefix.file is None else None
        )
        if start is None:
            return False
        seq.start, seq.size = start, size
        if prefix is not None and shared and (prefix.file is not None or prefix in self.prefixes):
            if prefix.file is not None:  # read from the file instead of prefilled
                t0 = time.perf_counter()
                self.drop(prefix)  # read once: then it is this sequence's (a corrupted file: gone)
                try:
                    read_cache_file(prefix.file, engine.region(start, shared).tensors())
                except UserError:
                    self.free(seq)
                    raise
                seq.stats.cache_load_seconds = time.perf_counter() - t0
            else:
                engine.copy_positions(prefix.start, start, shared)
                prefix.used = self._tick()
            self._reuse(seq, shared, prefix)
        return True

    def _place_from_running(self, seq: Sequence, size: int, source: Prefix, shared: int) -> bool:
        """seq in a region of its own, with the first `shared` positions copied from a running
        sequence's region (which stays where it is: growing the cache keeps every live region)."""
        start = self._take(size, seq.context, keep=None)
        if start is None:
            return False
        seq.start, seq.size = start, size
        self.engine.copy_positions(source.start, start, shared)  # (after the queued steps' writes)
        self._reuse(seq, shared, source)
        return True

    def _reuse(self, seq: Sequence, shared: int, prefix: Prefix) -> None:
        seq.reused, seq.reused_angles = shared, prefix.angles_len

    def _take(self, size: int, context: int, keep: Prefix | None) -> int | None:
        """A free region of `size` positions: evicting cached prefixes (least recent first, `keep`
        last), else growing the cache."""
        start = self.regions.take(size)
        while start is None:
            victims = [p for p in self.prefixes if p.file is None and p is not keep]
            if not victims:
                break
            self.drop(min(victims, key=lambda p: p.used))
            start = self.regions.take(size)
        return start if start is not None else self._grow(size, context, keep)

    @property
    def _longest_prompt(self) -> int:
        """The longest waiting prompt: its prefill's temporaries are what the cache leaves room for."""
        return max([len(s.prompt_ids) for s in self.waiting] or [1])

    def _demand(self, size: int) -> int:
        """Positions the waiting requests would take, the head's `size` first, up to the free rows."""
        rows = self.engine.max_batch - len(self.running)
        others = [self.engine.region_size(s.context) for s in list(self.waiting)[1:rows]]
        return size + sum(others)

    def _grow(self, size: int, context: int, keep: Prefix | None) -> int | None:
        """A larger cache with a region of `size` free; None while running sequences hold too much
        of the device for one (they keep their places: the old cache is copied into the new)."""
        engine, planner = self.engine, self.engine.planner
        reserve = planner.activations(self._longest_prompt)
        live = [(s.start, s.size) for s in self.running]
        if keep is not None:
            live.append((keep.start, keep.size))
        used = max((a + n for a, n in live), default=0)
        per_token = planner.kv_bytes_per_token
        if live:  # grow in place: the old cache stays allocated during the copy
            free = self.min_over_ranks(engine.free_bytes()) - reserve
            room = max(0, free // per_token - engine.granule) // engine.granule * engine.granule
            if room >= used + size:
                target = min(room, max(used + self._demand(size), 2 * engine.capacity))
                engine.resize(target, keep=used)
                self.regions.grow(target)
                return self.regions.take(size)
            if self.running:
                return None  # wait for room
            self.drop(keep)  # the prefix does not fit beside the request: prefill it again
        self._reallocate(size, self._demand(size), reserve, context)
        return self.regions.take(size)

    def _reallocate(self, size: int, target: int, reserve: int, context: int) -> None:
        """With nothing running: a new cache for `target` positions (at least `size`, as many as
        fit), every cached prefix dropped; UserError (naming the request's `context`) if not even
        `size` fits."""
        engine, planner = self.engine, self.engine.planner
        for prefix in [p for p in self.prefixes if p.file is None]:
            self.drop(prefix)
        free = self.min_over_ranks(engine.free_bytes() + engine.cache_bytes)
        room = max(0, (free - reserve) // planner.kv_bytes_per_token - engine.granule)
        room = room // engine.granule * engine.granule
        if room < size:
            raise UserError(planner.refusal(planner.plan(size, self._longest_prompt, free=free), context))
        engine.resize(min(room, target))
        self.regions = Regions(engine.capacity)

    def clear(self) -> None:
        """Free the cache and every cached prefix (nothing may be running)."""
        if self.running:
            raise UserError("the cache is in use by running requests")
        self.prefixes.clear()
        self.engine.release()
        self.regions = Regions(0)

    def free(self, seq: Sequence) -> None:
        """A sequence that never ran (refused or aborted in prefill) gives its region back."""
        if seq.start >= 0:
            self.regions.give(seq.start, seq.size)
            seq.start = -1

    @property
    def used_positions(self) -> int:
        """Positions held by running sequences (what KV cache usage reports)."""
        return sum(s.size for s in self.running)

"""The scheduler: the waiting queue, the one prefill in progress, the running sequences and the
prefix cache of finished ones, and each engine step as one plan (plan.py) that the engine runs on
every rank alike.

Each `schedule()` gives one StepPlan: the rows of sequences that ended, the admission of the head
of the queue (its region and reused prefix: the cache's resize, copy or file read), the prefill in
progress, and a decode step of the running sequences. A prefill beside running sequences goes in
chunks, one a step, each run with the running rows' decode step as one mixed step: its chunk is
as long as the step's budget (Engine.step_tokens, rows through the weights) leaves beside the
decode rows, its rows' attention to their past counted in (`mixed.chunk_end`), so that the prefill
advances every step and the streams get a token every step, each step about as long (under
context parallelism, which runs no mixed steps, a unit of its whole prefill follows each of their
decode steps instead). A prefill beside none (or once the running sequences have all ended) runs
as one unit of a whole prefill a plan, its fastest form. Sequences admitted together start
together (their prefills run back to back, without steps between them). Where running
sequences speculate, each step makes their next drafts on the device, and the plan says how many
query rows its step gives a row: enough for the drafts last seen ready (a step's results reach the
host a step late, as its tokens do); a step with drafts runs as its own graph (the engine then runs
the chunk alone after it), one without rides in the chunk.
`update()` takes the plan's StepOutput back: tokens fed, a prefill ended (its sequence now runs)
or failed.

Requests are admitted in order while a decode row and a region of the cache are free. A finished
sequence's K/V stay in its region as a cached prefix (evicted least-recently-used, only when the
room is needed); a new request whose tokens start like a cached prefix (or a loaded cache file)
reuses the longest common part: in place where the prefix's region is large enough (or can grow
into free positions after it), else copied on the device into a new region (milliseconds, where
prefilling it again takes seconds at long context). A running sequence whose prefill has ended
is a source too (its prompt and the tokens fed back so far, never in place): several choices of
one prompt (the server's `n`) prefill it once. The cache grows when a request needs more
room than is free, keeping everything in place (one device copy); with nothing running it is
reallocated to the demand. Whether a context fits at all is one check (`check_fits`), which the
API's up-front refusal uses too."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from .cache import Regions
from .cache_file import CacheFile
from .decode import draft_bucket
from .engine import Engine
from .errors import UserError
from .mixed import chunk_bucket, chunk_end, rows_per_key
from .plan import Copy, Decode, DecodeKind, FileRead, Prefill, Release, Resize, RowStart, StepOutput, StepPlan
from .sampling import batch_mode
from .sequence import Sequence
from .speculation import grown_draft_count, most_drafts


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


def cache_room(engine: Engine, free: int, prompt_len: int) -> int:
    """Region positions (whole granules) a cache can have in `free` bytes beside its spare granule
    and the prefill temporaries of a `prompt_len` prompt."""
    planner, granule = engine.planner, engine.granule
    room = max(0, (free - planner.activations(prompt_len)) // planner.kv_bytes_per_token - granule)
    return room // granule * granule


def check_fits(engine: Engine, size: int, prompt_len: int, context: int, free: int) -> int:
    """The one fit check: a region of `size` positions and a `prompt_len` prompt's prefill in
    `free` bytes (beside the weights) -> the cache's room in positions; else the memory plan's
    one-line UserError naming the request's `context`."""
    room, plan = cache_room(engine, free, prompt_len), engine.planner.plan(size, prompt_len, free=free)
    if room < size or not plan.fits:
        raise UserError(engine.planner.refusal(plan, context))
    return room


def step_kind(seqs: list[Sequence]) -> DecodeKind:
    """The decode step these sequences need: each part on if any sequence needs it."""
    return DecodeKind(
        batch_mode([s.params for s in seqs]),
        any(s.want_logprobs for s in seqs),
        any(s.params.adjusts for s in seqs),
        any(s.want_top for s in seqs),
        any(s.max_drafts for s in seqs),
    )


def step_queries(limits: Iterable[int], sizes: tuple[int, ...]) -> list[int]:
    """The query rows a sequence (1 + draft slots) that Scheduler._decode_step can size a step at
    where its rows' settings are `limits` (their speculate, 0: none): 1 (a plain step, or no row
    had drafts ready), and the bucket of each count grown_draft_count gives a row that had 1 up to
    its most drafts ready. A step's count is the largest of its rows', so it is among them. A row
    that kept all its drafts asks for at least size_up(2) next, so at 4 heads a KV head (sizes 1,
    3, 7, 15) a step verifies 1 draft only where every row's limit is 1."""
    counts = set()
    for speculate in limits:
        most = most_drafts(speculate, sizes)
        counts |= {grown_draft_count(ready, most, sizes) for ready in range(1, most + 1)}
    return [1, *sorted(draft_bucket(k, sizes) for k in counts)]


def step_graphs(
    kind: DecodeKind, limits: Iterable[int], sizes: tuple[int, ...]
) -> list[tuple[DecodeKind, int]]:
    """The decode steps (kind, query rows a sequence) that rows of `kind` whose speculate settings
    are `limits` may take: each of step_queries(limits, sizes), and where they look drafts up the
    plain step without the lookup (once the rows that speculate have ended)."""
    steps = [(kind, queries) for queries in step_queries(limits, sizes)]
    if kind.lookup:
        steps.append((replace(kind, lookup=False), 1))
    return steps


class Scheduler:
    """The queue, the rows, the regions and the step plans of one engine (the engine loop's thread
    only; under torchrun, rank 0's). `free_bytes()`: free device memory, the least over the ranks
    (every rank's cache is planned alike)."""

    def __init__(self, engine: Engine, prefix_reuse: bool, free_bytes: Callable[[], int] | None = None):
        self.engine, self.free_bytes = engine, free_bytes or engine.free_bytes
        self.prefix_reuse = prefix_reuse
        self.capacity = engine.capacity  # the cache's region positions once the planned work has run
        self.regions = Regions(engine.capacity)
        self.waiting: deque[Sequence] = deque()
        self.prefilling: Sequence | None = None  # admitted, its prefill in progress (no row yet)
        self.running: list[Sequence] = []  # row i of the decode state is running[i]
        self.prefixes: list[Prefix] = []
        self.clock = 0
        self.queries = self.hits = 0  # prefix-cache lookups and those that reused something
        # what the next plan carries: rows freed, cache work
        self._moves: list[tuple[int, int]] = []
        self._clears: list[int] = []
        self._ops: list = []
        self._cancel = False
        self.dropped: list[tuple[Sequence, str | None]] = []  # ended unrun: (seq, error or None: aborted)
        self._round = False  # admitting sequences back to back
        self._beside = False  # ... beside running ones: the prefills go in mixed steps with them
        self._next = 0  # the prefill in progress's next prompt position to plan (mixed steps' chunks)
        self._kind: DecodeKind | None = None  # the running rows' step (changes when a row starts or ends)
        # The prefill in progress's decode graphs, to capture during its mixed steps (_spread_prepare)
        self._to_prepare: list[tuple[int, DecodeKind, int]] = []
        self._last_step: tuple[int, int, int] | None = None  # the last mixed step's graph (its shape)
        self._key_rows = rows_per_key(engine.model, engine.device)  # a key of attention, in rows

    # ---- plans -------------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        """Nothing to plan until a request arrives."""
        pending = self._moves or self._clears or self._ops or self._cancel
        return not (self.waiting or self.running or self.prefilling or pending)

    def schedule(self) -> StepPlan:
        """The next step's plan (empty when there is nothing to do)."""
        plan = StepPlan()
        if self.prefilling is not None and self.prefilling.aborted:
            self.cancel_prefill()
        if self.prefilling is None:
            self._admit(plan)
        if self.prefilling is not None and plan.prefill is None:
            seq = self.prefilling
            plan.prefill = self._prefill_work(seq, begin=False)
        # A prefill beside running rows: a mixed step, or under context parallelism (no mixed
        # steps) one unit of its whole prefill after their decode step (running sequences cannot
        # start during it, so once they have all ended the rest of it runs as a whole prefill's units)
        beside = self.prefilling is not None and self._beside and bool(self.running)
        if self.running and (self.prefilling is None or beside):
            if self._kind is None:
                self._kind = step_kind(self.running)
            plan.decode = self._decode_step()
        if beside and not self.engine.context_parallel:
            lo, room = self._next, self.engine.step_tokens - len(self.running)
            end = min(len(self.prefilling.prompt_ids), lo + self.engine.prefill_chunk)  # (its temporaries)
            self._next = chunk_end(lo, end, room, self._key_rows)
            plan.prefill.chunk = (lo, self._next)
            self._spread_prepare(plan, last=self._next == len(self.prefilling.prompt_ids))
        elif self._to_prepare:  # the prefill runs on as a whole prefill's units, or failed
            if self.prefilling is not None:
                plan.prepare += self._to_prepare
            self._to_prepare = []
        done = self.pending()  # rows freed and cache work, this admission's included
        done.admit, done.prepare = plan.admit, plan.prepare
        done.prefill, done.decode = plan.prefill, plan.decode
        return done

    def _decode_step(self) -> Decode:
        """The running rows' step: with query rows for drafts where a row had drafts ready when
        last seen, room for the size that holds twice as many (a row's lookup asks for up to that:
        speculation.next_draft_count), up to its limit; a row given fewer verifies its first ones."""
        kind, running, sizes = self._kind, self.running, self.engine.draft_sizes
        grown = (grown_draft_count(s.ready_drafts, most_drafts(s.max_drafts, sizes), sizes) for s in running)
        most = max(grown, default=0)
        return Decode(len(running), kind, draft_bucket(most, sizes) if most else 1)

    def _admit(self, plan: StepPlan) -> None:
        """Admit the head of the queue if a row and a region are free: its cache work and its
        prefill's first part go into `plan`. A round of admissions starts beside running sequences
        (its prefills then run as mixed steps with them) or not (its sequences start together)."""
        if not self._round:
            self._round, self._beside = True, bool(self.running)
        while self.waiting and len(self.running) < self.engine.max_batch:
            seq = self.waiting[0]
            try:
                placed = self.place(seq)
            except UserError as e:  # it cannot fit the device even alone
                self.waiting.popleft()
                self.dropped.append((seq, str(e)))
                continue
            if not placed:
                break  # in order: the head waits for room (no request overtakes it for ever)
            self.waiting.popleft()
            self.prefilling, self._next = seq, seq.reused
            plan.admit = seq.id
            # The step graphs it will decode in (step_graphs), captured before its prefill, not in
            # its decoding.
            rows, together = len(self.running) + 1, [*self.running, seq]
            limits, kind = {s.max_drafts for s in together}, step_kind(together)
            steps = step_graphs(kind, limits, self.engine.draft_sizes)
            prepare = [(rows, k, queries) for k, queries in steps]
            if self._beside and not self.engine.context_parallel:  # mixed steps: in theirs
                self._to_prepare, self._last_step = prepare, None
            else:
                plan.prepare += prepare
            plan.prefill = self._prefill_work(seq, begin=True)
            return
        self._round = False

    def _spread_prepare(self, plan: StepPlan, last: bool) -> None:
        """The decode graphs that a prefill beside running rows will need, captured one a plan
        during its mixed steps: in a plan whose step has the shape of the one before (chunk rows,
        decode rows, queries: its graphs exist, so it captures nothing else), all that are left
        with its last chunk. So no plan holds two captures (~40 ms each for an 8B): the
        admission's, which grew the cache and captured its mixed step's graph beside the decode
        graph, held the streams for ~100 ms (bench/NOTES-engine.md)."""
        decode, (lo, hi) = plan.decode, plan.prefill.chunk
        rows, queries = (decode.rows, decode.queries) if decode is not None else (0, 0)
        shape = (chunk_bucket(hi - lo), rows, queries)
        if last:
            plan.prepare += self._to_prepare
            self._to_prepare = []
        elif self._to_prepare and shape == self._last_step:
            plan.prepare.append(self._to_prepare.pop(0))
        self._last_step = shape

    def _prefill_work(self, seq: Sequence, begin: bool) -> Prefill:
        row = RowStart(
            len(self.running), seq.start, len(seq.prompt_ids), seq.params, seq.max_drafts, seq.draft_end
        )
        return Prefill(
            seq.id, seq.start, seq.size, seq.reused, row, seq.want_logprobs, seq.want_top > 0,
            begin=seq.prompt_ids if begin else None,
        )  # fmt: skip

    def cancel_prefill(self) -> None:
        """The prefill in progress ends unrun (its caller has gone, or the loop stops)."""
        seq, self.prefilling = self.prefilling, None
        self._cancel = True
        self.free(seq)
        self.dropped.append((seq, None))

    def update(self, plan: StepPlan, out: StepOutput) -> Sequence | None:
        """A plan has run: the running sequences were fed a token (or more: kept drafts);
        -> the sequence whose prefill ended (its first token in out.first, its row the last)."""
        seq = self.prefilling
        if out.failed is not None and seq is not None and out.failed[0] == seq.id:
            self.prefilling = None
            self.free(seq)
            self.dropped.append((seq, out.failed[1]))
        if out.resized and out.capacity != self.capacity:  # a resize failed (out of memory)
            self._rebuild_regions(out.capacity)
        if plan.decode is not None:
            # the step writes the K/V of its rows' tokens; the step before's kept drafts are now known
            kept = [0] * plan.decode.rows if out.verdicts is None else [v[1] for v in out.verdicts]
            for row, fed in enumerate(self.running[: plan.decode.rows]):
                fed.fed += 1 + (0 if fed.skip else kept[row])
                # (its first step's copy holds none: it stays at none, so a row whose lookups find
                # nothing only ever runs plain steps, the rounding of a step without speculation)
                if out.draft_lens is not None and not fed.skip:
                    fed.ready_drafts = out.draft_lens[row]
        if self.prefilling is not None and out.file_seconds:
            seq.stats.cache_load_seconds = out.file_seconds
        if self.prefilling is None or out.first is None:
            return None
        self.prefilling = None
        self.running.append(seq)
        self._kind = None
        return seq

    def end(self, ended: list[Sequence]) -> None:
        """Free the ended sequences' rows (the last row moves into each: rows stay packed, in the
        next plan) and keep their regions as cached prefixes."""
        running = self.running
        for seq in ended:
            row, last = running.index(seq), len(running) - 1
            if row != last:
                self._moves.append((last, row))
                running[row] = running[last]
            running.pop()
            self._kind = None
            self._clears.append(last)
            self.keep(seq)

    def _rebuild_regions(self, capacity: int) -> None:
        """The cache is not what was planned (a resize ran out of memory): its regions again from
        what lives in it; cached prefixes that no longer fit are dropped."""
        self.capacity, self.regions = capacity, Regions(capacity)
        live = [s for s in self.running if s.start >= 0]
        for seq in live:
            self.regions.take_at(seq.start, seq.size)
        for prefix in [p for p in self.prefixes if p.file is None]:
            if not self.regions.take_at(prefix.start, prefix.size):
                self.prefixes.remove(prefix)

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
                self.drop(prefix)  # read once: then it is this sequence's (a corrupted file: gone)
                self._ops.append(FileRead(prefix.file, start, shared))
            else:
                self._ops.append(Copy(prefix.start, start, shared))
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
        self._ops.append(Copy(source.start, start, shared))  # (after the queued steps' writes)
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
            free = self.free_bytes() - reserve
            room = max(0, free // per_token - engine.granule) // engine.granule * engine.granule
            if room >= used + size:
                target = min(room, max(used + self._demand(size), 2 * self.capacity))
                self._ops.append(Resize(target, keep=used))
                self.capacity = target
                self.regions.grow(target)
                return self.regions.take(size)
            if self.running:
                return None  # wait for room
            self.drop(keep)  # the prefix does not fit beside the request: prefill it again
        self._reallocate(size, self._demand(size), context)
        return self.regions.take(size)

    def _reallocate(self, size: int, target: int, context: int) -> None:
        """With nothing running: a new cache for `target` positions (at least `size`, as many as
        fit), every cached prefix dropped; UserError (naming the request's `context`) if not even
        `size` fits (check_fits)."""
        engine = self.engine
        for prefix in [p for p in self.prefixes if p.file is None]:
            self.drop(prefix)
        free = self.free_bytes() + engine.cache_bytes
        room = check_fits(engine, size, self._longest_prompt, context, free)
        self._ops.append(Resize(min(room, target)))
        self.capacity = min(room, target)
        self.regions = Regions(self.capacity)

    def clear(self) -> StepPlan:
        """Free the cache and every cached prefix (nothing may be running) -> the plan that does."""
        if self.running or self.prefilling is not None:
            raise UserError("the cache is in use by running requests")
        self.prefixes.clear()
        self._ops.append(Release())
        self.capacity, self.regions = 0, Regions(0)
        return self.pending()

    def pending(self) -> StepPlan:
        """A plan of only the work waiting to be planned (rows freed, cache work)."""
        plan = StepPlan(self._moves, self._clears, self._cancel, cache=self._ops)
        self._moves, self._clears, self._ops, self._cancel = [], [], [], False
        return plan

    def free(self, seq: Sequence) -> None:
        """A sequence that never ran (refused or aborted in prefill) gives its region back."""
        if seq.start >= 0:
            self.regions.give(seq.start, seq.size)
            seq.start = -1

    @property
    def used_positions(self) -> int:
        """Positions held by running sequences (what KV cache usage reports)."""
        return sum(s.size for s in self.running)

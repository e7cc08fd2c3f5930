"""The model runner: one KV cache for every sequence, prefill into a sequence's region of it, and
the decode step of every running sequence at once, as one CUDA graph replay per batch-size
bucket.

The cache is one allocation with one shared position axis, `[layers, 1, Hkv, P, D]`. Each
sequence (running, or a finished one kept as a cached prefix) owns a contiguous region of it, so
the lean decode kernel streams each (sequence, KV head) as one contiguous run; after the regions
comes one spare granule, where idle decode rows write their (ignored) K/V. Which region belongs
to whom is the scheduler's business (scheduler.py); this module only runs the model on them.

The decode step runs rows 0..n-1 of a fixed-size `DecodeState`: the running sequences packed into
the first rows of a bucket (1, 2, 4, ...) and the rest idle (length 0: the lean kernel gives them
no work). Positions, region starts and sampling settings are device tensors, so one graph serves
every step of every mix of sequences; the graphs are captured once per cache allocation
(decode.py holds the step and its state).

With speculation (Request.speculate) a step takes several query rows a sequence: its token and
the drafts the step before found for it on the device (prompt lookup over the token history kept
beside the cache), verified in the same step (decode.py's draft_step, one graph per draft size:
speculation.py); its results reach the host a step later, as a plain step's do.

A prompt that prefills beside running sequences goes chunk by chunk, each chunk in one mixed step
with the running rows (Transformer.mixed: one forward, the weights read once for both; on CUDA a
graph per size: mixed.py): the chunk's rows attend as a prefill's do, the decode rows as the decode
step's, and the decode rows are sampled by the decode step's own sampling (decode.sample_rows); a
step with drafts runs as its own graph, and the chunk alone after it. A prefill beside no running
rows runs as the model's generator of units of work (Transformer.prefill_units: layer by layer over
the whole prompt, its fastest form), held here between plans.

The engine decides nothing: each turn it runs one step plan (plan.py, made by scheduler.py) with
`run(plan)` -> StepOutput, the same plan on every rank under torchrun (fanout.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from minidecode.kernels import ops
from minidecode.kernels.prefill import choose_backend
from minidecode.models.cache import KVCache
from minidecode.models.llama import Transformer, weight_bytes, weights_description

from .cache_parts import CacheParts
from .decode import (
    DecodeGraphs,
    DecodeState,
    HostRows,
    TokenHistory,
    check_max_batch,
    propose,
    sample_rows,
)
from .diagnose import nonfinite_logits_error
from .errors import UserError
from .memory import Planner, default_prefill_chunk, free_memory
from .mixed import STEP_TOKENS, MixedSteps
from .plan import (
    Copy,
    Decode,
    DecodeKind,
    FileOpen,
    FileRead,
    FileSave,
    Prefill,
    Resize,
    StepOutput,
    StepPlan,
)
from .request import DEFAULT_MAX_BATCH
from .sampling import SamplingParams, process, sample, top_logprobs
from .speculation import DraftCounts, draft_sizes, first_draft_count, most_drafts


@dataclass
class Prefilling:
    """The prefill in progress, held by the engine between plans: its prompt and region, and how
    far it has run."""

    prompt: list[int]
    start: int
    size: int
    done: int  # prompt positions whose K/V its region holds: the reused prefix, then each chunk run
    staging: tuple[torch.Tensor, torch.Tensor] | None = None  # its chunks' FP8 staging (chunk_staging)
    units: Generator[float, None, torch.Tensor] | None = None  # the rest as a whole prefill, once begun


class Engine:
    """Runs the model on one device: the cache and its regions' contents, prefill, the decode
    step. Every method runs on the thread that owns the device (the engine loop, loop.py)."""

    def __init__(
        self,
        model: Transformer,
        device: torch.device,
        dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
        prefill_chunk: int | None = None,
        use_cuda_graph: bool = True,
        pdl: bool = True,
        max_batch: int = DEFAULT_MAX_BATCH,
        step_tokens: int | None = None,
        context_parallel: bool = False,
        prefill_attention: str = "auto",
    ):
        if (problem := ops.decode_attention_problem(device, model.config.head_dim)) is not None:
            raise UserError(problem)
        self.model, self.device, self.dtype = model, device, dtype
        self.kv_dtype = kv_dtype or dtype  # the cache's: the model dtype, or FP8 (e4m3 + scales)
        self.config = model.config
        self.prefill_chunk = prefill_chunk or default_prefill_chunk(device)
        self.use_cuda_graph = use_cuda_graph and device.type == "cuda"
        self.pdl = pdl  # chain the decode step's kernels by programmatic dependent launch (Hopper+)
        # context_parallel: the model's ranks each hold a share of every sequence's positions
        # (models/parallel.py): its prefills run as whole prefills' units (no mixed steps).
        self.context_parallel = context_parallel
        self.prefill_attention = prefill_attention  # "auto": SDPA's faster backend; "fp8": the e4m3 kernel
        self.max_batch = check_max_batch(max_batch)
        self.draft_sizes = draft_sizes(self.config.group_size)  # the draft counts a step is built for
        self.step_tokens = step_tokens or STEP_TOKENS[device.type]  # a mixed step's budget (rows)
        self.weights = weights_description(model)  # "bfloat16", or the FP8 scheme that runs
        self.planner = Planner(
            self.config, dtype, self.kv_dtype, device, self.prefill_chunk, weight_bytes(model), self.max_batch
        )
        self.granule = KVCache.region_granule(self.kv_dtype)  # region starts and sizes: multiples of it
        self.cache: KVCache | None = None  # [layers, 1, Hkv, capacity + granule, D]
        self.history: TokenHistory | None = None  # the token at each of the cache's sequence positions
        self.capacity = 0  # positions for regions; the spare granule follows them
        self.state = DecodeState.zeros(self.max_batch, device)
        # Work that stops the loop outside prefill and decode (monitoring: the server's /metrics):
        # cache reallocations (each also drops the graphs), and graph captures with their time.
        self.resizes = 0
        counts = DraftCounts.make(self.draft_sizes, device)
        self.graphs = DecodeGraphs(model, dtype, self.state, self.max_batch, self.use_cuda_graph, pdl, counts)
        # the mixed step's inputs and graphs (mixed.py; the graphs dropped with the cache)
        mixed = (self.step_tokens, self.use_cuda_graph, self.max_batch, self.prefill_chunk)
        self.mixed = MixedSteps(model, device, dtype, self.kv_dtype, *mixed)
        self._prefilling: Prefilling | None = None  # the prefill in progress
        # Pinned host copies of each step's results, made while the next step runs (the host hands
        # out a step's tokens one step late); whether the last step queued verified drafts (its
        # verdicts then go with its copy), and whether the copy in flight holds verdicts
        self._lagged = HostRows.empty(self.max_batch, device.type == "cuda")
        self._drafted = self._copied_verdicts = False
        self.files = CacheParts(model, self.kv_dtype)  # this rank's parts of cache files

    @property
    def captures(self) -> int:
        """CUDA graphs captured: the decode step's and the mixed steps'."""
        return self.graphs.captures + self.mixed.captures

    @property
    def capture_seconds(self) -> float:
        return self.graphs.capture_seconds + self.mixed.capture_seconds

    @property
    def prefill_backend(self) -> str:
        """What prefill attention runs: "fp8" (the e4m3 kernel where it pays, fp8_kernel_applies in
        kernels/prefill.py), else the SDPA backend ("default": PyTorch chooses)."""
        return self.attention_backend() or "default"

    def attention_backend(self) -> str | None:
        if self.prefill_attention == "fp8":
            return "fp8"
        return choose_backend(self.device, self.config.head_dim, self.config.group_size, self.dtype)

    # ---- the cache ---------------------------------------------------------------------------
    def region_size(self, context: int) -> int:
        """This rank's positions for a context, rounded up to whole granules (FP8: V blocks)."""
        positions = self.model.cache_len(context)  # context parallelism splits them
        return -(-positions // self.granule) * self.granule

    @property
    def spare_start(self) -> int:
        """Where the spare granule begins (idle rows write their ignored K/V there): after the regions."""
        return self.capacity

    @property
    def cache_bytes(self) -> int:
        return 0 if self.cache is None else self.cache.nbytes

    def region(self, start: int, size: int) -> KVCache:
        return self.cache.region(start, size)

    def resize(self, capacity: int, keep: int = 0) -> None:
        """A cache of `capacity` region positions (a multiple of the granule) plus the spare;
        positions 0..keep-1 of the old one are copied to the same places (the running sequences
        and cached prefixes stay where they are). keep 0 frees the old cache first."""
        old = self.cache
        if not keep:
            self.release()
        cfg = self.config
        new = KVCache(
            cfg.num_layers,
            1,
            cfg.num_kv_heads,
            capacity + self.granule,
            cfg.head_dim,
            self.kv_dtype,
            self.device,
        )
        if keep:
            copied = old.entries(keep)
            for name, t in new.tensors().items():
                t[:, :, :, : copied[name]] = old.tensors()[name][:, :, :, : copied[name]]
        history = TokenHistory.empty(capacity + self.granule, self.model.context_ranks, self.device)
        if keep:
            history.tokens[: keep * history.scale] = self.history.tokens[: keep * history.scale]
        self.cache, self.history, self.capacity = new, history, capacity
        self.graphs.reset()
        self.mixed.reset()
        self.resizes += 1
        self.state.starts.masked_fill_(self.state.active == 0, self.spare_start)  # idle rows: the new spare

    def release(self) -> None:
        """Free the cache and the graphs captured on it."""
        self.cache, self.history, self.capacity = None, None, 0
        self.graphs.reset()
        self.mixed.reset()

    def copy_positions(self, src: int, dst: int, count: int) -> None:
        """Positions src..src+count-1 of the cache to dst.. (a cached prefix moved to a larger
        region: device copies, ordered after the queued work). src and dst are region starts."""
        sequence, count = count, self.model.held_positions(count)  # (context parallel: this rank's share)
        self.history.span(dst, 0, sequence).copy_(self.history.span(src, 0, sequence))
        source, target = self.region(src, count).tensors(), self.region(dst, count).tensors()
        for name, t in target.items():
            t.copy_(source[name])

    def free_bytes(self) -> int:
        return free_memory(self.device)

    # ---- decode rows -------------------------------------------------------------------------
    def start_row(
        self,
        row: int,
        start: int,
        position: int,
        params: SamplingParams,
        prompt_ids: list[int] | None = None,
        speculate: int = 0,
        draft_end: int = 0,
    ) -> None:
        """Row `row` now decodes a sequence whose region starts at `start`, its next token at
        `position` (the prompt's length); `prompt_ids` are its prompt (for a repetition penalty).
        speculate: its setting (0: none), the most drafts a step of it verifies where that is a
        draft size (else the largest size below: speculation.most_drafts), none at positions past
        `draft_end` (each step makes the next one's: its first step has none)."""
        state = self.state
        state.sampling.set(row, params)
        if params.adjusts:
            self.state.add_processors(self.config.vocab_size)
        if state.processors is not None:  # neutral values for a sequence that uses none
            state.processors.set(row, params, prompt_ids or [], position)
        state.positions[row], state.starts[row], state.active[row] = position, start, 1
        most = most_drafts(speculate, self.draft_sizes)
        state.speculate[row], state.draft_end[row] = most, draft_end
        state.draft_k[row], state.draft_lens[row] = first_draft_count(most, self.draft_sizes), 0

    def move_row(self, src: int, dst: int) -> None:
        self.state.move(src, dst)

    def clear_row(self, row: int) -> None:
        """An idle row: reads nothing, writes its K/V to the spare granule."""
        state = self.state
        state.active[row], state.starts[row] = 0, self.spare_start
        state.positions[row], state.tokens[row] = 0, 0
        state.speculate[row], state.draft_k[row], state.draft_lens[row] = 0, 0, 0

    # ---- a step plan -------------------------------------------------------------------------
    def run(self, plan: StepPlan, on_progress: Callable[[int, int], None] | None = None) -> StepOutput:
        """Run one step plan (plan.py: its parts in their order) -> its StepOutput. The admitted
        sequence's cache work, and its prefill, fail that sequence only (UserError, out of memory:
        `failed`; the plan's decode rows step all the same); anything else raises (the loop dies).
        `on_progress(done, total)`: the prefill's progress (rank 0's caller)."""
        out = StepOutput()
        for src, dst in plan.moves:
            self.move_row(src, dst)
        for row in plan.clears:
            self.clear_row(row)
        if plan.cancel:
            self._prefilling = None
        admitted = self._cache_work(plan, out)
        for rows, kind, queries in plan.prepare:
            self.prepare(rows, kind, queries)
        p = plan.prefill if plan.prefill is not None and (admitted or plan.prefill.begin is None) else None
        if p is not None and p.begin is not None:
            out.prefill_began = time.perf_counter()
            self._prefilling = Prefilling(p.begin, p.start, p.size, p.reused)
            if any(isinstance(op, FileRead) for op in plan.cache):  # (a region's own prefix has its tokens)
                self._write_history(p.start, p.begin[: p.reused])
        # The decode rows ride in the prefill's chunk, unless they verify drafts (their graph's step)
        chunked, decode = p is not None and p.chunk is not None, plan.decode
        riding = chunked and decode is not None and decode.queries == 1
        if plan.decode is not None and not riding:
            self._decode(plan.decode)
        if chunked:
            self._mixed_step(decode if riding else None, p, out, on_progress)
        elif p is not None:
            self._prefill_units(p, out, on_progress)
        if plan.score is not None:
            out.logits = self.score(plan.score)
        if plan.file is not None:
            self._file_work(plan.file, out)
        if plan.decode is not None:
            self._hand_back(plan.decode, out)
        out.capacity = self.capacity
        return out

    def _cache_work(self, plan: StepPlan, out: StepOutput) -> bool:
        """plan.cache in order -> False if it failed (the admitted sequence's failure in `out`)."""
        try:
            for op in plan.cache:
                if isinstance(op, Resize):
                    out.resized = True
                    self.resize(op.capacity, op.keep)
                elif isinstance(op, Copy):
                    self.copy_positions(op.src, op.dst, op.count)
                elif isinstance(op, FileRead):
                    t0 = time.perf_counter()
                    region = self.region(op.start, self.model.held_positions(op.count))
                    self.files.read(op, region.tensors())
                    out.file_seconds = time.perf_counter() - t0
                else:
                    self.release()
        except UserError as e:  # a cache file that does not read back
            out.failed = (plan.admit, str(e))
            return False
        except torch.OutOfMemoryError:
            out.failed = (plan.admit, f"out of memory on {self.device} while making room for its cache")
            return False
        return True

    def _write_history(self, start: int, ids: list[int]) -> None:
        """Token ids of positions 0.. of the region at `start` into the history (host ids: a cache
        file's prefix, whose tokens the region did not hold)."""
        if ids:
            values = torch.tensor(ids, dtype=torch.long, pin_memory=self.device.type == "cuda")
            self.history.span(start, 0, len(ids)).copy_(values, non_blocking=True)

    def _file_work(self, op: FileSave | FileOpen, out: StepOutput) -> None:
        """Save or open this rank's part of a cache file; a UserError is `out.file_error`."""
        try:
            if isinstance(op, FileSave):  # the valid positions of the prefix's region (this rank's)
                region = self.region(op.start, self.model.held_positions(len(op.ids)))
                out.file_results = [self.files.save(op, region.tensors())]
            else:
                out.file_results = [self.files.open(op)]
        except UserError as e:
            out.file_error = str(e)

    def _decode(self, decode: Decode) -> None:
        """Copy the rows' results of the step before to the host, then queue the step (it runs
        while they are handed out)."""
        n, kind = decode.rows, decode.kind
        self._copy_results(n, kind)
        self.step(n, kind, decode.queries)

    def _copy_results(self, n: int, kind: DecodeKind) -> None:
        """Queue the copies of rows 0..n-1's results so far (the step before's), to be read by
        _hand_back once the next step is queued."""
        self._copied_verdicts = self._drafted
        self._lagged.copy_from(self.state, n, kind.logprobs, kind.top, kind.lookup, self._drafted)

    def _hand_back(self, decode: Decode, out: StepOutput) -> None:
        n, kind, host = decode.rows, decode.kind, self._lagged
        host.wait()
        out.tokens = host.tokens[:n].tolist()
        if kind.logprobs or kind.top:
            out.logprobs = host.logprob[:n].tolist()
        if kind.top:
            out.top_ids, out.top_logprobs = host.top_ids[:n], host.top_logprob[:n]
        if self._copied_verdicts:
            out.verdicts = host.verdicts[:n].tolist()
        if kind.lookup:
            out.draft_lens = host.draft_lens[:n].tolist()

    def _mixed_step(self, decode: Decode | None, p: Prefill, out: StepOutput, on_progress) -> None:
        """The chunk p.chunk of the prefill in progress and the decode rows (if any) in one forward
        (Transformer.mixed: its CUDA graph's replay where MixedSteps.graphed, else eagerly); the
        decode rows' previous tokens are copied to the host first and their logits sampled as the
        decode step samples (sample_rows: the same tokens). A failure of the chunk (UserError, out
        of memory) fails its sequence only: the decode rows then step on their own. Once the chunk
        is the prompt's last, the prefill ends (its first token)."""
        n, work = (0 if decode is None else decode.rows), self._prefilling
        if n:
            kind = decode.kind
            self._copy_results(n, kind)
        try:
            logits = self._mixed_logits(work, p.chunk, n)  # [1 + n, V]: the chunk's last row, the decode rows
        except (UserError, torch.OutOfMemoryError) as e:
            self._prefill_failed(p, e, out)
            if n:
                self.step(n, kind)
            return
        if n:
            if kind.adjust:
                self.state.add_processors(self.config.vocab_size)
            rows = self.state.rows(n)
            self.history.write(rows, rows.tokens)
            sample_rows(logits[1:], rows, kind.mode, kind.logprobs, kind.adjust, kind.top)
            if kind.lookup:
                propose(self.history, rows)
            self._drafted = False
        work.done = p.chunk[1]
        total = len(work.prompt) - p.reused
        if on_progress is not None:
            on_progress(work.done - p.reused, total)
        if work.done == len(work.prompt):
            try:
                self._check_finite(logits[:1], work.prompt, work.start, work.size, p.reused)
            except UserError as e:
                self._prefill_failed(p, e, out)
                return
            self._end_prefill(p, logits[:1], out)

    def _mixed_logits(self, work: Prefilling, chunk: tuple[int, int], n: int) -> torch.Tensor:
        """The mixed step's forward -> float32 logits [1 + n, V] (the chunk's last position, then
        decode rows 0..n-1): its graph's replay, or eagerly."""
        region, (lo, hi) = self.region(work.start, work.size), chunk
        if work.staging is None:  # (an FP8 cache's, made at the prefill's first chunk)
            work.staging = self.model.chunk_staging(region, len(work.prompt))
        where = (lo, work.start, len(work.prompt), region, work.staging, self.spare_start)
        chunk = self.mixed.chunk(work.prompt[lo:hi], *where)
        self.history.span(work.start, lo, hi).copy_(chunk.ids[: hi - lo])
        return self.mixed.logits(chunk, self.state, n, self.cache)

    def _prefill_units(self, p: Prefill, out: StepOutput, on_progress) -> None:
        """Run p.units units of the prefill in progress as a whole prefill of the positions not yet
        run (begun here at its first such plan); once its last unit has run, end it."""
        work = self._prefilling
        try:
            if work.units is None:
                report = on_progress
                if on_progress is not None and work.done > p.reused:  # after chunks: the count goes on
                    done, total = work.done - p.reused, len(work.prompt) - p.reused
                    report = lambda d, t: on_progress(done + d, total)  # noqa: E731
                work.units = self.prefill_units(work.prompt, work.start, work.size, work.done, report)
            ran = 0
            while p.units is None or ran < p.units:
                try:
                    next(work.units)
                except StopIteration as done:
                    self._end_prefill(p, done.value, out)
                    return
                ran += 1
        except (UserError, torch.OutOfMemoryError) as e:
            self._prefill_failed(p, e, out)

    def _prefill_failed(self, p: Prefill, error: Exception, out: StepOutput) -> None:
        self._prefilling = None
        message = str(error) if isinstance(error, UserError) else (
            f"out of memory on {self.device} in prefill: lower the prompt length"
        )  # fmt: skip
        out.failed = (p.seq, message)

    def _end_prefill(self, p: Prefill, logits: torch.Tensor, out: StepOutput) -> None:
        """The prefill's last position has run (its logits [1, V]): its row starts and its first
        token is sampled into out.first."""
        prompt, row = self._prefilling.prompt, p.row
        self._prefilling = None
        self.start_row(row.row, row.start, row.position, row.params, prompt, row.speculate, row.draft_end)
        first = self.sample_first(row.row, logits, row.params, p.logprobs, p.top)
        logprob = float(self.state.logprob[row.row]) if p.logprobs else None
        top = (self.state.top_ids[row.row], self.state.top_logprob[row.row]) if p.top else None
        out.first = (first, logprob, top)

    def prefill_units(
        self, prompt_ids: list[int], start: int, size: int, reused: int, on_progress
    ) -> Generator[float, None, torch.Tensor]:
        """The prefill of prompt positions reused.. into the region [start, start + size) as units
        (Transformer.prefill_units) -> float32 logits [1, V] of the last position. NaN / inf logits
        are one UserError naming the first layer that made them."""
        region = self.region(start, size)
        tokens = torch.tensor([prompt_ids[reused:]], device=self.device)  # [1, T - reused]
        self.history.span(start, reused, len(prompt_ids)).copy_(tokens[0])
        new = len(prompt_ids) - reused
        report = None if on_progress is None else (lambda done, total: on_progress(new * done // total, new))
        args = (tokens, region, self.prefill_chunk, self.attention_backend())
        hidden = yield from self.model.prefill_units(*args, on_progress=report, start=reused)
        logits = self.model.logits(hidden)
        self._check_finite(logits, prompt_ids, start, size, reused)
        return logits

    def _check_finite(
        self, logits: torch.Tensor, prompt_ids: list[int], start: int, size: int, reused: int
    ) -> None:
        """One check per request (its first token is a host sync anyway; decode steps are not
        checked): NaN / inf in a prefill's last logits [1, V] are a UserError naming the first layer
        that made them (found by the prompt's whole prefill again, with hooks)."""
        if bool(torch.isfinite(logits).all()):
            return
        tokens = torch.tensor([prompt_ids[reused:]], device=self.device)
        args = (tokens, self.region(start, size), self.prefill_chunk, self.attention_backend())
        rerun = lambda: self.model.logits(self.model.prefill(*args, start=reused))  # noqa: E731
        raise nonfinite_logits_error(self.model, rerun)

    def prefill(self, prompt_ids: list[int], start: int, size: int, reused: int) -> torch.Tensor:
        """A whole prefill at once (as a plan's units would run it) -> float32 logits [1, V]."""
        units = self.prefill_units(prompt_ids, start, size, reused, None)
        while True:
            try:
                next(units)
            except StopIteration as done:
                return done.value

    def sample_first(
        self, row: int, logits: torch.Tensor, params: SamplingParams, logprobs: bool, top: bool = False
    ) -> int:
        """Sample the first new token of the sequence of `row` (started) from its prefill logits
        [1, V] into its decode buffers (top: its top log-probs too); -> the token (a host sync:
        prefill's end)."""
        one = self.state.rows(1, row)
        if params.adjusts:
            chosen = process(logits, one.processors, one.positions)  # [1, V]
            first = sample(chosen, one.sampling, one.positions, params.mode)
            one.processors.count(first, one.active)
        else:
            first = sample(logits, one.sampling, one.positions, params.mode)  # [1]
        one.tokens.copy_(first)
        if logprobs or top:
            logprobs_all = logits.log_softmax(-1)  # [1, V]
            one.logprob.copy_(logprobs_all.gather(-1, first[:, None])[:, 0])
            if top:
                top_logprobs(logprobs_all, one.top_logprob, one.top_ids)
        return int(first.item())

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """float32 logits [T, V] of every position of `token_ids`, in one causal pass (scoring),
        through the same prefill as generation, in a cache of its own."""
        cfg = self.config
        tokens = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        positions = self.model.cache_len(len(token_ids))
        cache = KVCache(
            cfg.num_layers, 1, cfg.num_kv_heads, positions, cfg.head_dim, self.kv_dtype, self.device
        )
        hidden = self.model.prefill(
            tokens, cache, self.prefill_chunk, backend=self.attention_backend(), last_only=False
        )
        return self.model.logits(hidden[0])

    # ---- decode ------------------------------------------------------------------------------
    def step(self, n: int, kind: DecodeKind, queries: int = 1) -> None:
        """One decode step of rows 0..n-1 of `kind` (plan.DecodeKind; a CUDA graph replay of their
        bucket on CUDA): tokens -> the next tokens, positions += 1. queries > 1 (a draft size +
        1): the step verifies the drafts the step before made (positions += kept + 1)."""
        self.graphs.step(self.cache, self.history, self.spare_start, n, *self._graph_kind(kind, queries))
        self._drafted = queries > 1

    def prepare(self, n: int, kind: DecodeKind, queries: int = 1) -> None:
        """Capture the graph of n rows' step (its bucket), once per cache allocation: the loop calls
        this before a prefill, so that capture stays out of the decode steps' time."""
        self.graphs.prepare(self.cache, self.history, self.spare_start, n, *self._graph_kind(kind, queries))

    @staticmethod
    def _graph_kind(kind: DecodeKind, queries: int) -> tuple:
        """What decode_step takes of a step's kind (DecodeGraphs' key, less the bucket)."""
        return kind.mode, kind.logprobs, kind.adjust, kind.top, queries, kind.lookup


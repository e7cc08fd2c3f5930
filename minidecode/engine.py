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
every step of every mix of sequences; the graphs are captured once per cache allocation.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minidecode.kernels import ops
from minidecode.kernels.prefill import choose_backend
from minidecode.models.llama import Transformer, weight_bytes, weights_description

from .cache import KVCache
from .diagnose import nonfinite_logits_error
from .errors import UserError
from .memory import Planner, default_prefill_chunk, free_memory
from .request import DEFAULT_MAX_BATCH, MAX_TOP_LOGPROBS, check_int
from .sampling import ProcessorRows, SamplingParams, SamplingRows, process, sample, top_logprobs

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # batch sizes a decode graph is captured for
# The most work (FLOPs) in one unit of a prefill that runs beside decoding sequences: they may
# step after any unit (pacer.py decides when). About 3 ms of bf16 tensor-core work at a prefill's
# ~500 TFLOP/s on an H100 or H200, short against a step's 4-8 ms; on the CPU, a few milliseconds.
PREFILL_UNIT_FLOPS = {"cuda": 1.5e12, "cpu": 5e8}


def bucket(n: int) -> int:
    """The smallest bucket that holds n running sequences."""
    return next(b for b in BUCKETS if b >= n)


def check_max_batch(max_batch: int) -> int:
    check_int("max_batch", max_batch, 1)
    if max_batch > BUCKETS[-1]:
        raise UserError(f"max_batch must be in [1, {BUCKETS[-1]}], got {max_batch}")
    return max_batch


@dataclass
class DecodeState:
    """The decode step's device buffers, [B] each: a captured graph reads and writes exactly these,
    so they live as long as the engine. A step uses the first rows of a bucket (views)."""

    tokens: torch.Tensor  # int64: in, the last token; out, the next one
    positions: torch.Tensor  # int64: where the next token goes (+= 1 per step, active rows only)
    logprob: torch.Tensor  # float32: log p of the token just sampled (when asked for)
    sampling: SamplingRows  # each sequence's sampling settings
    starts: torch.Tensor  # int64: where each sequence's region begins in the cache row
    active: torch.Tensor  # int32 0/1: 0 is an idle slot (reads nothing, does not advance)
    # [B, MAX_TOP_LOGPROBS]: the most likely ids and their log p at the token just sampled (when asked for)
    top_ids: torch.Tensor  # int64
    top_logprob: torch.Tensor  # float32
    processors: ProcessorRows | None = None  # logits-processor state, once a sequence uses one

    @classmethod
    def zeros(cls, batch: int, device: torch.device) -> DecodeState:
        def new(dtype):
            return torch.zeros(batch, dtype=dtype, device=device)

        tokens, positions, starts = (new(torch.long) for _ in range(3))
        top_ids = torch.zeros(batch, MAX_TOP_LOGPROBS, dtype=torch.long, device=device)
        top_logprob = torch.zeros(batch, MAX_TOP_LOGPROBS, dtype=torch.float32, device=device)
        # active is int32, as the decode kernel's lengths (lengths * active stays int32)
        sampling, logprob, active = SamplingRows.zeros(batch, device), new(torch.float32), new(torch.int32)
        return cls(tokens, positions, logprob, sampling, starts, active, top_ids, top_logprob)

    def add_processors(self, vocab: int) -> ProcessorRows:
        """The logits-processor state ([B, vocab] buffers), allocated on first use."""
        if self.processors is None:
            self.processors = ProcessorRows.zeros(self.tokens.shape[0], vocab, self.tokens.device)
        return self.processors

    def rows(self, n: int, first: int = 0) -> DecodeState:
        """Rows first..first+n-1, as views."""
        tokens, positions, logprob, starts, active, top_ids, top_logprob = (
            x[first : first + n] for x in self._columns()
        )
        processors = None if self.processors is None else self.processors.rows(n, first)
        return DecodeState(
            tokens, positions, logprob, self.sampling.rows(n, first), starts, active, top_ids, top_logprob,
            processors,
        )  # fmt: skip

    def _columns(self) -> tuple[torch.Tensor, ...]:
        rows = self.tokens, self.positions, self.logprob, self.starts, self.active
        return (*rows, self.top_ids, self.top_logprob)

    def move(self, src: int, dst: int) -> None:
        """Row src's sequence moves to row dst (device copies, ordered after queued steps)."""
        for t in self._columns():
            t[dst] = t[src]
        self.sampling.move(src, dst)
        if self.processors is not None:
            self.processors.move(src, dst)


def decode_step(
    model: Transformer,
    cache: KVCache,
    state: DecodeState,
    mode: str,
    want_logprobs: bool,
    pdl: bool,
    adjust: bool = False,
    top: bool = False,
) -> None:
    """One token for every row of `state`, reading and writing only its device buffers (so it can
    be captured in a CUDA graph): each row's sequence lives in its region of the cache's one row
    (state.starts); idle rows (state.active 0) read nothing. adjust: some row uses a logits
    processor (state.processors); top: some row reports its top log-probs (implies want_logprobs)."""
    hidden = model.decode(state.tokens, state.positions, cache, pdl, starts=state.starts, active=state.active)
    logits = model.logits(hidden)  # [B, V] float32
    if adjust:  # rows that use no processor have neutral state: their logits pass unchanged
        positions = state.positions + 1
        nxt = sample(process(logits, state.processors, positions), state.sampling, positions, mode)  # [B]
        state.processors.count(nxt, state.active)
    else:
        nxt = sample(logits, state.sampling, state.positions + 1, mode)  # [B]
    if top:
        logprobs = logits.log_softmax(-1)  # [B, V]: of the model's own distribution, not the processed one
        state.logprob.copy_(logprobs.gather(-1, nxt[:, None])[:, 0])
        top_logprobs(logprobs, state.top_logprob, state.top_ids)
    elif want_logprobs:
        state.logprob.copy_(logits.log_softmax(-1).gather(-1, nxt[:, None])[:, 0])
    state.tokens.copy_(nxt)
    state.positions.add_(state.active)


@functools.cache
def _warm_up_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for every warm-up: cuBLAS keeps a workspace per stream it ran
    on, so a new stream per capture would leave one more workspace allocated each time."""
    return torch.cuda.Stream(device)


def capture(step: Callable[[], None], warm_up: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `step`, after `warm_up` ran once on a side stream (kernel compilation,
    workspaces, library handles: nothing may allocate or compile during capture)."""
    stream = _warm_up_stream(torch.device("cuda", torch.cuda.current_device()))
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        warm_up()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


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
        prefill_unit_flops: float | None = None,
        one_sequence: bool = False,
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
        # one_sequence: one sequence at a time, in a cache of exactly its region, which the decode step
        # reads as its whole row (context parallelism splits the row's positions over the ranks).
        self.one_sequence = one_sequence
        self.prefill_attention = prefill_attention  # "auto": SDPA's faster backend; "fp8": the e4m3 kernel
        self.max_batch = 1 if one_sequence else check_max_batch(max_batch)
        self.prefill_unit_flops = prefill_unit_flops or PREFILL_UNIT_FLOPS[device.type]
        self.weights = weights_description(model)  # "bfloat16", or the FP8 scheme that runs
        self.planner = Planner(
            self.config, dtype, self.kv_dtype, device, self.prefill_chunk, weight_bytes(model)
        )
        self.granule = KVCache.region_granule(self.kv_dtype)  # region starts and sizes: multiples of it
        self.cache: KVCache | None = None  # [layers, 1, Hkv, capacity + granule, D]
        self.capacity = 0  # positions for regions; the spare granule follows them
        self.state = DecodeState.zeros(self.max_batch, device)
        # Work that stops the loop outside prefill and decode (monitoring: the server's /metrics):
        # cache reallocations (each also drops the decode graphs), and graph captures with their time.
        self.resizes, self.captures, self.capture_seconds = 0, 0, 0.0
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}

    @property
    def prefill_backend(self) -> str:
        """What prefill attention runs: "fp8" (the e4m3 kernel where it pays, fp8_kernel_applies in
        kernels/prefill.py), else the SDPA backend ("default": PyTorch chooses)."""
        return self._backend() or "default"

    def _backend(self) -> str | None:
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
        self.cache, self.capacity, self._graphs = new, capacity, {}
        self.resizes += 1
        self.state.starts.masked_fill_(self.state.active == 0, self.spare_start)  # idle rows: the new spare

    def release(self) -> None:
        """Free the cache and the graphs captured on it."""
        self.cache, self.capacity, self._graphs = None, 0, {}

    def copy_positions(self, src: int, dst: int, count: int) -> None:
        """Positions src..src+count-1 of the cache to dst.. (a cached prefix moved to a larger
        region: device copies, ordered after the queued work). src and dst are region starts."""
        source, target = self.region(src, count).tensors(), self.region(dst, count).tensors()
        for name, t in target.items():
            t.copy_(source[name])

    def free_bytes(self) -> int:
        return free_memory(self.device)

    # ---- decode rows -------------------------------------------------------------------------
    def start_row(
        self, row: int, start: int, position: int, params: SamplingParams, prompt_ids: list[int] | None = None
    ) -> None:
        """Row `row` now decodes a sequence whose region starts at `start`, its next token at
        `position` (the prompt's length); `prompt_ids` are its prompt (for a repetition penalty)."""
        state = self.state
        state.sampling.set(row, params)
        if params.adjusts:
            self._processors()
        if state.processors is not None:  # neutral values for a sequence that uses none
            state.processors.set(row, params, prompt_ids or [], position)
        state.positions[row], state.starts[row], state.active[row] = position, start, 1

    def _processors(self) -> ProcessorRows:
        return self.state.add_processors(self.config.vocab_size)

    def move_row(self, src: int, dst: int) -> None:
        self.state.move(src, dst)

    def clear_row(self, row: int) -> None:
        """An idle row: reads nothing, writes its K/V to the spare granule."""
        state = self.state
        state.active[row], state.starts[row] = 0, self.spare_start
        state.positions[row], state.tokens[row] = 0, 0

    # ---- prefill -----------------------------------------------------------------------------
    def prefill(
        self,
        prompt_ids: list[int],
        start: int,
        size: int,
        reused: int,
        between: Callable[[float], None] | None = None,
        interleave: bool = False,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> torch.Tensor:
        """Prefill prompt positions reused.. into the region [start, start + size), whose
        positions 0..reused-1 already hold the prompt's K/V -> float32 logits [1, V] of the last
        position. `between(flops)` runs after each unit of work; `interleave` keeps units within
        prefill_unit_flops (the running sequences may step after any unit). NaN / inf logits are
        one UserError naming the first layer that made them."""
        region = self.region(start, size)
        tokens = torch.tensor([prompt_ids[reused:]], device=self.device)  # [1, T - reused]
        new = len(prompt_ids) - reused
        report = None if on_progress is None else (lambda done, total: on_progress(new * done // total, new))

        def run(between=None, report=None, unit_flops=None) -> torch.Tensor:
            hidden = self.model.prefill(
                tokens, region, self.prefill_chunk, self._backend(), on_progress=report, start=reused,
                between=between, unit_flops=unit_flops,
            )  # fmt: skip
            return self.model.logits(hidden)

        logits = run(between, report, self.prefill_unit_flops if interleave else None)
        # One check per request (its first token is a host sync anyway); decode steps are not checked.
        if not bool(torch.isfinite(logits).all()):
            raise nonfinite_logits_error(self.model, run)
        return logits

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
            tokens, cache, self.prefill_chunk, backend=self._backend(), last_only=False
        )
        return self.model.logits(hidden[0])

    # ---- decode ------------------------------------------------------------------------------
    def step(self, n: int, mode: str, logprobs: bool, adjust: bool = False, top: bool = False) -> None:
        """One decode step of rows 0..n-1 (a CUDA graph replay of their bucket on CUDA): tokens ->
        the next tokens, positions += 1. adjust: some row uses a logits processor; top: some row
        reports top log-probs (decode_step)."""
        if not self.use_cuda_graph:
            if adjust:
                self._processors()
            kind = (mode, logprobs, self.pdl, adjust, top)
            decode_step(self.model, self._decoded(), self.state.rows(n), *kind)
            return
        self.prepare(n, mode, logprobs, adjust, top)
        self._graphs[min(bucket(n), self.max_batch), mode, logprobs, adjust, top].replay()

    def prepare(self, n: int, mode: str, logprobs: bool, adjust: bool = False, top: bool = False) -> None:
        """Capture the graph of n rows' step (its bucket), once per cache allocation: the loop calls
        this before a prefill, so that capture stays out of the decode steps' time."""
        b = min(bucket(n), self.max_batch)
        key = (b, mode, logprobs, adjust, top)
        if not self.use_cuda_graph or key in self._graphs:
            return
        if adjust:  # the graph reads the processors' buffers: they exist before it is captured
            self._processors()
        cache = self._decoded()
        kind = (mode, logprobs, self.pdl, adjust, top)
        step = functools.partial(decode_step, self.model, cache, self.state.rows(b), *kind)
        idle = DecodeState.zeros(b, self.device)  # the warm-up writes only the spare granule
        idle.starts.fill_(self.spare_start)
        if adjust:
            idle.add_processors(self.config.vocab_size)
        warm_up = functools.partial(decode_step, self.model, cache, idle, *kind)
        t0 = time.perf_counter()
        self._graphs[key] = capture(step, warm_up)
        self.captures += 1
        self.capture_seconds += time.perf_counter() - t0

    def _decoded(self) -> KVCache:
        """What the decode step reads: the whole cache row, or (one_sequence) the one region."""
        return self.region(0, self.capacity) if self.one_sequence else self.cache

    def warm_up(self) -> None:
        """Compile the prefill's and the decode step's kernels on a small cache (the first request
        then pays none of it), and free that cache."""
        if self.device.type != "cuda":
            return
        size = self.region_size(64)
        self.resize(size)
        ids = list(range(1, 17))
        self.prefill(ids, 0, size, 0)
        self.prepare(1, SamplingParams().mode, False)
        torch.cuda.synchronize(self.device)
        self.release()

"""The generation loop: memory plan, chunked prefill, and a decode step that runs as one CUDA
graph replay per token while the context grows."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from minidecode.kernels.prefill import BLOCK as PREFILL_BLOCK
from minidecode.kernels.prefill import choose_backend
from minidecode.models.llama import Transformer, weight_bytes

from .cache import FP8, KVCache
from .cache_file import CacheFile, open_cache_file, read_cache_file, write_cache_file
from .config import ModelConfig
from .diagnose import nonfinite_logits_error
from .errors import UserError
from .memory import free_memory, gib
from .sampling import SamplingParams, SamplingRows, sample
from .validate import check_int, check_stops


@dataclass
class Request:
    """One generation request, in token ids; `Engine.validate` is the one place that checks it."""

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 256
    max_context: int | None = None  # cache positions to reserve; None: prompt + max_new_tokens
    stop: list[str] = field(default_factory=list)  # matched on the decoded text (by the API)
    eos_ids: frozenset[int] = frozenset()  # generation ends at any of these (not returned)
    ignore_eos: bool = False  # run to max_new_tokens even past eos
    want_logprobs: bool = False
    allow_extrapolation: bool = False  # allow positions beyond the model's trained context
    reuse_prefix: bool = True  # keep the cached K/V of a common prefix with the previous request

    @property
    def context(self) -> int:
        return self.max_context or len(self.prompt_ids) + self.max_new_tokens


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt positions whose K/V came from the cache (or a cache file)
    prefilled_tokens: int = 0  # prompt positions computed by this request's prefill
    cache_load_seconds: float = 0.0  # reading a loaded cache file onto the device (within TTFT)
    prefill_seconds: float = 0.0
    prefill_tokens_per_s: float = 0.0
    time_to_first_token: float = 0.0  # from the request to the first new token on the host
    new_tokens: int = 0
    decode_seconds: float = 0.0  # first new token to last: prefill excluded
    decode_tokens_per_s: float = 0.0
    peak_memory_bytes: int = 0
    kv_cache_dtype: str = ""  # what the KV cache stored: the model's dtype, or "fp8_e4m3"

    def summary(self) -> str:
        return (
            f"prompt {self.prompt_tokens} tok"
            + (f" ({self.reused_tokens} from the cache)" if self.reused_tokens else "")
            + f", prefill {self.prefill_seconds:.2f} s "
            f"({self.prefill_tokens_per_s:,.0f} tok/s), TTFT {self.time_to_first_token:.3f} s | "
            f"{self.new_tokens} new tok, decode {self.decode_tokens_per_s:.1f} tok/s | "
            f"peak memory {self.peak_memory_bytes / 2**30:.2f} GiB | KV cache {self.kv_cache_dtype}"
        )


@dataclass
class MemoryPlan:
    weights_bytes: int
    kv_cache_bytes: int
    activation_bytes: int
    free_bytes: int  # available to this process before the cache and activations are allocated
    device: str
    kv_cache_dtype: str = ""  # kv_dtype_name of the cache the plan is for

    @property
    def needed_bytes(self) -> int:
        return self.kv_cache_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.free_bytes


def kv_dtype_name(dtype: torch.dtype) -> str:
    """How plans, stats and results name a cache dtype: "bfloat16", ..., or "fp8_e4m3"."""
    return "fp8_e4m3" if dtype == FP8 else str(dtype).removeprefix("torch.")


def activation_bytes(
    cfg: ModelConfig,
    prompt_len: int,
    chunk: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_dtype: torch.dtype | None = None,
    rank_positions: int | None = None,
) -> int:
    """Peak temporaries of the layer-major prefill (an estimate with margin): the residual stream
    and the q / attention-output buffer over the whole prompt, one head group's attention output,
    and one chunk's projections and MLP intermediates; one query block's blocked-attention
    temporaries (kernels/prefill.py); plus a decode step's logits. An FP8 cache (kv_dtype) adds
    one layer's unquantized K and V over the prompt (the staging buffer) and one chunk's float32
    quantization temporaries. rank_positions: the cache positions of a context-parallel rank, if
    fewer than the prompt's: it prefills only those rows, and receives one layer's K/V of the earlier
    ranks' positions at a time (models/parallel.py)."""
    received = 0
    if rank_positions is not None and rank_positions < prompt_len:
        received = (prompt_len - rank_positions) * 2 * cfg.num_kv_heads * cfg.head_dim
        prompt_len = rank_positions
    T, c = prompt_len, min(chunk, prompt_len)
    whole_prompt = T * (cfg.hidden_size + cfg.num_heads * cfg.head_dim + cfg.group_size * cfg.head_dim)
    if kv_dtype == FP8:
        whole_prompt += T * 2 * cfg.num_kv_heads * cfg.head_dim
        whole_prompt += c * cfg.num_kv_heads * cfg.head_dim * 8 // dtype.itemsize  # float32 copies
    per_row = (
        4 * cfg.hidden_size
        + 3 * cfg.intermediate_size
        + 2 * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    )
    rope = c * cfg.head_dim * 8 * 2  # float64 angles
    lse = T * cfg.group_size * 4  # SDPA's float32 log-sum-exp
    blocked = min(T, PREFILL_BLOCK) * cfg.group_size * cfg.head_dim * (2 * 4 + 2 * dtype.itemsize)
    logits = 4 * cfg.vocab_size * 4
    margin = 512 * 2**20 if device.type == "cuda" else 64 * 2**20  # library workspaces
    return (whole_prompt + c * per_row + received) * dtype.itemsize + rope + lse + blocked + logits + margin


def default_prefill_chunk(device: torch.device) -> int:
    """Query rows per prefill pass: bounds activation memory for very long prompts."""
    return 8192 if device.type == "cuda" else 2048


@dataclass
class DecodeState:
    """The decode step's device buffers, [B] each: a captured graph reads and writes exactly these,
    so they are allocated with the cache and live as long as it. A batch uses the first n rows
    (views); `starts` and `active` are for a batch in regions of one shared cache row."""

    tokens: torch.Tensor  # int64: in, the last token; out, the next one
    positions: torch.Tensor  # int64: where the next token goes (+= 1 per step, active rows only)
    logprob: torch.Tensor  # float32: log p of the token just sampled (when asked for)
    sampling: SamplingRows  # each sequence's sampling settings
    starts: torch.Tensor  # int64: where each sequence's region begins in the cache row
    active: torch.Tensor  # int64 0/1: 0 is an idle slot (reads nothing, does not advance)

    @classmethod
    def zeros(cls, batch: int, device: torch.device) -> DecodeState:
        def new(dtype):
            return torch.zeros(batch, dtype=dtype, device=device)

        tokens, positions, starts, active = (new(torch.long) for _ in range(4))
        return cls(tokens, positions, new(torch.float32), SamplingRows.zeros(batch, device), starts, active)

    def rows(self, n: int, first: int = 0) -> DecodeState:
        """Rows first..first+n-1, as views."""
        tokens, positions, logprob, starts, active = (x[first : first + n] for x in self._columns())
        return DecodeState(tokens, positions, logprob, self.sampling.rows(n, first), starts, active)

    def _columns(self) -> tuple[torch.Tensor, ...]:
        return self.tokens, self.positions, self.logprob, self.starts, self.active

    def move(self, src: int, dst: int) -> None:
        """Row src's sequence moves to row dst (device copies, ordered after queued steps)."""
        for t in self._columns():
            t[dst] = t[src]
        self.sampling.move(src, dst)


def decode_step(
    model: Transformer,
    cache: KVCache,
    state: DecodeState,
    mode: str,
    want_logprobs: bool,
    pdl: bool,
    batch: bool,
) -> None:
    """One token for every row of `state`, reading and writing only its device buffers (so it can
    be captured in a CUDA graph). batch: the rows are sequences in regions of one cache row
    (state.starts), with idle rows (state.active 0)."""
    starts, active = (state.starts, state.active) if batch else (None, None)
    hidden = model.decode(state.tokens, state.positions, cache, pdl, starts=starts, active=active)
    logits = model.logits(hidden)  # [B, V] float32
    nxt = sample(logits, state.sampling, state.positions + 1, mode)  # [B]
    if want_logprobs:
        state.logprob.copy_(logits.log_softmax(-1).gather(-1, nxt[:, None])[:, 0])
    state.tokens.copy_(nxt)
    state.positions.add_(state.active if batch else 1)


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


@dataclass
class Generation:
    """Engine.generate's result: `tokens` yields (token id, log-prob or None) per new token, eos not
    included; `stats` and `finish_reason` ("eos"/"length") are final once it ends or is closed."""

    request: Request
    stats: GenerationStats = field(default_factory=GenerationStats)
    finish_reason: str = "length"
    tokens: Iterator[tuple[int, float | None]] | None = None  # set by Engine.generate


class Engine:
    """Runs requests on one model, one at a time: memory plan, cache (reused by the next request
    that fits), prefill, and the decode step (a CUDA graph replay per token on CUDA)."""

    def __init__(
        self,
        model: Transformer,
        device: torch.device,
        dtype: torch.dtype,
        prefill_chunk: int | None = None,
        use_cuda_graph: bool = True,
        pdl: bool = True,
        kv_dtype: torch.dtype | None = None,
        prefix_reuse: bool = True,
    ):
        self.model, self.device, self.dtype = model, device, dtype
        self.kv_dtype = kv_dtype or dtype  # the cache's: the model dtype, or FP8 (e4m3 + scales)
        self.config = model.config
        self.prefill_chunk = prefill_chunk or default_prefill_chunk(device)
        self.use_cuda_graph = use_cuda_graph and device.type == "cuda"
        self.pdl = pdl  # chain the decode step's kernels by programmatic dependent launch (Hopper+)
        self.cache: KVCache | None = None
        self.state: DecodeState | None = None  # allocated with the cache
        self.prefix_reuse = prefix_reuse
        # The token ids whose K/V are valid at cache positions 0..len-1: the last prompt and the
        # new tokens that were fed to a decode step (the last one yielded never is). With
        # `loaded` set they are the positions of that cache file, read in by the next request.
        self.cached_ids: list[int] = []
        self.loaded: CacheFile | None = None
        # The longest forward pass (RoPE seq_len) under which any cached position was computed.
        self.angles_len = 0
        self.busy = False  # a generation is in progress
        self._step: Callable[[], None] | None = None  # the prepared decode step (graph replay or eager)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_key: tuple | None = None

    @property
    def prefill_backend(self) -> str:
        """The SDPA backend prefill attention uses ("default": PyTorch chooses)."""
        return self._backend() or "default"

    def _backend(self) -> str | None:
        return choose_backend(self.device, self.config.head_dim, self.config.group_size, self.dtype)

    # ---- memory -------------------------------------------------------------------------
    def plan(self, max_context: int, prompt_len: int) -> MemoryPlan:
        cfg = self.config
        positions = self.model.cache_len(max_context)
        kv = KVCache.bytes_needed(cfg.num_layers, cfg.num_kv_heads, positions, cfg.head_dim, self.kv_dtype)
        free = free_memory(self.device)
        activations = activation_bytes(
            cfg, prompt_len, self.prefill_chunk, self.dtype, self.device, self.kv_dtype,
            self.model.cache_len(prompt_len),
        )  # fmt: skip
        return MemoryPlan(
            weight_bytes(self.model), kv, activations, free, str(self.device), kv_dtype_name(self.kv_dtype)
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """Cache bytes of one position, all layers (FP8: e4m3 rows plus their bfloat16 scales)."""
        cfg = self.config
        return KVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.kv_dtype)

    def _cache_fits(self, max_context: int) -> bool:
        positions = self.model.cache_len(max_context)  # on this rank (context parallelism splits them)
        return self.cache is not None and self.cache.fits(positions, self.kv_dtype, self.device)

    def ensure_cache(self, max_context: int) -> KVCache:
        """A cache of at least max_context positions, with its decode buffers (reused if it fits)."""
        if not self._cache_fits(max_context):
            self.release()  # free a cache that is too small before allocating the new one
            self.cache, self.state = self._new_cache(max_context), DecodeState.zeros(1, self.device)
        return self.cache

    def _new_cache(self, max_len: int, device: torch.device | str | None = None) -> KVCache:
        cfg = self.config
        device = self.device if device is None else device
        positions = self.model.cache_len(max_len)
        return KVCache(cfg.num_layers, 1, cfg.num_kv_heads, positions, cfg.head_dim, self.kv_dtype, device)

    def release(self) -> None:
        """Free the cache, its decode buffers and the captured graph (the next request allocates)."""
        self.cache = self.state = self._step = self._graph = self._graph_key = self.loaded = None
        self.cached_ids, self.angles_len = [], 0

    def reusable_prefix(self, request: Request) -> int:
        """How many leading prompt positions the cache (or a loaded file) already holds: the
        longest common prefix with cached_ids, leaving at least one token to prefill (its logits
        give the first new token). 0 when reuse is off or the cache must be reallocated (a cache
        too small for the request is replaced, not grown)."""
        if not (self.prefix_reuse and request.reuse_prefix):
            return 0
        if self.loaded is None and not self._cache_fits(request.context):
            return 0
        # Dynamic NTK / LongRoPE: the angles depend on the pass's length; reuse positions only
        # when they and a fresh prefill of this prompt both ran below the length where they change.
        limit = self.model.rope.length_free_up_to
        if limit is not None and max(self.angles_len, len(request.prompt_ids)) > limit:
            return 0
        cached, prompt = self.cached_ids, request.prompt_ids
        n = min(len(cached), len(prompt) - 1)
        if cached[:n] == prompt[:n]:
            return n
        return next(i for i in range(n) if cached[i] != prompt[i])

    # ---- cache files --------------------------------------------------------------------
    def _cache_layout(self, length: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """{name: (dtype, shape)} of the cache's stored tensors holding `length` positions."""
        template = self._new_cache(length, device="meta")  # shapes and dtypes, no memory
        return {name: (t.dtype, tuple(t.shape)) for name, t in template.tensors().items()}

    def _identity(self, model_identity: dict[str, str]) -> dict[str, str]:
        """What a cache file must match: the model's identity and the cache dtype."""
        return dict(model_identity, cache_dtype=str(self._cache_layout(1)["k"][0]).removeprefix("torch."))

    def save_cache(self, path: str | Path, identity: dict[str, str]) -> int:
        """Write the cache's valid positions and their token ids to `path` (atomically); bytes written."""
        self.check_idle()
        if self.cache is None or self.loaded is not None or not self.cached_ids:
            raise UserError("there is no prefilled cache to save: run a request first")
        meta = dict(self._identity(identity), rope_length=str(self.angles_len))
        valid = self.cache.region(0, len(self.cached_ids)).tensors()  # dim 3 cut to the valid positions
        return write_cache_file(Path(path), valid, self.cached_ids, meta)

    def load_cache(self, path: str | Path, identity: dict[str, str]) -> int:
        """Check the cache file at `path` against this model and make it the cached prefix: the
        next request that starts with its tokens reads them onto the device instead of
        prefilling them. Returns its token count."""
        self.check_idle()
        if not self.prefix_reuse:
            raise UserError("prefix reuse is off (prefix_reuse=False): a loaded cache would never be used")
        file = open_cache_file(Path(path), self._identity(identity), self._cache_layout)
        self.cached_ids, self.loaded = file.token_ids, file
        self.angles_len = int(file.metadata.get("rope_length", file.length))
        return file.length

    # ---- requests -----------------------------------------------------------------------
    def validate(self, request: Request) -> None:
        """The one place a request is checked: limits, context and memory (refusing with what to
        change), and that no other generation is running."""
        self.check_idle()
        self.check_limits(request)
        if self.loaded is not None and request.reuse_prefix and self.loaded.length > request.context:
            raise UserError(
                f"the loaded cache holds {self.loaded.length:,} tokens, more than this request's context of "
                f"{request.context:,} (max_context, else prompt + max_new_tokens); raise --max-context"
            )
        plan = self.plan(request.context, len(request.prompt_ids))
        if self._cache_fits(request.context):
            plan.kv_cache_bytes = 0  # already allocated
        elif self.cache is not None:
            plan.free_bytes += self.cache.nbytes  # freed before the new one is allocated
        if not plan.fits:
            per_token = self.kv_bytes_per_token
            fit_tokens = max(0, (plan.free_bytes - plan.activation_bytes) // per_token)
            raise UserError(
                f"KV cache for {request.context:,} tokens needs {gib(plan.kv_cache_bytes)} plus "
                f"{gib(plan.activation_bytes)} of activations, but only {gib(plan.free_bytes)} is free on "
                f"{plan.device}; lower the prompt length, max_new_tokens or --max-context "
                f"(about {fit_tokens:,} tokens fit with a {plan.kv_cache_dtype} cache)"
            )

    def check_limits(self, request: Request) -> None:
        """A request's values and context against the model (not memory, not the engine's state)."""
        request.params.validate()
        check_int("max_new_tokens", request.max_new_tokens, 1)
        check_stops(request.stop)
        prompt_len, needed = len(request.prompt_ids), len(request.prompt_ids) + request.max_new_tokens
        if request.max_context is not None and request.max_context < needed:
            raise UserError(
                f"max_context {request.max_context:,} is less than prompt ({prompt_len:,}) + "
                f"max_new_tokens ({request.max_new_tokens:,}) = {needed:,}"
            )
        cfg, context = self.config, request.context
        if context > cfg.max_position_embeddings and not request.allow_extrapolation:
            raise UserError(
                f"a context of {context:,} positions (max_context, else prompt + max_new_tokens) exceeds "
                f"the {cfg.max_position_embeddings:,} the model was trained for; shorten it or opt in with "
                "allow_extrapolation (--allow-extrapolation)"
            )
        if cfg.sliding_window is not None and context > cfg.sliding_window:
            raise UserError(
                f"this model uses sliding-window attention ({cfg.sliding_window:,} tokens), which minidecode "
                f"does not implement; keep prompt + max_new_tokens within {cfg.sliding_window:,} tokens"
            )

    def generate(
        self,
        request: Request,
        on_progress: Callable[[int, int], None] | None = None,
        t_request: float | None = None,
    ) -> Generation:
        """Validate `request` now (a bad one raises here, before anything runs) and return its
        Generation; the work starts when its tokens are iterated. t_request (a perf_counter
        reading) is when the request arrived, for time to first token."""
        self.validate(request)
        generation = Generation(request)
        t_request = time.perf_counter() if t_request is None else t_request
        generation.tokens = self._run(generation, on_progress, t_request)
        return generation

    def check_idle(self) -> None:
        if self.busy:
            raise UserError("this model is still generating: finish or close the previous stream first")

    @torch.inference_mode()
    def _run(
        self, generation: Generation, on_progress: Callable[[int, int], None] | None, t_request: float
    ) -> Iterator[tuple[int, float | None]]:
        request, stats = generation.request, generation.stats
        # One request at a time: two interleaved generations would share the cache and buffers.
        self.check_idle()
        self.busy = True
        eos_ids = frozenset() if request.ignore_eos else request.eos_ids
        cuda, want_logprobs = self.device.type == "cuda", request.want_logprobs
        t_first = None
        try:
            self._start(request, stats, on_progress)
            t_first = time.perf_counter()
            stats.time_to_first_token = t_first - t_request
            # Each step's token is copied to pinned host memory and the next step is launched
            # before the host waits for that copy: the GPU never idles while the host streams text.
            host_tokens = torch.empty(1, dtype=torch.long, pin_memory=cuda)
            host_logprob = torch.empty(1, dtype=torch.float32, pin_memory=cuda)
            copied = torch.cuda.Event() if cuda else None
            while True:
                host_tokens.copy_(self.state.tokens, non_blocking=True)
                if want_logprobs:
                    host_logprob.copy_(self.state.logprob, non_blocking=True)
                if copied is not None:
                    copied.record()
                fed = stats.new_tokens + 1 < request.max_new_tokens
                if fed:
                    self.step()  # run the next step while this token is handed out
                if copied is not None:
                    copied.synchronize()
                token, stats.new_tokens = int(host_tokens[0]), stats.new_tokens + 1
                if fed:  # its K/V are written at the next position by the step just launched
                    self.cached_ids.append(token)
                    self.angles_len = max(self.angles_len, len(self.cached_ids))
                if token in eos_ids:
                    generation.finish_reason = "eos"
                    return
                yield token, (float(host_logprob[0]) if want_logprobs else None)
                if stats.new_tokens >= request.max_new_tokens:
                    return
        finally:
            self.busy = False
            if t_first is not None:
                stats.decode_seconds = time.perf_counter() - t_first
                steps = stats.new_tokens - 1
                stats.decode_tokens_per_s = steps / stats.decode_seconds if steps else 0.0
                stats.peak_memory_bytes = (
                    torch.cuda.max_memory_allocated(self.device) if cuda else _host_peak_bytes()
                )

    def _start(
        self, request: Request, stats: GenerationStats, on_progress: Callable[[int, int], None] | None
    ) -> None:
        """Cache, decode step and prefill for a request; the first token lands in the DecodeState.
        Positions 0..start-1 that the cache (or a loaded file) holds for this prompt are kept."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        start, loaded = self.reusable_prefix(request), self.loaded
        # Until this prefill completes, nothing is known to be valid (an interrupted one leaves a mix).
        self.cached_ids, self.loaded = [], None
        angles_len = self.angles_len if start else 0
        self.ensure_cache(request.context)
        params = request.params
        self.prepare_decode(params, request.want_logprobs)  # may capture a graph (runs a step)
        self.state.sampling.set(0, params)
        n = stats.prompt_tokens = len(request.prompt_ids)
        stats.kv_cache_dtype = kv_dtype_name(self.kv_dtype)
        stats.reused_tokens, stats.prefilled_tokens = start, n - start
        if loaded is not None and start:
            t0 = time.perf_counter()
            read_cache_file(loaded, self.cache.region(0, start).tensors())
            stats.cache_load_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        # Layer-major prefill: progress counts chunks of every layer, scaled to prompt tokens.
        new = n - start
        report = None if on_progress is None else (lambda done, total: on_progress(new * done // total, new))
        prompt = torch.tensor([request.prompt_ids[start:]], device=self.device)  # [1, T - start]

        def prefill(progress=None) -> torch.Tensor:  # [1, V] float32 logits of the last position
            backend, chunk = self._backend(), self.prefill_chunk
            hidden = self.model.prefill(prompt, self.cache, chunk, backend, on_progress=progress, start=start)
            return self.model.logits(hidden)

        logits = prefill(report)
        # One check per request (prefill ends in a host sync anyway); decode steps are not checked.
        if not bool(torch.isfinite(logits).all()):
            raise nonfinite_logits_error(self.model, prefill)
        self.state.positions.fill_(n)
        first = sample(logits, self.state.sampling, self.state.positions, params.mode)  # [1]
        self.state.tokens.copy_(first)
        if request.want_logprobs:
            self.state.logprob.copy_(logits.log_softmax(-1).gather(-1, first[:, None])[:, 0])
        first.item()  # waits for the prefill
        self.cached_ids, self.angles_len = list(request.prompt_ids), max(angles_len, n)
        stats.prefill_seconds = time.perf_counter() - t0
        stats.prefill_tokens_per_s = new / max(stats.prefill_seconds, 1e-9)

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """float32 logits [T, V] of every position of `token_ids`, in one causal pass (scoring),
        through the same prefill as generation, in a cache of its own."""
        tokens = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        cache, backend = self._new_cache(len(token_ids)), self._backend()
        hidden = self.model.prefill(tokens, cache, self.prefill_chunk, backend=backend, last_only=False)
        return self.model.logits(hidden[0])

    # ---- decode -------------------------------------------------------------------------
    def step(self) -> None:
        """One decode step of the running request: state.tokens -> the next tokens, positions += 1."""
        self._step()

    def prepare_decode(self, params: SamplingParams, want_logprobs: bool) -> None:
        """Set the decode step `step()` runs: a CUDA graph replay on CUDA, the eager step elsewhere.

        The graph is captured once per cache, sampling mode (greedy, sample, or with cuts; the
        values themselves are device tensors) and logprobs setting, before prefill (so capture
        stays out of the decode timing), and stays valid for every later context length: it
        reads the position from a device buffer and the kernel derives its schedule from it, so
        a prefill that starts after a reused prefix needs no recapture. The warm-up runs a real
        step at position 0: its K/V (a reused prefix's first position) are put back after."""
        mode = params.mode
        eager = functools.partial(
            decode_step, self.model, self.cache, self.state, mode, want_logprobs, self.pdl, batch=False
        )
        if not self.use_cuda_graph:
            self._step = eager
            return
        key = (id(self.cache), mode, want_logprobs, self.pdl)
        if self._graph_key != key:
            # dim 3 index 0 holds position 0 (an FP8 cache's V: the whole first block, a superset)
            position0 = {name: t[:, :, :, 0].clone() for name, t in self.cache.tensors().items()}
            self._graph = None
            self.state.positions.zero_()
            self.state.tokens.zero_()
            self._graph, self._graph_key = capture(eager, eager), key
            for name, t in self.cache.tensors().items():
                t[:, :, :, 0] = position0[name]
        self._step = self._graph.replay


def _host_peak_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

"""The generation loop: memory plan, chunked prefill, and a decode step that runs as one CUDA
graph replay per token while the context grows."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from minidecode.kernels.prefill import BLOCK as PREFILL_BLOCK
from minidecode.kernels.prefill import choose_backend
from minidecode.models.llama import Transformer

from .cache import KVCache
from .config import ModelConfig
from .errors import UserError
from .sampling import SamplingParams, sample


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    prefill_tokens_per_s: float = 0.0
    time_to_first_token: float = 0.0  # from the request to the first new token on the host
    new_tokens: int = 0
    decode_seconds: float = 0.0  # first new token to last: prefill excluded
    decode_tokens_per_s: float = 0.0
    peak_memory_bytes: int = 0

    def summary(self) -> str:
        return (
            f"prompt {self.prompt_tokens} tok, prefill {self.prefill_seconds:.2f} s "
            f"({self.prefill_tokens_per_s:,.0f} tok/s), TTFT {self.time_to_first_token:.3f} s | "
            f"{self.new_tokens} new tok, decode {self.decode_tokens_per_s:.1f} tok/s | "
            f"peak memory {self.peak_memory_bytes / 2**30:.2f} GiB"
        )


@dataclass
class MemoryPlan:
    weights_bytes: int
    kv_cache_bytes: int
    activation_bytes: int
    free_bytes: int  # available to this process before the cache and activations are allocated
    device: str

    @property
    def needed_bytes(self) -> int:
        return self.kv_cache_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.free_bytes


def free_memory(device: torch.device) -> int:
    """Bytes a new allocation can still get on `device`."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def activation_bytes(
    cfg: ModelConfig, prompt_len: int, chunk: int, dtype: torch.dtype, device: torch.device
) -> int:
    """Peak temporaries of the layer-major prefill (an estimate with margin): the residual stream
    and the q / attention-output buffer over the whole prompt, one head group's attention output,
    and one chunk's projections and MLP intermediates; one query block's blocked-attention
    temporaries (kernels/prefill.py); plus a decode step's logits."""
    T, c = prompt_len, min(chunk, prompt_len)
    whole_prompt = T * (cfg.hidden_size + cfg.num_heads * cfg.head_dim + cfg.group_size * cfg.head_dim)
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
    return (whole_prompt + c * per_row) * dtype.itemsize + rope + lse + blocked + logits + margin


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


class Engine:
    def __init__(
        self,
        model: Transformer,
        device: torch.device,
        dtype: torch.dtype,
        prefill_chunk: int | None = None,
        use_cuda_graph: bool = True,
    ):
        self.model, self.device, self.dtype = model, device, dtype
        self.config = model.config
        # Query rows per prefill pass: bounds activation memory for very long prompts.
        self.prefill_chunk = prefill_chunk or (8192 if device.type == "cuda" else 2048)
        self.use_cuda_graph = use_cuda_graph and device.type == "cuda"
        self.cache: KVCache | None = None
        self.busy = False  # a generation is in progress
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_key: tuple | None = None
        # One generator for the engine's life: a captured graph is bound to it; re-seeded per request.
        self._generator = torch.Generator(device=device)

    # ---- memory -------------------------------------------------------------------------
    def plan(self, max_context: int, prompt_len: int, batch: int = 1) -> MemoryPlan:
        cfg = self.config
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        kv = KVCache.bytes_needed(
            cfg.num_layers, batch, cfg.num_kv_heads, max_context, cfg.head_dim, self.dtype
        )
        free = free_memory(self.device)
        activations = activation_bytes(cfg, prompt_len, self.prefill_chunk, self.dtype, self.device)
        return MemoryPlan(weights, kv, activations, free, str(self.device))

    def ensure_cache(self, max_context: int, prompt_len: int) -> KVCache:
        """A cache of at least max_context positions, after checking that it and the prefill of a
        prompt_len-token prompt fit in free memory (refusing with what to change if not)."""
        cfg = self.config
        reuse = self.cache is not None and self.cache.fits(1, max_context, self.dtype, self.device)
        if not reuse:  # free a cache that is too small before measuring what is free
            self.cache = self._graph = self._graph_key = None
        plan = self.plan(max_context, prompt_len)
        if reuse:
            plan.kv_cache_bytes = 0  # already allocated
        if not plan.fits:
            per_token = cfg.kv_bytes_per_token(self.dtype.itemsize)
            fit_tokens = max(0, (plan.free_bytes - plan.activation_bytes) // per_token)
            raise UserError(
                f"KV cache for {max_context:,} tokens needs {_gib(plan.kv_cache_bytes)} plus "
                f"{_gib(plan.activation_bytes)} of activations, but only {_gib(plan.free_bytes)} is free on "
                f"{plan.device}; lower the prompt length, max_new_tokens or --max-context "
                f"(about {fit_tokens:,} tokens fit)"
            )
        if not reuse:
            # The decode step's static buffers live as long as the cache: a captured graph uses them.
            self._tokens = torch.zeros(1, dtype=torch.long, device=self.device)  # [B] last / next token
            self._positions = torch.zeros(1, dtype=torch.long, device=self.device)  # [B] next position
            self._logprob = torch.zeros(1, dtype=torch.float32, device=self.device)  # [B]
            self.cache = KVCache(
                cfg.num_layers, 1, cfg.num_kv_heads, max_context, cfg.head_dim, self.dtype, self.device
            )
        return self.cache

    # ---- prefill ------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(
        self, prompt: torch.Tensor, on_progress: Callable[[int, int], None] | None = None
    ) -> torch.Tensor:
        """prompt [1, T] -> float32 logits [1, V] of the last position; fills the cache."""
        T, layers = prompt.shape[1], self.config.num_layers
        backend = choose_backend(self.device, self.config.head_dim, self.config.group_size, self.dtype)
        self.prefill_backend = backend or "default"  # reported by the benchmark
        # Layer-major prefill: progress is whole layers over the whole prompt.
        report = None if on_progress is None else (lambda i: on_progress(T * (i + 1) // layers, T))
        hidden = self.model.prefill(prompt, self.cache, self.prefill_chunk, backend=backend, on_layer=report)
        return self.model.logits(hidden)

    # ---- decode -------------------------------------------------------------------------
    def _decode_step(self) -> None:
        """One token for every sequence, reading and writing only static device buffers:
        tokens [B] (in: last token, out: next token), positions [B] (+= 1), logprob [B]."""
        hidden = self.model.decode(self._tokens, self._positions, self.cache)
        logits = self.model.logits(hidden)  # [B, V] float32
        nxt = sample(logits, self._params, self._generator)  # [B]
        if self._want_logprobs:
            self._logprob.copy_(logits.log_softmax(-1).gather(-1, nxt[:, None])[:, 0])
        self._tokens.copy_(nxt)
        self._positions.add_(1)

    def _prepare_decode(self, params: SamplingParams, want_logprobs: bool) -> Callable[[], None]:
        """The decode step to run: a CUDA graph replay on CUDA, the eager step elsewhere.

        The graph is captured once per cache and sampling setting, before prefill (so capture
        stays out of the decode timing), and stays valid for every later context length: it
        reads the position from a device buffer and the kernel derives its schedule from it.
        Capture runs a real step at position 0, whose K/V the prefill then overwrites."""
        self._params, self._want_logprobs = params, want_logprobs
        if not self.use_cuda_graph:
            return self._decode_step
        key = (id(self.cache), params.temperature, params.top_k, params.top_p, want_logprobs)
        if self._graph_key != key:
            self._graph = None
            self._positions.zero_()
            self._tokens.zero_()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up: kernel workspaces, cuBLAS handles, compilation
                self._decode_step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            if not params.greedy:
                graph.register_generator_state(self._generator)
            self._positions.zero_()
            with torch.cuda.graph(graph):
                self._decode_step()
            self._graph, self._graph_key = graph, key
        return self._graph.replay

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        params: SamplingParams,
        eos_ids: set[int],
        max_context: int,
        stats: GenerationStats,
        on_progress: Callable[[int, int], None] | None = None,
        want_logprobs: bool = False,
        t_request: float | None = None,
    ) -> Iterator[tuple[int, float | None]]:
        """Yield (token id, log-prob or None) for each new token; stop at eos or max_new_tokens.
        `stats` is filled in as it goes (complete once the iterator ends or is closed);
        t_request (a perf_counter reading) is when the request arrived, for time to first token."""
        t_request = time.perf_counter() if t_request is None else t_request
        # One request at a time: two interleaved generations would share the cache and buffers.
        self.check_idle()
        self.busy = True
        cuda = self.device.type == "cuda"
        produced, t_first = 0, None
        try:
            token, logprob, step = self._start(
                prompt_ids, params, max_context, stats, on_progress, want_logprobs
            )
            t_first = time.perf_counter()
            stats.time_to_first_token = t_first - t_request
            # Each step's token is copied to pinned host memory and the next step is launched
            # before the host waits for that copy: the GPU never idles while the host streams text.
            host_tokens = torch.empty(1, dtype=torch.long, pin_memory=cuda)
            host_logprob = torch.empty(1, dtype=torch.float32, pin_memory=cuda)
            copied = torch.cuda.Event() if cuda else None
            stats.new_tokens = produced = 1
            yield token, logprob
            if token in eos_ids or max_new_tokens <= 1:
                return
            step()
            while True:
                host_tokens.copy_(self._tokens, non_blocking=True)
                if want_logprobs:
                    host_logprob.copy_(self._logprob, non_blocking=True)
                if copied is not None:
                    copied.record()
                if produced + 1 < max_new_tokens:
                    step()  # run the next step while this token is handed out
                if copied is not None:
                    copied.synchronize()
                token = int(host_tokens[0])
                stats.new_tokens = produced = produced + 1
                yield token, (float(host_logprob[0]) if want_logprobs else None)
                if token in eos_ids or produced >= max_new_tokens:
                    return
        finally:
            self.busy = False
            if t_first is not None:
                stats.decode_seconds = time.perf_counter() - t_first
                steps = produced - 1
                stats.decode_tokens_per_s = steps / stats.decode_seconds if steps else 0.0
                stats.peak_memory_bytes = (
                    torch.cuda.max_memory_allocated(self.device) if cuda else _host_peak_bytes()
                )

    def release(self) -> None:
        """Free the KV cache and the captured decode graph; the next request allocates them again."""
        self.check_idle()
        self.cache = self._graph = self._graph_key = None

    def check_idle(self) -> None:
        if self.busy:
            raise UserError("this model is still generating: finish or close the previous stream first")

    def _start(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        max_context: int,
        stats: GenerationStats,
        on_progress: Callable[[int, int], None] | None,
        want_logprobs: bool,
    ) -> tuple[int, float | None, Callable[[], None]]:
        """Cache, decode step and prefill for a request: -> first token, its log-prob, the step."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.ensure_cache(max_context, len(prompt_ids))
        step = self._prepare_decode(params, want_logprobs)  # may capture a graph: draws random numbers
        if params.seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(params.seed)
        stats.prompt_tokens = len(prompt_ids)
        prompt = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        t0 = time.perf_counter()
        logits = self.prefill(prompt, on_progress)
        first = sample(logits, params, self._generator)  # [1]
        self._tokens.copy_(first)
        self._positions.fill_(len(prompt_ids))
        if want_logprobs:
            self._logprob.copy_(logits.log_softmax(-1).gather(-1, first[:, None])[:, 0])
        token = int(first.item())  # waits for the prefill
        stats.prefill_seconds = time.perf_counter() - t0
        stats.prefill_tokens_per_s = len(prompt_ids) / max(stats.prefill_seconds, 1e-9)
        return token, (float(self._logprob[0]) if want_logprobs else None), step


def _host_peak_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def check_context(
    max_context: int, max_positions: int, sliding_window: int | None, allow_extrapolation: bool
) -> None:
    if max_context > max_positions and not allow_extrapolation:
        raise UserError(
            f"prompt + max_new_tokens needs {max_context:,} positions but the model was trained for "
            f"{max_positions:,}; shorten the request or opt in with allow_extrapolation "
            f"(--allow-extrapolation)"
        )
    if sliding_window is not None and max_context > sliding_window:
        raise UserError(
            f"this model uses sliding-window attention ({sliding_window:,} tokens), which minidecode does "
            f"not implement; keep prompt + max_new_tokens within {sliding_window:,} tokens"
        )

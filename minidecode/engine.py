"""The generation loop: memory plan, chunked prefill, and a decode step that runs as one CUDA
graph replay per token while the context grows."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

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


def activation_bytes(cfg: ModelConfig, prefill_chunk: int, dtype: torch.dtype, device: torch.device) -> int:
    """Peak temporaries of one prefill chunk plus a decode step's logits (an estimate with
    margin: hidden states, q/k/v, attention output, the MLP's three intermediates)."""
    per_row = (
        6 * cfg.hidden_size
        + 3 * cfg.intermediate_size
        + 2 * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    )
    rope = prefill_chunk * cfg.head_dim * 8 * 2  # float64 angles
    logits = 4 * cfg.vocab_size * 4
    margin = 512 * 2**20 if device.type == "cuda" else 64 * 2**20  # library workspaces
    return prefill_chunk * per_row * dtype.itemsize + rope + logits + margin


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
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_key: tuple | None = None

    # ---- memory -------------------------------------------------------------------------
    def plan(self, max_context: int, batch: int = 1) -> MemoryPlan:
        cfg = self.config
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        kv = KVCache.bytes_needed(
            cfg.num_layers, batch, cfg.num_kv_heads, max_context, cfg.head_dim, self.dtype
        )
        free = free_memory(self.device)
        if self.cache is not None:  # the current cache will be freed first
            free += self.cache.k.numel() * self.cache.k.element_size() * 2
        activations = activation_bytes(cfg, self.prefill_chunk, self.dtype, self.device)
        return MemoryPlan(weights, kv, activations, free, str(self.device))

    def ensure_cache(self, max_context: int) -> KVCache:
        cfg = self.config
        if self.cache is not None and self.cache.fits(1, max_context, self.dtype, self.device):
            return self.cache
        plan = self.plan(max_context)
        if not plan.fits:
            per_token = cfg.kv_bytes_per_token(self.dtype.itemsize)
            fit_tokens = max(0, (plan.free_bytes - plan.activation_bytes) // per_token)
            raise UserError(
                f"KV cache for {max_context:,} tokens needs {_gib(plan.kv_cache_bytes)} plus "
                f"{_gib(plan.activation_bytes)} of activations, but only {_gib(plan.free_bytes)} is free on "
                f"{plan.device}; lower the prompt length, max_new_tokens or --max-context "
                f"(about {fit_tokens:,} tokens fit)"
            )
        self.cache = self._graph = self._graph_key = None
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
        T = prompt.shape[1]
        hidden = None
        for start in range(0, T, self.prefill_chunk):
            chunk = prompt[:, start : start + self.prefill_chunk]
            hidden = self.model.prefill(chunk, start, self.cache, rope_len=T)[:, -1]
            if on_progress is not None:
                on_progress(start + chunk.shape[1], T)
        return self.model.logits(hidden)

    # ---- decode -------------------------------------------------------------------------
    def _decode_step(self) -> None:
        """One token for every sequence, reading and writing only static device buffers:
        tokens [B] (in: last token, out: next token), positions [B] (+= 1), logprob [B]."""
        hidden = self.model.decode(self._tokens, self._positions, self.cache)
        logits = self.model.logits(hidden)  # [B, V] float32
        nxt = sample(logits, self._params, self._generator)
        if self._want_logprobs:
            self._logprob.copy_(logits.log_softmax(-1).gather(-1, nxt[:, None])[:, 0])
        self._tokens.copy_(nxt)
        self._positions.add_(1)

    def _step_fn(self) -> Callable[[], None]:
        """The step to run: a CUDA graph replay on CUDA (captured once per cache and sampling
        setting, valid for every later context length), the eager step elsewhere."""
        if not self.use_cuda_graph:
            return self._decode_step
        key = (
            id(self.cache),
            self._params.temperature,
            self._params.top_k,
            self._params.top_p,
            self._want_logprobs,
            self._generator is not None,
        )
        if self._graph_key != key:
            self._graph = None
            saved = (self._tokens.clone(), self._positions.clone())
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up: kernel workspaces, cuBLAS handles
                self._decode_step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            if self._generator is not None:
                graph.register_generator_state(self._generator)
            with torch.cuda.graph(graph):
                self._decode_step()
            self._tokens.copy_(saved[0])  # warm-up and capture advanced the buffers: restore
            self._positions.copy_(saved[1])
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
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self.ensure_cache(max_context)
        self._params, self._want_logprobs = params, want_logprobs
        self._generator = None
        if not params.greedy:
            self._generator = torch.Generator(device=self.device)
            if params.seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(params.seed)
        stats.prompt_tokens = len(prompt_ids)

        prompt = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        t0 = time.perf_counter()
        logits = self.prefill(prompt, on_progress)
        first = sample(logits, params, self._generator)  # [1]
        first_logprob = logits.log_softmax(-1).gather(-1, first[:, None])[:, 0] if want_logprobs else None
        token = int(first.item())  # waits for the prefill
        t_first = time.perf_counter()
        stats.prefill_seconds = t_first - t0
        stats.prefill_tokens_per_s = len(prompt_ids) / max(stats.prefill_seconds, 1e-9)
        stats.time_to_first_token = t_first - t_request

        self._tokens = first.clone()
        self._positions = torch.full((1,), len(prompt_ids), dtype=torch.long, device=self.device)
        self._logprob = torch.zeros(1, dtype=torch.float32, device=self.device)
        # Each step's output token is copied to pinned host memory and the next step is launched
        # before the host waits for that copy: the GPU never idles while the host streams text.
        host_tokens = torch.empty(1, dtype=torch.long, pin_memory=cuda)
        host_logprob = torch.empty(1, dtype=torch.float32, pin_memory=cuda)
        copied = torch.cuda.Event() if cuda else None
        produced = 0
        try:
            stats.new_tokens = produced = 1
            yield token, (float(first_logprob.item()) if want_logprobs else None)
            if token in eos_ids or max_new_tokens <= 1:
                return
            step = self._step_fn()
            step()
            while True:
                host_tokens.copy_(self._tokens, non_blocking=True)
                if want_logprobs:
                    host_logprob.copy_(self._logprob, non_blocking=True)
                if copied is not None:
                    copied.record()
                if produced + 1 < max_new_tokens:
                    step()  # speculatively run the next step while this token is handed out
                if copied is not None:
                    copied.synchronize()
                token = int(host_tokens[0])
                produced += 1
                stats.new_tokens = produced
                stats.decode_seconds = time.perf_counter() - t_first
                yield token, (float(host_logprob[0]) if want_logprobs else None)
                if token in eos_ids or produced >= max_new_tokens:
                    return
        finally:
            stats.new_tokens = produced
            stats.decode_seconds = time.perf_counter() - t_first
            steps = produced - 1
            stats.decode_tokens_per_s = (
                steps / stats.decode_seconds if steps and stats.decode_seconds else 0.0
            )
            stats.peak_memory_bytes = (
                torch.cuda.max_memory_allocated(self.device) if cuda else _host_peak_bytes()
            )


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

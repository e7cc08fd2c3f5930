"""The one memory planner: what a device can still give, what a context needs (KV cache and
prefill temporaries), how many tokens fit, and the message that refuses what does not. The
engine sizes its cache with it, and the API, the CLI (`info`, `--prompt-tokens`) and the bench
refuse with it."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from minidecode.kernels.prefill import BLOCK as PREFILL_BLOCK
from minidecode.models.cache import FP8, KVCache
from minidecode.models.config import ModelConfig
from minidecode.models.temporaries import chunk_row_elements, rope_bytes

from .cache import kv_dtype_name

# Per decode row: the step's [B, vocab] float32 logits and the sampling temporaries (sort, softmax,
# noise: about 8 vocab-sized float32 / int64 tensors at most).
SAMPLING_BYTES_PER_ROW_AND_TOKEN = 32
# Per decode row, once a request uses a logits processor (sampling.ProcessorRows): the bias
# (float32), the counts (int32) and two bool masks, 10 bytes, plus the processed logits' float32
# copy in the step.
PROCESSOR_BYTES_PER_ROW_AND_TOKEN = 14


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
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def default_prefill_chunk(device: torch.device) -> int:
    """Query rows per prefill pass: bounds activation memory for very long prompts."""
    return 8192 if device.type == "cuda" else 2048


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
    and one chunk's projections and MLP intermediates, which an attention call over several KV
    heads reuses (they are not alive then: prefill_attention_kv_heads keeps it within them); one
    chunk's float64 RoPE angles, which also bound the float32 cos/sin a prompt of up to two chunks
    keeps for every layer; one query block's blocked-attention temporaries (kernels/prefill.py);
    plus a decode step's logits. An FP8 cache (kv_dtype) adds one layer's unquantized K and V over
    the prompt (the staging buffer) and one chunk's float32 quantization temporaries.
    rank_positions: the cache positions of a context-parallel rank, if fewer than the prompt's: it
    prefills only its share of the rows (at most rank_positions), and a layer's attention gathers
    the layer's K and V of the whole prompt, every KV head (models/parallel.py's
    ContextParallelAttention): the K in position order (the prompt) kept while the V gathers, its
    own part padded to the longest share, every rank's parts (about the prompt plus a share) and
    their copy in rank order (as many), before it too is put in position order."""
    received = 0
    if rank_positions is not None and rank_positions < prompt_len:
        received = 3 * cfg.num_kv_heads * cfg.head_dim * (prompt_len + rank_positions)
        prompt_len = rank_positions
    T, c = prompt_len, min(chunk, prompt_len)
    whole_prompt = T * (cfg.hidden_size + cfg.num_heads * cfg.head_dim + cfg.group_size * cfg.head_dim)
    if kv_dtype == FP8:
        whole_prompt += T * 2 * cfg.num_kv_heads * cfg.head_dim
        whole_prompt += c * cfg.num_kv_heads * cfg.head_dim * 8 // dtype.itemsize  # float32 copies
    rope = rope_bytes(cfg, c)
    lse = T * cfg.group_size * 4  # SDPA's float32 log-sum-exp
    blocked = min(T, PREFILL_BLOCK) * cfg.group_size * cfg.head_dim * (2 * 4 + 2 * dtype.itemsize)
    logits = 4 * cfg.vocab_size * 4
    margin = 512 * 2**20 if device.type == "cuda" else 64 * 2**20  # library workspaces
    chunk_rows = c * chunk_row_elements(cfg)
    return (whole_prompt + chunk_rows + received) * dtype.itemsize + rope + lse + blocked + logits + margin


@dataclass
class MemoryPlan:
    """What a context of `positions` cache positions (this rank's) and a prompt need beside the
    weights, against what the device can still give."""

    weights_bytes: int
    kv_cache_bytes: int
    activation_bytes: int
    free_bytes: int  # available before the cache and activations are allocated
    device: str
    kv_cache_dtype: str  # kv_dtype_name of the cache the plan is for
    kv_bytes_per_token: int

    @property
    def needed_bytes(self) -> int:
        return self.kv_cache_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.free_bytes


@dataclass
class Planner:
    """The memory arithmetic of one model on one device (of one rank: `cfg` is the rank's)."""

    cfg: ModelConfig
    dtype: torch.dtype
    kv_dtype: torch.dtype
    device: torch.device
    prefill_chunk: int
    weights_bytes: int = 0
    rows: int = 1  # decode rows whose sampling temporaries are reserved (the engine's max_batch)

    @property
    def kv_bytes_per_token(self) -> int:
        """Cache bytes of one position, all layers (FP8: e4m3 rows plus their bfloat16 scales)."""
        cfg = self.cfg
        return KVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.kv_dtype)

    def kv_bytes(self, positions: int) -> int:
        cfg = self.cfg
        return KVCache.bytes_needed(cfg.num_layers, cfg.num_kv_heads, positions, cfg.head_dim, self.kv_dtype)

    def activations(self, prompt_len: int, rank_positions: int | None = None) -> int:
        """A prefill's temporaries plus the decode rows' sampling and logits-processor state (kept
        free for them: a request may ask for a processor at any time)."""
        act = activation_bytes(
            self.cfg, prompt_len, self.prefill_chunk, self.dtype, self.device, self.kv_dtype, rank_positions
        )
        per_token = SAMPLING_BYTES_PER_ROW_AND_TOKEN + PROCESSOR_BYTES_PER_ROW_AND_TOKEN
        return act + self.rows * self.cfg.vocab_size * per_token

    def plan(self, positions: int, prompt_len: int, free: int | None = None) -> MemoryPlan:
        return MemoryPlan(
            self.weights_bytes,
            self.kv_bytes(positions),
            self.activations(prompt_len, positions if positions < prompt_len else None),
            free_memory(self.device) if free is None else free,
            str(self.device),
            kv_dtype_name(self.kv_dtype),
            self.kv_bytes_per_token,
        )

    def fit_tokens(self, free: int) -> int:
        """The longest context (prompt of that length) whose cache and prefill fit in `free` bytes."""
        low, high = 0, max(1, free // max(self.kv_bytes_per_token, 1))
        while low < high:  # activations grow with the prompt: the largest n whose plan fits
            mid = (low + high + 1) // 2
            if self.plan(mid, mid, free).fits:
                low = mid
            else:
                high = mid - 1
        return low

    def refusal(self, plan: MemoryPlan, context: int, what: str = "a context") -> str:
        """The one-line refusal of a plan that does not fit, saying how much would."""
        return (
            f"{what} of {context:,} tokens needs {gib(plan.kv_cache_bytes)} of KV cache plus "
            f"{gib(plan.activation_bytes)} of activations, but only {gib(plan.free_bytes)} is free on "
            f"{plan.device} beside the weights ({gib(plan.weights_bytes)}); about "
            f"{self.fit_tokens(plan.free_bytes):,} tokens fit with a {plan.kv_cache_dtype} cache: lower the "
            "prompt length, max_new_tokens or max_context"
        )

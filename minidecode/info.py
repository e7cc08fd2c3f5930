"""What runs where: the device, dtypes and synthetic shapes a model is loaded with, and what
`minidecode info` prints (architecture, size and the memory plan, without loading weights)."""

from __future__ import annotations

from pathlib import Path

import torch

from minidecode.models.cache import FP8
from minidecode.models.config import ModelConfig

from .cache import kv_dtype_name
from .errors import UserError
from .loading import DEFAULT_MODEL, read_config, resolve_model_dir
from .memory import Planner, default_prefill_chunk, gib
from .request import DEFAULT_MAX_BATCH
from .validate import DEVICES, DTYPE_NAMES, check_device_name, check_dtype_name, check_kv_cache_dtype_name

SYNTHETIC = "synthetic:"
DTYPES = {name: getattr(torch, dtype) for name, dtype in DTYPE_NAMES.items()}  # name -> dtype


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, str):
        check_device_name(device)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UserError(f"unknown device {device!r} (use {DEVICES})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError("device 'cuda' was asked for but no CUDA GPU is available")
    if dev.type not in ("cpu", "cuda"):
        raise UserError(f"unsupported device {device!r} (use {DEVICES})")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:  # bf16 where it is fast, float32 on the CPU (where bf16 matmuls are slow)
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise UserError(f"unsupported dtype {dtype}")
        return dtype
    check_dtype_name(dtype)
    return DTYPES[dtype]


def resolve_kv_cache_dtype(kv_cache_dtype: str, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """`auto` -> the model's dtype; `fp8` -> float8_e4m3fn, which a CUDA GPU must be able to
    convert (compute capability 8.9+: Ada, Hopper and later)."""
    if check_kv_cache_dtype_name(kv_cache_dtype) == "auto":
        return dtype
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise UserError(
                f"an FP8 KV cache needs a GPU with FP8 conversion (compute capability 8.9 or newer); "
                f"{torch.cuda.get_device_name(device)} has {major}.{minor}: use --kv-cache-dtype auto"
            )
    return FP8


def synthetic_config(name: str) -> ModelConfig:
    from minidecode.models.presets import PRESETS, preset_config

    preset = name.removeprefix(SYNTHETIC)
    if preset not in PRESETS:
        raise UserError(f"unknown synthetic model {preset!r}; known: {', '.join(PRESETS)}")
    return preset_config(preset)


def describe(
    model: str | Path | None,
    context: int | None = None,
    dtype: str | None = None,
    device: str | None = None,
    prefill_chunk: int | None = None,
    kv_cache_dtype: str = "auto",
    tp: int = 1,
    cp: int = 1,
    quantization: str | None = None,
) -> str:
    """What `minidecode info` prints: architecture, size, context and a memory plan (no weights
    loaded); with tp x cp > 1, the plan of each GPU (rank 0's: every rank holds as much)."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    kv_dt = resolve_kv_cache_dtype(kv_cache_dtype, dev, dt)
    if model is not None and str(model).startswith(SYNTHETIC):
        cfg, source = synthetic_config(str(model)), "random weights (synthetic)"
    else:
        model_dir = resolve_model_dir(DEFAULT_MODEL if model is None else model)
        cfg, source = read_config(model_dir), str(model_dir)
    context = cfg.max_position_embeddings if context is None else context
    if context < 1:
        raise UserError(f"context must be >= 1, got {context}")
    from .loading import weight_plan

    weights, described = weight_plan(cfg, dt, quantization)  # FP8 layers at 1 byte a weight + scales
    rank_cfg, positions, parallel, plan_weights = cfg, context, None, weights
    if (tp, cp) != (1, 1):
        from minidecode.models.config import ConfigError
        from minidecode.models.sharding import rank_config, rank_positions, shard_plan

        try:
            shard = shard_plan(cfg, tp, 0)
        except ConfigError as e:
            raise UserError(str(e)) from None
        rank_cfg, plan_weights = rank_config(cfg, shard), weight_plan(cfg, dt, quantization, tp)[0]
        positions = rank_positions(context, cp)
        parallel = (
            f"parallel     tp {tp} x cp {cp} = {tp * cp} GPUs (torchrun); each GPU holds "
            f"{rank_cfg.num_heads} q / {rank_cfg.num_kv_heads} kv heads, MLP {rank_cfg.intermediate_size}, "
            f"{'the whole vocabulary' if tp == 1 else f'{shard.vocab_rows:,} vocabulary rows'} "
            f"and {positions:,} cache positions"
        )
    chunk = prefill_chunk or default_prefill_chunk(dev)
    planner = Planner(rank_cfg, dt, kv_dt, dev, chunk, plan_weights, rows=DEFAULT_MAX_BATCH)  # as LLM()'s
    plan = planner.plan(positions, context)
    kv, act, free = plan.kv_cache_bytes, plan.activation_bytes, plan.free_bytes
    kv_per_token = planner.kv_bytes_per_token
    rope = cfg.rope.rope_type + (f" x{cfg.rope.factor:g}" if cfg.rope.factor else "")
    lines = [
        f"model        {model or 'stdlib-tiny (shipped)'}  [{source}]",
        f"architecture {cfg.model_type}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"MLP {cfg.intermediate_size}, heads {cfg.num_heads} q / {cfg.num_kv_heads} kv x {cfg.head_dim}",
        f"parameters   {cfg.num_parameters() / 1e9:.3f} B ({gib(weights)}: {described})",
        f"vocabulary   {cfg.vocab_size:,}; tied embeddings: {cfg.tie_word_embeddings}",
        f"context      {cfg.max_position_embeddings:,} positions; RoPE {rope}, theta {cfg.rope.theta:g}"
        + (f"; sliding window {cfg.sliding_window:,}" if cfg.sliding_window else ""),
        *([parallel] if parallel else []),
        f"memory plan  at {context:,} tokens on {dev}{' (per GPU)' if parallel else ''}: "
        f"weights {gib(plan_weights)} + KV cache {gib(kv)} "
        f"in {kv_dtype_name(kv_dt)} ({kv_per_token / 1024:g} KiB/token) + activations {gib(act)} "
        f"= {gib(plan_weights + kv + act)}; free now {gib(free)} -> "
        + ("fits" if plan_weights + kv + act <= free else "DOES NOT FIT"),
    ]
    if cp > 1:  # measured: bench/results/distributed-2gpu-h200.md
        lines.append(
            "note         context parallel pays at long contexts: each step adds a merge of the ranks' "
            "partial attention, so it beats one GPU where reading the cache dominates the step (2 x H200, "
            "Llama-3-8B, FP8 cache: 1.02x one GPU at 32k, 1.15x at 128k, 1.52x at 512k); below that, one "
            "GPU or --tp"
        )
    if context > cfg.max_position_embeddings:
        lines.append(
            f"note         {context:,} tokens exceed the {cfg.max_position_embeddings:,} positions the model "
            "was trained for: generating that far extrapolates (--allow-extrapolation)"
        )
    return "\n".join(lines)

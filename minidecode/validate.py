"""Checks of the runtime's settings that need no model and no torch (device, dtypes, process
counts, the tokenizer against the model): the CLI runs them before the model loads, so a typo
costs milliseconds, not a load. A request's own values are checked by request.py."""

from __future__ import annotations

import re
from typing import Any

from .errors import UserError
from .request import check_int

DTYPE_NAMES = ("float32", "fp32", "float16", "fp16", "bfloat16", "bf16")
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the model's dtype; fp8: e4m3 with per-row scales
_DEVICE = re.compile(r"(cpu|cuda)(:\d+)?")


def check_device_name(device: str | None) -> None:
    if device is not None and not _DEVICE.fullmatch(device):
        raise UserError(f"unknown device {device!r} (use cpu, cuda or cuda:N)")


def check_dtype_name(dtype: str | None) -> None:
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise UserError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_NAMES)}")


def check_kv_cache_dtype_name(kv_cache_dtype: Any) -> str:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise UserError(f"unknown KV cache dtype {kv_cache_dtype!r}; use one of {', '.join(KV_CACHE_DTYPES)}")
    return kv_cache_dtype


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise UserError(f"unknown {name} {value!r}; use one of {', '.join(choices)}")
    return value


def check_vocab(tokenizer_vocab: int, model_vocab: int) -> None:
    """A tokenizer id beyond the embedding would fail as an index error mid-generation."""
    if tokenizer_vocab > model_vocab:
        raise UserError(
            f"the tokenizer has {tokenizer_vocab:,} tokens but the model's vocab_size is {model_vocab:,}: "
            "tokenizer.json does not belong to this checkpoint"
        )


def check_parallel(tp: Any, cp: Any, world_size: int | None) -> int:
    """tp x cp processes, one per GPU, launched by torchrun (world_size: its WORLD_SIZE, None when
    not under torchrun) -> the number of processes. Every rank runs this check on the same
    values, so every rank refuses alike."""
    tp, cp = check_int("tp", tp, 1), check_int("cp", cp, 1)
    needed = tp * cp
    if world_size is None and needed > 1:
        raise UserError(
            f"--tp {tp} --cp {cp} runs {needed} processes (one per GPU): launch it with "
            f"`torchrun --nproc-per-node {needed} -m minidecode ...` (or the Python API inside a "
            "torchrun script); WORLD_SIZE is not set"
        )
    if world_size is not None and world_size != needed:
        raise UserError(
            f"torchrun started {world_size} processes but --tp {tp} x --cp {cp} needs {needed}: "
            f"give --nproc-per-node {needed}, or --tp / --cp whose product is {world_size}"
        )
    return needed

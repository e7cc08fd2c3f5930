"""Checks of the runtime's settings that need no model and no torch (device, dtypes, process
counts, the tokenizer against the model): the CLI runs them before the model loads, so a typo
costs milliseconds, not a load. A request's own values are checked by request.py."""

from __future__ import annotations

import re
from typing import Any

from .errors import UserError
from .request import check_int

# The one list of each choice (a tuple's first is the default); the CLI's options, `info` and
# the runtime's checks import them from here. A kernel's own (PREFILL_ATTENTION) is in
# kernels/choices.py, below the runtime.
DEVICES = "cpu, cuda or cuda:N"
DTYPE_NAMES = {  # name -> the torch dtype's name, with short aliases
    **dict.fromkeys(("float32", "fp32"), "float32"),
    **dict.fromkeys(("float16", "fp16"), "float16"),
    **dict.fromkeys(("bfloat16", "bf16"), "bfloat16"),
}
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the model's dtype; fp8: e4m3 with per-row scales
QUANTIZATIONS = ("none", "fp8")  # none: the checkpoint's weights; fp8: e4m3 per output channel on load
_DEVICE = re.compile(r"(cpu|cuda)(:\d+)?")


def check_choice(name: str, value: Any, choices: tuple[str, ...] | dict[str, Any]) -> str:
    """The one check of a setting against its list of choices: `value`, or a UserError naming
    `name` (the caller's spelling: "--quantization" on the command line, "quantization" in the API)."""
    if not isinstance(value, str) or value not in choices:
        raise UserError(f"unknown {name} {value!r}; use one of {', '.join(choices)}")
    return value


def check_device_name(device: str | None) -> None:
    if device is not None and not _DEVICE.fullmatch(device):
        raise UserError(f"unknown device {device!r} (use {DEVICES})")


def check_dtype_name(dtype: str | None) -> None:
    if dtype is not None:
        check_choice("dtype", dtype, DTYPE_NAMES)


def check_kv_cache_dtype_name(kv_cache_dtype: Any) -> str:
    return check_choice("KV cache dtype", kv_cache_dtype, KV_CACHE_DTYPES)


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

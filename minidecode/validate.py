"""Checks of a request's values that need no model and no torch: the API runs them before a
generation starts, the CLI before the model loads (so a typo costs milliseconds, not a load)."""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Sequence
from typing import Any

from .errors import UserError

DTYPE_NAMES = ("float32", "fp32", "float16", "fp16", "bfloat16", "bf16")
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the model's dtype; fp8: e4m3 with per-row scales
_DEVICE = re.compile(r"(cpu|cuda)(:\d+)?")


def check_int(name: str, value: Any, minimum: int) -> int:
    """An integer >= minimum: rejects 2.5 (which would round), '5' and True (not numbers of tokens)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise UserError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise UserError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_sampling(
    temperature: float | None, top_k: int | None, top_p: float | None, seed: int | None
) -> None:
    """The user-given sampling values (None: the checkpoint's default, checked at load)."""
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise UserError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if temperature is not None and (not math.isfinite(temperature) or temperature < 0):
        raise UserError(f"temperature must be a finite number >= 0, got {temperature}")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
            raise UserError(f"top_k must be an integer, got {top_k!r} ({type(top_k).__name__})")
        if top_k < 0:
            raise UserError(f"top_k must be >= 0 (0 turns it off), got {top_k}")
    if top_p is not None and not (0 < top_p <= 1):
        raise UserError(f"top_p must be in (0, 1], got {top_p}")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise UserError(f"seed must be an integer, got {seed!r} ({type(seed).__name__})")
        if not 0 <= seed < 2**63:
            raise UserError(f"seed must be in [0, 2**63), got {seed}")


def check_text(text: Any, what: str = "the prompt") -> str:
    """A str that encodes as UTF-8: text read with surrogateescape (command-line arguments, a
    stdin in the C locale) carries undecodable bytes as lone surrogates, which tokenizers refuse."""
    if not isinstance(text, str):
        raise UserError(f"{what} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        byte = f" (byte 0x{ord(bad) - 0xDC00:02x})" if 0xDC80 <= ord(bad) <= 0xDCFF else ""
        raise UserError(f"{what} is not valid UTF-8 text: bad character at index {e.start}{byte}") from None
    return text


def check_token_ids(token_ids: Any, vocab_size: int) -> list[int]:
    """A sequence of integer ids in [0, vocab_size); a str is a sequence too, so it is named."""
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise UserError(f"token_ids must be a list of integers, got {type(token_ids).__name__}")
    wrong = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
    if wrong:
        raise UserError(f"token_ids must be integers, got {wrong[0]!r} ({type(wrong[0]).__name__})")
    ids = [int(t) for t in token_ids]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise UserError(f"token ids out of range [0, {vocab_size}): {bad[:5]}")
    return ids


def check_stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not isinstance(s, str) for s in stops):
        raise UserError("stop must be a string or a list of strings")
    if any(not s for s in stops):
        raise UserError("stop strings must be non-empty")
    return [check_text(s, "a stop string") for s in stops]


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


def check_vocab(tokenizer_vocab: int, model_vocab: int) -> None:
    """A tokenizer id beyond the embedding would fail as an index error mid-generation."""
    if tokenizer_vocab > model_vocab:
        raise UserError(
            f"the tokenizer has {tokenizer_vocab:,} tokens but the model's vocab_size is {model_vocab:,}: "
            "tokenizer.json does not belong to this checkpoint"
        )


def check_request(
    max_new_tokens: Any, temperature: Any, top_k: Any, top_p: Any, seed: Any, stop: Any
) -> list[str]:
    """Everything of a request but the prompt: -> the stop strings as a list."""
    check_int("max_new_tokens", max_new_tokens, 1)
    check_sampling(temperature, top_k, top_p, seed)
    return check_stops(stop)


def check_parallel(tp: Any, cp: Any, world_size: int | None) -> int:
    """tp x cp processes, one per GPU, launched by torchrun (world_size: its WORLD_SIZE, None when
    not under torchrun) -> the number of processes. Every rank runs this check on the same
    values, so every rank refuses alike."""
    tp, cp = check_int("tp", tp, 1), check_int("cp", cp, 1)
    needed = tp * cp
    if world_size is None and needed > 1:
        raise UserError(
            f"--tp {tp} --cp {cp} runs {needed} processes (one per GPU): launch it with "
            f"`torchrun --nproc-per-node {needed} -m minidecode_cli.cli ...` (or the Python API inside a "
            "torchrun script); WORLD_SIZE is not set"
        )
    if world_size is not None and world_size != needed:
        raise UserError(
            f"torchrun started {world_size} processes but --tp {tp} x --cp {cp} needs {needed}: "
            f"give --nproc-per-node {needed}, or --tp / --cp whose product is {world_size}"
        )
    return needed

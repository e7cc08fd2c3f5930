"""One spelling of a request: what to continue (a prompt, chat messages or token ids) and how
(sampling, limits, stop strings, log-probs, seed). The CLI, the Python API, batch JSONL lines and
the server all build a `Request`, and `Request.check` is the one place its values are checked:
each field takes exactly its type (a JSON `"false"` is not a boolean), with one message per
mistake. Checks that need the model (token ids against the vocabulary, the context against its
positions and the device's memory) happen when the runtime resolves the request."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

from .errors import UserError

DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_MAX_BATCH = 32  # sequences decoded at once (the engine's rows)
MAX_SEED = 2**63


@dataclass
class Request:
    """None means "not set": the batch's or the checkpoint's default, else the runtime's."""

    prompt: str | None = None
    messages: list[dict[str, str]] | None = None  # chat turns, through the checkpoint's template
    token_ids: list[int] | None = None
    max_new_tokens: int | None = None  # default DEFAULT_MAX_NEW_TOKENS
    temperature: float | None = None  # 0: greedy; default: the checkpoint's generation_config
    top_k: int | None = None  # 0: off
    top_p: float | None = None  # 1: off
    seed: int | None = None  # default: a fresh random seed
    stop: str | list[str] | None = None  # generation ends before the first of these texts
    max_context: int | None = None  # cache positions to reserve (default prompt + max_new_tokens)
    allow_extrapolation: bool | None = None  # contexts past the model's trained positions
    logprobs: bool | None = None  # log p of each new token
    ignore_eos: bool | None = None  # run to max_new_tokens past the end-of-sequence token
    reuse_prefix: bool | None = None  # reuse a cached prefix's K/V (default on)

    @classmethod
    def from_dict(cls, fields: Any, what: str = "request") -> Request:
        """From a JSON object (a batch line); an unknown key is refused, naming the known ones."""
        if not isinstance(fields, dict):
            raise UserError(f"a {what} must be a JSON object, got {type(fields).__name__}")
        unknown = sorted(set(fields) - set(SETTINGS) - set(PROMPTS))
        if unknown:
            known = ", ".join([*PROMPTS, *SETTINGS])
            raise UserError(f"unknown {what} field {', '.join(map(repr, unknown))}; known: {known}")
        return cls(**fields)

    def with_defaults(self, defaults: Request | None) -> Request:
        """This request with its unset settings taken from `defaults` (the prompt stays its own)."""
        if defaults is None:
            return self
        given = {name: getattr(defaults, name) for name in SETTINGS if getattr(self, name) is None}
        return dataclasses.replace(self, **{k: v for k, v in given.items() if v is not None})

    def check(self, need_prompt: bool = True) -> Request:
        """Check every field's type and range (UserError names the first mistake); -> self."""
        given = [name for name in PROMPTS if getattr(self, name) is not None]
        if need_prompt and len(given) != 1:
            raise UserError(
                "give exactly one of prompt, messages or token_ids"
                + (f" (got {', '.join(given)})" if given else "")
            )
        if not need_prompt and given:
            raise UserError(f"{given[0]} cannot be a default setting: give it with each prompt")
        if self.prompt is not None:
            check_text(self.prompt)
            if not self.prompt:
                raise UserError("the prompt is empty")
        if self.messages is not None:
            check_messages(self.messages)
        if self.token_ids is not None:
            check_token_id_list(self.token_ids)
        for name in ("max_new_tokens", "max_context"):
            if (value := getattr(self, name)) is not None:
                check_int(name, value, 1)
        check_sampling(self.temperature, self.top_k, self.top_p, self.seed)
        check_stops(self.stop)
        for name in ("allow_extrapolation", "logprobs", "ignore_eos", "reuse_prefix"):
            if (value := getattr(self, name)) is not None and not isinstance(value, bool):
                raise UserError(f"{name} must be true or false, got {value!r} ({type(value).__name__})")
        return self

    @property
    def new_tokens(self) -> int:
        return DEFAULT_MAX_NEW_TOKENS if self.max_new_tokens is None else self.max_new_tokens

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


PROMPTS = ("prompt", "messages", "token_ids")
SETTINGS = tuple(f.name for f in dataclasses.fields(Request) if f.name not in PROMPTS)


def check_int(name: str, value: Any, minimum: int) -> int:
    """An integer >= minimum: rejects 2.5 (which would round), '5' and True (not numbers of tokens)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise UserError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise UserError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise UserError(f"{name} must be a number, got {value!r} ({type(value).__name__})")


def check_sampling(temperature: Any, top_k: Any, top_p: Any, seed: Any) -> None:
    """The sampling values given (None: the checkpoint's default, checked when it loads)."""
    if temperature is not None:
        _check_number("temperature", temperature)
        if not math.isfinite(temperature) or temperature < 0:
            raise UserError(f"temperature must be a finite number >= 0, got {temperature}")
    if top_k is not None:
        check_int("top_k", top_k, 0)
    if top_p is not None:
        _check_number("top_p", top_p)
        if not 0 < top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {top_p}")
    if seed is not None:
        check_int("seed", seed, -MAX_SEED)
        if not 0 <= seed < MAX_SEED:
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


def check_messages(messages: Any) -> None:
    """A non-empty list of {"role": str, "content": str} (other keys pass to the template)."""
    if not isinstance(messages, list | tuple) or not messages:
        raise UserError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise UserError(f"messages[{i}] must be an object with role and content, got {message!r}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise UserError(f"messages[{i}].{key} must be a string, got {message.get(key)!r}")
            check_text(message[key], f"messages[{i}].{key}")


def check_token_id_list(token_ids: Any) -> list[int]:
    """A non-empty list of integer ids (a str is a sequence too, so it is named)."""
    if not isinstance(token_ids, list | tuple):
        raise UserError(f"token_ids must be a list of integers, got {type(token_ids).__name__}")
    if not token_ids:
        raise UserError("the prompt is empty (token_ids holds no ids)")
    if all(type(t) is int for t in token_ids):  # the usual case, without the slow ABC checks below
        return list(token_ids)
    wrong = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
    if wrong:
        raise UserError(f"token_ids must be integers, got {wrong[0]!r} ({type(wrong[0]).__name__})")
    return [int(t) for t in token_ids]


def check_token_ids(token_ids: Any, vocab_size: int) -> list[int]:
    """Token ids that the model can embed: integers in [0, vocab_size)."""
    ids = check_token_id_list(token_ids)
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        raise UserError(f"token ids out of range [0, {vocab_size}): {bad[:5]}")
    return ids


def check_stops(stop: Any) -> list[str]:
    """A string or a list of strings, each non-empty text -> the list."""
    if stop is None:
        return []
    if not isinstance(stop, str | list | tuple) or any(not isinstance(s, str) for s in stop):
        raise UserError(f"stop must be a string or a list of strings, got {stop!r}")
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(not s for s in stops):
        raise UserError("stop strings must be non-empty")
    return [check_text(s, "a stop string") for s in stops]

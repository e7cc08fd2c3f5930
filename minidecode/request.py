"""One spelling of a request: what to continue (a prompt, chat messages or token ids) and how
(sampling, limits, stop strings, log-probs, seed). The CLI, the Python API, batch JSONL lines and
the server all build a `Request`, and `Request.check` is the one place its values are checked:
each field takes exactly its type (a JSON `"false"` is not a boolean), with one message per
mistake. Checks that need the model (token ids against the vocabulary, the context against its
positions and the device's memory) happen when the runtime resolves the request."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import UserError

DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_MAX_BATCH = 32  # sequences decoded at once (the engine's rows)
MAX_SEED = 2**63
MAX_TOP_LOGPROBS = 20  # the most alternatives a token reports (OpenAI's limit)
MAX_SPECULATE = 16  # the most draft tokens a decode step verifies for one sequence


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
    # Logits processors (applied in this order before temperature / top-k / top-p):
    logit_bias: dict[int, float] | None = None  # token id (or its decimal string) -> added to its logit
    min_tokens: int | None = None  # end-of-sequence and stop_token_ids masked until this many new tokens
    repetition_penalty: float | None = None  # > 0, 1: off; over prompt + generated tokens (transformers)
    presence_penalty: float | None = None  # [-2, 2]; over generated tokens (OpenAI)
    frequency_penalty: float | None = None  # [-2, 2]; times each generated token's count (OpenAI)
    stop_token_ids: list[int] | None = None  # generation ends when one is sampled (not returned)
    top_logprobs: int | None = None  # [0, 20]: each new token's most likely alternatives (implies logprobs)
    # [0, 16]: the most draft tokens a decode step verifies (prompt lookup: the tokens that followed
    # the latest earlier occurrence of the last few, in the prompt or the answer); 0 or unset: off.
    # A step verifies one of the model's draft sizes (those that fill the attention's tiles: 1, 3,
    # 7 or 15 with 1, 2, 4 or 8 query heads a KV head), so 8 runs as 7 and 16 as 15.
    # Greedy output is unchanged token for token; sampling keeps the model's distribution (a seeded
    # request's draws are its own in any batch, but not those it draws without speculation). With
    # log-probs, top log-probs or a logits processor it makes no drafts (one token a step: exact).
    speculate: int | None = None

    @classmethod
    def from_prompt(cls, item: Any) -> Request:
        """A prompt list's item (a text, token ids, chat messages, a Request or a dict of its fields)
        as a Request, its own settings kept."""
        if isinstance(item, Request):
            return item
        if isinstance(item, dict):
            return cls.from_dict(item)
        if isinstance(item, str):
            return cls(prompt=item)
        if isinstance(item, list | tuple) and item and all(isinstance(m, dict) for m in item):
            return cls(messages=list(item))
        if isinstance(item, list | tuple):
            return cls(token_ids=list(item))
        raise UserError(f"a prompt must be a text, token ids, messages, a Request or a dict, got {item!r}")

    @classmethod
    def from_dict(cls, fields: Any, what: str = "request") -> Request:
        """From a JSON object (a batch line); an unknown key is refused, naming the known ones."""
        if not isinstance(fields, dict):
            raise UserError(f"a {what} must be a JSON object, got {type(fields).__name__}")
        return cls(**check_known(fields, f"{what} field"))

    @classmethod
    def settings(cls, fields: dict[str, Any], what: str = "setting") -> Request:
        """Only settings (a batch's defaults): no prompt field, an unknown key refused."""
        return cls(**check_known(fields, what, prompts=False)).check(need_prompt=False)

    def with_defaults(self, defaults: Request | None) -> Request:
        """This request with its unset settings taken from `defaults` (the prompt stays its own)."""
        if defaults is None:
            return self
        given = {name: getattr(defaults, name) for name in SETTINGS if getattr(self, name) is None}
        return dataclasses.replace(self, **{k: v for k, v in given.items() if v is not None})

    def check(self, need_prompt: bool = True, names: Mapping[str, str] | None = None) -> Request:
        """Check every field's type and range (UserError names the first mistake, its `field` the
        Request field); -> self. `names` maps Request field names to the caller's own (the
        server's max_tokens for max_new_tokens), which the messages then use."""

        def name(field: str) -> str:
            return names.get(field, field) if names else field

        given = [field for field in PROMPTS if getattr(self, field) is not None]
        if need_prompt and len(given) != 1:
            raise UserError(
                f"give exactly one of {name('prompt')}, {name('messages')} or {name('token_ids')}"
                + (f" (got {', '.join(map(name, given))})" if given else ""),
                field=given[1] if len(given) > 1 else "prompt",
            )
        if not need_prompt and given:
            raise UserError(
                f"{name(given[0])} cannot be a default setting: give it with each prompt", field=given[0]
            )
        if self.prompt is not None:
            with about("prompt"):
                check_text(self.prompt)
                if not self.prompt:
                    raise UserError("the prompt is empty")
        if self.messages is not None:
            with about("messages"):
                check_messages(self.messages, name("messages"))
        if self.token_ids is not None:
            with about("token_ids"):
                check_token_id_list(self.token_ids, name("token_ids"))
        for field in ("max_new_tokens", "max_context"):
            if (value := getattr(self, field)) is not None:
                with about(field):
                    check_int(name(field), value, 1)
        check_sampling(self.temperature, self.top_k, self.top_p, self.seed, names)
        with about("stop"):
            check_stops(self.stop, name("stop"))
        for field in ("allow_extrapolation", "logprobs", "ignore_eos", "reuse_prefix"):
            if (value := getattr(self, field)) is not None and not isinstance(value, bool):
                got = f"{value!r} ({type(value).__name__})"
                raise UserError(f"{name(field)} must be true or false, got {got}", field=field)
        self._check_processors(name)
        return self

    def _check_processors(self, name: Callable[[str], str]) -> None:
        """The logits processors' fields (and top_logprobs)."""
        if self.logit_bias is not None:
            with about("logit_bias"):
                logit_bias_ids(self.logit_bias, name("logit_bias"))
        if self.min_tokens is not None:
            with about("min_tokens"):
                check_int(name("min_tokens"), self.min_tokens, 0)
                if self.max_new_tokens is not None and self.min_tokens > self.max_new_tokens:
                    raise UserError(
                        f"{name('min_tokens')} ({self.min_tokens}) must be <= "
                        f"{name('max_new_tokens')} ({self.max_new_tokens})"
                    )
        if self.repetition_penalty is not None:
            with about("repetition_penalty"):
                value = self.repetition_penalty
                _check_number(name("repetition_penalty"), value)
                if not math.isfinite(value) or value <= 0:
                    raise UserError(f"{name('repetition_penalty')} must be a finite number > 0, got {value}")
        for field in ("presence_penalty", "frequency_penalty"):
            if (value := getattr(self, field)) is not None:
                with about(field):
                    _check_number(name(field), value)
                    if not -2 <= value <= 2:
                        raise UserError(f"{name(field)} must be in [-2, 2], got {value}")
        if self.stop_token_ids is not None:
            with about("stop_token_ids"):
                check_id_list(self.stop_token_ids, name("stop_token_ids"))
        if self.top_logprobs is not None:
            with about("top_logprobs"):
                check_int(name("top_logprobs"), self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        if self.speculate is not None:
            with about("speculate"):
                check_int(name("speculate"), self.speculate, 0, MAX_SPECULATE)

    @property
    def new_tokens(self) -> int:
        return DEFAULT_MAX_NEW_TOKENS if self.max_new_tokens is None else self.max_new_tokens

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


PROMPTS = ("prompt", "messages", "token_ids")
SETTINGS = tuple(f.name for f in dataclasses.fields(Request) if f.name not in PROMPTS)


def check_known(fields: dict[str, Any], what: str, prompts: bool = True) -> dict[str, Any]:
    """The one check of a request's field names (API keywords, batch lines, batch defaults): an
    unknown one is refused, naming the known ones; -> fields."""
    known = [*PROMPTS, *SETTINGS] if prompts else list(SETTINGS)
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise UserError(
            f"unknown {what} {', '.join(map(repr, unknown))}; known: {', '.join(known)}", field=unknown[0]
        )
    return fields


@contextlib.contextmanager
def about(field: str) -> Iterator[None]:
    """A UserError raised inside is about `field` (unless it already names one)."""
    try:
        yield
    except UserError as e:
        if e.field is None:
            e.field = field
        raise


def check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """An integer in [minimum, maximum]: rejects 2.5 (which would round), '5' and True (not numbers
    of tokens)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise UserError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise UserError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise UserError(f"{name} must be <= {maximum}, got {value}")
    return int(value)


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise UserError(f"{name} must be a number, got {value!r} ({type(value).__name__})")


def check_sampling(
    temperature: Any, top_k: Any, top_p: Any, seed: Any, names: Mapping[str, str] | None = None
) -> None:
    """The sampling values given (None: the checkpoint's default, checked when it loads); `names`
    as in Request.check."""
    names = names or {}
    if temperature is not None:
        with about("temperature"):
            name = names.get("temperature", "temperature")
            _check_number(name, temperature)
            if not math.isfinite(temperature) or temperature < 0:
                raise UserError(f"{name} must be a finite number >= 0, got {temperature}")
    if top_k is not None:
        with about("top_k"):
            check_int(names.get("top_k", "top_k"), top_k, 0)
    if top_p is not None:
        with about("top_p"):
            name = names.get("top_p", "top_p")
            _check_number(name, top_p)
            if not 0 < top_p <= 1:
                raise UserError(f"{name} must be in (0, 1], got {top_p}")
    if seed is not None:
        with about("seed"):
            name = names.get("seed", "seed")
            check_int(name, seed, -MAX_SEED)
            if not 0 <= seed < MAX_SEED:
                raise UserError(f"{name} must be in [0, 2**63), got {seed}")


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


def check_messages(messages: Any, name: str = "messages") -> None:
    """A non-empty list of {"role": str, "content": str} (other keys pass to the template)."""
    if not isinstance(messages, list | tuple) or not messages:
        raise UserError(f"{name} must be a non-empty list of {{'role': ..., 'content': ...}} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise UserError(f"{name}[{i}] must be an object with role and content, got {message!r}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise UserError(f"{name}[{i}].{key} must be a string, got {message.get(key)!r}")
            check_text(message[key], f"{name}[{i}].{key}")


def check_token_id_list(token_ids: Any, name: str = "token_ids") -> list[int]:
    """A non-empty list of integer ids (a str is a sequence too, so it is named)."""
    ids = check_id_list(token_ids, name)
    if not ids:
        raise UserError(f"the prompt is empty ({name} holds no ids)")
    return ids


def check_id_list(token_ids: Any, name: str) -> list[int]:
    """A list of integer ids, maybe empty (their range is the model's: check_token_ids)."""
    if not isinstance(token_ids, list | tuple):
        raise UserError(f"{name} must be a list of integers, got {type(token_ids).__name__}")
    if all(type(t) is int for t in token_ids):  # the usual case, without the slow ABC checks below
        return list(token_ids)
    wrong = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
    if wrong:
        raise UserError(f"{name} must be integers, got {wrong[0]!r} ({type(wrong[0]).__name__})")
    return [int(t) for t in token_ids]


def check_token_ids(token_ids: Any, vocab_size: int) -> list[int]:
    """Token ids that the model can embed: integers in [0, vocab_size)."""
    with about("token_ids"):
        return check_in_vocab(check_token_id_list(token_ids), vocab_size)


def check_in_vocab(ids: list[int], vocab_size: int, what: str = "token ids") -> list[int]:
    """Checked integer ids, each in [0, vocab_size) (`what` names them in the message)."""
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        raise UserError(f"{what} out of range [0, {vocab_size}): {bad[:5]}")
    return ids


_DECIMAL = re.compile(r"-?[0-9]+")


def logit_bias_ids(bias: Any, name: str = "logit_bias") -> dict[int, float]:
    """{token id: bias in [-100, 100]}, the ids ints or decimal strings (JSON object keys are
    strings) -> {int id: float bias}. Their range is the model's: check_token_ids."""
    if not isinstance(bias, dict):
        raise UserError(f"{name} must be an object of token id -> bias, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if isinstance(key, str) and _DECIMAL.fullmatch(key):
            token = int(key)
        elif isinstance(key, numbers.Integral) and not isinstance(key, bool):
            token = int(key)
        else:
            raise UserError(f"{name} keys must be token ids (integers or decimal strings), got {key!r}")
        if token in out:
            raise UserError(f"{name} gives token {token} more than once")
        _check_number(f"{name}[{key!r}]", value)
        if not -100 <= value <= 100:
            raise UserError(f"{name}[{key!r}] must be in [-100, 100], got {value}")
        out[token] = float(value)
    return out


def check_stops(stop: Any, name: str = "stop") -> list[str]:
    """A string or a list of strings, each non-empty text -> the list."""
    if stop is None:
        return []
    if not isinstance(stop, str | list | tuple) or any(not isinstance(s, str) for s in stop):
        raise UserError(f"{name} must be a string or a list of strings, got {stop!r}")
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(not s for s in stops):
        raise UserError("stop strings must be non-empty")
    return [check_text(s, "a stop string") for s in stops]

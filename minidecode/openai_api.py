"""The OpenAI API's side of the server: a request body -> the `Request`s it asks for, and results
and events -> OpenAI's response bodies and stream chunks. It holds no state and never touches the
engine; server.py holds the app (routes, auth, streaming, shutdown).

Each endpoint accepts exactly the fields in FIELDS, plus those in NEUTRAL at their neutral value
(an OpenAI feature minidecode does not have, asked not to be used); `null` is the same as leaving
a field out. Any other field is a 400 naming it, never a 200 that silently ignored it. Every
error is in OpenAI's shape, its message and `param` naming the client's field (`max_tokens`, not
the Request's `max_new_tokens`).

`n` choices of a prompt are n Requests (choice i seeded with seed + i when a seed is given); a
list of prompts gives n each, choice `i * n + j` being prompt i's j-th, as OpenAI numbers them.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from .errors import UserError
from .request import MAX_SEED, Request
from .sequence import Event, GenerationResult
from .tokenizer import StreamDecoder

MAX_CHOICES = 128  # n (times the prompts of a completion): OpenAI's limit of n
COMPLETION_MAX_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions

# The Request settings a client sets by the same name. top_k, ignore_eos, repetition_penalty,
# stop_token_ids and min_tokens are extensions (vLLM's names), and speculate minidecode's.
SAMPLING = (
    "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "stop_token_ids", "min_tokens", "speculate",
)  # fmt: skip
_GENERATE = {"model", "n", "stream", "stream_options", "max_tokens", "logprobs", "user", *SAMPLING}
FIELDS = {
    "completions": frozenset({*_GENERATE, "prompt"}),
    "chat": frozenset({*_GENERATE, "messages", "max_completion_tokens", "top_logprobs"}),
    "tokenize": frozenset({"model", "prompt", "messages", "add_special_tokens"}),
    "detokenize": frozenset({"model", "tokens"}),
}
# OpenAI fields accepted only at the value that asks for nothing minidecode lacks.
NEUTRAL: dict[str, dict[str, tuple[Any, ...]]] = {
    "completions": {"echo": (False,), "suffix": ("",), "best_of": (1,)},
    "chat": {
        "tools": ([],),
        "tool_choice": ("none",),
        "response_format": ({"type": "text"},),
        "store": (False,),
        "modalities": (["text"],),
    },
}
MESSAGE_FIELDS = frozenset({"role", "content"})
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def refusal(error: UserError, names: dict[str, str] | None = None, param: str | None = None) -> APIError:
    """A UserError as a 400 whose param is the client's name of the field it is about."""
    message = str(error)
    field = error.field
    param = (names or {}).get(field, field) if field is not None else param
    fit = "context" in message or "fit" in message
    return APIError(message, param=param, code="context_length_exceeded" if fit else None)


# ---- the request -----------------------------------------------------------------------------------


def check_fields(endpoint: str, data: Any, model: str | None = None) -> dict[str, Any]:
    """The body's fields, every one accepted by `endpoint` (nulls dropped); APIError names the
    first that is not. `model`: the served model's id, which a given `model` must be."""
    if not isinstance(data, dict):
        raise APIError("the body must be a JSON object")
    neutral = NEUTRAL.get(endpoint, {})
    for name in data:
        if name not in FIELDS[endpoint] and name not in neutral:
            raise APIError(f"unknown field {name!r}: minidecode does not implement it", param=name)
    data = {k: v for k, v in data.items() if v is not None}
    for name, values in neutral.items():
        if name in data and data[name] not in values:
            shown = " or ".join(repr(v) for v in values)
            raise APIError(f"{name} is not supported by minidecode (only {shown})", param=name)
        data.pop(name, None)
    if model is not None and "model" in data and data["model"] != model:
        raise APIError(
            f"the model {data['model']!r} does not exist: this server serves {model!r}", 400, "model",
            "model_not_found",
        )  # fmt: skip
    return data


@dataclass
class Call:
    """One generation request, translated: a Request per prompt (max_new_tokens None where the
    client gave none) and how to answer."""

    endpoint: str  # "completions" or "chat"
    prompts: list[Request]
    n: int
    stream: bool
    include_usage: bool
    top_logprobs: int | None  # the alternatives each token reports (None: no log-probs)
    names: dict[str, str]  # Request field -> the client's field, for messages and params

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n


def parse(endpoint: str, body: Any, model: str) -> Call:
    """A /v1/completions or /v1/chat/completions body -> its Call (APIError if it is wrong)."""
    data = check_fields(endpoint, body, model)
    stream, include_usage = _stream_options(data)
    n = data.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise APIError(f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}", param="n")
    settings = {name: data[name] for name in SAMPLING if name in data}
    if settings.get("top_k") == -1:  # vLLM's and the OpenAI clients' "off"
        settings["top_k"] = 0
    if endpoint == "completions":
        names = {"max_new_tokens": "max_tokens", "token_ids": "prompt", "top_logprobs": "logprobs"}
        settings["max_new_tokens"] = data.get("max_tokens")
        if "logprobs" in data:  # the legacy shape: how many alternatives (0: the token's own)
            settings["logprobs"], settings["top_logprobs"] = True, data["logprobs"]
        prompts = [{_prompt_kind(p): p} for p in completion_prompts(data.get("prompt"))]
    else:
        limit = "max_completion_tokens" if "max_completion_tokens" in data else "max_tokens"
        names = {"max_new_tokens": limit}
        settings["max_new_tokens"] = data.get(limit)
        settings.update(_chat_logprobs(data))
        prompts = [{"messages": chat_messages(data.get("messages"))}]
    requests = [check(Request(**prompt, **settings), names) for prompt in prompts]
    if len(requests) * n > MAX_CHOICES:
        raise APIError(f"{len(requests)} prompts x n {n} is more than {MAX_CHOICES} choices", param="n")
    top = (requests[0].top_logprobs or 0) if requests[0].logprobs else None
    return Call(endpoint, requests, n, stream, include_usage, top, names)


def check(request: Request, names: dict[str, str]) -> Request:
    try:
        return request.check(names=names)
    except UserError as e:
        raise refusal(e, names) from None


def _stream_options(data: dict[str, Any]) -> tuple[bool, bool]:
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(f"stream must be true or false, got {stream!r}", param="stream")
    options = data.get("stream_options", {})
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise APIError("stream_options must be an object of include_usage only", param="stream_options")
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool):
        raise APIError("stream_options.include_usage must be true or false", param="stream_options")
    if options and not stream:
        raise APIError("stream_options is only for stream: true", param="stream_options")
    return stream, usage


def _chat_logprobs(data: dict[str, Any]) -> dict[str, Any]:
    logprobs, top = data.get("logprobs"), data.get("top_logprobs")
    if top is not None and logprobs is not True:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    out: dict[str, Any] = {} if logprobs is None else {"logprobs": logprobs}
    if top is not None:
        out["top_logprobs"] = top
    return out


def completion_prompts(prompt: Any) -> list[str | list[int]]:
    """A completion's prompt: a string, token ids, or a list of either (several prompts)."""
    if isinstance(prompt, str) or _is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        return list(prompt)
    raise APIError(
        "prompt must be a string, a list of token ids, or a non-empty list of either", param="prompt"
    )


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def _prompt_kind(prompt: str | list[int]) -> str:
    return "prompt" if isinstance(prompt, str) else "token_ids"


def chat_messages(messages: Any) -> list[dict[str, str]]:
    """OpenAI chat messages -> {"role", "content"} with text content (a list of text parts joined);
    roles system, user, assistant, and developer (OpenAI's newer name for system)."""
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise APIError(f"{where} must be an object", param=where)
        message = {k: v for k, v in message.items() if v is not None}
        extra = sorted(set(message) - MESSAGE_FIELDS)
        if extra:
            raise APIError(f"{where}.{extra[0]} is not supported by minidecode", param=f"{where}.{extra[0]}")
        role = message.get("role")
        if role not in ROLES:
            raise APIError(
                f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role"
            )
        content = message.get("content", "" if role == "assistant" else None)
        if isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
                raise APIError(f"{where}.content: only text parts are supported", param=f"{where}.content")
            content = "".join(parts)
        if not isinstance(content, str):
            raise APIError(f"{where}.content must be a string, got {content!r}", param=f"{where}.content")
        out.append({"role": ROLES[role], "content": content})
    return out


def choices(
    call: Call,
    prompt_ids: list[list[int]],
    context: int,
    chat_cap: int,
    allow_extrapolation: bool,
    check_context: Callable[..., bool],
) -> list[Request]:
    """The Call's Requests, choice by choice, each prompt as its token ids: max_tokens' default
    (completions 16, chat the rest of the model's `context` positions up to `chat_cap`), the
    context checked by the runtime's one check (`check_context`: LLM.check_context, naming the
    client's fields), n choices of each prompt. A field the client leaves out stays unset: the
    LLM's default applies (speculate's: `serve --speculate`)."""
    out = []
    for request, ids in zip(call.prompts, prompt_ids, strict=True):
        new = request.max_new_tokens
        if new is None:
            rest = min(chat_cap, context - len(ids))  # a chat's: the rest of the context
            new = max(1, COMPLETION_MAX_TOKENS if call.endpoint == "completions" else rest)
        prompt = "prompt" if call.endpoint == "completions" else "messages"
        what = f"the {prompt}'s {len(ids):,} tokens + {call.names['max_new_tokens']} {new:,}"
        try:
            check_context(len(ids) + new, allow_extrapolation, what, "--allow-extrapolation on the server")
        except UserError as e:
            raise APIError(str(e), param=prompt, code="context_length_exceeded") from None
        base = dataclasses.replace(
            request, prompt=None, messages=None, token_ids=ids, max_new_tokens=new,
            allow_extrapolation=True if allow_extrapolation else None,
        )  # fmt: skip
        check(base, call.names)  # min_tokens against the default max_tokens
        for i in range(call.n):
            seed = None if base.seed is None else (base.seed + i) % MAX_SEED
            out.append(dataclasses.replace(base, seed=seed))
    return out


# ---- the answer --------------------------------------------------------------------------------


def finish_reason(result: GenerationResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def usage(results: list[GenerationResult], n: int) -> dict[str, Any]:
    """OpenAI's usage: each prompt counted once (and its cached tokens: the first choice's, which
    prefilled it; the others reuse its positions), every choice's completion tokens."""
    firsts = results[::n]
    prompt = sum(r.stats.prompt_tokens for r in firsts)
    completion = sum(len(r.token_ids) for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.stats.reused_tokens for r in firsts)},
    }


class Reply:
    """The bodies of one call's answer: its response, or its stream's chunks."""

    prefix = object_name = chunk_name = ""

    def __init__(self, call: Call, model: str, tokenizer: Any):
        self.call, self.model, self.tokenizer = call, model, tokenizer
        self.id, self.created = f"{self.prefix}-{uuid.uuid4().hex}", int(time.time())
        self.streamed = [0] * call.choices  # characters streamed so far, per choice

    def _base(self, name: str) -> dict[str, Any]:
        return {"id": self.id, "object": name, "created": self.created, "model": self.model}

    def text(self, token: int) -> str:
        """A token's text in log-prob entries: its bytes as UTF-8, or, where they are part of a
        character that spans tokens, "bytes:" and their escapes (as vLLM writes them), so that
        different partial tokens stay different keys of a top-log-probs dict."""
        raw = self.tokenizer.token_bytes(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def response(self, results: list[GenerationResult]) -> dict[str, Any]:
        choices = [self.choice(i, r) for i, r in enumerate(results)]
        return {**self._base(self.object_name), "choices": choices, "usage": usage(results, self.call.n)}

    def head(self) -> list[dict[str, Any]]:
        """The chunks before any token."""
        return []

    def usage_chunk(self, results: list[GenerationResult]) -> dict[str, Any]:
        return {**self._base(self.chunk_name), "choices": [], "usage": usage(results, self.call.n)}

    def chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {**self._base(self.chunk_name), "choices": [choice]}

    def choice(self, index: int, result: GenerationResult) -> dict[str, Any]:
        raise NotImplementedError

    def token_chunk(self, index: int, event: Event) -> dict[str, Any] | None:
        raise NotImplementedError

    def finish_chunk(self, index: int, result: GenerationResult) -> dict[str, Any]:
        raise NotImplementedError


class CompletionReply(Reply):
    """/v1/completions: text choices, log-probs in the legacy shape (tokens, token_logprobs,
    top_logprobs as {token text: log p} with the sampled token among them, text_offset)."""

    prefix, object_name, chunk_name = "cmpl", "text_completion", "text_completion"

    def choice(self, index: int, result: GenerationResult) -> dict[str, Any]:
        logprobs = None
        if result.logprobs is not None:
            ids = result.token_ids
            tops = result.top_logprobs or [None] * len(ids)
            logprobs = self._logprobs(ids, result.logprobs, tops, _offsets(self.tokenizer, ids))
        return _text_choice(index, result.text, finish_reason(result), logprobs)

    def token_chunk(self, index: int, event: Event) -> dict[str, Any] | None:
        if not event.piece and event.logprob is None:
            return None
        logprobs = None
        if event.logprob is not None and event.token is not None:
            offset = [self.streamed[index]]
            logprobs = self._logprobs([event.token], [event.logprob], [event.top_logprobs], offset)
        self.streamed[index] += len(event.piece)
        return self.chunk(_text_choice(index, event.piece, None, logprobs))

    def finish_chunk(self, index: int, result: GenerationResult) -> dict[str, Any]:
        return self.chunk(_text_choice(index, "", finish_reason(result), None))

    def _logprobs(self, ids: list[int], logprobs: list[float], tops: list, offsets: list[int]) -> dict:
        k = self.call.top_logprobs or 0
        tokens = [self.text(t) for t in ids]
        top_dicts = []
        for token, text, logprob, top in zip(ids, tokens, logprobs, tops, strict=True):
            entries = {self.text(t): lp for t, lp in (top or [])[:k]}
            if token not in [t for t, _ in (top or [])[:k]]:
                entries.setdefault(text, logprob)
            top_dicts.append(entries)
        return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": top_dicts,
                "text_offset": offsets}  # fmt: skip


class ChatReply(Reply):
    """/v1/chat/completions: assistant messages, log-probs as OpenAI's chat content entries."""

    prefix, object_name, chunk_name = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def choice(self, index: int, result: GenerationResult) -> dict[str, Any]:
        logprobs = None
        if result.logprobs is not None:
            tops = result.top_logprobs or [None] * len(result.token_ids)
            rows = zip(result.token_ids, result.logprobs, tops, strict=True)
            logprobs = {"content": [self._entry(t, lp, top) for t, lp, top in rows]}
        return {
            "index": index,
            "message": {"role": "assistant", "content": result.text},
            "finish_reason": finish_reason(result),
            "logprobs": logprobs,
        }

    def head(self) -> list[dict[str, Any]]:
        role = {"role": "assistant", "content": ""}
        return [self.chunk(_delta_choice(i, role, None, None)) for i in range(self.call.choices)]

    def token_chunk(self, index: int, event: Event) -> dict[str, Any] | None:
        if not event.piece and event.logprob is None:
            return None
        logprobs = None
        if event.logprob is not None and event.token is not None:
            logprobs = {"content": [self._entry(event.token, event.logprob, event.top_logprobs)]}
        return self.chunk(_delta_choice(index, {"content": event.piece}, None, logprobs))

    def finish_chunk(self, index: int, result: GenerationResult) -> dict[str, Any]:
        return self.chunk(_delta_choice(index, {}, finish_reason(result), None))

    def _entry(self, token: int, logprob: float, top: list[tuple[int, float]] | None) -> dict[str, Any]:
        entry = self._one(token, logprob)
        k = self.call.top_logprobs or 0
        entry["top_logprobs"] = [self._one(t, lp) for t, lp in (top or [])[:k]]
        return entry

    def _one(self, token: int, logprob: float) -> dict[str, Any]:
        raw = list(self.tokenizer.token_bytes(token))
        return {"token": self.text(token), "logprob": logprob, "bytes": raw}


REPLIES: dict[str, type[Reply]] = {"completions": CompletionReply, "chat": ChatReply}


def _text_choice(index: int, text: str, finish: str | None, logprobs: dict | None) -> dict[str, Any]:
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def _delta_choice(index: int, delta: dict, finish: str | None, logprobs: dict | None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}


def _offsets(tokenizer: Any, ids: list[int]) -> list[int]:
    """Where each token's text begins in the decoded text of `ids` (the legacy text_offset)."""
    decoder, offsets, length = StreamDecoder(tokenizer), [], 0
    for token in ids:
        offsets.append(length)
        length += len(decoder.push(token))
    return offsets

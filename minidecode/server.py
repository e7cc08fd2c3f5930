"""An OpenAI-compatible HTTP server on the engine loop (`minidecode serve`; the `serve` extra:
FastAPI, uvicorn, prometheus-client).

Every HTTP request becomes one `Request` submitted to the model's engine loop, so concurrent
clients decode in one batch. Bodies are read as plain JSON and checked here and by
`Request.check`: every bad request is a 400 in OpenAI's error shape (never FastAPI's 422). A
client that disconnects aborts its request at the next step; a stream that waits (queued or in
prefill) sends an SSE comment every KEEP_ALIVE_S so proxies keep the connection.
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import UserError
from .llm import LLM
from .request import Request, check_int, check_token_ids
from .sequence import Event, GenerationResult

KEEP_ALIVE_S = 10.0
# OpenAI fields minidecode does not implement: a request that sets one to anything but its
# neutral value is refused rather than silently answered differently.
NEUTRAL = {
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "logit_bias": (None, {}),
    "echo": (False, None),
    "suffix": (None, ""),
    "best_of": (1, None),
    "tools": (None, []),
    "response_format": (None, {"type": "text"}),
}


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        body = {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


SWITCH_INTERVAL_S = 0.0005  # the interpreter's thread switch interval in the server's process


@dataclass
class ServerSettings:
    model_name: str  # the id clients name (`model`); the checkpoint's name by default
    max_tokens_default: int = 4096  # the cap of a chat's default max_tokens (the rest of the context)
    max_waiting: int = 256  # queued requests beyond this get a 503


class Metrics:
    """The /metrics registry: the engine loop's counters and gauges, read at each scrape, and
    latency histograms that the loop feeds as tokens are handed out."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.registry = CollectorRegistry()
        buckets = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
        names = {
            "ttft": ("minidecode_time_to_first_token_seconds", "Time to first token"),
            "inter_token": ("minidecode_inter_token_latency_seconds", "Time between tokens"),
            "e2e": ("minidecode_e2e_request_latency_seconds", "Request latency"),
        }
        self.histograms = {
            key: Histogram(name, text, buckets=buckets, registry=None) for key, (name, text) in names.items()
        }
        for histogram in self.histograms.values():
            self.registry.register(histogram)
        self.registry.register(self)
        llm.loop.stats.observe = lambda what, seconds: self.histograms[what].observe(seconds)

    def collect(self):
        loop = self.llm.loop
        stats, scheduler, engine = loop.stats, loop.scheduler, self.llm.engine
        running, waiting = loop.counts()
        yield GaugeMetricFamily("minidecode_requests_running", "Sequences decoding", value=running)
        yield GaugeMetricFamily("minidecode_requests_waiting", "Requests queued", value=waiting)
        capacity = max(engine.capacity, 1)
        usage = scheduler.used_positions / capacity if engine.capacity else 0.0
        yield GaugeMetricFamily(
            "minidecode_kv_cache_usage_ratio", "Cache positions held by running sequences", value=usage
        )
        counters = {
            "minidecode_prompt_tokens": ("Prompt tokens of admitted requests", stats.prompt_tokens),
            "minidecode_generation_tokens": ("Tokens generated", stats.generation_tokens),
            "minidecode_requests_finished": ("Requests that ended", stats.requests_finished),
            "minidecode_prefix_cache_queries": ("Requests that looked up a cached prefix", scheduler.queries),
            "minidecode_prefix_cache_hits": ("Requests that reused a cached prefix", scheduler.hits),
            "minidecode_cache_reallocations": ("KV cache reallocations", engine.resizes),
            "minidecode_graph_captures": ("Decode-step CUDA graphs captured", engine.captures),
            "minidecode_graph_capture_seconds": ("Time spent capturing them", engine.capture_seconds),
        }  # fmt: skip
        for name, (help_text, value) in counters.items():
            yield CounterMetricFamily(name, help_text, value=value)


class EventRelay:
    """Hands events from the engine loop's thread to the server's event loop: each event waits
    here, and one wake-up of the event loop delivers every event waiting by then. The engine
    hands a token to every running sequence each step, so this is about one wake-up a step
    instead of one a token: less of the interpreter's time away from the engine loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.pending: collections.deque[tuple[asyncio.Queue, Event]] = collections.deque()
        self.scheduled = False

    def put(self, queue: asyncio.Queue, event: Event) -> None:
        """(the engine loop's thread) Queue `event` for `queue`."""
        self.pending.append((queue, event))
        if not self.scheduled:  # read after the append: a delivery that clears it later sees the event
            self.scheduled = True
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        self.scheduled = False  # before the draining: an event added meanwhile is drained or rescheduled
        while self.pending:
            queue, event = self.pending.popleft()
            queue.put_nowait(event)


def create_app(llm: LLM, settings: ServerSettings) -> FastAPI:
    """The FastAPI app serving `llm` under the OpenAI API."""
    app = FastAPI(title="minidecode", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = Metrics(llm)
    context = llm.config.max_position_embeddings
    relays: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its EventRelay

    @app.exception_handler(APIError)
    async def api_error(_, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, error: StarletteHTTPException) -> JSONResponse:
        return APIError(
            str(error.detail), error.status_code, code="not_found" if error.status_code == 404 else None
        ).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, error: RequestValidationError) -> JSONResponse:
        return APIError(f"invalid request: {error.errors()[:1]}").response()

    async def body(http: HTTPRequest) -> dict[str, Any]:
        try:
            data = json.loads(await http.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"the body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise APIError("the body must be a JSON object")
        model = data.get("model")
        if model is not None and model != settings.model_name:
            raise APIError(
                f"the model {model!r} does not exist: this server serves {settings.model_name!r}",
                400, "model", "model_not_found",
            )  # fmt: skip
        for name, neutral in NEUTRAL.items():
            if name in data and data[name] not in neutral:
                raise APIError(f"{name} is not supported by minidecode", param=name)
        if data.get("n", 1) != 1:
            raise APIError("n must be 1: minidecode returns one choice per request", param="n")
        return data

    def common(data: dict[str, Any], max_tokens: Any) -> dict[str, Any]:
        """The sampling fields every endpoint shares, as Request settings."""
        fields = {"max_new_tokens": max_tokens, "stop": data.get("stop")}
        for name in ("temperature", "top_p", "top_k", "seed", "ignore_eos"):  # top_k, ignore_eos: vLLM's
            fields[name] = data.get(name)
        if fields["top_k"] == -1:  # vLLM's and the OpenAI clients' "off"
            fields["top_k"] = 0
        if isinstance(fields["stop"], list) and not fields["stop"]:
            fields["stop"] = None
        return fields

    def stream_options(data: dict[str, Any]) -> tuple[bool, bool]:
        stream = data.get("stream", False)
        if not isinstance(stream, bool):
            raise APIError(f"stream must be true or false, got {stream!r}", param="stream")
        options = data.get("stream_options") or {}
        if not isinstance(options, dict):
            raise APIError("stream_options must be an object", param="stream_options")
        usage = options.get("include_usage", False)
        if not isinstance(usage, bool):
            raise APIError("stream_options.include_usage must be true or false", param="stream_options")
        return stream, usage

    async def start(request: Request) -> tuple[Any, asyncio.Queue]:
        """Check and submit: -> (its sequence, its event queue)."""
        _, waiting = llm.loop.counts()
        if waiting >= settings.max_waiting:
            raise APIError(f"the server is busy ({waiting} requests waiting): try again later", 503)
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        if loop not in relays:
            relays[loop] = EventRelay(loop)
        relay = relays[loop]

        def sink(event: Event) -> None:  # called from the engine loop's thread
            relay.put(events, event)

        try:
            request.check()
            seq = await run_in_threadpool(llm.submit, request, sink)
        except UserError as e:
            message = str(e)
            code = "context_length_exceeded" if "context" in message or "fit" in message else None
            raise APIError(message, code=code) from None
        return seq, events

    async def run(seq, events: asyncio.Queue, http: HTTPRequest) -> GenerationResult:
        """Wait for the whole result (aborting if the client goes away)."""
        try:
            while True:
                try:
                    event = await asyncio.wait_for(events.get(), timeout=1.0)
                except TimeoutError:
                    if await http.is_disconnected():
                        raise asyncio.CancelledError from None
                    continue
                if event.done:
                    return finished(event)
        finally:
            llm.loop.abort([seq])  # a no-op once it has ended

    def finished(event: Event) -> GenerationResult:
        if event.error is not None:
            raise APIError(event.error, 500 if event.fatal else 400)
        return event.result

    def usage_of(result: GenerationResult) -> dict[str, Any]:
        stats = result.stats
        return {
            "prompt_tokens": stats.prompt_tokens,
            "completion_tokens": len(result.token_ids),
            "total_tokens": stats.prompt_tokens + len(result.token_ids),
            "prompt_tokens_details": {"cached_tokens": stats.reused_tokens},
        }

    def finish_reason(result: GenerationResult) -> str:
        return "length" if result.finish_reason == "length" else "stop"

    async def sse(seq, events: asyncio.Queue, chunk, include_usage: bool) -> AsyncIterator[str]:
        """The SSE stream: chunk(piece=..., logprob=...) per token, chunk(finish=...) at the end,
        the usage chunk when asked, then [DONE]; a comment while nothing comes."""
        try:
            head = chunk(first=True)
            out = [] if head is None else [f"data: {json.dumps(head)}\n\n"]
            while True:
                if not events.empty():  # what has come is sent in one write
                    event = events.get_nowait()
                else:
                    if out:
                        yield "".join(out)
                        out = []
                    try:
                        event = await asyncio.wait_for(events.get(), timeout=KEEP_ALIVE_S)
                    except TimeoutError:
                        yield ": keep-alive\n\n"
                        continue
                if event.error is not None:
                    error = {"message": event.error, "type": "server_error", "param": None, "code": None}
                    out.append(f"data: {json.dumps({'error': error})}\n\n")
                    break
                if event.result is not None:
                    out.append(f"data: {json.dumps(chunk(finish=finish_reason(event.result)))}\n\n")
                    if include_usage:
                        out.append(f"data: {json.dumps(chunk(usage=usage_of(event.result)))}\n\n")
                    break
                if event.piece or event.logprob is not None:
                    part = chunk(piece=event.piece, token=event.token, logprob=event.logprob)
                    out.append(f"data: {json.dumps(part)}\n\n")
            out.append("data: [DONE]\n\n")
            yield "".join(out)
        finally:
            llm.loop.abort([seq])  # the client went away: free its row at the next step

    def token_logprob(token: int | None, logprob: float) -> dict[str, Any]:
        text = llm.tokenizer.decode([token]) if token is not None else ""
        return {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        data = await body(http)
        stream, include_usage = stream_options(data)
        prompt = data.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        fields = common(data, data.get("max_tokens", 16))
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            fields["token_ids"] = prompt
        elif isinstance(prompt, str):
            fields["prompt"] = prompt
        else:
            raise APIError(
                "prompt must be a string or a list of token ids (one prompt a request)", param="prompt"
            )
        logprobs = data.get("logprobs")
        if logprobs not in (None, 0) or isinstance(logprobs, bool):
            raise APIError(
                f"logprobs must be 0 (the sampled token's log-probability), got {logprobs!r}",
                param="logprobs",
            )
        fields["logprobs"] = logprobs == 0
        seq, events = await start(Request(**fields))
        name, created, rid = settings.model_name, int(time.time()), f"cmpl-{uuid.uuid4().hex}"

        def chunk(first=False, piece=None, token=None, logprob=None, finish=None, usage=None):
            if first:
                return None
            base = {"id": rid, "object": "text_completion", "created": created, "model": name}
            if usage is not None:
                return {**base, "choices": [], "usage": usage}
            choice = {"index": 0, "text": piece or "", "finish_reason": finish, "logprobs": None}
            if logprob is not None:
                entry = token_logprob(token, logprob)
                choice["logprobs"] = {
                    "tokens": [entry["token"]],
                    "token_logprobs": [logprob],
                    "top_logprobs": [],
                }
            return {**base, "choices": [choice]}

        if stream:
            return StreamingResponse(sse(seq, events, chunk, include_usage), media_type="text/event-stream")
        result = await run(seq, events, http)
        choice = {"index": 0, "text": result.text, "finish_reason": finish_reason(result), "logprobs": None}
        if result.logprobs is not None:
            choice["logprobs"] = {
                "tokens": [llm.tokenizer.decode([t]) for t in result.token_ids],
                "token_logprobs": result.logprobs,
                "top_logprobs": [],
            }
        return {"id": rid, "object": "text_completion", "created": created, "model": name,
                "choices": [choice], "usage": usage_of(result)}  # fmt: skip

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        data = await body(http)
        stream, include_usage = stream_options(data)
        messages = chat_messages(data.get("messages"))
        if not llm.tokenizer.chat_template:
            raise APIError("this model has no chat template: use /v1/completions", param="messages")
        max_tokens = data.get("max_completion_tokens", data.get("max_tokens"))
        if max_tokens is None:  # the rest of the context, capped
            prompt_len = len(await run_in_threadpool(llm.tokenizer.encode_chat, messages))
            max_tokens = max(1, min(settings.max_tokens_default, context - prompt_len))
        fields = common(data, max_tokens)
        logprobs, top = data.get("logprobs", False), data.get("top_logprobs")
        if not isinstance(logprobs, bool):
            raise APIError(f"logprobs must be true or false, got {logprobs!r}", param="logprobs")
        if top not in (None, 0):
            raise APIError(
                f"top_logprobs must be 0 (the sampled token's only), got {top!r}", param="top_logprobs"
            )
        seq, events = await start(Request(messages=messages, logprobs=logprobs, **fields))
        name, created, rid = settings.model_name, int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"

        def chunk(first=False, piece=None, token=None, logprob=None, finish=None, usage=None):
            base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name}
            if usage is not None:
                return {**base, "choices": [], "usage": usage}
            delta = (
                {"role": "assistant", "content": ""}
                if first
                else ({} if finish else {"content": piece or ""})
            )
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            if logprob is not None:
                choice["logprobs"] = {"content": [token_logprob(token, logprob)]}
            return {**base, "choices": [choice]}

        if stream:
            return StreamingResponse(sse(seq, events, chunk, include_usage), media_type="text/event-stream")
        result = await run(seq, events, http)
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": result.text},
            "finish_reason": finish_reason(result),
            "logprobs": None,
        }
        if result.logprobs is not None:
            content = [token_logprob(t, lp) for t, lp in zip(result.token_ids, result.logprobs, strict=True)]
            choice["logprobs"] = {"content": content}
        return {"id": rid, "object": "chat.completion", "created": created, "model": name,
                "choices": [choice], "usage": usage_of(result)}  # fmt: skip

    @app.get("/v1/models")
    async def models():
        card = {"id": settings.model_name, "object": "model", "created": int(time.time()),
                "owned_by": "minidecode", "max_model_len": context}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        if not llm.loop.healthy:
            return JSONResponse({"status": "error", "error": repr(llm.loop.error)}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_text():
        return PlainTextResponse(
            generate_latest(metrics.registry).decode(), media_type="text/plain; version=0.0.4"
        )

    @app.post("/tokenize")
    async def tokenize(http: HTTPRequest):
        data = await body(http)
        try:
            if "messages" in data:
                ids = await run_in_threadpool(
                    llm.encode, Request(messages=chat_messages(data["messages"])).check()
                )
            else:
                prompt = data.get("prompt")
                Request(prompt=prompt).check()
                special = data.get("add_special_tokens", True)
                if not isinstance(special, bool):
                    raise APIError("add_special_tokens must be true or false", param="add_special_tokens")
                ids = await run_in_threadpool(llm.tokenizer.encode, prompt, special)
        except UserError as e:
            raise APIError(str(e)) from None
        return {"tokens": ids, "count": len(ids), "max_model_len": context}

    @app.post("/detokenize")
    async def detokenize(http: HTTPRequest):
        data = await body(http)
        tokens = data.get("tokens")
        try:
            check_token_ids(tokens, llm.config.vocab_size)
        except UserError as e:
            raise APIError(str(e), param="tokens") from None
        return {"prompt": llm.tokenizer.decode(tokens)}

    return app


def chat_messages(messages: Any) -> list[dict[str, str]]:
    """OpenAI chat messages -> {"role", "content"} with text content (a list of text parts joined)."""
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise APIError(f"messages[{i}] must be an object", param="messages")
        content = message.get("content")
        if isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
                raise APIError(f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(parts)
        if content is None and message.get("role") == "assistant":
            content = ""
        out.append({"role": message.get("role"), "content": content})
    return out


def serve(llm: LLM, settings: ServerSettings, host: str, port: int) -> None:
    """Run the server until interrupted (uvicorn; one process, one engine loop)."""
    import uvicorn

    check_int("port", port, 0)
    # The engine loop's thread holds the interpreter while it queues a prefill's kernels; at the
    # default 5 ms switch interval the event loop's thread waits up to that long for each of its
    # turns, so requests that arrive during a prefill reach the engine late (and then prefill
    # beside decoding sequences, at half speed). The interval bounds that wait.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    uvicorn.run(create_app(llm, settings), host=host, port=port, log_level="warning", timeout_keep_alive=30)

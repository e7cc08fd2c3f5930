"""An OpenAI-compatible HTTP server on the engine loop (`minidecode serve`; the `serve` extra:
FastAPI, uvicorn, prometheus-client).

Every HTTP request becomes `Request`s (openai_api.py translates the body: one per choice) submitted
to the model's engine loop, so concurrent clients decode in one batch. Bodies are read as plain
JSON; every bad request is a 400 in OpenAI's error shape (never FastAPI's 422). A client that
disconnects aborts its request at the next step, streamed or not; a stream that waits (queued or
in prefill) sends an SSE comment every KEEP_ALIVE_S so proxies keep the connection. With an API
key every endpoint but /health needs `Authorization: Bearer KEY`. Each request leaves one access
line on stderr.

Ctrl-C (or SIGTERM) stops the server in two steps: the first closes the listener (new requests
are refused, 503 on an open connection) and lets the running requests finish; a second aborts
them, each stream ending with an error event and `data: [DONE]`, each other request with a 503.
`serve` then returns 128 + the signal's number (130 for Ctrl-C).

Under torchrun (--tp / --cp) rank 0 serves and the other ranks run its step plans (fanout.py); a
rank that dies fails every request in the engine loop with the error, and the server exits 1.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import json
import signal
import sys
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import openai_api
from .errors import UserError
from .llm import LLM
from .openai_api import APIError, Call, check_fields, refusal
from .request import Request, check_int, check_token_ids
from .sequence import Event, GenerationResult, Sequence

__all__ = ["APIError", "EventRelay", "Metrics", "ServerSettings", "create_app", "serve"]

KEEP_ALIVE_S = 10.0
SWITCH_INTERVAL_S = 0.0005  # the interpreter's thread switch interval in the server's process
OPEN_PATHS = ("/health",)  # answered without the API key
QUIET_PATHS = ("/health", "/metrics")  # probes and scrapes: no access line
STOPPING = "the server is shutting down: this request was aborted"


@dataclass
class ServerSettings:
    model_name: str  # the id clients name (`model`); the checkpoint's name by default
    max_tokens_default: int = 4096  # the cap of a chat's default max_tokens (the rest of the context)
    max_waiting: int = 256  # queued requests beyond this get a 503
    api_key: str | None = None  # every endpoint but /health needs `Authorization: Bearer <it>`
    allow_extrapolation: bool = False  # contexts past the model's trained positions
    access_log: bool = True  # one line per request on stderr


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
            "minidecode_decode_steps": ("Decode steps of each sequence, summed", stats.decode_steps),
            "minidecode_proposed_tokens": ("Speculation's draft tokens verified", stats.proposed_tokens),
            "minidecode_accepted_tokens": ("Speculation's draft tokens kept", stats.accepted_tokens),
            "minidecode_prefix_cache_queries": ("Requests that looked up a cached prefix", scheduler.queries),
            "minidecode_prefix_cache_hits": ("Requests that reused a cached prefix", scheduler.hits),
            "minidecode_cache_reallocations": ("KV cache reallocations", engine.resizes),
            "minidecode_graph_captures": ("CUDA graphs captured (decode and mixed steps)", engine.captures),
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
        self.pending: collections.deque[tuple[asyncio.Queue, Any]] = collections.deque()
        self.scheduled = False

    def put(self, queue: asyncio.Queue, event: Any) -> None:
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


@dataclass
class Exchange:
    """One HTTP request's access line: filled in as it is answered, written when it ends."""

    method: str
    path: str
    id: str = field(default_factory=lambda: f"req-{uuid.uuid4().hex[:16]}")
    started: float = field(default_factory=time.perf_counter)
    status: int = 500  # until a response starts
    job: Job | None = None

    def line(self) -> str:
        parts = [f"{self.id} {self.method} {self.path} {self.status}"]
        if self.job is not None:  # (its sequences' counts so far: an aborted one's too)
            seqs, done, n = self.job.seqs, self.job.done, self.job.n
            reasons = [done[i].finish_reason if i in done else "abort" for i in range(len(seqs))]
            parts += [
                f"prompt={sum(len(s.prompt_ids) for s in seqs[::n])}",
                f"cached={','.join(str(s.reused) for s in seqs)}",  # each choice's
                f"completion={sum(len(s.token_ids) for s in seqs)}",
                f"ttft={seqs[0].stats.time_to_first_token if seqs else 0.0:.3f}s",
                f"finish={','.join(reasons)}",
            ]
        return " ".join([*parts, f"{time.perf_counter() - self.started:.3f}s"])


class Job:
    """One call's choices in the engine: their sequences, and one queue of (choice, Event)
    (choice -1: the whole job, a shutdown's error or the client's disconnection)."""

    def __init__(self, size: int, n: int):
        self.size, self.n = size, n
        self.seqs: list[Sequence] = []
        self.events: asyncio.Queue = asyncio.Queue()
        self.done: dict[int, GenerationResult] = {}

    def results(self) -> list[GenerationResult]:
        return [self.done[i] for i in range(self.size)]


GONE = Event(-1)  # the client disconnected


class Service:
    """What the routes share: the model, the settings, the jobs running, the shutdown's state."""

    def __init__(self, llm: LLM, settings: ServerSettings):
        self.llm, self.settings = llm, settings
        self.metrics = Metrics(llm)
        self.context = llm.config.max_position_embeddings
        self.relays: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its relay
        self.jobs: set[Job] = set()
        self.draining = False  # a first Ctrl-C: no new requests
        self.aborting = False  # a second: the running ones end

    # ---- a generation: translate, submit, answer ----------------------------------------------
    async def generate(self, endpoint: str, http: HTTPRequest) -> Any:
        call = openai_api.parse(endpoint, await read_body(http), self.settings.model_name)
        reply = openai_api.REPLIES[endpoint](call, self.settings.model_name, self.llm.tokenizer)
        exchange = exchange_of(http)
        exchange.id = reply.id
        job = exchange.job = await self.submit(call)
        if call.stream:
            events = self.stream(job, reply, call.include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        results = await self.wait(job, http)
        if results is None:  # nobody to answer
            return Response(status_code=499)
        return reply.response(results)

    async def submit(self, call: Call) -> Job:
        """The call's choices, submitted to the engine loop as one Job."""
        if call.endpoint == "chat" and not self.llm.tokenizer.chat_template:
            raise APIError("this model has no chat template: use /v1/completions", param="messages")
        _, waiting = self.llm.loop.counts()
        if waiting >= self.settings.max_waiting:
            raise APIError(f"the server is busy ({waiting} requests waiting): try again later", 503)
        job = Job(call.choices, call.n)
        relay = self.relay()

        def sink(choice: int) -> Callable[[Event], None]:
            return lambda event: relay.put(job.events, (choice, event))  # (the engine loop's thread)

        def submit_all() -> None:  # (a worker thread: tokenizing may take a while)
            for choice, request in enumerate(self.requests(call)):
                job.seqs.append(self.llm.submit(request, sink(choice)))

        self.jobs.add(job)
        try:
            await run_in_threadpool(submit_all)
        except (UserError, APIError) as e:
            self.end(job)
            if isinstance(e, APIError):
                raise
            raise refusal(e, call.names, "prompt" if call.endpoint == "completions" else "messages") from None
        if self.aborting:  # a second Ctrl-C came while it was being submitted
            self.llm.loop.abort(job.seqs)
        return job

    def requests(self, call: Call) -> list[Request]:
        """The call's prompts as token ids (tokenized here: their lengths set the default
        max_tokens and the context check) -> one Request per choice."""
        ids = [self.llm.encode(request) for request in call.prompts]
        settings = self.settings
        return openai_api.choices(
            call, ids, self.context, settings.max_tokens_default, settings.allow_extrapolation,
            self.llm.check_context,
        )  # fmt: skip

    def relay(self) -> EventRelay:
        loop = asyncio.get_running_loop()
        if loop not in self.relays:
            self.relays[loop] = EventRelay(loop)
        return self.relays[loop]

    def end(self, job: Job) -> None:
        """The job's answer is over: whatever still runs is aborted at the next step."""
        self.llm.loop.abort(job.seqs)  # a no-op for those that have ended
        self.jobs.discard(job)

    async def wait(self, job: Job, http: HTTPRequest) -> list[GenerationResult] | None:
        """Every choice's result; None if the client went away (its choices are aborted)."""
        watch = asyncio.create_task(watch_disconnect(http, job))
        try:
            while len(job.done) < job.size:
                choice, event = await job.events.get()
                if event is GONE:
                    return None
                if event.error is not None:
                    raise job_error(event)
                if event.result is not None:
                    job.done[choice] = event.result
            return job.results()
        finally:
            watch.cancel()
            self.end(job)

    async def stream(self, job: Job, reply: openai_api.Reply, include_usage: bool) -> AsyncIterator[str]:
        """The SSE stream: the reply's chunks as events come, the usage chunk when asked, then
        [DONE]; an error ends it with an error event, then [DONE]; a comment while nothing comes."""
        try:
            out = [sse(chunk) for chunk in reply.head()]
            failed = False
            while len(job.done) < job.size and not failed:
                if job.events.empty():
                    if out:  # what has come is sent in one write
                        yield "".join(out)
                        out = []
                    try:
                        choice, event = await asyncio.wait_for(job.events.get(), timeout=KEEP_ALIVE_S)
                    except TimeoutError:
                        yield ": keep-alive\n\n"
                        continue
                else:
                    choice, event = job.events.get_nowait()
                failed = event.error is not None
                out.append(sse(self.chunk(job, reply, choice, event)))
            if include_usage and not failed:
                out.append(sse(reply.usage_chunk(job.results())))
            out.append("data: [DONE]\n\n")
            yield "".join(out)
        finally:
            self.end(job)  # (the client went away: its rows are freed at the next step)

    @staticmethod
    def chunk(job: Job, reply: openai_api.Reply, choice: int, event: Event) -> dict[str, Any] | None:
        if event.error is not None:
            return job_error(event).body()
        if event.result is not None:
            job.done[choice] = event.result
            return reply.finish_chunk(choice, event.result)
        return reply.token_chunk(choice, event)

    # ---- shutdown ---------------------------------------------------------------------------------
    def abort_all(self) -> int:
        """(the event loop's thread) End every running job with the shutdown's error; -> how many."""
        self.aborting = self.draining = True
        jobs = list(self.jobs)
        for job in jobs:
            job.events.put_nowait((-1, Event(-1, error=STOPPING, fatal=True)))
            self.llm.loop.abort(job.seqs)
        return len(jobs)


def job_error(event: Event) -> APIError:
    if event.error == STOPPING:
        return APIError(STOPPING, 503, code="server_shutdown")
    return APIError(event.error, 500 if event.fatal else 400)


def sse(chunk: dict[str, Any] | None) -> str:
    return "" if chunk is None else f"data: {json.dumps(chunk)}\n\n"


async def watch_disconnect(http: HTTPRequest, job: Job) -> None:
    """Wait for the client to go away (its body has been read: the next message is the
    disconnection), then abort the job's choices at the next step."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    job.events.put_nowait((-1, GONE))


async def read_body(http: HTTPRequest) -> Any:
    try:
        return json.loads(await http.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the body is not valid JSON: {e}") from None


def exchange_of(http: HTTPRequest) -> Exchange:
    return http.scope.get("minidecode.exchange") or Exchange(http.method, http.url.path)


class Gate:
    """The ASGI layer in front of the routes: the API key, the 503 while the server stops, and
    each request's access line (on stderr, when it has been answered)."""

    def __init__(self, app: Any, service: Service):
        self.app, self.service = app, service

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        exchange = scope["minidecode.exchange"] = Exchange(scope["method"], scope["path"])

        async def noted(message: dict) -> None:
            if message["type"] == "http.response.start":
                exchange.status = message["status"]
            await send(message)

        try:
            error = self.refusal(scope)
            app = self.app if error is None else error.response()
            await app(scope, receive, noted)
        finally:
            if self.service.settings.access_log and scope["path"] not in QUIET_PATHS:
                print(exchange.line(), file=sys.stderr, flush=True)

    def refusal(self, scope: dict) -> APIError | None:
        key, path = self.service.settings.api_key, scope["path"]
        if key is not None and path not in OPEN_PATHS:
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
                return APIError(
                    "missing or incorrect API key: send the header Authorization: Bearer <key>",
                    401, code="invalid_api_key",
                )  # fmt: skip
        if self.service.draining and path not in QUIET_PATHS:
            return APIError("the server is shutting down: no new requests", 503, code="server_shutdown")
        return None


def create_app(llm: LLM, settings: ServerSettings) -> FastAPI:
    """The FastAPI app serving `llm` under the OpenAI API (its Service in app.state.service)."""
    app = FastAPI(title="minidecode", docs_url=None, redoc_url=None, openapi_url=None)
    service = app.state.service = Service(llm, settings)
    app.add_middleware(Gate, service=service)
    add_error_handlers(app)
    add_openai_routes(app, service)
    add_tool_routes(app, service)
    return app


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, error: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if error.status_code == 404 else None
        return APIError(str(error.detail), error.status_code, code=code).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, error: RequestValidationError) -> JSONResponse:
        return APIError(f"invalid request: {error.errors()[:1]}").response()


def add_openai_routes(app: FastAPI, service: Service) -> None:
    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        return await service.generate("completions", http)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        return await service.generate("chat", http)

    @app.get("/v1/models")
    async def models():
        card = {"id": service.settings.model_name, "object": "model", "created": int(time.time()),
                "owned_by": "minidecode", "max_model_len": service.context}  # fmt: skip
        return {"object": "list", "data": [card]}


def add_tool_routes(app: FastAPI, service: Service) -> None:
    """/health, /metrics, /tokenize and /detokenize."""
    llm = service.llm

    @app.get("/health")
    async def health():
        if not llm.loop.healthy:
            return JSONResponse({"status": "error", "error": repr(llm.loop.error)}, status_code=503)
        if service.draining:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_text():
        text = generate_latest(service.metrics.registry).decode()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(http: HTTPRequest):
        data = check_fields("tokenize", await read_body(http), service.settings.model_name)
        try:
            if "messages" in data:
                request = Request(messages=openai_api.chat_messages(data["messages"])).check()
                ids = await run_in_threadpool(llm.encode, request)
            else:
                prompt = data.get("prompt")
                Request(prompt=prompt).check()
                special = data.get("add_special_tokens", True)
                if not isinstance(special, bool):
                    raise APIError("add_special_tokens must be true or false", param="add_special_tokens")
                ids = await run_in_threadpool(llm.tokenizer.encode, prompt, special)
        except UserError as e:
            raise refusal(e) from None
        return {"tokens": ids, "count": len(ids), "max_model_len": service.context}

    @app.post("/detokenize")
    async def detokenize(http: HTTPRequest):
        data = check_fields("detokenize", await read_body(http), service.settings.model_name)
        tokens = data.get("tokens")
        try:
            check_token_ids(tokens, llm.config.vocab_size)
        except UserError as e:
            raise APIError(str(e), param="tokens") from None
        return {"prompt": llm.tokenizer.decode(tokens)}


class _Server(uvicorn.Server):
    """uvicorn's server with minidecode's signals: the first stops new requests and lets the
    running ones finish, the second aborts them cleanly, a third stops waiting for them. uvicorn's
    own handling (a second Ctrl-C cancels the tasks mid-chunk, then re-raises the signal) never
    runs."""

    def __init__(self, config: uvicorn.Config, service: Service):
        super().__init__(config)
        self.service = service
        self.signals: list[int] = []
        self.rank_failed = False

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()  # (called inside serve(): handlers run on the event loop)
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig in previous:
            loop.add_signal_handler(sig, self.interrupt, sig)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                loop.remove_signal_handler(sig)
                signal.signal(sig, handler)  # (the CLI's Ctrl-C handler again)

    def interrupt(self, sig: int) -> None:
        self.signals.append(sig)
        running = len(self.service.jobs)
        if len(self.signals) == 1:
            self.service.draining = True
            self.should_exit = True  # uvicorn closes the listener and waits for the connections
            if running:
                say(f"stopping: {running} running request(s) finish first (Ctrl-C again aborts them)")
        elif len(self.signals) == 2:
            say(f"aborting {self.service.abort_all()} running request(s)")
        else:
            self.force_exit = True

    def watch_ranks(self, fanout) -> None:
        """Under torchrun: once a rank has died or failed (the engine loop then failed every
        request with its error), stop serving, exit code 1."""
        while not self.should_exit:
            if fanout.error is not None:
                say(f"stopping: {fanout.error}")
                self.rank_failed, self.should_exit, self.force_exit = True, True, True
                return
            time.sleep(0.2)

    @property
    def exit_code(self) -> int:
        if self.rank_failed:
            return 1
        return 128 + self.signals[0] if self.signals else 0


def say(message: str) -> None:
    print(f"minidecode serve: {message}", file=sys.stderr, flush=True)


def serve(llm: LLM, settings: ServerSettings, host: str, port: int) -> int:
    """Run the server until interrupted (uvicorn, one engine loop; under torchrun on rank 0, the
    other ranks running its plans); -> the exit code (128 + the signal that stopped it: 130 for
    Ctrl-C; 1 when another rank died)."""
    check_int("port", port, 0)
    # The engine loop's thread holds the interpreter while it queues a prefill's kernels; at the
    # default 5 ms switch interval the event loop's thread waits up to that long for each of its
    # turns, so requests that arrive during a prefill reach the engine late (and then prefill
    # beside decoding sequences, at half speed). The interval bounds that wait.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    app = create_app(llm, settings)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_keep_alive=30)
    server = _Server(config, app.state.service)
    if llm.fanout is not None:
        threading.Thread(target=server.watch_ranks, args=(llm.fanout,), daemon=True).start()
    server.run()
    return server.exit_code

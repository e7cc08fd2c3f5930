"""The public API: load a checkpoint once, generate many times, as text or as a stream."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Self

import torch

from .batching import DEFAULT_MAX_BATCH, Batch, BatchEvent, BatchProgress, check_max_batch
from .cache import FP8, KVCache
from .cache_file import config_hash, weights_fingerprint
from .config import ModelConfig
from .engine import (
    Engine,
    Generation,
    GenerationStats,
    Request,
    activation_bytes,
    default_prefill_chunk,
    kv_dtype_name,
)
from .errors import UserError
from .loading import DEFAULT_MODEL, build_model, resolve_model_dir
from .memory import free_memory, gib
from .sampling import SamplingParams
from .tokenizer import ByteTokenizer, StreamDecoder, Tokenizer
from .validate import (
    check_int,
    check_kv_cache_dtype_name,
    check_request,
    check_text,
    check_token_ids,
    check_vocab,
)

if TYPE_CHECKING:
    from .distributed import Parallel

SYNTHETIC = "synthetic:"
DTYPES = {  # name -> dtype, with short aliases
    **dict.fromkeys(("float32", "fp32"), torch.float32),
    **dict.fromkeys(("float16", "fp16"), torch.float16),
    **dict.fromkeys(("bfloat16", "bf16"), torch.bfloat16),
}


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # the new tokens only
    prompt_token_ids: list[int]
    finish_reason: str  # "eos", "stop" (a stop string) or "length"
    stats: GenerationStats
    logprobs: list[float] | None = None  # log p(token) of each new token, when asked for
    error: str | None = None  # a batch request that was refused (finish_reason "error")


class _HoldsModel:
    """What Stream and BatchStream share: they hold the model (or their requests in a batch)
    until closed, explicitly, by a `with` block, by running out, or when dropped."""

    _pieces: Generator | None
    _release: Callable[[], None]

    def close(self) -> None:
        if self._pieces is not None:
            self._pieces.close()
        self._release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # an abandoned stream must not hold the model forever
        self.close()


@dataclass
class Stream(_HoldsModel):
    """Iterate for text pieces as they are decoded; `.result` holds the full result afterwards.

    A stream holds its model from creation until it is exhausted or closed (`close()`, or use it
    as a context manager): other threads' calls on that model wait their turn meanwhile (a stream
    that joined a running batch holds only its request in it)."""

    _pieces: Generator[str, None, GenerationResult]
    _release: Callable[[], None]
    result: GenerationResult | None = field(default=None, init=False)

    def __iter__(self) -> Iterator[str]:
        try:
            self.result = yield from self._pieces
        finally:
            self.close()

    def close(self) -> None:
        """Stop generating (if still running) and give the model to the next caller."""
        super().close()


@dataclass
class PromptRequest:
    """One prompt of a batch with its own settings (None: the batch's default). Give exactly one
    of prompt, token_ids or messages."""

    prompt: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    max_context: int | None = None
    allow_extrapolation: bool | None = None
    logprobs: bool | None = None
    ignore_eos: bool | None = None

    @classmethod
    def from_dict(cls, fields: dict) -> PromptRequest:
        """From a JSON object (a line of a batch file); unknown keys are refused."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise UserError(f"unknown request fields {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**fields)

    def settings(self) -> dict:
        return {name: getattr(self, name) for name in BATCH_DEFAULTS}


# A batch's settings (in the order LLM._request takes them after the prompt) and their defaults.
BATCH_DEFAULTS = {
    "max_new_tokens": 256,
    "temperature": None,
    "top_k": None,
    "top_p": None,
    "seed": None,
    "stop": None,
    "max_context": None,
    "allow_extrapolation": False,
    "logprobs": False,
    "ignore_eos": False,
}
BatchItem = str | list[int] | list[dict[str, str]] | PromptRequest | dict


@dataclass
class BatchStream(_HoldsModel):
    """Iterate for (prompt index, text piece); `.results` fills in as requests end (all set once
    the iteration ends). Holds its requests in the batch until exhausted or closed (closing ends
    them; the requests of other callers that joined the batch go on)."""

    _pieces: Generator[tuple[int, str], None, None] | None
    _release: Callable[[], None]
    results: list[GenerationResult | None]
    progress: BatchProgress

    def __iter__(self) -> Iterator[tuple[int, str]]:
        try:
            yield from self._pieces
        finally:
            self.close()

    def close(self) -> None:
        """Stop (this stream's requests still running end where they are); the batch ends, giving
        the model to the next caller, once no caller's requests remain."""
        super().close()


class _Member:
    """One caller's requests in a shared batch: its handle for their events, in its own indices."""

    def __init__(self, shared: _SharedBatch, indices: list[int]):
        self.shared = shared
        self.indices = indices  # the caller's index i -> the batch's
        self.own = {index: i for i, index in enumerate(indices)}
        self.pending = set(indices)  # batch indices whose end the caller has not taken yet
        self.queue: deque[BatchEvent] = deque()  # routed to it, not taken yet
        self.open = True

    def events(self) -> Iterator[BatchEvent]:
        """Its events (indexed as the caller gave the requests) until each request has ended."""
        while self.pending:
            event = self.shared.next_event(self)
            if event is None:  # the caller has left
                return
            if event.done:
                self.pending.discard(event.index)
            yield dataclasses.replace(event, index=self.own[event.index])

    def finish(self, i: int) -> None:
        """End the caller's request i now (a stop string): its end event follows."""
        self.shared.batch.finish(self.indices[i])

    def leave(self) -> None:
        """The caller has gone (idempotent): its unfinished requests end, the others' go on."""
        self.shared.leave(self)


class _SharedBatch:
    """A running Batch that the calls of several threads join. Its event loop is driven by
    whichever caller needs an event while no other caller drives it (one step at a time, outside
    the lock, so a joiner never waits for a step); each event goes to the queue of the caller that
    owns its request, and callers with an empty queue wait on the condition (no busy-waiting).
    The batch ends when its loop ends, fails, or its last caller leaves (then the driver, or the
    leaver, closes it); `on_end` then gives the model back. An error in the loop (a CUDA error, an
    interrupt) ends the batch for every caller: the thread that drove the step gets the exception
    itself, every other caller with requests still running an error that names it."""

    def __init__(self, batch: Batch, on_end: Callable[[], None]):
        self.batch, self._on_end = batch, on_end
        self._events = batch.events()
        self._cond = threading.Condition()
        self._owners: dict[int, _Member] = {}  # batch index -> the caller that owns it
        self._callers = 0  # callers that have not left
        self._driving = False  # a thread is inside the loop's next step
        self._ended = False  # the loop ended, failed or was closed: no more events
        self._error: BaseException | None = None

    def join(self, requests: list[Request | UserError]) -> _Member | None:
        """Add a caller's requests; None when the batch has ended or cannot hold them (Batch.add)."""
        with self._cond:
            if self._ended or (indices := self.batch.add(requests)) is None:
                return None
            member = _Member(self, indices)
            self._owners.update(dict.fromkeys(indices, member))
            self._callers += 1
            return member

    def next_event(self, member: _Member) -> BatchEvent | None:
        """The member's next event (None once it has left), driving the loop while nobody else does."""
        while True:
            with self._cond:
                while member.open and not member.queue and self._driving and self._error is None:
                    self._cond.wait()
                if not member.open:
                    return None
                if member.queue:
                    return member.queue.popleft()
                if self._error is not None:
                    if isinstance(self._error, UserError):
                        raise UserError(str(self._error))
                    error = self._error
                    raise RuntimeError(f"the batch failed in another thread: {error!r}") from error
                if self._ended:  # the loop ends only after every request's end was routed
                    raise RuntimeError("the batch ended before this caller's requests did")
                self._driving = True
            self._drive()

    def _drive(self) -> None:
        """One event of the loop (this thread alone), routed to its owner's queue."""
        event, error = None, None
        try:
            event = next(self._events)
        except StopIteration:
            pass
        except BaseException as e:  # re-raised here; the other callers get it from next_event
            error = e
            raise
        finally:
            with self._cond:
                self._driving = False
                ended = event is None and not self._ended  # the loop has ended: this thread ends the batch
                if event is None:
                    self._ended, self._error = True, error
                elif (owner := self._owners.get(event.index)) is not None and owner.open:
                    owner.queue.append(event)
                deserted = self._deserted()
                self._cond.notify_all()
            if deserted:
                self._close()
            elif ended:
                self._on_end()

    def leave(self, member: _Member) -> None:
        with self._cond:
            if not member.open:
                return
            member.open = False
            member.queue.clear()
            self._callers -= 1
            for index in member.pending:  # a waiting one never starts, a running one stops
                self.batch.finish(index)
            deserted = self._deserted()
            self._cond.notify_all()
        if deserted:
            self._close()

    def _deserted(self) -> bool:
        """(Under the lock.) No caller is left, so the batch ends now; while a step is driven,
        its driver decides after it (a leave from within that thread must not wait for it)."""
        if self._ended or self._driving or self._callers:
            return False
        self._ended = True
        return True

    def _close(self) -> None:
        self._events.close()  # the batch's finally: the engine is idle, its cache freed
        self._on_end()


class _Turns:
    """Who runs on a model's one cache: one single request at a time, or one batch that the calls
    of other threads join while it runs. A thread that calls again while its own stream is open is
    refused, since it would wait for itself."""

    def __init__(self):
        self._cond = threading.Condition()
        self._busy = False  # a single request or a batch holds the cache
        self._batch: _SharedBatch | None = None  # the running batch, open to joiners
        self._open: Counter[int] = Counter()  # thread id -> its open calls on the model

    def enter(self) -> Callable[[], None]:
        """Note a call of this thread, refused while it has an open stream; -> its end (idempotent)."""
        me = threading.get_ident()
        with self._cond:
            if self._open[me]:
                raise UserError(
                    "this model is still generating: finish or close the previous stream first "
                    "(stream.close(), or `with llm.stream(...) as stream:`)"
                )
            self._open[me] += 1
        ended = False

        def end() -> None:
            nonlocal ended
            with self._cond:
                if not ended:
                    ended = True
                    self._open[me] -= 1
                    if not self._open[me]:
                        del self._open[me]  # threads come and go: keep only those with a stream

        return end

    def take(self, join: list[Request | UserError] | None = None) -> _Member | None:
        """Wait for the model and hold it (-> None; hand it back with `give_back`, or run a batch on
        it with `open_batch`); or, given requests to `join`, add them to the batch that runs when
        it can hold them (-> their member)."""
        with self._cond:
            while True:
                if join is not None and self._batch is not None:
                    member = self._batch.join(join)
                    if member is not None:
                        return member
                if not self._busy:
                    self._busy = True
                    return None
                self._cond.wait()

    def open_batch(self, batch: Batch, requests: list[Request | UserError]) -> _Member:
        """Run `batch` on the held model, open to joiners; -> the member of `requests`. The model
        is given back when the batch ends."""
        shared = _SharedBatch(batch, self.give_back)
        member = shared.join(requests)
        with self._cond:
            self._batch = shared
            self._cond.notify_all()
        return member

    def give_back(self) -> None:
        with self._cond:
            self._busy, self._batch = False, None
            self._cond.notify_all()

    @contextmanager
    def hold(self) -> Iterator[None]:
        """The model to this thread alone for a while (no batch to join)."""
        end = self.enter()
        try:
            self.take()
            try:
                yield
            finally:
                self.give_back()
        finally:
            end()


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UserError(f"unknown device {device!r} (use cpu, cuda or cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError("device 'cuda' was asked for but no CUDA GPU is available")
    if dev.type not in ("cpu", "cuda"):
        raise UserError(f"unsupported device {device!r} (use cpu, cuda or cuda:N)")
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
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
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


class LLM:
    """A loaded model. `LLM()` with no model uses the small model shipped with minidecode."""

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        prefill_chunk: int | None = None,
        cuda_graph: bool = True,
        kv_cache_dtype: str = "auto",
        prefix_reuse: bool = True,
        tp: int = 1,
        cp: int = 1,
        quantization: str | None = None,
    ):
        # tp x cp > 1: one rank of a torchrun launch (minidecode/distributed.py); each rank loads
        # its share of the weights and every rank runs every request in step with the others.
        self.parallel: Parallel | None = None
        if (tp, cp) != (1, 1):  # torch.distributed loads only here
            from .distributed import init_parallel

            self.parallel = init_parallel(tp, cp, device)
            self.parallel.check_same(model=str(model), dtype=str(dtype), kv_cache_dtype=kv_cache_dtype)
        self.device = resolve_device(device) if self.parallel is None else self.parallel.device
        self.dtype = resolve_dtype(dtype, self.device)
        self.kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.device, self.dtype)
        if prefill_chunk is not None and prefill_chunk < 1:
            raise UserError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.name = str(model) if model is not None else "stdlib-tiny (shipped with minidecode)"
        self.synthetic = str(model).startswith(SYNTHETIC)
        if self.synthetic:
            self.model_dir = None
            self.config = synthetic_config(str(model))
            self.tokenizer = ByteTokenizer(self.config.vocab_size)
            self.generation_defaults, self.eos_ids = SamplingParams(), set()
        else:
            self.model_dir = resolve_model_dir(DEFAULT_MODEL if model is None else model)
            self.config = ModelConfig.from_file(self.model_dir / "config.json")
            self.tokenizer = Tokenizer(self.model_dir)
            check_vocab(self.tokenizer.vocab_size, self.config.vocab_size)
            self.generation_defaults, self.eos_ids = self._generation_config()
        self.model = build_model(
            self.config, self.model_dir, self.device, self.dtype, self.parallel, quantization=quantization
        )
        self.engine = Engine(
            self.model,
            self.device,
            self.dtype,
            prefill_chunk,
            use_cuda_graph=cuda_graph,
            kv_dtype=self.kv_dtype,
            prefix_reuse=prefix_reuse and cp == 1,  # context-parallel prefill starts at position 0
        )
        self._turns = _Turns()  # calls from several threads take turns on the one cache, or join its batch
        self._identity: dict[str, str] | None = None  # computed on the first save/load

    @property
    def identity(self) -> dict[str, str]:
        """What a saved cache must match: a hash of config.json (of the preset for a synthetic
        model) and a fingerprint of the loaded weights (computed once)."""
        if self._identity is None:
            config = (
                self.name.encode()
                if self.model_dir is None
                else (self.model_dir / "config.json").read_bytes()
            )
            self._identity = {
                "config_sha256": config_hash(config),
                "weights_fingerprint": weights_fingerprint(self.model),
            }
        return self._identity

    def save_cache(self, path: str | Path) -> int:
        """Save the prefilled cache (the last request's prompt and the answer tokens fed back, up to
        the last) to `path`, a safetensors file, atomically; returns its size in bytes."""
        self._check_single_process("saving a cache")
        with self._turns.hold():
            return self.engine.save_cache(path, self.identity)

    def load_cache(self, path: str | Path) -> int:
        """Check the cache file at `path` against this model (refusing a mismatch) and make it the
        cached prefix: the next request that starts with its tokens reads them from the file instead
        of prefilling them. Returns the number of tokens it holds."""
        self._check_single_process("loading a cache")
        with self._turns.hold():
            return self.engine.load_cache(path, self.identity)

    def _check_single_process(self, what: str) -> None:
        if self.parallel is not None:
            raise UserError(f"{what} is not supported with tp / cp > 1 (each rank holds a part of it)")

    def _generation_config(self) -> tuple[SamplingParams, set[int]]:
        eos = set(self.config.eos_token_ids)
        defaults = SamplingParams()
        path = self.model_dir / "generation_config.json"
        if path.exists():
            try:
                gen = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise UserError(f"{path} is not valid JSON: {e}") from None
            ids = gen.get("eos_token_id")
            eos |= set(ids if isinstance(ids, list) else [] if ids is None else [ids])
            if gen.get("do_sample"):
                defaults = SamplingParams(
                    temperature=float(gen.get("temperature") or 1.0),
                    top_k=int(gen.get("top_k") or 0),
                    top_p=float(gen.get("top_p") or 1.0),
                )
        eos_text = self.tokenizer.token_id(self.tokenizer.eos_token)
        if not eos and eos_text is not None:
            eos.add(eos_text)
        return defaults, {int(i) for i in eos}

    # ---- inputs -------------------------------------------------------------------------
    def encode_prompt(
        self,
        prompt: str | None = None,
        token_ids: list[int] | None = None,
        messages: list[dict[str, str]] | None = None,
    ) -> list[int]:
        given = [x is not None for x in (prompt, token_ids, messages)]
        if sum(given) != 1:
            raise UserError("give exactly one of prompt, token_ids or messages")
        if messages is not None:
            ids = self.tokenizer.encode_chat(messages)
        elif token_ids is not None:
            ids = check_token_ids(token_ids, self.config.vocab_size)
        else:
            ids = self.tokenizer.encode_long(check_text(prompt))
        if not ids or (prompt is not None and not prompt):
            raise UserError("the prompt is empty")
        return ids

    def sampling_params(
        self, temperature: float | None, top_k: int | None, top_p: float | None, seed: int | None
    ) -> SamplingParams:
        """The request's sampling settings over the checkpoint's defaults (checked by the engine)."""
        d = self.generation_defaults
        return SamplingParams(
            temperature=d.temperature if temperature is None else float(temperature),
            top_k=d.top_k if top_k is None else int(top_k),
            top_p=d.top_p if top_p is None else float(top_p),
            seed=seed,
        )

    def random_prompt(self, num_tokens: int, seed: int = 0) -> list[int]:
        """A prompt of exactly num_tokens random ids (benchmarks, synthetic models)."""
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.config.vocab_size, (num_tokens,), generator=generator).tolist()

    # ---- generation ---------------------------------------------------------------------
    def stream(
        self,
        prompt: str | None = None,
        *,
        token_ids: list[int] | None = None,
        messages: list[dict[str, str]] | None = None,
        max_new_tokens: int = 256,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: list[str] | str | None = None,
        max_context: int | None = None,
        allow_extrapolation: bool = False,
        logprobs: bool = False,
        ignore_eos: bool = False,
        reuse_prefix: bool = True,
        on_prefill_progress: Callable[[int, int], None] | None = None,
    ) -> Stream:
        """Like `generate`, but yields text pieces as they are decoded (never a broken UTF-8
        character); after iteration, `.result` is the GenerationResult.

        While a batch runs on this model (another thread's `generate([...])` or `stream_batch`),
        the request joins it and gets the same tokens (its prefill is not reused from the cache,
        and on_prefill_progress is not called); while another single request runs, it waits."""
        t_request = time.perf_counter()
        make_request = functools.partial(
            self._request, prompt, token_ids, messages, max_new_tokens, temperature, top_k, top_p, seed, stop,
            max_context, allow_extrapolation, logprobs, ignore_eos, reuse_prefix,
        )  # fmt: skip
        if self.parallel is None:
            request = make_request()
        else:  # rank 0's prompt and its seed: every rank then samples the same tokens
            request = self.parallel.from_rank0(lambda: with_seed(make_request()))
        if self.parallel is None:
            self.engine.check_limits(request)  # refused here, whether it joins a batch or not
        end = self._turns.enter()
        try:
            member = self._turns.take(join=[request] if self.parallel is None else None)
            if member is not None:
                return Stream(self._joined_pieces(member, request), _both(member.leave, end))
            start = functools.partial(self.engine.generate, request, on_prefill_progress, t_request)
            try:  # generate refuses a bad request
                generation = start() if self.parallel is None else self.parallel.agree(start)
            except BaseException:
                self._turns.give_back()
                raise
        except BaseException:
            end()
            raise
        return Stream(self._pieces(generation), _both(self._turns.give_back, end))

    def _request(
        self,
        prompt: str | None,
        token_ids: list[int] | None,
        messages: list[dict[str, str]] | None,
        max_new_tokens: int,
        temperature: float | None,
        top_k: int | None,
        top_p: float | None,
        seed: int | None,
        stop: list[str] | str | None,
        max_context: int | None,
        allow_extrapolation: bool,
        logprobs: bool,
        ignore_eos: bool,
        reuse_prefix: bool = True,
    ) -> Request:
        """A checked engine Request (a bad value raises UserError)."""
        stops = check_request(max_new_tokens, temperature, top_k, top_p, seed, stop)
        return Request(
            prompt_ids=self.encode_prompt(prompt, token_ids, messages),
            params=self.sampling_params(temperature, top_k, top_p, seed),
            max_new_tokens=max_new_tokens,
            max_context=max_context,
            stop=stops,
            eos_ids=frozenset(self.eos_ids),
            ignore_eos=ignore_eos,
            want_logprobs=logprobs,
            reuse_prefix=reuse_prefix,
            # Synthetic models are noise at any length: only their speed matters, so no position limit.
            allow_extrapolation=allow_extrapolation or self.synthetic,
        )

    def _pieces(self, generation: Generation) -> Generator[str, None, GenerationResult]:
        text = _Text(self.tokenizer, generation.request)
        with closing(generation.tokens):  # closing runs the engine's finally, which completes the stats
            for token, logprob in generation.tokens:
                if piece := text.push(token, logprob):
                    yield piece
                if text.stopped:
                    break
        if piece := text.flush():
            yield piece
        return text.result(generation)

    def _joined_pieces(self, member: _Member, request: Request) -> Generator[str, None, GenerationResult]:
        """A single request's pieces, from the running batch it joined."""
        text = _Text(self.tokenizer, request)
        for event in member.events():
            if event.error is not None:
                raise UserError(event.error)
            if event.done:
                if piece := text.flush():
                    yield piece
                return text.result(event.generation)
            if piece := text.push(event.token, event.logprob):
                yield piece
            if text.stopped:
                member.finish(0)  # its end follows
        raise RuntimeError("the request left its batch before it ended")

    def generate(self, prompt: str | None | Sequence[BatchItem] = None, **kwargs) -> GenerationResult:
        """Generate a continuation of `prompt` (or of `token_ids=`, or a chat reply to
        `messages=`). Sampling defaults come from the checkpoint's generation_config.json
        (greedy when it does not sample); temperature=0 is greedy.

        A list of prompts (texts, token-id lists, message lists or `PromptRequest`s) runs as one
        batch and returns a list of results in order (see `stream_batch`). Calls from other
        threads meanwhile join that batch (see `stream_batch`)."""
        if isinstance(prompt, list | tuple):
            return self.generate_batch(prompt, **kwargs)
        with self.stream(prompt, **kwargs) as stream:
            for _ in stream:
                pass
        return stream.result

    # ---- many prompts at once -----------------------------------------------------------
    def generate_batch(self, prompts: Sequence[BatchItem], **kwargs) -> list[GenerationResult]:
        """Every prompt's result, in order; a refused one has finish_reason "error" and `.error`."""
        with self.stream_batch(prompts, **kwargs) as stream:
            for _ in stream:
                pass
        return stream.results

    def stream_batch(
        self,
        prompts: Sequence[BatchItem],
        *,
        max_batch: int = DEFAULT_MAX_BATCH,
        on_result: Callable[[int, GenerationResult], None] | None = None,
        **defaults,
    ) -> BatchStream:
        """Run many prompts as one continuously refilled batch; iterate for (prompt index, text
        piece) as pieces are decoded (requests interleave). Each item is a text, a list of token
        ids, a list of chat messages, or a `PromptRequest` with its own settings; `defaults`
        (generate's keywords: max_new_tokens, temperature, stop, ...) apply where an item sets
        none. `on_result(index, result)` is called as each request ends; afterwards `.results`
        holds every result in order. A request that is refused (empty prompt, too long, ...)
        gets a result with finish_reason "error" and the reason in `.error`; the others go on.
        Each request yields the tokens it would alone (greedy; seeded sampling too).

        Calls from several threads share one batch: while a batch runs on this model, the prompts
        of a later call (and a later single `generate` / `stream`) join its queue, in order, under
        its max_batch, in the cache it allocated (none is allocated for them), and each caller
        gets its own results and pieces only. The cache is sized when the batch starts to the
        requests given by then; a call with a request larger than that whole cache does not join
        but waits for the batch to end and runs in a batch of its own. The batch ends when every
        request of every caller has ended; a caller that closes its stream ends its own requests
        only. An error inside the batch's loop (a device error, an interrupt) ends it for every
        caller that still has requests in it."""
        self._check_single_process("batched generation")
        unknown = sorted(set(defaults) - set(BATCH_DEFAULTS))
        if unknown:
            raise UserError(
                f"unknown batch settings {', '.join(unknown)}; known: {', '.join(BATCH_DEFAULTS)}"
            )
        if not isinstance(prompts, list | tuple) or not prompts:
            raise UserError("give a non-empty list of prompts")
        check_int("max_batch", max_batch, 1)
        check_max_batch(max_batch)
        settings = {**BATCH_DEFAULTS, **defaults}
        check_request(
            settings["max_new_tokens"], settings["temperature"], settings["top_k"], settings["top_p"],
            settings["seed"], settings["stop"],
        )  # fmt: skip
        requests = [self._batch_request(item, settings) for item in prompts]
        end = self._turns.enter()
        try:
            member = self._turns.take(join=requests)
            if member is None:  # the model is ours: a batch that later calls may join
                try:
                    member = self._turns.open_batch(Batch(self.engine, [], max_batch), requests)
                except BaseException:
                    self._turns.give_back()
                    raise
        except BaseException:
            end()
            raise
        progress = BatchProgress(total=len(requests))
        stream = BatchStream(None, _both(member.leave, end), [None] * len(requests), progress)
        stream._pieces = self._batch_pieces(member, requests, stream.results, on_result, progress)
        return stream

    def _batch_request(self, item: BatchItem, settings: dict) -> Request | UserError:
        """An item as a Request, or the UserError that refuses it (reported as its result)."""
        try:
            if isinstance(item, dict):
                item = PromptRequest.from_dict(item)
            if isinstance(item, str):
                item = PromptRequest(prompt=item)
            elif isinstance(item, list | tuple) and item and all(isinstance(m, dict) for m in item):
                item = PromptRequest(messages=list(item))
            elif isinstance(item, list | tuple):
                item = PromptRequest(token_ids=list(item))
            elif not isinstance(item, PromptRequest):
                raise UserError(
                    f"a prompt must be a text, token ids, messages or a PromptRequest, got {item!r}"
                )
            own = {k: v for k, v in item.settings().items() if v is not None}
            merged = {**settings, **own}
            return self._request(
                item.prompt, item.token_ids, item.messages, *(merged[k] for k in BATCH_DEFAULTS)
            )
        except UserError as e:
            return e

    def _batch_pieces(
        self,
        member: _Member,
        requests: list[Request | UserError],
        results: list[GenerationResult | None],
        on_result: Callable[[int, GenerationResult], None] | None,
        progress: BatchProgress,
    ) -> Generator[tuple[int, str], None, None]:
        texts = {i: _Text(self.tokenizer, r) for i, r in enumerate(requests) if isinstance(r, Request)}
        running: set[int] = set()  # this caller's requests that have handed out a token
        for event in member.events():
            i = event.index
            if event.error is not None:
                request = requests[i]
                prompt_ids = request.prompt_ids if isinstance(request, Request) else []
                results[i] = GenerationResult(
                    "", [], prompt_ids, "error", GenerationStats(), error=event.error
                )
                progress.failed += 1
            elif event.done:
                running.discard(i)
                progress.done += 1
                if piece := texts[i].flush():
                    yield i, piece
                results[i] = texts[i].result(event.generation)
            else:
                running.add(i)
                progress.new_tokens += 1
            progress.running = len(running)
            progress.waiting = progress.total - progress.done - progress.failed - progress.running
            if not event.done:
                if piece := texts[i].push(event.token, event.logprob):
                    yield i, piece
                if texts[i].stopped:
                    member.finish(i)
                continue
            if on_result is not None:
                on_result(i, results[i])

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """float32 logits [T, V] of every position of `token_ids`, in one causal pass (scoring)."""
        with self._turns.hold():
            return self.engine.score(token_ids)


def _both(first: Callable[[], None], then: Callable[[], None]) -> Callable[[], None]:
    """A stream's release: first, then `then`, once however often it is called."""
    done = threading.Lock()

    def both() -> None:
        if done.acquire(blocking=False):
            try:
                first()
            finally:
                then()

    return both


def with_seed(request: Request) -> Request:
    """The request with a seed drawn now where it has none (what every rank then seeds with)."""
    if request.params.seed is None:
        request.params.seed = int.from_bytes(os.urandom(8), "little") >> 1
    return request


class _Text:
    """One request's new tokens -> text pieces: never a broken UTF-8 character, nothing past the
    first stop string (text that may still turn into one is held back)."""

    def __init__(self, tokenizer: Tokenizer | ByteTokenizer, request: Request):
        self.request = request
        self.decoder = StreamDecoder(tokenizer)
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.text, self.emitted = "", 0  # all text decoded so far; how much of it was handed out
        self.hold = max((len(s) for s in request.stop), default=1) - 1  # a stop string may be forming
        self.stopped = False

    def push(self, token: int, logprob: float | None) -> str:
        """Add a token; -> the text that can be handed out now ("" if none)."""
        self.token_ids.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        self.text += self.decoder.push(token)
        cut = _find_stop(self.text, self.request.stop, self.emitted - self.hold)
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True
            return ""
        if len(self.text) - self.hold > self.emitted:
            piece, self.emitted = (
                self.text[self.emitted : len(self.text) - self.hold],
                len(self.text) - self.hold,
            )
            return piece
        return ""

    def flush(self) -> str:
        """The end: -> the text held back (and the decoder's last bytes unless stopped)."""
        if not self.stopped:
            self.text += self.decoder.flush()
        piece, self.emitted = self.text[self.emitted :], len(self.text)
        return piece

    def result(self, generation: Generation) -> GenerationResult:
        # One count: the new tokens returned. An eos ends generation but is not part of the
        # output, so it is neither in token_ids nor in stats.new_tokens.
        generation.stats.new_tokens = len(self.token_ids)
        return GenerationResult(
            text=self.text,
            token_ids=self.token_ids,
            prompt_token_ids=self.request.prompt_ids,
            finish_reason="stop" if self.stopped else generation.finish_reason,
            stats=generation.stats,
            logprobs=self.logprobs if self.request.want_logprobs else None,
        )


def _find_stop(text: str, stops: list[str], search_from: int) -> int | None:
    """Index where the earliest stop string begins in text, searching only new text."""
    hits = [i for s in stops if (i := text.find(s, max(0, search_from))) >= 0]
    return min(hits) if hits else None


_default: tuple[tuple, LLM] | None = None  # (load arguments, model) of the one-call function
_default_lock = threading.Lock()


def generate(
    prompt: str | None = None,
    *,
    model: str | Path | None = None,
    device: str | None = None,
    dtype: str | None = None,
    **kwargs,
) -> GenerationResult:
    """One-call convenience: load `model` (kept for the next call with the same arguments) and
    generate. `minidecode.generate("def fib(n):")` uses the shipped model."""
    global _default
    key = (str(model), device, dtype)
    with _default_lock:  # two threads' first calls load one model, not two
        if _default is None or _default[0] != key:
            _default = (key, LLM(model, device=device, dtype=dtype))
        llm = _default[1]
    return llm.generate(prompt, **kwargs)


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
        cfg, source = ModelConfig.from_file(model_dir / "config.json"), str(model_dir)
    context = cfg.max_position_embeddings if context is None else context
    if context < 1:
        raise UserError(f"context must be >= 1, got {context}")
    weights = cfg.num_parameters() * dt.itemsize
    rank_cfg, positions, parallel, plan_weights = cfg, context, None, weights
    if (tp, cp) != (1, 1):
        from minidecode.models.parallel import rank_weight_bytes

        from .distributed import rank_config, rank_positions, shard_plan

        shard = shard_plan(cfg, tp, 0)
        rank_cfg, plan_weights = rank_config(cfg, shard), rank_weight_bytes(cfg, shard, tp, dt.itemsize)
        positions = rank_positions(context, cp)
        parallel = (
            f"parallel     tp {tp} x cp {cp} = {tp * cp} GPUs (torchrun); each GPU holds "
            f"{rank_cfg.num_heads} q / {rank_cfg.num_kv_heads} kv heads, MLP {rank_cfg.intermediate_size}, "
            f"{'the whole vocabulary' if tp == 1 else f'{shard.vocab_rows:,} vocabulary rows'} "
            f"and {positions:,} cache positions"
        )
    kv_per_token = KVCache.bytes_per_token(cfg.num_layers, rank_cfg.num_kv_heads, cfg.head_dim, kv_dt)
    kv = KVCache.bytes_needed(cfg.num_layers, rank_cfg.num_kv_heads, positions, cfg.head_dim, kv_dt)
    chunk = prefill_chunk or default_prefill_chunk(dev)
    act = activation_bytes(rank_cfg, context, chunk, dt, dev, kv_dt, positions)
    free = free_memory(dev)
    rope = cfg.rope.rope_type + (f" x{cfg.rope.factor:g}" if cfg.rope.factor else "")
    lines = [
        f"model        {model or 'stdlib-tiny (shipped)'}  [{source}]",
        f"architecture {cfg.model_type}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"MLP {cfg.intermediate_size}, heads {cfg.num_heads} q / {cfg.num_kv_heads} kv x {cfg.head_dim}",
        f"parameters   {cfg.num_parameters() / 1e9:.3f} B ({gib(weights)} in {str(dt)[6:]})",
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
    if context > cfg.max_position_embeddings:
        lines.append(
            f"note         {context:,} tokens exceed the {cfg.max_position_embeddings:,} positions the model "
            "was trained for: generating that far extrapolates (--allow-extrapolation)"
        )
    return "\n".join(lines)

"""The public API: load a checkpoint once, then generate from any number of threads, as text, as a
stream, or for many prompts at once. Every call becomes sequences submitted to the model's one
engine loop (loop.py), which owns the device; each caller reads only its own events."""

from __future__ import annotations

import os
import queue
import threading
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from minidecode.kernels.prefill import check_prefill_attention

from .cache import kv_dtype_name
from .cache_file import config_hash, launch_name, part_path
from .engine import Engine
from .errors import UserError
from .info import SYNTHETIC, resolve_device, resolve_dtype, resolve_kv_cache_dtype, synthetic_config
from .loading import DEFAULT_MODEL, build_model, read_config, read_generation_config, resolve_model_dir
from .loop import EngineLoop
from .plan import FileOpen, FileSave, StepPlan
from .request import (
    DEFAULT_MAX_BATCH,
    MAX_SPECULATE,
    Request,
    about,
    check_in_vocab,
    check_int,
    check_known,
    check_token_ids,
    logit_bias_ids,
)
from .sampling import SamplingParams
from .scheduler import check_fits
from .sequence import Event, GenerationResult, GenerationStats, Sequence
from .streams import BatchProgress, BatchStream, Stream
from .tokenizer import ByteTokenizer, Tokenizer
from .validate import check_vocab
from .warm_up import warm_up

if TYPE_CHECKING:
    from .distributed import Parallel

__all__ = ["LLM", "BatchProgress", "BatchStream", "GenerationResult", "GenerationStats", "Stream", "generate"]

# A prompt of a list: a text, token ids, chat messages, a Request, or a dict of Request fields.
Prompt = str | list[int] | list[dict[str, str]] | Request | dict


class LLM:
    """A loaded model. `LLM()` with no model uses the small model shipped with minidecode.

    max_batch: the most sequences decoded at once (requests beyond it wait their turn).
    prefix_reuse: keep finished sequences' K/V and reuse the longest cached prefix of a new prompt.
    step_tokens: the rows a step takes through the weights while a prompt prefills beside running
    requests (a chunk of it beside their decode rows: mixed.STEP_TOKENS; None, the device's).
    speculate: the `speculate` of requests that do not set their own (the most draft tokens a
    step; 0: off). The steps its drafts take are compiled when the model loads; a request that
    speculates further compiles the steps it adds before its prefill (Triton keeps them on disk)."""

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
        max_batch: int = DEFAULT_MAX_BATCH,
        tp: int = 1,
        cp: int = 1,
        quantization: str | None = None,
        prefill_attention: str = "auto",
        step_tokens: int | None = None,
        speculate: int = 0,
    ):
        # tp x cp > 1: one rank of a torchrun launch (minidecode/distributed.py); each rank loads
        # its share of the weights. Rank 0 runs the engine loop and the API; every step's plan goes
        # to the other ranks (fanout.py), which run it in `serve_plans`.
        self.parallel: Parallel | None = None
        if (tp, cp) != (1, 1):  # torch.distributed loads only here
            from .distributed import init_parallel

            self.parallel = init_parallel(tp, cp, device)
            self.parallel.check_same(
                model=str(model), dtype=str(dtype), kv_cache_dtype=kv_cache_dtype, quantization=quantization,
                prefill_attention=prefill_attention, speculate=speculate,
            )  # fmt: skip
        self.device = resolve_device(device) if self.parallel is None else self.parallel.device
        self.dtype = resolve_dtype(dtype, self.device)
        self.kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.device, self.dtype)
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or prefill_chunk < 1):
            raise UserError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if step_tokens is not None:
            check_int("step_tokens", step_tokens, 1)
        self.speculate = check_int("speculate", speculate, 0, MAX_SPECULATE)
        for name, value in (("cuda_graph", cuda_graph), ("prefix_reuse", prefix_reuse)):
            if not isinstance(value, bool):
                raise UserError(f"{name} must be True or False, got {value!r}")
        self.name = str(model) if model is not None else "stdlib-tiny (shipped with minidecode)"
        self.synthetic = str(model).startswith(SYNTHETIC)
        if self.synthetic:
            self.model_dir = None
            self.config = synthetic_config(str(model))
            self.tokenizer = ByteTokenizer(self.config.vocab_size)
            self.generation_defaults, self.eos_ids = SamplingParams(), set()
        else:
            self.model_dir = resolve_model_dir(DEFAULT_MODEL if model is None else model)
            self.config = read_config(self.model_dir)
            self.tokenizer = Tokenizer(self.model_dir)
            check_vocab(self.tokenizer.vocab_size, self.config.vocab_size)
            sampling, self.eos_ids = read_generation_config(self.model_dir, self.config)
            self.generation_defaults = SamplingParams(**sampling) if sampling else SamplingParams()
            eos_text = self.tokenizer.token_id(self.tokenizer.eos_token)
            if not self.eos_ids and eos_text is not None:
                self.eos_ids.add(eos_text)
        self.model = build_model(
            self.config, self.model_dir, self.device, self.dtype, self.parallel, quantization=quantization
        )
        cp_ranks = 1 if self.parallel is None else self.parallel.cp
        try:
            check_prefill_attention(prefill_attention, self.device, self.config.head_dim)
        except ValueError as e:
            raise UserError(str(e)) from None
        self.engine = Engine(
            self.model, self.device, self.dtype, self.kv_dtype, prefill_chunk, use_cuda_graph=cuda_graph,
            max_batch=max_batch, step_tokens=step_tokens, context_parallel=cp_ranks > 1,
            prefill_attention=prefill_attention,
        )  # fmt: skip
        if self.parallel is not None:  # its part of a cache file (cache_file.part_path)
            par = self.parallel
            self.engine.files.place = (par.tp, par.cp, par.rank, self.model.cp_chunk)
        self.fanout = None  # rank 0's channel to the other ranks
        if self.parallel is not None and self.parallel.rank == 0:
            from .fanout import Fanout

            self.fanout = Fanout(self.parallel, self.engine)
        self.loop = EngineLoop(self.engine, self.tokenizer, prefix_reuse, ranks=self.fanout)
        # The loop's thread holds the model (not this object): dropping the LLM stops it, and frees
        # the weights and the cache.
        weakref.finalize(self, EngineLoop.close, self.loop)
        # Kernels compiled now, not in the first request's wait: under torchrun every rank at once,
        # before rank 0's loop starts (a script may also drive the engines in step itself).
        if self.parallel is None:
            self.loop.call(lambda: warm_up(self.engine, self.speculate))
        else:
            with torch.inference_mode():
                warm_up(self.engine, self.speculate)
        self._identity: dict[str, str] | None = None  # computed on the first save / load

    @property
    def rank(self) -> int:
        """This process's rank under torchrun (0 in one process)."""
        return 0 if self.parallel is None else self.parallel.rank

    def serve_plans(self) -> int:
        """On a rank other than 0 of a torchrun launch: run rank 0's step plans until its LLM
        closes -> how many ran. Raises RuntimeError (fanout.RankError) if rank 0 dies."""
        if self.rank == 0:
            raise UserError("serve_plans runs on the ranks other than 0 of a torchrun launch")
        from .fanout import serve_plans

        return serve_plans(self.parallel, self.engine)

    def _check_rank0(self) -> None:
        if self.rank != 0:
            raise UserError(
                f"rank {self.rank} of a torchrun launch runs rank 0's plans: make requests on rank 0 "
                "and call llm.serve_plans() on the others"
            )

    # ---- settings -------------------------------------------------------------------------
    def random_prompt(self, num_tokens: int, seed: int = 0) -> list[int]:
        """A prompt of exactly num_tokens random ids (benchmarks, synthetic models)."""
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.config.vocab_size, (num_tokens,), generator=generator).tolist()

    def encode(self, request: Request) -> list[int]:
        """A checked request's prompt as token ids (through the chat template for messages)."""
        if request.messages is not None:
            return self.tokenizer.encode_chat(request.messages)
        if request.token_ids is not None:
            return check_token_ids(request.token_ids, self.config.vocab_size)
        ids = self.tokenizer.encode_long(request.prompt)
        if not ids:
            raise UserError("the prompt is empty", field="prompt")
        return ids

    def _resolve(self, request: Request) -> dict[str, Any]:
        """A checked request -> the fields of its engine Sequence (token ids, sampling over the
        checkpoint's defaults with the seed drawn, limits): refused here, in the caller's thread,
        when the model or the device could never run it."""
        ids = self.encode(request)
        d = self.generation_defaults
        seed = request.seed if request.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        params = SamplingParams(
            temperature=d.temperature if request.temperature is None else float(request.temperature),
            top_k=d.top_k if request.top_k is None else int(request.top_k),
            top_p=d.top_p if request.top_p is None else float(request.top_p),
            seed=seed,
            **self._processor_settings(request),
        )
        new = request.new_tokens
        needed = len(ids) + new
        if request.max_context is not None and request.max_context < needed:
            raise UserError(
                f"max_context {request.max_context:,} is less than prompt ({len(ids):,}) + "
                f"max_new_tokens ({new:,}) = {needed:,}"
            )
        context = request.max_context or needed
        self.check_context(context, request.allow_extrapolation)
        self.check_fits(context, len(ids))
        eos = frozenset() if request.ignore_eos else frozenset(self.eos_ids)
        return dict(
            prompt_ids=ids, params=params, max_new_tokens=new, context=context, stops=request.stops,
            eos_ids=eos, want_logprobs=bool(request.logprobs or request.top_logprobs),
            reuse_prefix=request.reuse_prefix is not False, stop_ids=frozenset(request.stop_token_ids or ()),
            want_top=request.top_logprobs or 0,
            speculate=self.speculate if request.speculate is None else request.speculate,
        )  # fmt: skip

    def _processor_settings(self, request: Request) -> dict[str, Any]:
        """A checked request's logits-processor settings for its SamplingParams (neutral where
        unset), their token ids checked against the vocabulary."""
        vocab = self.config.vocab_size
        with about("logit_bias"):
            bias = logit_bias_ids(request.logit_bias) if request.logit_bias else None
            check_in_vocab(list(bias or ()), vocab, "logit_bias token ids")
        with about("stop_token_ids"):
            stop_ids = check_in_vocab(list(request.stop_token_ids or ()), vocab, "stop_token_ids")
        min_tokens = request.min_tokens or 0
        eos = frozenset() if request.ignore_eos else frozenset(self.eos_ids)
        repetition = request.repetition_penalty
        end_ids = eos | frozenset(stop_ids) if min_tokens else frozenset()  # what min_tokens holds back
        return dict(
            logit_bias=bias, min_tokens=min_tokens, end_ids=end_ids,
            repetition_penalty=1.0 if repetition is None else float(repetition),
            presence_penalty=float(request.presence_penalty or 0),
            frequency_penalty=float(request.frequency_penalty or 0),
        )  # fmt: skip

    def check_context(
        self,
        context: int,
        allow_extrapolation: bool | None = False,
        what: str = "max_context, else prompt + max_new_tokens",
        opt_in: str = "allow_extrapolation (--allow-extrapolation)",
    ) -> bool:
        """Refuse a context this model could never run: past the positions it was trained for
        (unless allow_extrapolation), or past a sliding window (not implemented). -> whether it
        extrapolates (past the trained positions, allowed). `what` and `opt_in` name the caller's
        own fields in the refusal (the server's clients send max_tokens)."""
        cfg = self.config
        # Synthetic models are noise at any length: only their speed matters, so no position limit.
        beyond = context > cfg.max_position_embeddings and not self.synthetic
        if beyond and not allow_extrapolation:
            raise UserError(
                f"a context of {context:,} positions ({what}) exceeds the {cfg.max_position_embeddings:,} "
                f"the model was trained for; shorten it or opt in with {opt_in}"
            )
        if cfg.sliding_window is not None and context > cfg.sliding_window:
            raise UserError(
                f"this model uses sliding-window attention ({cfg.sliding_window:,} tokens), which minidecode "
                f"does not implement; keep prompt + max_new_tokens within {cfg.sliding_window:,} tokens"
            )
        return beyond

    def check_fits(self, context: int, prompt_len: int) -> None:
        """Refuse a context whose cache and prefill could never fit this device (beside the
        weights, with the engine's cache given back): the memory plan's one line."""
        engine = self.engine
        free = self.loop.free_bytes() + engine.cache_bytes  # (the least over the ranks)
        check_fits(engine, engine.region_size(context), prompt_len, context, free)

    def _request(self, prompt: Any, settings: dict[str, Any]) -> Request:
        """The one Request of a call's prompt and keyword settings, checked."""
        check_known(settings, "setting")
        if isinstance(prompt, Request):
            return prompt.with_defaults(Request(**settings)).check()
        return Request(prompt=prompt, **settings).check()

    # ---- generation ---------------------------------------------------------------------------
    def stream(
        self,
        prompt: str | Request | None = None,
        *,
        on_prefill_progress: Callable[[int, int], None] | None = None,
        **settings: Any,
    ) -> Stream:
        """Like `generate` for one prompt, but yields text pieces as they are decoded; `.result`
        is the GenerationResult afterwards. The request runs in the model's engine loop with any
        other thread's requests (one batch); a bad request raises UserError here."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        seq = self.submit(self._request(prompt, settings), events.put, on_prefill_progress)
        return Stream(self.loop, seq, events)

    def submit(
        self,
        request: Request,
        sink: Callable[[Event], None],
        on_prefill_progress: Callable[[int, int], None] | None = None,
    ) -> Sequence:
        """Queue a checked request in the engine loop; its events go to `sink` (called from the
        loop's thread). A request the model or the device could never run raises UserError here.
        -> its Sequence (abort it with `llm.loop.abort([seq])`)."""
        self._check_rank0()
        seq = Sequence(**self._resolve(request), sink=sink, on_progress=on_prefill_progress)
        self.loop.submit([seq])
        return seq

    def generate(self, prompt: str | Request | list[Prompt] | None = None, **settings: Any) -> Any:
        """Generate a continuation of `prompt` (or of `token_ids=`, or a chat reply to
        `messages=`); the keywords are `Request`'s fields (max_new_tokens, temperature, top_k,
        top_p, seed, stop, max_context, allow_extrapolation, logprobs, ignore_eos, reuse_prefix,
        logit_bias, min_tokens, repetition_penalty, presence_penalty, frequency_penalty,
        stop_token_ids, top_logprobs, speculate). Sampling defaults come from the checkpoint's
        generation_config.json (greedy when it does not sample); temperature=0 is greedy. A list of
        prompts runs as one batch and returns a list of results in order (see `stream_batch`)."""
        if isinstance(prompt, list | tuple):
            return self.generate_batch(prompt, **settings)
        with self.stream(prompt, **settings) as stream:
            for _ in stream.events():
                pass
        return stream.result

    def generate_batch(self, prompts: list[Prompt], **defaults: Any) -> list[GenerationResult]:
        """Every prompt's result, in order; a refused one has finish_reason "error" and `.error`."""
        with self.stream_batch(prompts, **defaults) as stream:
            for _ in stream:
                pass
        return stream.results

    def stream_batch(
        self,
        prompts: list[Prompt],
        *,
        on_result: Callable[[int, GenerationResult], None] | None = None,
        **defaults: Any,
    ) -> BatchStream:
        """Run many prompts together; iterate for (prompt index, text piece) as they are decoded.
        Each item is a text, a list of token ids, a list of chat messages, a `Request`, or a dict
        of Request fields; `defaults` (Request settings) apply where an item sets none.
        `on_result(index, result)` is called as each request ends. A request that is refused
        gets a result with finish_reason "error" and the reason in `.error`; the others go on.
        Each request yields the tokens it would alone (greedy; seeded sampling too)."""
        self._check_rank0()
        if not isinstance(prompts, list | tuple) or not prompts:
            raise UserError("give a non-empty list of prompts")
        base = Request.settings(defaults, "batch setting")
        events: queue.SimpleQueue = queue.SimpleQueue()
        results: list[GenerationResult | None] = [None] * len(prompts)
        seqs = []
        for i, item in enumerate(prompts):
            try:
                request = Request.from_prompt(item).with_defaults(base).check()
                seqs.append(Sequence(**self._resolve(request), sink=events.put, index=i))
            except UserError as e:
                results[i] = GenerationResult("", [], [], "error", GenerationStats(), error=str(e))
        if seqs:
            self.loop.submit(seqs)
        return BatchStream(self.loop, seqs, results, events, on_result)

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """float32 logits [T, V] of every position of `token_ids`, in one causal pass (scoring)."""
        self._check_rank0()
        ids = check_token_ids(token_ids, self.config.vocab_size)
        return self.loop.call(lambda: self.loop.execute(StepPlan(score=ids)).logits)

    def release_cache(self) -> None:
        """Free the KV cache and every cached prefix (between requests: its memory for others)."""
        self._check_rank0()
        self.loop.call(lambda: self.loop.execute(self.loop.scheduler.clear()))

    def close(self) -> None:
        """Stop the engine loop (requests still running get an error) and free the cache."""
        self.loop.close()
        self.engine.release()

    # ---- cache files --------------------------------------------------------------------------
    @property
    def identity(self) -> dict[str, str]:
        """What a saved cache must match: a hash of config.json (of the preset for a synthetic
        model), a fingerprint of the loaded weights (computed once; under --tp, of this rank's
        shard: each rank's part records its own) and the cache dtype."""
        if self._identity is None:
            config = (
                self.name.encode()
                if self.model_dir is None
                else (self.model_dir / "config.json").read_bytes()
            )
            self._identity = {
                "config_sha256": config_hash(config),
                "weights_fingerprint": self.loop.call(self.engine.files.fingerprint),
                "cache_dtype": str(self._layout(1)["k"][0]).removeprefix("torch."),
            }
        return self._identity

    def _layout(self, length: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """{name: (dtype, shape)} of a saved cache's tensors holding `length` positions (this
        rank's KV heads)."""
        return self.engine.files.layout(length)

    def save_cache(self, path: str | Path) -> int:
        """Save the last finished request's cache (its prompt and the answer tokens fed back) to
        `path`, a safetensors file, atomically; returns its size in bytes. Under torchrun every
        rank saves its part of it (--tp: its KV heads; --cp: its positions) in the same plan: rank
        0's to `path`, rank k's beside it (cache_file.part_path); the size is all the parts'."""
        identity = self.identity

        def save() -> int:
            prefix = self.loop.scheduler.latest()
            if prefix is None:
                raise UserError("there is no prefilled cache to save: run a request first")
            meta = {key: identity[key] for key in ("config_sha256", "cache_dtype")}
            meta.update(rope_length=str(prefix.angles_len), save_id=uuid.uuid4().hex)
            return sum(self._file_plan(FileSave(Path(path), prefix.start, prefix.ids, meta)))

        return self.loop.call(save)

    def load_cache(self, path: str | Path) -> int:
        """Check the cache file at `path` against this model (refusing a mismatch) and keep it as a
        cached prefix: a request that starts with its tokens reads them from the file instead of
        prefilling them. Returns the number of tokens it holds. Under torchrun every rank opens
        and checks its own part."""
        if not self.loop.scheduler.prefix_reuse:
            raise UserError("prefix reuse is off (prefix_reuse=False): a loaded cache would never be used")
        path = Path(path)
        identity = {key: self.identity[key] for key in ("config_sha256", "cache_dtype")}

        def load() -> int:
            parts = self._file_plan(FileOpen(path, identity))
            others = [part_path(path, r, len(parts)).name for r, p in enumerate(parts) if p != parts[0]]
            if others:
                tp, cp = self.parallel.tp, self.parallel.cp
                raise UserError(
                    f"cache file {path} and its part {others[0]} were written by different saves: "
                    f"save it again under {launch_name(tp, cp)}"
                )
            file = self.engine.files.opened[path]
            angles = int(file.metadata.get("rope_length", file.length))
            self.loop.scheduler.add_file(file, angles)
            return file.length

        return self.loop.call(load)

    def _file_plan(self, op: FileSave | FileOpen) -> list:
        """Run a cache file's save or open on every rank -> each rank's answer."""
        out = self.loop.execute(StepPlan(file=op))
        if out.file_error is not None:
            raise UserError(out.file_error)
        return out.file_results

    @property
    def kv_cache_dtype(self) -> str:
        return kv_dtype_name(self.kv_dtype)


_default: tuple[tuple, LLM] | None = None  # (load arguments, model) of the one-call function
_default_lock = threading.Lock()


def generate(
    prompt: str | None = None,
    *,
    model: str | Path | None = None,
    device: str | None = None,
    dtype: str | None = None,
    **settings: Any,
) -> GenerationResult:
    """One-call convenience: load `model` (kept for the next call with the same arguments) and
    generate. `minidecode.generate("def fib(n):")` uses the shipped model."""
    global _default
    key = (str(model), device, dtype)
    with _default_lock:  # two threads' first calls load one model, not two
        if _default is None or _default[0] != key:
            _default = (key, LLM(model, device=device, dtype=dtype))
        llm = _default[1]
    return llm.generate(prompt, **settings)

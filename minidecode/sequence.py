"""A request's life in the engine: the `Sequence` the engine loop runs (prompt ids and resolved
settings, then its region, tokens and text), and what it returns (`GenerationResult` with its
`GenerationStats`)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .sampling import SamplingParams
from .tokenizer import StreamDecoder

_ids = itertools.count()


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt positions whose K/V came from the cache (or a cache file)
    prefilled_tokens: int = 0  # prompt positions computed by this request's prefill
    cache_load_seconds: float = 0.0  # reading a loaded cache file onto the device (within TTFT)
    prefill_seconds: float = 0.0
    prefill_tokens_per_s: float = 0.0
    time_to_first_token: float = 0.0  # from the request's arrival to its first new token on the host
    new_tokens: int = 0
    decode_seconds: float = 0.0  # first new token to last: prefill excluded
    decode_tokens_per_s: float = 0.0
    peak_memory_bytes: int = 0
    kv_cache_dtype: str = ""  # what the KV cache stored: the model's dtype, or "fp8_e4m3"
    weights: str = ""  # which weights ran: the model's dtype, or their FP8 scheme
    prefill_attention: str = ""  # what prefill attention ran: an SDPA backend, or "fp8"
    decode_steps: int = 0  # decode steps the sequence ran in (with speculation, fewer than its tokens)
    proposed_tokens: int = 0  # speculation: draft tokens verified, and those kept
    accepted_tokens: int = 0

    def summary(self) -> str:
        """The stats line: `prompt 1,120 tok (1,089 from the cache), prefill 0.01 s (...) ...`."""
        return (
            f"prompt {self.prompt_tokens:,} tok"
            + (f" ({self.reused_tokens:,} from the cache)" if self.reused_tokens else "")
            + f", prefill {self.prefill_seconds:.2f} s "
            f"({self.prefill_tokens_per_s:,.0f} tok/s), TTFT {self.time_to_first_token:.3f} s | "
            f"{self.new_tokens:,} new tok, decode {self.decode_tokens_per_s:,.1f} tok/s | "
            f"peak memory {self.peak_memory_bytes / 2**30:.2f} GiB | KV cache {self.kv_cache_dtype}"
            + (f" | weights {self.weights}" if self.weights.startswith("fp8") else "")
            + (" | FP8 prefill attention" if self.prefill_attention == "fp8" else "")
            + (
                f" | drafts {self.accepted_tokens:,} of {self.proposed_tokens:,} accepted, "
                f"{self.decode_steps:,} steps"
                if self.proposed_tokens
                else ""
            )
        )


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # the new tokens only (an end-of-sequence token is not one)
    prompt_token_ids: list[int]
    finish_reason: str  # "eos", "stop" (a stop string), "length", "abort", or "error"
    stats: GenerationStats
    logprobs: list[float] | None = None  # log p(token) of each new token, when asked for
    error: str | None = None  # why a request was refused or failed (finish_reason "error")
    # per new token, its top_logprobs most likely (token id, log p), most likely first (when asked for)
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class Sequence:
    """One request in the engine: its prompt ids and resolved settings (sampling over the
    checkpoint's defaults, the seed drawn), then its run."""

    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    context: int  # positions it needs: max_context, else prompt + max_new_tokens
    stops: list[str]
    eos_ids: frozenset[int]  # ends generation (not returned), unless ignore_eos
    want_logprobs: bool
    reuse_prefix: bool
    sink: Callable[[Event], None]  # where its events go (the caller's queue)
    index: int = 0  # the caller's index of this request (a prompt list's position)
    stop_ids: frozenset[int] = frozenset()  # stop_token_ids: end generation (not returned), "stop"
    want_top: int = 0  # top_logprobs: how many most likely alternatives each new token reports
    on_progress: Callable[[int, int], None] | None = None  # prefill progress (done, total)
    speculate: int = 0  # the most draft tokens a decode step verifies (0: no speculation)
    id: int = field(default_factory=lambda: next(_ids))
    arrived: float = field(default_factory=time.perf_counter)
    # the run (the engine loop's thread only)
    start: int = -1  # its region of the cache row: [start, start + size)
    size: int = 0
    reused: int = 0  # prompt positions taken from a cached prefix
    reused_angles: int = 0  # that prefix's longest RoPE pass (dynamic NTK / LongRoPE reuse rule)
    sampled: list[int] = field(default_factory=list)  # every token drawn, an end-of-sequence one too
    token_ids: list[int] = field(default_factory=list)  # the new tokens returned (no end-of-sequence)
    fed: int = 0  # how many of `sampled` a decode step has written into the cache
    skip: bool = False  # its row's next hand-out is the first token, already handed out
    aborted: bool = False  # its caller has gone: it ends at the next step boundary
    prefill_began: float = 0.0  # when its prefill's first unit was queued
    t_first: float = 0.0  # when its first and its latest token were handed out
    t_last: float = 0.0
    finish_reason: str = "length"
    stats: GenerationStats = field(default_factory=GenerationStats)
    text: TextStream | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    ready_drafts: int = 0  # the drafts its row had ready for a step, as last seen (StepOutput.draft_lens)

    @property
    def max_drafts(self) -> int:
        """The most drafts a step of it verifies: `speculate`, or 0 for a sequence with log-probs
        or a logits processor (exact one token a step: its one query row is the plain step's)."""
        return 0 if self.want_logprobs or self.want_top or self.params.adjusts else self.speculate

    @property
    def draft_end(self) -> int:
        """The last sequence position a draft of it may take: a step's tokens stay within
        max_new_tokens and its K/V within the positions its region was made for."""
        return min(len(self.prompt_ids) + self.max_new_tokens - 2, self.context - 1)

    @property
    def cached_ids(self) -> list[int]:
        """The token ids whose K/V its region holds, at positions 0..len-1."""
        return self.prompt_ids + self.sampled[: self.fed]


@dataclass
class Event:
    """What happened to a sequence: a new token (with the text it completes, maybe ""), or its
    end (`result`), or its refusal or failure (`error`, with `result` also set when it ran)."""

    index: int
    token: int | None = None
    piece: str = ""
    logprob: float | None = None
    result: GenerationResult | None = None
    error: str | None = None
    fatal: bool = False  # the error is the engine loop's failure, not this request's
    top_logprobs: list[tuple[int, float]] | None = None  # the token's most likely (id, log p), when asked

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None


class TextStream:
    """One sequence's new tokens -> text pieces: never a broken UTF-8 character, nothing past the
    first stop string (text that may still turn into one is held back)."""

    def __init__(self, tokenizer: Any, stops: list[str]):
        self.decoder = StreamDecoder(tokenizer)
        self.stops = stops
        self.text, self.emitted = "", 0  # all text decoded so far; how much of it was handed out
        self.hold = max((len(s) for s in stops), default=1) - 1  # a stop string may be forming
        self.stopped = False

    def push(self, token: int) -> str:
        """Add a token; -> the text that can be handed out now ("" if none)."""
        self.text += self.decoder.push(token)
        hits = [i for s in self.stops if (i := self.text.find(s, max(0, self.emitted - self.hold))) >= 0]
        if hits:
            self.text, self.stopped = self.text[: min(hits)], True
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

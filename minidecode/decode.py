"""The decode step: the device buffers of every decode row (`DecodeState`), one token for every
row through the model, the logits processors and the sampler (`decode_step`; its sampling,
`sample_rows`, also samples a mixed step's decode rows: engine.py), and its capture as a CUDA graph
(`capture`). The engine (engine.py) owns one DecodeState and replays the graphs.

Every step writes the tokens it feeds into the token history (the engine's `history`: the token at
each of a region's sequence positions, beside the cache's K/V), and where a row speculates the step
ends with the drafts of its next step, found on the device by prompt lookup over that history
(ops.prompt_lookup: what followed the latest earlier occurrence of the row's last tokens). A step
with drafts takes Q = k + 1 tokens a row, the row's token and up to k drafts, all through the model
at once, and keeps the longest verified prefix plus one token of the model's own (speculation.accept:
the drafts against what the step's own sampler draws at their positions), so a row moves on by
1..Q positions in one step. The drafts never cross to the host: a step with drafts is queued
without waiting for the one before, as a plain step is."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from minidecode.kernels import ops
from minidecode.models.cache import FP8, KVCache
from minidecode.models.llama import Transformer

from .errors import UserError
from .request import MAX_SPECULATE, MAX_TOP_LOGPROBS, check_int
from .sampling import ProcessorRows, SamplingRows, process, sample, top_logprobs
from .speculation import DraftCounts, accept, size_up

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # batch sizes a decode graph is captured for


def check_max_batch(max_batch: int) -> int:
    check_int("max_batch", max_batch, 1)
    if max_batch > BUCKETS[-1]:
        raise UserError(f"max_batch must be in [1, {BUCKETS[-1]}], got {max_batch}")
    return max_batch


def bucket(n: int) -> int:
    """The smallest bucket that holds n running sequences."""
    return next(b for b in BUCKETS if b >= n)


def draft_bucket(k: int, sizes: Sequence[int]) -> int:
    """The step's query rows a sequence for k drafts (k >= 1): 1 + the smallest draft size >= k
    (`sizes`: speculation.draft_sizes of the model)."""
    return 1 + size_up(k, sizes)


@dataclass
class DecodeState:
    """The decode step's device buffers, [B] each unless shown: a captured graph reads and writes
    exactly these, so they live as long as the engine. A step uses the first rows of a bucket
    (views)."""

    tokens: torch.Tensor  # int64: in, the last token; out, the next one
    positions: torch.Tensor  # int64: where the next token goes (+= 1 per step, active rows only)
    logprob: torch.Tensor  # float32: log p of the token just sampled (when asked for)
    sampling: SamplingRows  # each sequence's sampling settings
    starts: torch.Tensor  # int64: where each sequence's region begins in the cache row
    active: torch.Tensor  # int32 0/1: 0 is an idle slot (reads nothing, does not advance)
    # [B, MAX_TOP_LOGPROBS]: the most likely ids and their log p at the token just sampled (when asked for)
    top_ids: torch.Tensor  # int64
    top_logprob: torch.Tensor  # float32
    # Speculation, int64. Each row's settings: `speculate`, the most drafts a step of it verifies
    # (speculation.most_drafts of its setting: a draft size; 0: it makes none), `draft_end`, the
    # last sequence position a draft may take (its region, its max_new_tokens); `draft_k`, how many
    # its next lookup asks for (a draft size following its acceptance, at most speculate: 0 for an
    # idle row).
    speculate: torch.Tensor
    draft_end: torch.Tensor
    draft_k: torch.Tensor
    # Made by each step for the next (ops.prompt_lookup): drafts [B, MAX_SPECULATE], the first
    # draft_lens of which follow the row's token.
    drafts: torch.Tensor
    draft_lens: torch.Tensor
    # What the last step with drafts did, [B, 2 + MAX_SPECULATE] (one copy to the host): each row's
    # drafts verified, those kept, then the drafts it verified (the kept ones first).
    verdicts: torch.Tensor
    processors: ProcessorRows | None = None  # logits-processor state, once a sequence uses one

    @classmethod
    def zeros(cls, batch: int, device: torch.device) -> DecodeState:
        def new(dtype, *shape):
            return torch.zeros(batch, *shape, dtype=dtype, device=device)

        # active is int32, as the decode kernel's lengths (lengths * active stays int32)
        return cls(
            tokens=new(torch.long), positions=new(torch.long), logprob=new(torch.float32),
            sampling=SamplingRows.zeros(batch, device), starts=new(torch.long), active=new(torch.int32),
            top_ids=new(torch.long, MAX_TOP_LOGPROBS), top_logprob=new(torch.float32, MAX_TOP_LOGPROBS),
            speculate=new(torch.long), draft_end=new(torch.long), draft_k=new(torch.long),
            drafts=new(torch.long, MAX_SPECULATE), draft_lens=new(torch.long),
            verdicts=new(torch.long, 2 + MAX_SPECULATE),
        )  # fmt: skip

    @classmethod
    def idle(cls, batch: int, device: torch.device, spare: int) -> DecodeState:
        """`batch` idle rows (active 0) that read nothing and write only cache position `spare`
        (the spare granule): a warm-up's."""
        state = cls.zeros(batch, device)
        state.starts.fill_(spare)
        return state

    def add_processors(self, vocab: int) -> ProcessorRows:
        """The logits-processor state ([B, vocab] buffers), allocated on first use."""
        if self.processors is None:
            self.processors = ProcessorRows.zeros(self.tokens.shape[0], vocab, self.tokens.device)
        return self.processors

    def rows(self, n: int, first: int = 0) -> DecodeState:
        """Rows first..first+n-1, as views."""
        views = {name: t[first : first + n] for name, t in self._columns().items()}
        processors = None if self.processors is None else self.processors.rows(n, first)
        return DecodeState(**views, sampling=self.sampling.rows(n, first), processors=processors)

    def _columns(self) -> dict[str, torch.Tensor]:
        """The buffers with a row a sequence (all but sampling and processors)."""
        skip = ("sampling", "processors")
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}

    def move(self, src: int, dst: int) -> None:
        """Row src's sequence moves to row dst (device copies, ordered after queued steps)."""
        for t in self._columns().values():
            t[dst] = t[src]
        self.sampling.move(src, dst)
        if self.processors is not None:
            self.processors.move(src, dst)


@dataclass
class HostRows:
    """Pinned host copies of the first rows of a DecodeState's results, [B] each (the copies run
    beside the device's work): the tokens, their log p and top log-probs, the drafts ready for each
    row's next step (`draft_lens`, where rows speculate) and the last step with drafts' verdicts;
    `copied`, the CUDA event after the last copies (None on the CPU, where a copy is done when it
    returns)."""

    tokens: torch.Tensor  # int64
    logprob: torch.Tensor  # float32
    top_ids: torch.Tensor  # [B, MAX_TOP_LOGPROBS] int64
    top_logprob: torch.Tensor  # [B, MAX_TOP_LOGPROBS] float32
    draft_lens: torch.Tensor  # int64
    verdicts: torch.Tensor  # [B, 2 + MAX_SPECULATE] int64
    copied: torch.cuda.Event | None = None

    @classmethod
    def empty(cls, batch: int, pin: bool) -> HostRows:
        def new(dtype, *shape):
            return torch.empty(batch, *shape, dtype=dtype, pin_memory=pin)

        top, event = MAX_TOP_LOGPROBS, torch.cuda.Event() if pin else None
        return cls(
            new(torch.long), new(torch.float32), new(torch.long, top), new(torch.float32, top),
            new(torch.long), new(torch.long, 2 + MAX_SPECULATE), event,
        )  # fmt: skip

    def copy_from(
        self, state: DecodeState, n: int, logprobs: bool, top: bool, lookup: bool, verdicts: bool
    ) -> None:
        """Queue the copies of rows 0..n-1 (what the step's kind holds) after the queued work."""
        pairs = [(self.tokens, state.tokens)]
        if logprobs:
            pairs.append((self.logprob, state.logprob))
        if top:
            pairs += [(self.top_ids, state.top_ids), (self.top_logprob, state.top_logprob)]
        if lookup:
            pairs.append((self.draft_lens, state.draft_lens))
        if verdicts:
            pairs.append((self.verdicts, state.verdicts))
        for host, device in pairs:
            host[:n].copy_(device[:n], non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def wait(self) -> None:
        """Until the copies have landed."""
        if self.copied is not None:
            self.copied.synchronize()


@dataclass
class TokenHistory:
    """The token at each sequence position of every region, beside the cache (prompt lookup reads
    it): tokens [(capacity + granule) * scale] int64, where the region starting at cache position s
    keeps its sequence's positions 0.. at s * scale.. . scale is 1, or under context parallelism
    the ranks (a region holds a 1/scale share of its positions, the history all of them, alike on
    every rank). Written by whatever feeds a token to the model: the prefill (its prompt), each
    decode step (its rows' tokens and drafts; the rejected ones lie past the row's position and are
    overwritten later, as their K/V are), a cache file read."""

    tokens: torch.Tensor
    scale: int

    @classmethod
    def empty(cls, capacity: int, scale: int, device: torch.device) -> TokenHistory:
        return cls(torch.zeros(capacity * scale, dtype=torch.long, device=device), scale)

    def offsets(self, starts: torch.Tensor) -> torch.Tensor:
        """[B] int64: where each region's position 0 is."""
        return starts if self.scale == 1 else starts * self.scale

    def span(self, start: int, lo: int, hi: int) -> torch.Tensor:
        """The entries of positions lo..hi-1 of the region starting at `start` (a view)."""
        base = start * self.scale
        return self.tokens[base + lo : base + hi]

    def write(self, state: DecodeState, tokens: torch.Tensor, q_lens: torch.Tensor | None = None) -> None:
        """The tokens fed at each row's position: tokens [B] (a plain step), or [B, Q] at positions
        + 0, 1, ..., the first q_lens[b] of row b (a step with drafts). Idle rows' go to the spare
        granule's entries (their starts), the rest of a step with drafts' to the last entry: no
        region reads them."""
        at = self.offsets(state.starts) + state.positions  # [B]
        if q_lens is None:
            self.tokens[at] = tokens
            return
        Q = tokens.shape[1]
        j = torch.arange(Q, device=tokens.device)
        at = torch.where(j < q_lens[:, None], at[:, None] + j, self.tokens.shape[0] - 1)  # [B, Q]
        self.tokens[at.reshape(-1)] = tokens.reshape(-1)


def propose(history: TokenHistory, state: DecodeState) -> None:
    """Each row's drafts for its next step, by prompt lookup over its history and its token
    (ops.prompt_lookup): up to draft_k of them (<= speculate; 0 for idle rows and rows that do not
    speculate), none past draft_end."""
    want = torch.minimum(state.draft_k, state.draft_end - state.positions)  # drafts go at positions + 1..
    ops.prompt_lookup(
        history.tokens, history.offsets(state.starts), state.positions, state.tokens, want,
        state.drafts, state.draft_lens,
    )  # fmt: skip


def decode_step(
    model: Transformer,
    cache: KVCache,
    history: TokenHistory,
    state: DecodeState,
    mode: str,
    want_logprobs: bool,
    pdl: bool,
    adjust: bool = False,
    top: bool = False,
    queries: int = 1,
    spare: int = 0,
    lookup: bool = False,
    counts: DraftCounts | None = None,
) -> None:
    """One token for every row of `state`, reading and writing only its device buffers (so it can
    be captured in a CUDA graph): each row's sequence lives in its region of the cache's one row
    (state.starts); idle rows (state.active 0) read nothing. adjust: some row uses a logits
    processor (state.processors); top: some row reports its top log-probs (implies want_logprobs);
    lookup: some row speculates (the step ends with every row's next drafts: `propose`).

    queries > 1: the step with drafts (`draft_step`: `queries` - 1 draft slots a row, padding
    rows' K/V written at cache position `spare`; `counts`, the model's draft-count rule)."""
    if queries > 1:
        draft_step(model, cache, history, state, mode, queries, spare, pdl, counts, want_logprobs,
                   adjust, top)
    else:
        history.write(state, state.tokens)
        hidden = model.decode(
            state.tokens, state.positions, cache, pdl, starts=state.starts, active=state.active
        )
        sample_rows(model.logits(hidden), state, mode, want_logprobs, adjust, top)
    if lookup:
        propose(history, state)


def sample_rows(
    logits: torch.Tensor,
    state: DecodeState,
    mode: str,
    want_logprobs: bool,
    adjust: bool = False,
    top: bool = False,
) -> None:
    """The decode step's sampling of each row's next token from its logits [B, V] float32 (the
    decode step's, or a mixed step's decode rows': engine.py): the logits processors, the sampler,
    the log-probs asked for; then tokens <- the next tokens, positions += 1 (active rows)."""
    if adjust:  # rows that use no processor have neutral state: their logits pass unchanged
        positions = state.positions + 1
        nxt = sample(process(logits, state.processors, positions), state.sampling, positions, mode)  # [B]
        state.processors.count(nxt, state.active)
    else:
        nxt = sample(logits, state.sampling, state.positions + 1, mode)  # [B]
    if want_logprobs or top:
        record_logprobs(logits, nxt, state, top)
    state.tokens.copy_(nxt)
    state.positions.add_(state.active)


def record_logprobs(logits: torch.Tensor, nxt: torch.Tensor, state: DecodeState, top: bool) -> None:
    """state.logprob <- log p of each row's next token nxt [B] under the model's own distribution
    (logits [B, V] float32, not the processed ones); with `top`, its most likely ids too."""
    logprobs = logits.log_softmax(-1)  # [B, V]
    state.logprob.copy_(logprobs.gather(-1, nxt[:, None])[:, 0])
    if top:
        top_logprobs(logprobs, state.top_logprob, state.top_ids)


def draft_step(
    model: Transformer,
    cache: KVCache,
    history: TokenHistory,
    state: DecodeState,
    mode: str,
    queries: int,
    spare: int,
    pdl: bool,
    counts: DraftCounts,
    want_logprobs: bool = False,
    adjust: bool = False,
    top: bool = False,
) -> None:
    """The decode step with drafts: each row's token and its drafts (state.drafts, the first
    draft_lens of them, at most queries - 1: made by the step before) as `queries` query rows
    through the model at once (Transformer.decode_drafts), the accept rule (speculation.accept)
    on the tokens `sample` draws from each query row's logits at its position, as the plain step
    would there, then tokens <- the token after the kept drafts,
    verdicts <- (drafts verified, kept, the drafts), positions += kept + 1 (active rows), and each
    row's next lookup sized by its acceptance (counts: speculation.DraftCounts). The rejected drafts' K/V stay
    behind the new position, overwritten by later steps. Device work only, fixed shapes (a CUDA
    graph per `queries`).

    Rows with logits processors or log-probs make no drafts (their `speculate` is 0): their one
    query row is the plain step's, so adjust / want_logprobs / top do what decode_step does, on
    each row's first query row (a row with drafts uses no processor: its state is neutral)."""
    k = queries - 1
    drafts = state.drafts[:, :k]  # [B, k]
    draft_lens = torch.where(state.active > 0, state.draft_lens.clamp(max=k), 0)  # [B]
    q_lens = (draft_lens + 1).to(torch.int32)
    tokens = torch.cat((state.tokens[:, None], drafts), dim=1)  # [B, Q]
    history.write(state, tokens, q_lens)
    hidden = model.decode_drafts(
        tokens, state.positions, q_lens, cache, spare, pdl, starts=state.starts, active=state.active
    )
    logits = model.logits(hidden)  # [B, Q, V] float32
    chosen = logits
    if adjust:  # the first query rows processed, as decode_step processes its one
        first = process(logits[:, 0], state.processors, state.positions + 1)  # [B, V]
        chosen = torch.cat((first[:, None], logits[:, 1:]), dim=1)
    B, Q, V = logits.shape
    at = state.positions[:, None] + 1 + torch.arange(Q, device=logits.device)  # [B, Q] where each is drawn
    own = sample(chosen.reshape(B * Q, V), state.sampling.repeat(Q), at.reshape(-1), mode).view(B, Q)
    accepted, nxt = accept(drafts, own, draft_lens)
    if adjust:
        state.processors.count(nxt, state.active)
    if want_logprobs or top:  # rows that ask make no drafts: their next token follows query row 0
        record_logprobs(logits[:, 0], nxt, state, top)
    state.verdicts[:, : 2 + k] = torch.cat((draft_lens[:, None], accepted[:, None], drafts), dim=1)
    state.draft_k.copy_(counts.next(state.draft_k, draft_lens, accepted, state.speculate))
    state.tokens.copy_(nxt)
    state.positions.add_((accepted + 1) * state.active)


@functools.cache
def _warm_up_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for every warm-up: cuBLAS keeps a workspace per stream it ran
    on, so a new stream per capture would leave one more workspace allocated each time."""
    return torch.cuda.Stream(device)


def launch_config(model: Transformer, dtype: torch.dtype, cache: KVCache) -> int:
    """Which of the decode kernel's launch configs a step of a `dtype` model over `cache` takes (how
    many of ops.decode_cache_sizes its positions reach): a kernel of its own each, so a warm-up
    stands for every cache of the same config, and only for those."""
    cfg = model.config
    sizes = ops.decode_cache_sizes(cfg.head_dim, dtype, cache.dtype == FP8, cfg.num_kv_heads)
    return sum(cache.max_len >= size for size in sizes)


def capture(step: Callable[[], None], warm_up: Callable[[], None], pool: Any = None) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `step`, after `warm_up` ran once on a side stream (kernel compilation,
    workspaces, library handles: nothing may allocate or compile during capture); `pool`: a
    memory pool it shares with graphs that never run at the same time (torch.cuda.graph_pool_handle)."""
    stream = _warm_up_stream(torch.device("cuda", torch.cuda.current_device()))
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        warm_up()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # Captured on the side stream as torch.cuda.graph captures, but without its synchronize() and
    # empty_cache(): a capture records and launches nothing, so the queued steps run on during it
    # (a mixed step captures a graph at each new chunk size while streams wait: the ~15 ms of the
    # step before it would add to their gap), and with the allocator's cache freed every later
    # allocation would be a cudaMalloc again.
    with torch.cuda.stream(stream):
        graph.capture_begin(*([] if pool is None else [pool]))
        try:
            step()
        finally:
            graph.capture_end()
    return graph


class DecodeGraphs:
    """The decode step of rows 0..n-1 of `state` as one CUDA graph per (bucket, mode, log-probs,
    logits processors, top log-probs, query rows, lookup), captured on first use or ahead of it
    (`prepare`: before a prefill, so the capture stays out of the decode steps' time) and dropped
    with the cache their addresses are in (`reset`); eagerly where graphs are off. A graph's
    warm-up runs once a process for its key and launch config (`warmed`, kept over resets): after
    the cache grows, a capture is the recording alone (~half the time the streams wait)."""

    def __init__(
        self,
        model: Transformer,
        dtype: torch.dtype,
        state: DecodeState,
        max_batch: int,
        graphed: bool,
        pdl: bool,
        counts: DraftCounts,
    ):
        self.model, self.dtype, self.state, self.max_batch = model, dtype, state, max_batch
        self.graphed, self.pdl, self.counts = graphed, pdl, counts
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.warmed: set[tuple] = set()
        self.captures, self.capture_seconds = 0, 0.0

    def reset(self) -> None:
        self._graphs = {}

    def step(self, cache: KVCache, history: TokenHistory, spare: int, n: int, *kind: Any) -> None:
        """One step of rows 0..n-1 over `cache` and `history` (idle rows write position `spare`);
        kind: (mode, logprobs, adjust, top, queries, lookup) as decode_step takes them."""
        if not self.graphed:
            if kind[2]:  # adjust: the processors' buffers
                self.state.add_processors(self.model.config.vocab_size)
            decode_step(self.model, cache, history, self.state.rows(n), *self._args(kind, spare))
            return
        self.prepare(cache, history, spare, n, *kind)
        self._graphs[(min(bucket(n), self.max_batch), *kind)].replay()

    def prepare(self, cache: KVCache, history: TokenHistory, spare: int, n: int, *kind: Any) -> None:
        """Capture the graph of n rows' step (its bucket), once per cache allocation."""
        b = min(bucket(n), self.max_batch)
        if not self.graphed or (b, *kind) in self._graphs:
            return
        args, adjust = self._args(kind, spare), kind[2]
        if adjust:  # the graph reads the processors' buffers: they exist before it is captured
            self.state.add_processors(self.model.config.vocab_size)
        step = functools.partial(decode_step, self.model, cache, history, self.state.rows(b), *args)
        warm = (b, *kind, launch_config(self.model, self.dtype, cache))
        t0 = time.perf_counter()
        warm_up = lambda: None  # noqa: E731
        if warm not in self.warmed:
            warm_up = self._warm_up(cache, history, b, spare, adjust, args)
        self._graphs[(b, *kind)] = capture(step, warm_up)
        self.warmed.add(warm)
        self.captures += 1
        self.capture_seconds += time.perf_counter() - t0

    def _warm_up(
        self, cache: KVCache, history: TokenHistory, b: int, spare: int, adjust: bool, args: tuple
    ) -> Callable[[], None]:
        """A step of b idle rows (writing only the spare granule), run before a capture."""
        idle = DecodeState.idle(b, self.state.tokens.device, spare)
        if adjust:
            idle.add_processors(self.model.config.vocab_size)
        return functools.partial(decode_step, self.model, cache, history, idle, *args)

    def _args(self, kind: tuple, spare: int) -> tuple:
        mode, logprobs, adjust, top, queries, lookup = kind
        return mode, logprobs, self.pdl, adjust, top, queries, spare, lookup, self.counts

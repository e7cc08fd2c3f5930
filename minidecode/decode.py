"""The decode step: the device buffers of every decode row (`DecodeState`), one token for every
row through the model, the logits processors and the sampler (`decode_step`; its sampling,
`sample_rows`, also samples a mixed step's decode rows: engine.py), and its capture as a CUDA graph
(`capture`). The engine (engine.py) owns one DecodeState and replays the graphs.

With speculation the same step takes Q = k + 1 tokens a row: the row's last token and up to k
drafts (prompt lookup, made on the host: speculation.py), all through the model at once, and keeps
the longest verified prefix plus one token of the model's own (accept_greedy / accept_sampled), so
a row moves on by 1..Q positions in one step."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from minidecode.kernels import ops
from minidecode.models.cache import FP8, KVCache
from minidecode.models.llama import Transformer

from .errors import UserError
from .request import MAX_SPECULATE, MAX_TOP_LOGPROBS, check_int
from .sampling import GREEDY, ProcessorRows, SamplingRows, probabilities, process, sample, top_logprobs
from .speculation import accept_greedy, accept_sampled

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # batch sizes a decode graph is captured for
DRAFT_BUCKETS = (1, 2, 4, 8, MAX_SPECULATE)  # draft slots a row (query rows - 1) a graph is captured for


def check_max_batch(max_batch: int) -> int:
    check_int("max_batch", max_batch, 1)
    if max_batch > BUCKETS[-1]:
        raise UserError(f"max_batch must be in [1, {BUCKETS[-1]}], got {max_batch}")
    return max_batch


def bucket(n: int) -> int:
    """The smallest bucket that holds n running sequences."""
    return next(b for b in BUCKETS if b >= n)


def draft_bucket(k: int) -> int:
    """The step's query rows a sequence for k drafts (k >= 1): 1 + the smallest draft bucket >= k."""
    return 1 + next(b for b in DRAFT_BUCKETS if b >= k)


def step_queries(speculate: int) -> list[int]:
    """The query rows a sequence (1 + draft slots) that a step can take where its rows draft at
    most `speculate` tokens: 1 (a plain step), then draft_bucket(k) for k in 1..speculate; each is
    a graph of its own."""
    return [1, *sorted({draft_bucket(k) for k in range(1, speculate + 1)})]


@dataclass
class DecodeState:
    """The decode step's device buffers, [B] each: a captured graph reads and writes exactly these,
    so they live as long as the engine. A step uses the first rows of a bucket (views)."""

    tokens: torch.Tensor  # int64: in, the last token; out, the next one
    positions: torch.Tensor  # int64: where the next token goes (+= 1 per step, active rows only)
    logprob: torch.Tensor  # float32: log p of the token just sampled (when asked for)
    sampling: SamplingRows  # each sequence's sampling settings
    starts: torch.Tensor  # int64: where each sequence's region begins in the cache row
    active: torch.Tensor  # int32 0/1: 0 is an idle slot (reads nothing, does not advance)
    # [B, MAX_TOP_LOGPROBS]: the most likely ids and their log p at the token just sampled (when asked for)
    top_ids: torch.Tensor  # int64
    top_logprob: torch.Tensor  # float32
    # Speculation (a step with drafts): in, draft_table [B, 2 + MAX_SPECULATE] int64, each row's
    # lead (the token the host believes the row holds), draft_len, then drafts, the first draft_len
    # of which follow it (verified only where lead == tokens: a draft made before the row's last
    # token reached the host may be for another token), one table so that a plan's drafts cross in
    # one copy; out, accepted [B] int64, how many drafts were kept.
    draft_table: torch.Tensor
    accepted: torch.Tensor
    processors: ProcessorRows | None = None  # logits-processor state, once a sequence uses one

    @property
    def lead(self) -> torch.Tensor:  # [B]
        return self.draft_table[:, 0]

    @property
    def draft_lens(self) -> torch.Tensor:  # [B]
        return self.draft_table[:, 1]

    @property
    def drafts(self) -> torch.Tensor:  # [B, MAX_SPECULATE]
        return self.draft_table[:, 2:]

    @classmethod
    def zeros(cls, batch: int, device: torch.device) -> DecodeState:
        def new(dtype):
            return torch.zeros(batch, dtype=dtype, device=device)

        tokens, positions, starts = (new(torch.long) for _ in range(3))
        top_ids = torch.zeros(batch, MAX_TOP_LOGPROBS, dtype=torch.long, device=device)
        top_logprob = torch.zeros(batch, MAX_TOP_LOGPROBS, dtype=torch.float32, device=device)
        # active is int32, as the decode kernel's lengths (lengths * active stays int32)
        sampling, logprob, active = SamplingRows.zeros(batch, device), new(torch.float32), new(torch.int32)
        draft_table = torch.zeros(batch, 2 + MAX_SPECULATE, dtype=torch.long, device=device)
        return cls(
            tokens, positions, logprob, sampling, starts, active, top_ids, top_logprob, draft_table,
            new(torch.long),
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
        tokens, positions, logprob, starts, active, *rest = (x[first : first + n] for x in self._columns())
        processors = None if self.processors is None else self.processors.rows(n, first)
        # rest: top_ids, top_logprob, draft_table, accepted
        return DecodeState(
            tokens, positions, logprob, self.sampling.rows(n, first), starts, active, *rest, processors
        )  # fmt: skip

    def _columns(self) -> tuple[torch.Tensor, ...]:
        rows = self.tokens, self.positions, self.logprob, self.starts, self.active
        return (*rows, self.top_ids, self.top_logprob, self.draft_table, self.accepted)

    def load_drafts(self, drafts: list[list[int]], host: torch.Tensor) -> None:
        """A plan's drafts (a row's [lead, d1, ...], [] for none: lead 0, no drafts) into rows
        0..len-1 of draft_table, written into `host` (pinned [B, 2 + MAX_SPECULATE] int64) and
        copied to the device in one copy (the caller waits for the step before `host` is written
        again)."""
        n = len(drafts)
        table = host[:n].numpy()  # a view: no tensor is made
        table[:] = 0
        for i, row in enumerate(drafts):
            if row:
                table[i, 0], table[i, 1] = row[0], len(row) - 1
                table[i, 2 : len(row) + 1] = row[1:]
        self.draft_table[:n].copy_(host[:n], non_blocking=True)

    def move(self, src: int, dst: int) -> None:
        """Row src's sequence moves to row dst (device copies, ordered after queued steps)."""
        for t in self._columns():
            t[dst] = t[src]
        self.sampling.move(src, dst)
        if self.processors is not None:
            self.processors.move(src, dst)


@dataclass
class HostRows:
    """Pinned host copies of the first rows of a DecodeState's results, [B] each (the copies run
    beside the device's work): the tokens, their log p and top log-probs, and (a step with drafts)
    how many drafts each row kept; `copied`, the CUDA event after the last copies (None on the CPU,
    where a copy is done when it returns)."""

    tokens: torch.Tensor  # int64
    logprob: torch.Tensor  # float32
    top_ids: torch.Tensor  # [B, MAX_TOP_LOGPROBS] int64
    top_logprob: torch.Tensor  # [B, MAX_TOP_LOGPROBS] float32
    accepted: torch.Tensor  # int64
    copied: torch.cuda.Event | None = None

    @classmethod
    def empty(cls, batch: int, pin: bool) -> HostRows:
        def new(dtype, *shape):
            return torch.empty(batch, *shape, dtype=dtype, pin_memory=pin)

        top = MAX_TOP_LOGPROBS
        tokens, logprob, accepted = new(torch.long), new(torch.float32), new(torch.long)
        event = torch.cuda.Event() if pin else None
        return cls(tokens, logprob, new(torch.long, top), new(torch.float32, top), accepted, event)

    def copy_from(
        self, state: DecodeState, n: int, logprobs: bool, top: bool, accepted: bool = False
    ) -> None:
        """Queue the copies of rows 0..n-1 (what the step's kind holds) after the queued work."""
        pairs = [(self.tokens, state.tokens)]
        if logprobs:
            pairs.append((self.logprob, state.logprob))
        if top:
            pairs += [(self.top_ids, state.top_ids), (self.top_logprob, state.top_logprob)]
        if accepted:
            pairs.append((self.accepted, state.accepted))
        for host, device in pairs:
            host[:n].copy_(device[:n], non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def read(self, n: int, logprobs: bool, top: bool) -> tuple[list[int], list[float] | None, Any, Any]:
        """(tokens, log p or None, top ids [n, 20] or None, their log p or None) of rows 0..n-1,
        once the copies have landed (waited for here)."""
        if self.copied is not None:
            self.copied.synchronize()
        if not top:
            return self.tokens[:n].tolist(), self.logprob[:n].tolist() if logprobs else None, None, None
        return self.tokens[:n].tolist(), self.logprob[:n].tolist(), self.top_ids[:n], self.top_logprob[:n]


def decode_step(
    model: Transformer,
    cache: KVCache,
    state: DecodeState,
    mode: str,
    want_logprobs: bool,
    pdl: bool,
    adjust: bool = False,
    top: bool = False,
    queries: int = 1,
    spare: int = 0,
) -> None:
    """One token for every row of `state`, reading and writing only its device buffers (so it can
    be captured in a CUDA graph): each row's sequence lives in its region of the cache's one row
    (state.starts); idle rows (state.active 0) read nothing. adjust: some row uses a logits
    processor (state.processors); top: some row reports its top log-probs (implies want_logprobs).

    queries > 1: the step with drafts (`draft_step`: `queries` - 1 draft slots a row, padding
    rows' K/V written at cache position `spare`)."""
    if queries > 1:
        draft_step(model, cache, state, mode, queries, spare, pdl, want_logprobs, adjust, top)
        return
    hidden = model.decode(state.tokens, state.positions, cache, pdl, starts=state.starts, active=state.active)
    sample_rows(model.logits(hidden), state, mode, want_logprobs, adjust, top)


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
    state: DecodeState,
    mode: str,
    queries: int,
    spare: int,
    pdl: bool,
    want_logprobs: bool = False,
    adjust: bool = False,
    top: bool = False,
) -> None:
    """The decode step with drafts: each row's last token and its drafts (state.lead, drafts,
    draft_lens: up to queries - 1 of them, verified only where lead is the token the row holds) as
    `queries` query rows through the model at once (Transformer.decode_drafts), the accept rule on
    each row's logits (greedy: accept_greedy; sampling: accept_sampled, over the distributions
    `sample` draws from, its draws counted by position like sample's), then tokens <- the token
    after the kept drafts, accepted <- how many were kept, positions += accepted + 1 (active rows).
    The rejected drafts' K/V stay behind the new position, overwritten by later steps. Device
    work only, fixed shapes (a CUDA graph per `queries`).

    Rows with logits processors or log-probs get no drafts (the scheduler's rule): their one query
    row is the plain step's, so adjust / want_logprobs / top do what decode_step does, on each
    row's first query row (a row with drafts uses no processor: its state is neutral)."""
    k = queries - 1
    drafts = state.drafts[:, :k]  # [B, k]
    verified = (state.lead == state.tokens) & (state.active > 0)
    draft_lens = torch.where(verified, state.draft_lens.clamp(max=k), 0)  # [B]
    q_lens = (draft_lens + 1).to(torch.int32)
    tokens = torch.cat((state.tokens[:, None], drafts), dim=1)  # [B, Q]
    hidden = model.decode_drafts(
        tokens, state.positions, q_lens, cache, spare, pdl, starts=state.starts, active=state.active
    )
    logits = model.logits(hidden)  # [B, Q, V] float32
    chosen = logits
    if adjust:  # the first query rows processed, as decode_step processes its one
        first = process(logits[:, 0], state.processors, state.positions + 1)  # [B, V]
        chosen = torch.cat((first[:, None], logits[:, 1:]), dim=1)
    if mode == GREEDY:
        accepted, nxt = accept_greedy(drafts, chosen, draft_lens)
    else:
        B, Q, V = logits.shape
        probs = probabilities(chosen.reshape(B * Q, V), state.sampling.repeat(Q), mode).view(B, Q, V)
        accepted, nxt = accept_sampled(drafts, probs, draft_lens, state.sampling.seed, state.positions + 1)
    if adjust:
        state.processors.count(nxt, state.active)
    if want_logprobs or top:  # rows that ask make no drafts: their next token follows query row 0
        record_logprobs(logits[:, 0], nxt, state, top)
    state.accepted.copy_(accepted)
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
    logits processors, top log-probs, query rows), captured on first use or ahead of it
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
    ):
        self.model, self.dtype, self.state, self.max_batch = model, dtype, state, max_batch
        self.graphed, self.pdl = graphed, pdl
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.warmed: set[tuple] = set()
        self.captures, self.capture_seconds = 0, 0.0

    def reset(self) -> None:
        self._graphs = {}

    def step(self, cache: KVCache, spare: int, n: int, *kind: Any) -> None:
        """One step of rows 0..n-1 over `cache` (idle rows write position `spare`); kind: (mode,
        logprobs, adjust, top, queries) as decode_step takes them."""
        if not self.graphed:
            if kind[2]:  # adjust: the processors' buffers
                self.state.add_processors(self.model.config.vocab_size)
            decode_step(self.model, cache, self.state.rows(n), *self._args(kind, spare))
            return
        self.prepare(cache, spare, n, *kind)
        self._graphs[(min(bucket(n), self.max_batch), *kind)].replay()

    def prepare(self, cache: KVCache, spare: int, n: int, *kind: Any) -> None:
        """Capture the graph of n rows' step (its bucket), once per cache allocation."""
        b = min(bucket(n), self.max_batch)
        if not self.graphed or (b, *kind) in self._graphs:
            return
        args, adjust = self._args(kind, spare), kind[2]
        if adjust:  # the graph reads the processors' buffers: they exist before it is captured
            self.state.add_processors(self.model.config.vocab_size)
        step = functools.partial(decode_step, self.model, cache, self.state.rows(b), *args)
        warm = (b, *kind, launch_config(self.model, self.dtype, cache))
        t0 = time.perf_counter()
        warm_up = self._warm_up(cache, b, spare, adjust, args) if warm not in self.warmed else lambda: None
        self._graphs[(b, *kind)] = capture(step, warm_up)
        self.warmed.add(warm)
        self.captures += 1
        self.capture_seconds += time.perf_counter() - t0

    def _warm_up(self, cache: KVCache, b: int, spare: int, adjust: bool, args: tuple) -> Callable[[], None]:
        """A step of b idle rows (writing only the spare granule), run before a capture."""
        idle = DecodeState.idle(b, self.state.tokens.device, spare)
        if adjust:
            idle.add_processors(self.model.config.vocab_size)
        return functools.partial(decode_step, self.model, cache, idle, *args)

    def _args(self, kind: tuple, spare: int) -> tuple:
        mode, logprobs, adjust, top, queries = kind
        return mode, logprobs, self.pdl, adjust, top, queries, spare

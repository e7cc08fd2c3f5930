"""Next-token choice: greedy, temperature, top-k, top-p, per sequence, on the device, no host sync;
before it, for the sequences that ask, the logits processors (logit bias, min_tokens, repetition,
presence and frequency penalties: `process`).

Each sequence's settings live in device tensors (`SamplingRows`, and `ProcessorRows` once a
sequence uses a processor), so one captured decode step serves any mix of settings in a batch.
The randomness is a counter-based hash of (the request's seed, the position being sampled, the
token id): a seeded request draws the same tokens whatever batch it runs in, in whatever order,
and no generator state is shared between sequences.
"""

from __future__ import annotations

import functools
import math
import secrets
from dataclasses import dataclass

import torch

from .request import MAX_TOP_LOGPROBS, check_sampling

GREEDY, SAMPLE, FILTER = "greedy", "sample", "filter"  # what a batch's decode step must do


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1: no nucleus cut
    seed: int | None = None  # None: a fresh random seed per request
    # Logits processors, applied before temperature / top-k / top-p (these defaults: off)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_tokens: int = 0  # end_ids get -inf logits until this many new tokens were generated
    end_ids: frozenset[int] = frozenset()  # what would end the sequence: its eos ids and stop_token_ids
    repetition_penalty: float = 1.0  # over prompt + generated ids: > 0 logits divided, < 0 multiplied
    presence_penalty: float = 0.0  # subtracted once from each generated id's logit
    frequency_penalty: float = 0.0  # subtracted per occurrence of each generated id

    def validate(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p, self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts(self) -> bool:
        """Whether a logits processor changes this sequence's logits (its step then runs `process`)."""
        return (
            bool(self.logit_bias)
            or (self.min_tokens > 0 and bool(self.end_ids))
            or self.repetition_penalty != 1
            or self.presence_penalty != 0
            or self.frequency_penalty != 0
        )

    @property
    def mode(self) -> str:
        """GREEDY, SAMPLE (no cuts) or FILTER (top-k / top-p cuts)."""
        if self.greedy:
            return GREEDY
        return FILTER if self.top_k or self.top_p < 1 else SAMPLE


def batch_mode(params: list[SamplingParams]) -> str:
    """The least work that serves every sequence: FILTER if any cuts, SAMPLE if any samples."""
    modes = {p.mode for p in params}
    return FILTER if FILTER in modes else SAMPLE if SAMPLE in modes else GREEDY


@dataclass
class SamplingRows:
    """Per-sequence sampling settings, [B] device tensors each (a captured step reads them)."""

    temperature: torch.Tensor  # float32, 0: greedy
    top_k: torch.Tensor  # int64, 0: no cut
    top_p: torch.Tensor  # float32, 1: no cut
    seed: torch.Tensor  # int64 in [0, 2^63)

    @classmethod
    def zeros(cls, batch: int, device: torch.device) -> SamplingRows:
        dtypes = (torch.float32, torch.long, torch.float32, torch.long)
        return cls(*(torch.zeros(batch, dtype=dtype, device=device) for dtype in dtypes))

    def set(self, row: int, params: SamplingParams) -> None:
        """Row `row` takes `params`; an unseeded request gets a fresh random seed."""
        seed = secrets.randbits(63) if params.seed is None else params.seed
        values = (params.temperature, params.top_k, params.top_p, seed)
        for tensor, value in zip(self.tensors(), values, strict=True):
            tensor[row] = value

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.temperature, self.top_k, self.top_p, self.seed

    def rows(self, n: int, first: int = 0) -> SamplingRows:
        """Rows first..first+n-1 (views: a graph captured on them sees later writes)."""
        return SamplingRows(*(t[first : first + n] for t in self.tensors()))

    def move(self, src: int, dst: int) -> None:
        for t in self.tensors():
            t[dst] = t[src]

    def repeat(self, q: int) -> SamplingRows:
        """Each row's settings q times in a row ([B * q]: a sequence's q query rows; no host sync)."""
        return SamplingRows(*(t[:, None].expand(-1, q).reshape(-1) for t in self.tensors()))


@dataclass
class ProcessorRows:
    """Per-sequence logits-processor state, device tensors that a captured step reads, [B] or
    [B, V] each (V: the vocabulary). Allocated once a sequence first uses a processor; a row is
    written when its sequence starts (`set`: every row of a started sequence, neutral values for
    one that uses none) and its counts grow in the decode step (`count`), so no step syncs."""

    bias: torch.Tensor  # [B, V] float32: added to the logits (logit_bias; 0 elsewhere)
    end_mask: torch.Tensor  # [B, V] bool: the ids min_tokens holds back (eos ids, stop_token_ids)
    min_end: torch.Tensor  # [B] int64: a token sampled for a position below it cannot be end_mask's
    prompt_seen: torch.Tensor  # [B, V] bool: the prompt's ids (repetition penalty)
    counts: torch.Tensor  # [B, V] int32: how often each id was generated so far
    repetition: torch.Tensor  # [B] float32, 1: off
    presence: torch.Tensor  # [B] float32, 0: off
    frequency: torch.Tensor  # [B] float32, 0: off

    @classmethod
    def zeros(cls, batch: int, vocab: int, device: torch.device) -> ProcessorRows:
        def new(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(
            bias=new(batch, vocab, dtype=torch.float32),
            end_mask=new(batch, vocab, dtype=torch.bool),
            min_end=new(batch, dtype=torch.long),
            prompt_seen=new(batch, vocab, dtype=torch.bool),
            counts=new(batch, vocab, dtype=torch.int32),
            repetition=torch.ones(batch, dtype=torch.float32, device=device),
            presence=new(batch, dtype=torch.float32),
            frequency=new(batch, dtype=torch.float32),
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (
            self.bias, self.end_mask, self.min_end, self.prompt_seen, self.counts,
            self.repetition, self.presence, self.frequency,
        )  # fmt: skip

    def rows(self, n: int, first: int = 0) -> ProcessorRows:
        """Rows first..first+n-1 (views: a graph captured on them sees later writes)."""
        return ProcessorRows(*(t[first : first + n] for t in self.tensors()))

    def move(self, src: int, dst: int) -> None:
        for t in self.tensors():
            t[dst] = t[src]

    def set(self, row: int, params: SamplingParams, prompt_ids: list[int], position: int) -> None:
        """Row `row` starts a sequence with `params` whose first new token goes at `position`
        (the prompt's length); its counts start at zero."""
        device = self.bias.device
        self.bias[row] = 0
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
            values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
            self.bias[row, ids] = values
        self.end_mask[row] = False
        if params.min_tokens and params.end_ids:
            self.end_mask[row, torch.tensor(sorted(params.end_ids), dtype=torch.long, device=device)] = True
        self.min_end[row] = position + params.min_tokens
        self.prompt_seen[row] = False
        if params.repetition_penalty != 1:
            self.prompt_seen[row, torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True
        self.counts[row] = 0
        self.repetition[row] = params.repetition_penalty
        self.presence[row] = params.presence_penalty
        self.frequency[row] = params.frequency_penalty

    def count(self, tokens: torch.Tensor, active: torch.Tensor) -> None:
        """tokens [B] int64 were just sampled: each active row (active [B] int32 0/1) counts its."""
        self.counts.scatter_add_(1, tokens[:, None], active[:, None])


def process(logits: torch.Tensor, rows: ProcessorRows, positions: torch.Tensor) -> torch.Tensor:
    """logits [B, V] float32 -> the logits to sample from, [B, V], in vLLM's and transformers'
    order: logit bias (added), min_tokens (end ids at -inf while the token's position [B] int64 is
    below min_end), repetition penalty over prompt + generated ids (transformers'
    RepetitionPenaltyLogitsProcessor), then presence and frequency penalties over the generated
    ids (OpenAI's formula: logit -= frequency * count + presence * (count > 0))."""
    x = logits + rows.bias
    early = (positions < rows.min_end)[:, None]  # [B, 1]
    x = x.masked_fill(rows.end_mask & early, -math.inf)
    generated = rows.counts > 0  # [B, V]
    penalty = rows.repetition[:, None]  # [B, 1]
    penalized = torch.where(x < 0, x * penalty, x / penalty)
    x = torch.where(rows.prompt_seen | generated, penalized, x)
    x = x - rows.frequency[:, None] * rows.counts
    return x - rows.presence[:, None] * generated


def top_logprobs(logprobs: torch.Tensor, values: torch.Tensor, ids: torch.Tensor) -> None:
    """The MAX_TOP_LOGPROBS most likely of logprobs [B, V] (most likely first) into values [B, 20]
    float32 and ids [B, 20] int64 (a sequence keeps as many as it asked for)."""
    k = min(MAX_TOP_LOGPROBS, logprobs.shape[-1])
    top = logprobs.topk(k, dim=-1)
    values[:, :k].copy_(top.values)
    ids[:, :k].copy_(top.indices)


def sample(logits: torch.Tensor, rows: SamplingRows, positions: torch.Tensor, mode: str) -> torch.Tensor:
    """logits [B, V] float32 -> next token ids [B] int64. positions [B] int64: where each sampled
    token goes (the random draw's counter). mode: GREEDY (every row argmax), SAMPLE (some rows
    sample, none cut), FILTER (some rows cut by top-k / top-p). Greedy rows stay argmax in any mode."""
    greedy = argmax(logits)
    if mode == GREEDY:
        return greedy
    probs = _probs(logits, rows, mode)
    # Exponential race: argmax(p_i / E_i), E_i ~ Exponential(1) i.i.d., picks i with probability
    # p_i (like torch.multinomial, but with no host sync and with E from the counter-based hash).
    noise = -torch.log(_uniform(rows.seed, positions, logits.shape[-1]))  # [B, V]
    drawn = argmax(probs / noise)
    return torch.where(rows.temperature > 0, drawn, greedy)


def _probs(logits: torch.Tensor, rows: SamplingRows, mode: str) -> torch.Tensor:
    """logits [B, V] float32 -> the distribution [B, V] a sampling row draws from (temperature,
    then FILTER's top-k / top-p cuts); a greedy row's is its softmax (sample takes its argmax)."""
    temperature = rows.temperature[:, None]  # [B, 1]
    scaled = logits / torch.where(temperature > 0, temperature, 1.0)
    if mode == FILTER:
        scaled = _cut(scaled, rows.top_k, rows.top_p)
    return scaled.softmax(dim=-1)


def _cut(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per-row top-k then top-p (nucleus) cuts as transformers' warpers make them: top-k keeps the
    tokens >= the k-th largest logit (ties kept); top-p then keeps the smallest set of most likely
    tokens whose mass reaches top_p (always the most likely one). top_k [B] (0: off), top_p [B]."""
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    k = torch.where(top_k > 0, top_k.clamp(max=V), V)  # [B]
    kth = sorted_logits.gather(-1, (k - 1)[:, None])  # [B, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, -math.inf)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
    drop_sorted = (before >= top_p[:, None]) & (top_p[:, None] < 1)
    drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)  # back to token order
    return logits.masked_fill(drop | (logits < kth), -math.inf)


_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # a 32-bit mixing multiplier < 2^31: int64 products never overflow


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) of int64 values in [0, 2^32)."""
    x = ((x ^ (x >> 16)) * _MUL) & _M32
    x = ((x ^ (x >> 16)) * _MUL) & _M32
    return x ^ (x >> 16)


def _uniform(seed: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32 uniforms in (0, 1) from hash(seed [B], position [B], token id)."""
    key = _mix32(_mix32(seed & _M32) ^ (seed >> 32)) ^ _mix32(positions & _M32)  # [B]
    ids = torch.arange(vocab, device=seed.device)
    bits = _mix32(_mix32(key[:, None] ^ ids[None, :]) ^ key[:, None])  # [B, V] in [0, 2^32)
    return ((bits >> 8).float() + 0.5) * 2.0**-24  # 24 random bits: exact in float32, never 0 or 1


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [B, V] -> [B] int64, the first index of each row's max, as torch.argmax gives it.

    In two passes over rows of ~sqrt(V): one reduction over a 128k vocabulary runs one block per
    row, which leaves most SMs idle in every decode step; the two passes spread it over many.
    The first row holding the max holds its first index, so ties resolve as torch.argmax's do.
    """
    width = _row_width(x.shape[-1]) if x.dim() == 2 else None
    if width is None:
        return x.argmax(dim=-1)
    values, within = x.view(x.shape[0], -1, width).max(dim=-1)  # [B, V / width]
    row = values.argmax(dim=-1, keepdim=True)  # [B, 1]
    return (row * width + within.gather(-1, row)).squeeze(-1)


@functools.cache
def _row_width(vocab: int) -> int | None:
    """A divisor of `vocab` near its square root (None for small or awkward sizes)."""
    root = math.isqrt(vocab)
    if vocab < 4096:
        return None
    return next((w for w in range(root, 4 * root) if vocab % w == 0), None)

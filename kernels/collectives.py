"""One-shot collectives of the decode step in Triton: a sum or a gather of a small tensor over the
GPUs of one host, as one kernel over buffers every rank maps (symmetric memory; set up by
minidecode/distributed.py's OneShot).

The message travels as 8-byte words, each 4 bytes of data (two bf16 / fp16 values or one fp32)
and a 4-byte tag: the call's count + 1 (NCCL's "LL" protocol). A word is written and read whole
(8-byte accesses are single-copy atomic, over NVLink too), so a word that carries this call's tag
carries this call's data: no flag, no memory fence, no acknowledgement; one one-way trip a call.
Each rank's buffer holds, per CTA, a chunk of words per (slot, source rank):

    [2 slots, size, MAX_CTAS, CHUNK_BYTES / 4] int64

CTA c of a call takes CHUNK_BYTES of the message and:
1. pushes its words, tagged, into every peer's buffer (slot = its call count's parity, source =
   this rank): stores over NVLink, which nobody waits for;
2. reads every peer's chunk from its own buffer until all its words carry the tag (polling),
   then sums the values in rank order in float32 (every rank computes the same sum bit for bit),
   or writes them in rank order (gather).

Why two slots suffice: a peer can be at most one call ahead of us on a CTA (to finish a call it
needs our words of that call), so its next push goes to the other slot, and the push after that
only once it has our words of the next call, which we push after reading this one. That holds per
CTA because a CTA's chunk sits at the same place in every call, whatever the message's size, and
the call counts (one per CTA, in this rank's memory) advance the same way on every rank because
all ranks make the same calls in the same order. Tags are compared for equality: a slot's stale
words carry the tag of two calls before, so the counts may wrap.

A GEMV can take a sum's part of this (SumAfter): its CTAs push the words as they store them, and
its last CTA polls and sums, with the same tags, slots and call counts as this kernel's sum.

The kernel launches under programmatic dependent launch on Hopper: it lets the next kernel launch
as soon as it starts (a GEMV then issues its first weight tiles while the words travel), and waits
for the previous kernel's output before reading it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

CHUNK_BYTES = 8192  # of data a CTA takes from a message (16 KiB of tagged words)
MAX_CTAS = 64  # so a message is at most 512 KiB
MAX_BYTES = CHUNK_BYTES * MAX_CTAS
WORDS: tl.constexpr = tl.constexpr(CHUNK_BYTES // 4)  # words of a chunk
CTAS: tl.constexpr = tl.constexpr(MAX_CTAS)
MAX_RANKS = 8
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def buffer_bytes(size: int) -> int:
    """Bytes of each rank's buffer for a group of `size` ranks."""
    return 2 * size * MAX_CTAS * 2 * CHUNK_BYTES


def fits_one_chunk(x: torch.Tensor) -> bool:
    """Whether a sum of x runs in one CTA (so its kernel can also normalise it, as one row)."""
    return x.numel() * x.element_size() <= CHUNK_BYTES


def fits(x: torch.Tensor) -> bool:
    """Whether the kernel takes x: a contiguous tensor of a dtype it takes, whole 4-byte words
    from a 4-byte boundary, at most MAX_BYTES."""
    nbytes = x.numel() * x.element_size()
    words = nbytes % 4 == 0 and x.data_ptr() % 4 == 0
    return x.dtype in DTYPES and x.is_contiguous() and 0 < nbytes <= MAX_BYTES and words


@triton.jit
def _values(words, HALF: tl.constexpr, dtype: tl.constexpr):
    """int32 words [W] -> their values: [2 W] (HALF: two 16-bit values a word, the low one first,
    as memory holds them) or [W]."""
    if HALF:
        low = words.to(tl.int16).to(dtype, bitcast=True)
        high = (words >> 16).to(tl.int16).to(dtype, bitcast=True)
        values = tl.interleave(low, high)
    else:
        values = words.to(dtype, bitcast=True)
    return values


@triton.jit
def _tagged(words, tag):
    """int32 words [W] -> int64 [W]: the tag in the high half, the word in the low one."""
    return (tag.to(tl.int64) << 32) | (words.to(tl.int64) & 0xFFFFFFFF)


@triton.jit
def _slot(Buffer, slot, src, SIZE: tl.constexpr):
    """Where the message's word 0 from rank `src` lies in a buffer's slot (word w of the message is
    w past it: chunk c of CTA c holds words c * WORDS ...)."""
    return Buffer + ((slot * SIZE + src) * CTAS) * WORDS


@triton.jit
def _push(Buffer, Peers, word, words, ok, tag, slot, rank, SIZE: tl.constexpr):
    """This rank's words [W] of the message (int32, at word indices `word`, where ok), tagged, into
    every peer's buffer: stores over NVLink, which nobody waits for. A peer's buffer is ours plus
    a multiple of 16 bytes: the compiler sees its pointers as aligned as ours, and stores a
    thread's contiguous words two at a time (an address loaded as an integer and cast to a
    pointer would be accessed an element at a time)."""
    mine = _slot(Buffer, slot, rank, SIZE) + word
    tagged = _tagged(words, tag)
    for peer in tl.static_range(SIZE):
        if rank != peer:
            tl.store(mine + tl.load(Peers + peer) * 2, tagged, mask=ok)


@triton.jit
def _poll(Buffer, word, ok, tag, slot, src, SIZE: tl.constexpr):
    """Rank src's words [W] at word indices `word` of the message (int32), read from our buffer
    until every one (where ok) carries this call's tag (volatile: each poll reads memory)."""
    at = _slot(Buffer, slot, src, SIZE) + word
    got = tl.load(at, mask=ok, other=0, volatile=True)
    while tl.min(((got >> 32).to(tl.int32) == tag) | (ok == 0), 0) == 0:
        got = tl.load(at, mask=ok, other=0, volatile=True)
    return got.to(tl.int32)


@triton.jit
def _sum_words(
    Buffer, mine, word, ok, tag, slot, rank, SIZE: tl.constexpr, HALF: tl.constexpr, dtype: tl.constexpr
):
    """The sum over ranks, in rank order in float32, of the message's values at words `word` (a
    chunk: [WORDS]): ours are `mine` (int32), every peer's polled from our buffer. [2 WORDS] (HALF)
    or [WORDS] float32."""
    acc = tl.zeros([WORDS * (2 if HALF else 1)], dtype=tl.float32)
    for src in tl.static_range(SIZE):
        if rank != src:
            words = _poll(Buffer, word, ok, tag, slot, src, SIZE)
        else:
            words = mine
        acc += _values(words, HALF, dtype).to(tl.float32)
    return acc


@triton.jit
def _store_sum(Out, NormW, Normed, acc, first, n, eps, NORM: tl.constexpr):
    """Out[first : first + len(acc)] := acc (float32 sums) in Out's dtype, where below n values;
    NORM (the whole row is acc: n values, first = 0): its RMSNorm into Normed too, rounded as
    kernels/fused_triton.py rounds it."""
    dtype = Out.dtype.element_ty
    values = first + tl.arange(0, acc.shape[0])
    total = acc.to(dtype)
    tl.store(Out + values, total, mask=values < n)
    if NORM:
        xf = tl.where(values < n, total.to(tl.float32), 0.0)
        inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
        w = tl.load(NormW + values, mask=values < n, other=0.0).to(tl.float32)
        normed = (xf * inv_rms).to(dtype).to(tl.float32) * w
        tl.store(Normed + values, normed.to(dtype), mask=values < n)


@triton.jit
def _one_shot_kernel(
    X,  # [n_words] int32: this rank's part, as words
    Out,  # sum: [n] of the message's dtype (may be X); gather: [SIZE, n_words] int32
    Buffer,  # this rank's buffer: [2, SIZE, CTAS, WORDS] int64
    Peers,  # [SIZE] int64: each rank's buffer minus ours, in 16-byte units (0 for us)
    Calls,  # [CTAS] int32: this rank's call count per CTA
    NormW,  # NORM: the RMSNorm's weight [n] (else a dummy)
    Normed,  # NORM: [n] of the message's dtype, the normalised sum (else a dummy)
    n_words,
    rank,
    eps,
    SIZE: tl.constexpr,
    GATHER: tl.constexpr,
    HALF: tl.constexpr,  # two 16-bit values a word (else one 32-bit value)
    NORM: tl.constexpr,  # a sum of one row in one CTA: also its RMSNorm, into Normed
    USE_PDL: tl.constexpr,
):
    cta = tl.program_id(0)
    word = cta * WORDS + tl.arange(0, WORDS)  # this CTA's words of the message
    ok = word < n_words
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may launch and issue its weight loads
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
    x = tl.load(X + word, mask=ok, other=0)
    call = tl.load(Calls + cta)
    tag, slot = call + 1, call & 1
    _push(Buffer, Peers, word, x, ok, tag, slot, rank, SIZE)
    if GATHER:
        for src in tl.static_range(SIZE):
            words = _poll(Buffer, word, ok, tag, slot, src, SIZE) if rank != src else x
            tl.store(Out + src * n_words + word, words, mask=ok)
    else:
        acc = _sum_words(Buffer, x, word, ok, tag, slot, rank, SIZE, HALF, Out.dtype.element_ty)
        per_word = 2 if HALF else 1
        _store_sum(Out, NormW, Normed, acc, cta * WORDS * per_word, n_words * per_word, eps, NORM)
    tl.store(Calls + cta, tag)


@dataclass
class RankBuffers:
    """One rank's side of a group's buffers."""

    buffer: torch.Tensor  # this rank's buffer: buffer_bytes(size) uint8, 16-byte aligned
    peers: torch.Tensor  # [size] int64: each rank's buffer address minus ours, in 16-byte units
    calls: torch.Tensor  # [MAX_CTAS] int32 on the buffer's device, zero before the group's first call
    ticket: torch.Tensor  # [1] int32: a GEMV's CTAs' count of finished ones (SumAfter), zero between launches
    rank: int

    @staticmethod
    def of(buffer: torch.Tensor, addresses: list[int], rank: int) -> RankBuffers:
        """From every rank's buffer address as this process maps it (ours is `buffer`)."""
        if addresses[rank] != buffer.data_ptr() or any(a % 16 for a in addresses):
            raise ValueError("one-shot buffers: the addresses must be 16-byte aligned, ours at [rank]")
        peers = torch.tensor([(a - addresses[rank]) // 16 for a in addresses], device=buffer.device)
        calls = torch.zeros(MAX_CTAS, dtype=torch.int32, device=buffer.device)
        ticket = torch.zeros(1, dtype=torch.int32, device=buffer.device)
        return RankBuffers(buffer, peers, calls, ticket, rank)


@dataclass
class SumAfter:
    """The sum over the group of a GEMV's result, run by the GEMV's own launch (kernels/gemv.py's
    `sum_after`): each CTA pushes its outputs' words to the peers as it stores them, and the last CTA
    to finish sums every rank's, in rank order in float32 as one_shot does (the same calls, counts
    and bits), into `out`; with `norm` (weight, eps, normed) also the sum's RMSNorm, as one_shot's.
    One launch instead of two, and the words travel while the GEMV's other CTAs still stream. The
    GEMV's [B, N] result must fit one chunk (fits_one_chunk)."""

    ends: RankBuffers
    out: torch.Tensor  # [B, N], contiguous: the sum (may be the GEMV's own output)
    norm: tuple[torch.Tensor, float, torch.Tensor] | None = None


def one_shot(
    x: torch.Tensor,
    out: torch.Tensor,
    ends: RankBuffers,
    gather: bool,
    use_pdl: bool = False,
    norm: tuple[torch.Tensor, float, torch.Tensor] | None = None,
) -> torch.Tensor:
    """out := the sum of every rank's x (out may be x), or with `gather` out [size, *x.shape] :=
    every rank's x in rank order. `norm` = (weight, eps, normed): a sum that is one row of at most
    CHUNK_BYTES also writes that row's RMSNorm into `normed` (as kernels/fused_triton.rms_norm).
    Every rank of the group must make the same calls in the same order (shapes and dtypes
    included); x must `fit`."""
    size = ends.peers.numel()
    assert fits(x) and size <= MAX_RANKS and out.is_contiguous() and out.dtype == x.dtype
    assert out.numel() == x.numel() * (size if gather else 1)
    n_words = x.numel() * x.element_size() // 4
    if norm is not None:
        weight, eps, normed = norm
        assert not gather and n_words <= WORDS.value and weight.numel() == normed.numel() == x.numel()
        assert weight.dtype == normed.dtype == x.dtype and normed.is_contiguous()
    else:
        weight, eps, normed = x, 0.0, x  # unused
    _one_shot_kernel[(triton.cdiv(n_words, WORDS.value),)](
        x.view(-1).view(torch.int32),
        out.view(-1).view(torch.int32) if gather else out,
        ends.buffer.view(torch.int64),
        ends.peers,
        ends.calls,
        weight,
        normed,
        n_words,
        ends.rank,
        eps,
        SIZE=size,
        GATHER=gather,
        HALF=x.element_size() == 2,
        NORM=norm is not None,
        USE_PDL=use_pdl,
        num_warps=4,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return out

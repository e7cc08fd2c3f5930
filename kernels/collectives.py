"""One-shot collectives of the decode step in Triton: a sum or a gather of a small tensor over the
GPUs of one host, as one kernel over buffers every rank maps (symmetric memory; set up by
minidecode/distributed.py's OneShot).

Each rank's buffer holds a flag per (peer, CTA) and, per CTA, a chunk per (slot, source rank):

    flags [size, MAX_CTAS] int32 | data [2 slots, size, MAX_CTAS, CHUNK_BYTES]

CTA c of a call takes elements [c * block, (c + 1) * block) (CHUNK_BYTES of them) and:
1. pushes this rank's chunk into every peer's buffer (slot = its call count's parity, source =
   this rank): stores over NVLink, which nobody waits for one by one;
2. raises its flag in every peer's buffer to its call count + 1, a release at system scope after a
   CTA barrier, so the peer that sees the flag sees the chunk;
3. waits for every peer's flag in its own buffer to reach that count (acquire), then reads the
   peers' chunks from its own memory and sums them in rank order in float32 (every rank computes
   the same sum bit for bit), or writes them in rank order (gather).

One flag round trip a call, against two for a pull (signal "ready", read remote, signal "done"):
the two slots make the second barrier unnecessary. A peer can be at most one call ahead of us on a
CTA (it needs our flag of the call before to pass its wait), so its next push goes to the other
slot, and the push after that only once we raised our flag for the next call, which we do after
reading this one. That holds per CTA because a CTA's chunk sits at the same place in every call,
whatever the message's size, and the call counts (one per CTA, in this rank's memory) advance the
same way on every rank because all ranks make the same calls in the same order. The counts compare
modulo 2^32 (a difference, not an order), so they may wrap.

The kernel launches under programmatic dependent launch on Hopper: it lets the next kernel launch
as soon as it starts (a GEMV then issues its first weight tiles while the flags travel), and waits
for the previous kernel's output before reading it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

CHUNK_BYTES = 16384  # a CTA's share of a message
MAX_CTAS = 32  # so a message is at most 512 KiB
MAX_BYTES = CHUNK_BYTES * MAX_CTAS
DATA_OFFSET = 4096  # bytes before the data: the flags (size x MAX_CTAS int32, size <= 32)
MAX_RANKS = DATA_OFFSET // (4 * MAX_CTAS)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def buffer_bytes(size: int) -> int:
    """Bytes of each rank's buffer for a group of `size` ranks."""
    return DATA_OFFSET + 2 * size * MAX_CTAS * CHUNK_BYTES


def fits(x: torch.Tensor, parts: int = 1) -> bool:
    """Whether x (or `parts` x-sized pieces of one message) fits the kernel: a contiguous tensor of
    a dtype it takes, at most MAX_BYTES."""
    nbytes = x.numel() * x.element_size() * parts
    return x.dtype in DTYPES and x.is_contiguous() and 0 < nbytes <= MAX_BYTES


@triton.jit
def _one_shot_kernel(
    X,  # [n]: this rank's part
    Out,  # [n] (sum; may be X) or [SIZE, n] (gather)
    Data,  # this rank's buffer, as X's dtype
    Flags,  # this rank's buffer, as int32
    Peers,  # [SIZE] int64: each rank's buffer minus ours, in 16-byte units (0 for us)
    Calls,  # [MAX_CTAS] int32: this rank's call count per CTA
    n,
    rank,
    SIZE: tl.constexpr,
    BLOCK: tl.constexpr,  # elements of a chunk
    GATHER: tl.constexpr,
    USE_PDL: tl.constexpr,
    CTAS: tl.constexpr,
    DATA: tl.constexpr,  # DATA_OFFSET in elements
):
    # A peer's buffer is ours plus a multiple of 16 bytes: the compiler sees that its data pointers
    # are as aligned as ours, and moves 16 bytes an access (an address loaded as an integer and cast
    # to a pointer would be accessed an element at a time).
    EL: tl.constexpr = 16 // (X.dtype.element_ty.primitive_bitwidth // 8)  # elements in 16 bytes
    cta = tl.program_id(0)
    offs = cta * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may launch and issue its weight loads
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
    x = tl.load(X + offs, mask=ok, other=0.0)
    call = tl.load(Calls + cta)
    target = call + 1
    slot = call & 1
    # Chunk c of a call sits at the same place whatever the message's size: [slot, source, c].
    mine = Data + DATA + ((slot * SIZE + rank) * CTAS) * BLOCK + offs  # our chunk, in any buffer
    for peer in tl.static_range(SIZE):
        if rank != peer:
            tl.store(mine + tl.load(Peers + peer) * EL, x, mask=ok)
    tl.debug_barrier()  # every thread's pushes come before the flags' release
    flag = Flags + rank * CTAS + cta  # our flag for this CTA, in any buffer
    for peer in tl.static_range(SIZE):
        if rank != peer:
            tl.atomic_xchg(flag + tl.load(Peers + peer) * 4, target, sem="release", scope="sys")
    for peer in tl.static_range(SIZE):
        if rank != peer:
            theirs = Flags + peer * CTAS + cta
            seen = tl.atomic_add(theirs, 0, sem="acquire", scope="sys")
            while seen - target < 0:  # an int32 difference: the counts may wrap
                seen = tl.atomic_add(theirs, 0, sem="acquire", scope="sys")
    tl.debug_barrier()  # no thread reads before the flags are seen
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for src in tl.static_range(SIZE):
        where = Data + DATA + ((slot * SIZE + src) * CTAS) * BLOCK + offs
        # Our own chunk holds nothing of this call (x stands in for it): read and discarded.
        # .cg: from L2, which the peers' stores reached, never from a stale L1 line.
        part = tl.where(rank == src, x, tl.load(where, mask=ok, other=0.0, cache_modifier=".cg"))
        if GATHER:
            tl.store(Out + src * n + offs, part, mask=ok)
        else:
            acc += part.to(tl.float32)
    if not GATHER:
        tl.store(Out + offs, acc.to(X.dtype.element_ty), mask=ok)
    tl.store(Calls + cta, target)


@dataclass
class RankBuffers:
    """One rank's side of a group's buffers."""

    buffer: torch.Tensor  # this rank's buffer: buffer_bytes(size) uint8, 16-byte aligned
    peers: torch.Tensor  # [size] int64: each rank's buffer address minus ours, in 16-byte units
    calls: torch.Tensor  # [MAX_CTAS] int32 on the buffer's device, zero before the group's first call
    rank: int

    @staticmethod
    def of(buffer: torch.Tensor, addresses: list[int], rank: int) -> RankBuffers:
        """From every rank's buffer address as this process maps it (ours is `buffer`)."""
        if addresses[rank] != buffer.data_ptr() or any(a % 16 for a in addresses):
            raise ValueError("one-shot buffers: the addresses must be 16-byte aligned, ours at [rank]")
        peers = torch.tensor([(a - addresses[rank]) // 16 for a in addresses], device=buffer.device)
        return RankBuffers(
            buffer, peers, torch.zeros(MAX_CTAS, dtype=torch.int32, device=buffer.device), rank
        )


def one_shot(x: torch.Tensor, out: torch.Tensor, ends: RankBuffers, gather: bool, use_pdl: bool = False):
    """out := the sum of every rank's x (out may be x), or with `gather` out [size, *x.shape] :=
    every rank's x in rank order. Every rank of the group must make the same calls in the same
    order (shapes and dtypes included); x must `fit`."""
    size = ends.peers.numel()
    assert fits(x) and size <= MAX_RANKS and out.is_contiguous() and out.dtype == x.dtype
    assert out.numel() == x.numel() * (size if gather else 1)
    block = CHUNK_BYTES // x.element_size()
    _one_shot_kernel[(triton.cdiv(x.numel(), block),)](
        x,
        out,
        ends.buffer.view(x.dtype),
        ends.buffer.view(torch.int32),
        ends.peers,
        ends.calls,
        x.numel(),
        ends.rank,
        SIZE=size,
        BLOCK=block,
        GATHER=gather,
        USE_PDL=use_pdl,
        CTAS=MAX_CTAS,
        DATA=DATA_OFFSET // x.element_size(),
        num_warps=4,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return out

"""Lean attention under the Triton interpreter (CPU), against a float64 reference.

fp16 and fp32 only: the interpreter's tl.dot returns garbage for bf16 (triton-lang/triton#11584).
The GPU twin of this file is tests/test_lean_attention_gpu.py.
"""

import os

# Before triton is imported: the kernel must be built for the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import dataclasses  # noqa: E402
import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from minidecode.kernels import lean_attention as la  # noqa: E402
from minidecode.kernels.reference import decode_attention_reference  # noqa: E402

if not isinstance(la._lean_decode_kernel, InterpretedFunction):  # imported earlier, compiled for a GPU
    la = importlib.reload(la)

BLOCK_64 = la.DEFAULT_CONFIGS[64].block_n  # positions per tile at head_dim 64
TOL = {torch.float16: 2e-3, torch.float32: 2e-5}


def make_inputs(lengths, hq, hkv, head_dim=64, dtype=torch.float16, seed=0, slack=3):
    """Random q, K, V with K/V positions past each length poisoned: reading them gives NaN."""
    gen = torch.Generator().manual_seed(seed)
    batch, capacity = len(lengths), max(lengths) + slack
    q = torch.randn(batch, hq, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, hkv, capacity, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, hkv, capacity, head_dim, generator=gen).to(dtype)
    for b, n in enumerate(lengths):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("nan")
    return q, k, v, torch.tensor(lengths, dtype=torch.int32)


def reference(q, k, v, lengths, scale):
    """float64 inputs, float64 math, float64 output (not rounded back to q's dtype)."""
    return decode_attention_reference(q.double(), k.double(), v.double(), lengths, scale, torch.float64)


def run_lean(q, k, v, lengths, scale, num_ctas):
    """Run into a NaN-poisoned output, then check it is fully written and the counters are zero."""
    out = torch.full_like(q, float("nan"))
    la.lean_attention(q, k, v, lengths, scale, num_ctas=num_ctas, out=out)
    assert not out.isnan().any(), "output not fully written (or NaN computed)"
    for ws in la._WORKSPACES.values():
        assert ws.counters.eq(0).all(), "ticket counters not reset"
    return out


def check(lengths, hq, hkv, num_ctas, head_dim=64, dtype=torch.float16, scale=None, seed=0):
    q, k, v, lens = make_inputs(lengths, hq, hkv, head_dim, dtype, seed)
    scale = head_dim**-0.5 if scale is None else scale
    out = run_lean(q, k, v, lens, scale, num_ctas)
    ref = reference(q, k, v, lens, scale)
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    return out


def test_length_one():
    check([1], hq=4, hkv=1, num_ctas=4)
    check([1, 1, 1], hq=8, hkv=2, num_ctas=2, dtype=torch.float32)


@pytest.mark.parametrize("n", [BLOCK_64 - 1, BLOCK_64, BLOCK_64 + 1, 2 * BLOCK_64 + 1])
@pytest.mark.parametrize("num_ctas", [1, 3])
def test_block_edges(n, num_ctas):
    check([n], hq=8, hkv=2, num_ctas=num_ctas)


def test_fewer_tiles_than_ctas():
    sched = la.lean_schedule([5, 40], num_kv_heads=2, head_dim=64, num_ctas=16)
    assert sched.total_tiles < sched.grid
    check([5, 40], hq=4, hkv=2, num_ctas=16)


@pytest.mark.parametrize(
    "lengths, hkv, num_ctas",
    [
        ([3 * BLOCK_64], 4, 5),  # CTAs start mid-segment and hold two partial segments
        ([2 * BLOCK_64], 8, 3),  # whole segments in the middle of a range, split ones at its ends
        ([9 * BLOCK_64 - 7], 2, 4),  # long ranges, each head split over several CTAs
    ],
)
def test_many_tiles_per_cta(lengths, hkv, num_ctas):
    sched = la.lean_schedule(lengths, hkv, head_dim=64, num_ctas=num_ctas)
    assert sched.tiles_per_cta > 1 and sched.partial_segments > 0
    check(lengths, hq=2 * hkv, hkv=hkv, num_ctas=num_ctas)


def test_merge_in_several_chunks():
    """Group 16 at head_dim 128 merges two partials per step: a segment split four ways takes two."""
    sched = la.lean_schedule([700], 2, head_dim=128, num_ctas=7)
    assert sched.max_splits_per_head > 2
    check([700], hq=32, hkv=2, num_ctas=7, head_dim=128)


def test_ragged_batch():
    lengths = [1, BLOCK_64 + 2, 5 * BLOCK_64 + 3, 64, 2 * BLOCK_64]
    sched = la.lean_schedule(lengths, 2, head_dim=64, num_ctas=7)
    assert sched.max_splits_per_head > 1  # ranges cross sequence boundaries and split heads
    check(lengths, hq=8, hkv=2, num_ctas=7)
    check(lengths, hq=8, hkv=2, num_ctas=7, dtype=torch.float32, seed=1)


@pytest.mark.parametrize(
    "hq, hkv", [(4, 4), (4, 2), (8, 2), (16, 2), (32, 2), (16, 1), (4, 1)], ids=lambda x: str(x)
)
def test_gqa_groups(hq, hkv):
    check([BLOCK_64 + 9, 2 * BLOCK_64 + 1], hq=hq, hkv=hkv, num_ctas=3)


def test_head_dim_128():
    check([130, 700], hq=8, hkv=2, num_ctas=5, head_dim=128, dtype=torch.float32)
    check([1, 257], hq=4, hkv=4, num_ctas=3, head_dim=128)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_peaked_logits(dtype):
    # scores spread over hundreds of nats: a naive exp overflows, the softmax is nearly one-hot
    check([3 * BLOCK_64 + 5], hq=8, hkv=2, num_ctas=4, dtype=dtype, scale=40.0)


def test_bitwise_repeatable():
    q, k, v, lens = make_inputs([7 * BLOCK_64 + 3, BLOCK_64 - 2], 8, 2)
    first = run_lean(q, k, v, lens, 0.125, num_ctas=5)
    second = run_lean(q, k, v, lens, 0.125, num_ctas=5)
    assert torch.equal(first, second)


def test_growing_context_reuses_workspace():
    """As in a replayed CUDA graph: lengths grow in place, the workspace is reused every step."""
    q, k, v, lens = make_inputs([BLOCK_64 - 2], 8, 2, slack=4)
    for _ in range(4):
        k[:, :, lens[0]] = torch.randn_like(k[:, :, 0])  # the new token's K and V
        v[:, :, lens[0]] = torch.randn_like(v[:, :, 0])
        lens += 1
        out = run_lean(q, k, v, lens, 0.125, num_ctas=3)
        ref = reference(q, k, v, lens, 0.125)
        torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("head_dim", [32, 80, 96, 256])
def test_rejects_other_head_dims(head_dim):
    q, k, v, lens = make_inputs([4], 4, 2, head_dim=head_dim)
    with pytest.raises(ValueError, match="head_dim"):
        la.lean_attention(q, k, v, lens, 0.1)


def test_rejects_bad_group():
    q, k, v, lens = make_inputs([4], 6, 4)
    with pytest.raises(ValueError, match="multiple"):
        la.lean_attention(q, k, v, lens, 0.1)


def test_schedule_is_even():
    """Every CTA gets per or per - 1 tiles, and the ranges tile [0, total) exactly."""
    for total_lengths, hkv, grid in [([1000, 3, 77], 8, 13), ([5], 1, 9), ([4096] * 3, 2, 7)]:
        sched = la.lean_schedule(total_lengths, hkv, head_dim=64, num_ctas=grid)
        per, big = sched.tiles_per_cta, sched.total_tiles - (sched.tiles_per_cta - 1) * grid
        sizes = [per if c < big else per - 1 for c in range(grid)]
        assert sum(sizes) == sched.total_tiles and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("min_tiles", [2, 3, 5])
@pytest.mark.parametrize("lengths", [[1], [4 * BLOCK_64 + 7], [3 * BLOCK_64, 1, 9 * BLOCK_64 + 2]], ids=str)
def test_min_tiles_per_cta(min_tiles, lengths):
    """Fewer, longer ranges at short context: same result, counters left at zero."""
    q, k, v, lens = make_inputs(lengths, 8, 2)
    config = dataclasses.replace(la.default_config(64, q.dtype), min_tiles=min_tiles)
    out = la.lean_attention(q, k, v, lens, 64**-0.5, num_ctas=6, config=config)
    torch.testing.assert_close(
        out.double(), reference(q, k, v, lens, 64**-0.5), atol=TOL[q.dtype], rtol=TOL[q.dtype]
    )
    assert all(int(ws.counters.abs().sum()) == 0 for ws in la._WORKSPACES.values())
    schedule = la.lean_schedule(lens, 2, 64, num_ctas=6, config=config)
    assert schedule.total_tiles < min_tiles or schedule.tiles_per_cta >= min_tiles


@pytest.mark.parametrize("merge_chunk", [1, 2, 32])
def test_merge_chunk_sizes(merge_chunk):
    """Partials merged 1, 2 or 32 at a time (heads split over many CTAs): same result."""
    q, k, v, lens = make_inputs([14 * BLOCK_64 + 5, 3 * BLOCK_64], 8, 2)
    config = dataclasses.replace(la.default_config(64, q.dtype), merge_chunk=merge_chunk)
    out = la.lean_attention(q, k, v, lens, 64**-0.5, num_ctas=12, config=config)
    torch.testing.assert_close(
        out.double(), reference(q, k, v, lens, 64**-0.5), atol=TOL[q.dtype], rtol=TOL[q.dtype]
    )
    assert la.lean_schedule(lens, 2, 64, num_ctas=12, config=config).max_splits_per_head > 2

"""Lean attention compiled for the GPU: bf16/fp16 against a float64 reference, up to 1M positions,
and CUDA-graph replay across a growing context.

Run in its own process (`pytest -m gpu tests/test_lean_attention_gpu.py`): the CPU twin sets
TRITON_INTERPRET=1 for the whole process, and then these tests skip.
"""

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from minidecode.kernels import lean_attention as la
from minidecode.kernels.reference import decode_attention_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        isinstance(la._lean_decode_kernel, InterpretedFunction),
        reason="kernel built for the interpreter: run this file in its own pytest process",
    ),
]

DTYPES = [torch.bfloat16, torch.float16]
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}  # relative norm error
BLOCK_128 = la.DEFAULT_CONFIGS[128].block_n


def make_inputs(lengths, hq, hkv, head_dim=128, dtype=torch.bfloat16, seed=0, slack=3):
    """Random q, K, V on the GPU; K/V positions past each length are NaN, so reading them shows."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    batch, capacity = len(lengths), max(lengths) + slack
    q = torch.randn(batch, hq, head_dim, generator=gen, device="cuda", dtype=dtype)
    k = torch.randn(batch, hkv, capacity, head_dim, generator=gen, device="cuda", dtype=dtype)
    v = torch.randn(batch, hkv, capacity, head_dim, generator=gen, device="cuda", dtype=dtype)
    for b, n in enumerate(lengths):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("nan")
    return q, k, v, torch.tensor(lengths, dtype=torch.int32, device="cuda")


def reference(q, k, v, lengths, scale):
    """float64 inputs, math and output, one sequence at a time (1M positions fit in memory)."""
    return decode_attention_reference(q.double(), k.double(), v.double(), lengths, scale, torch.float64)


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def counters_zero():
    torch.cuda.synchronize()
    return all(ws.counters.eq(0).all().item() for ws in la._WORKSPACES.values())


def run_lean(q, k, v, lengths, scale, num_ctas=None):
    out = torch.full_like(q, float("nan"))
    la.lean_attention(q, k, v, lengths, scale, num_ctas=num_ctas, out=out)
    assert not out.isnan().any(), "output not fully written (or NaN computed)"
    assert counters_zero(), "ticket counters not reset"
    return out


def check(lengths, hq, hkv, head_dim=128, dtype=torch.bfloat16, num_ctas=None, scale=None, seed=0):
    q, k, v, lens = make_inputs(lengths, hq, hkv, head_dim, dtype, seed)
    scale = head_dim**-0.5 if scale is None else scale
    out = run_lean(q, k, v, lens, scale, num_ctas)
    err = rel_err(out, reference(q, k, v, lens, scale))
    assert err < TOL[dtype], f"relative error {err:.2e}"
    return q, k, v, lens, out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(
    "lengths", [[1], [BLOCK_128 - 1], [BLOCK_128], [BLOCK_128 + 1], [1000], [4096], [65536]], ids=str
)
def test_lengths(lengths, head_dim, dtype):
    check(lengths, hq=32, hkv=8, head_dim=head_dim, dtype=dtype)


@pytest.mark.parametrize("num_ctas", [1, 3, 7, 1000])  # few CTAs with long ranges; more CTAs than tiles
def test_grid_override(num_ctas):
    check([3000, 17, 70000], hq=16, hkv=4, num_ctas=num_ctas)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ragged_batch(dtype):
    check([1, 63, 64, 65, 1024, 5000, 100_000, 262_144], hq=32, hkv=8, dtype=dtype)


@pytest.mark.parametrize("hq, hkv", [(8, 8), (16, 8), (32, 8), (64, 8), (128, 8), (32, 1), (16, 1)], ids=str)
def test_gqa_groups(hq, hkv):
    check([777, 20_000], hq=hq, hkv=hkv)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32])
def test_peaked_logits(dtype):
    check([5000, 33], hq=32, hkv=8, dtype=dtype, scale=40.0)


def test_fp32():
    check([1, 300, 9000], hq=32, hkv=8, dtype=torch.float32, num_ctas=5)


def test_bitwise_repeatable():
    q, k, v, lens, first = check([123_457, 999], hq=32, hkv=8)
    for _ in range(3):
        assert torch.equal(first, run_lean(q, k, v, lens, 128**-0.5))


@pytest.mark.parametrize("lengths", [[1_048_576], [1_048_576, 3]], ids=str)
def test_one_million_positions(lengths):
    check(lengths, hq=32, hkv=8)


def test_rejects_other_head_dims():
    q, k, v, lens = make_inputs([4], 4, 2, head_dim=96)
    with pytest.raises(ValueError, match="head_dim"):
        la.lean_attention(q, k, v, lens, 0.1)


@pytest.mark.parametrize("start", [BLOCK_128 * 64 - 3, 200_001], ids=str)
def test_cuda_graph_growing_context(start):
    """Capture once at `start`, then replay while the context grows one token a step."""
    steps, batch_extra = 8, [start // 3, 5]
    lengths = [start, *batch_extra]
    q, k, v, lens = make_inputs(lengths, 32, 8, slack=steps + 1)
    out = torch.empty_like(q)
    la.lean_attention(q, k, v, lens, 128**-0.5, out=out)  # eager warm-up: compile, allocate workspace
    n_workspaces = len(la._WORKSPACES)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        la.lean_attention(q, k, v, lens, 128**-0.5, out=out)
    assert len(la._WORKSPACES) == n_workspaces  # capture allocated no workspace
    for _ in range(steps):
        # Write the new token's K/V at each sequence's end, grow the lengths in place, replay.
        for b in range(len(lengths)):
            n = int(lens[b])
            k[b, :, n] = torch.randn_like(k[b, :, 0])
            v[b, :, n] = torch.randn_like(v[b, :, 0])
        lens += 1
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not out.isnan().any()
        err = rel_err(out, reference(q, k, v, lens, 128**-0.5))
        assert err < TOL[torch.bfloat16], f"relative error {err:.2e} at lengths {lens.tolist()}"
        assert counters_zero()

"""The chunk attention kernel (a mixed step's graph: a prompt chunk after its past, its bounds on
the device) against float64 attention: on the CPU through the Triton interpreter (fp16 / fp32:
its tl.dot returns garbage for bf16), on a GPU in bf16, captured once and replayed with new
bounds (marked gpu)."""

import pytest
import torch
from helpers import rel_err

from minidecode.kernels.chunk_attention import MAX_SPLITS, chunk_attention, chunk_splits

ON_GPU = torch.cuda.is_available()
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def cache_row(kv_heads: int, positions: int, d: int, dtype, device, live: tuple[int, int]):
    """K and V cache rows [Hkv, positions, D], NaN outside positions live[0]..live[1]-1 (a read
    outside the chunk's keys shows in the output)."""
    k, v = (torch.randn(kv_heads, positions, d, device=device).to(dtype) for _ in "kv")
    for t in (k, v):
        t[:, : live[0]] = float("nan")
        t[:, live[1] :] = float("nan")
    return k, v


def exact(q, k, v, lo: int, count: int, start: int) -> torch.Tensor:
    """float64: query i of q [C, Hq, D] over cache positions start .. start + lo + i -> [count, Hq, D]."""
    group = q.shape[1] // k.shape[0]
    keys, values = (t[:, start : start + lo + count].double().repeat_interleave(group, 0) for t in (k, v))
    scores = torch.einsum("chd,hnd->hcn", q[:count].double(), keys) * q.shape[-1] ** -0.5
    keys_at, rows_at = (torch.arange(n, device=q.device) for n in (lo + count, count))
    hidden = keys_at[None, :] > lo + rows_at[:, None]
    return torch.einsum("hcn,hnd->chd", scores.masked_fill(hidden, float("-inf")).softmax(-1), values)


CASES = [  # kv heads, group, head_dim, lo, count, rows, start, splits
    (2, 4, 64, 100, 37, 48, 5, 3),  # a ragged chunk after a past, splits crossing the diagonal
    (1, 2, 64, 0, 20, 32, 0, 1),  # a prompt's first chunk: its own keys only
    (2, 3, 32, 300, 16, 16, 7, 4),  # a group of 3 (packed rows cross query boundaries mid-block)
    (2, 4, 128, 2, 50, 64, 3, 5),  # a past shorter than the splits: empty ranges
    (1, 4, 16, 1, 1, 16, 9, MAX_SPLITS),  # one query, one past key
]


@pytest.mark.skipif(ON_GPU, reason="the interpreter's run (the GPU has its own test)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kv_heads, group, d, lo, count, rows, start, splits", CASES)
def test_a_chunk_after_its_past_is_causal_attention(
    dtype, kv_heads, group, d, lo, count, rows, start, splits
):  # noqa: E501
    torch.manual_seed(0)
    k, v = cache_row(kv_heads, start + lo + rows + 20, d, dtype, "cpu", (start, start + lo + count))
    q = torch.randn(rows, kv_heads * group, d).to(dtype)
    out = chunk_attention(q, k, v, torch.tensor([lo, count, start, 0]), splits, d**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out[:count], exact(q, k, v, lo, count, start)) < TOL[dtype]
    assert not out[count:].any()  # padding rows: zero


def test_splits_fill_the_sms():
    """The split count keeps the last wave nearly full, and takes no more splits than that needs:
    8 KV heads of 4 query heads on 132 SMs, one row block a head at 16 rows (8 CTAs a split)."""
    for rows in (16, 64, 128, 384, 1024):
        splits = chunk_splits(rows, 32, 8, 132)
        ctas = -(-rows * 4 // 128) * 8 * splits
        assert 1 <= splits <= MAX_SPLITS and ctas / (-(-ctas // 132) * 132) >= 0.9, (rows, splits)
    assert chunk_splits(16, 32, 8, 132) == 16 and chunk_splits(1024, 32, 8, 132) < 4


@pytest.mark.gpu
@pytest.mark.parametrize("lo, count, rows", [(0, 50, 64), (3, 20, 32), (40000, 100, 128), (5000, 384, 384)])
def test_a_chunk_whose_bounds_live_on_the_device(lo, count, rows):
    """bf16, 8 KV heads of 4 query heads, the chunk at position 1000 of a cache row: the rows of
    float64 attention, padding rows zero; captured once in a CUDA graph and replayed with other
    bounds of the same shapes, the same."""
    torch.manual_seed(0)
    Hkv, G, D, start = 8, 4, 128, 1000
    k, v = cache_row(Hkv, start + 41000, D, torch.bfloat16, "cuda", (start, start + 41000))
    q = torch.randn(rows, Hkv * G, D, device="cuda", dtype=torch.bfloat16)
    where = torch.tensor([lo, count, start, 0], device="cuda")
    splits = chunk_splits(rows, Hkv * G, Hkv, torch.cuda.get_device_properties(0).multi_processor_count)
    out = chunk_attention(q, k, v, where, splits, D**-0.5)
    assert rel_err(out[:count], exact(q, k, v, lo, count, start)) < TOL[torch.bfloat16]
    assert not out[count:].any()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = chunk_attention(q, k, v, where, splits, D**-0.5)
    for lo2, count2 in ((lo + 7, max(1, count - 9)), (0, count)):
        where.copy_(torch.tensor([lo2, count2, start, 0]))
        graph.replay()
        assert rel_err(replayed[:count2], exact(q, k, v, lo2, count2, start)) < TOL[torch.bfloat16]
        assert not replayed[count2:].any()

"""Blocked causal prefill attention (diagonal causal blocks + full past blocks, merged by
log-sum-exp) against plain causal attention."""

import functools

import pytest
import torch
import torch.nn.functional as F
from helpers import rel_err

from minidecode.kernels import prefill
from minidecode.kernels.prefill import blocked_causal_attention, causal_attention, cudnn_with_lse


def math_with_lse(q, k, v, causal, scale):
    """Attention and its natural-log log-sum-exp in float64: the reference `attend`."""
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale  # [B, G, t, s]
    if causal:
        t, s = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(t, s, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, -1, keepdim=True)
    return (torch.exp(scores - lse) @ v.double()).to(q.dtype), lse.float()


@pytest.mark.parametrize("T, block", [(300, 64), (256, 64), (50, 64), (129, 128)])
def test_blocked_equals_causal(T, block):
    torch.manual_seed(0)
    B, G, D = 2, 3, 16
    q = torch.randn(B, G, T, D)
    k, v = torch.randn(B, 1, T, D), torch.randn(B, 1, T, D)
    out = blocked_causal_attention(q, k, v, block, functools.partial(math_with_lse, scale=D**-0.5))
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("past, T", [(100, 37), (64, 200), (1, 1)])
def test_suffix_after_cached_keys_equals_the_full_causal_rows(past, T):
    """Queries at the last T of past + T positions (a suffix prefilled after a cached prefix):
    both the SDPA path and the blocked log-sum-exp merge give the last T rows of full causal
    attention (query i sees keys 0..past+i)."""
    torch.manual_seed(0)
    B, G, D = 2, 3, 16
    q_all = torch.randn(B, G, past + T, D)
    k, v = torch.randn(B, 1, past + T, D), torch.randn(B, 1, past + T, D)
    ref = F.scaled_dot_product_attention(
        q_all.double(), k.double(), v.double(), is_causal=True, enable_gqa=True
    )[:, :, past:]
    q = q_all[:, :, past:]
    torch.testing.assert_close(causal_attention(q, k, v, D**-0.5).double(), ref, rtol=1e-5, atol=1e-5)
    blocked = blocked_causal_attention(q, k, v, 64, functools.partial(math_with_lse, scale=D**-0.5))
    torch.testing.assert_close(blocked.double(), ref, rtol=1e-5, atol=1e-5)


def gpu_suffix(past: int, T: int, G: int = 4, D: int = 128):
    """Random bf16 q [1, G, T, D] at the last T of past + T positions of k/v [1, 1, past + T, D] on
    the GPU -> (q, k, v, the float64 causal attention of those rows)."""
    torch.manual_seed(0)
    q = torch.randn(1, G, T, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 1, past + T, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q_all = torch.cat([torch.zeros(1, G, past, D, device="cuda"), q.float()], 2).double()
    exact = F.scaled_dot_product_attention(q_all, k.double(), v.double(), is_causal=True, enable_gqa=True)
    return q, k, v, exact[:, :, past:]


@pytest.mark.gpu
def test_suffix_attention_on_each_gpu_backend():
    from minidecode.kernels.prefill import CANDIDATES

    D = 128
    q, k, v, exact = gpu_suffix(3000, 700, D=D)
    for backend in CANDIDATES:
        assert rel_err(causal_attention(q, k, v, D**-0.5, backend), exact) < 1e-2, backend


@pytest.mark.gpu
def test_blocked_cudnn_equals_one_causal_call():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    T, G, D = 5000, 4, 128
    q = torch.randn(1, G, T, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 1, T, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out = blocked_causal_attention(q, k, v, 1024, functools.partial(cudnn_with_lse, scale=D**-0.5))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=D**-0.5, enable_gqa=True)
    exact = F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True
    )
    assert rel_err(out, exact) < 1.5 * rel_err(ref, exact) + 1e-3


@pytest.mark.parametrize("past, T", [(0, 300), (0, 64), (100, 150)])
def test_cpu_prompt_in_query_blocks_equals_causal(monkeypatch, past, T):
    """On the CPU a long prompt goes through in query blocks (Ctrl-C lands between blocks) with
    PyTorch's CPU flash attention merged by log-sum-exp: the rows of full causal attention."""
    monkeypatch.setattr(prefill, "CPU_BLOCK", 64)
    torch.manual_seed(1)
    B, G, D = 1, 4, 16
    q = torch.randn(B, G, T, D)
    k, v = torch.randn(B, 1, past + T, D), torch.randn(B, 1, past + T, D)
    out = causal_attention(q, k, v, D**-0.5)
    ref = math_with_lse(torch.cat([torch.zeros(B, G, past, D), q], 2).double(), k, v, True, D**-0.5)[0]
    assert rel_err(out, ref[:, :, past:]) < 1e-5


def causal_rows(q, k, v, scale):
    """float64 causal attention of the last t of P + t positions: query i sees keys 0..P+i."""
    t, keys = q.shape[2], k.shape[2]
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale  # [B, G, t, P + t]
    hidden = torch.ones(t, keys, dtype=torch.bool, device=q.device).triu(keys - t + 1)
    return torch.softmax(scores.masked_fill(hidden, float("-inf")), -1) @ v.double()


def recording(attend, calls):
    """`attend` that also notes each call's K shape and whether K lies in `calls`' first entry's
    storage (the cache: no copy of K/V was made)."""

    def call(q, k, v, causal, **kw):
        calls.append((tuple(k.shape), k.untyped_storage().data_ptr() == calls[0]))
        return attend(q, k, v, causal, **kw)

    return call


# (B, past, T, block, sms, split): a past of c x n keys (255 = 5 x 51), one with a remainder
# (203 = 10 x 20 + 3), B = 2, three query blocks each splitting its own past (300, 364 = 5 x 72
# + 4, 428 keys), and no split where the full call fills over half the SMs or the past is short.
SPLIT_CASES = [
    (1, 255, 5, 64, 8, True),
    (2, 203, 7, 64, 16, True),
    (1, 300, 150, 64, 8, True),
    (1, 255, 5, 64, 4, False),
    (2, 20, 5, 64, 64, False),
]


@pytest.mark.parametrize("B, past, T, block, sms, split", SPLIT_CASES)
def test_split_past_equals_the_full_causal_rows(monkeypatch, B, past, T, block, sms, split):
    """A short block after a long past: its past keys cut into chunks stacked on the batch axis of
    one call (views of the cache, no copy) and merged by log-sum-exp give the rows of full causal
    attention, for the float64 reference `attend` and for PyTorch's CPU flash attention."""
    monkeypatch.setattr(prefill, "SPLIT_MIN_KEYS", 16)
    torch.manual_seed(2)
    G, D = 3, 16
    S = past + T + 9
    k_cache, v_cache = torch.randn(B, 2, S, D), torch.randn(B, 2, S, D)  # [B, Hkv, S, D]
    k, v = k_cache[:, 1:2, : past + T], v_cache[:, 1:2, : past + T]  # one KV head, as prefill takes it
    q = torch.randn(B, G, T, D)
    ref = causal_rows(q, k, v, D**-0.5)
    for attend, tol in [(math_with_lse, 1e-6), (prefill.cpu_flash_with_lse, 1e-5)]:
        calls = [k_cache.untyped_storage().data_ptr()]
        attend = recording(functools.partial(attend, scale=D**-0.5), calls)
        out = blocked_causal_attention(q, k, v, block, attend, sms)
        assert rel_err(out, ref) < tol
        assert all(same_storage for _, same_storage in calls[1:])
        chunked = [shape for shape, _ in calls[1:] if shape[0] > B]  # [n, 1, c, D], c >= 16
        assert bool(chunked) == split
        assert all(shape[1] == 1 and shape[2] >= 16 for shape in chunked)


def test_past_chunks_on_llama_3_8b_shapes_fill_two_waves_of_132_sms():
    """4 query heads a KV head, 132 SMs: 100 queries after 512k keys take 66 chunks (264 CTAs,
    2 waves); after 128k, 32 chunks of the minimum 4096 keys; 2048 queries 4 chunks (256 CTAs);
    4096 queries (128 CTAs) or two sequences of 2048 already fill half the GPU: no split."""
    assert prefill.past_chunks(1, 4, 100, 524288, 132) == 66
    assert prefill.past_chunks(1, 4, 100, 131072, 132) == 32
    assert prefill.past_chunks(1, 4, 2048, 524288, 132) == 4
    assert prefill.past_chunks(1, 4, 4096, 524288, 132) == 1
    assert prefill.past_chunks(2, 4, 2048, 524288, 132) == 1
    assert prefill.past_chunks(2, 4, 100, 524288, 132) == 66
    assert prefill.past_chunks(1, 4, 100, 8191, 132) == 1
    assert prefill.past_chunks(1, 4, 100, 524288, None) == 1


@pytest.mark.gpu
def test_split_past_on_cudnn_equals_the_full_causal_rows(monkeypatch):
    """cuDNN through causal_attention: 100 queries of two sequences after 40000 cached keys go
    through 9 chunks of 4444 keys (and a 4-key remainder) a sequence, as accurate as one call."""
    calls = [None]
    monkeypatch.setattr(prefill, "cudnn_with_lse", recording(prefill.cudnn_with_lse, calls))
    torch.manual_seed(0)
    B, past, T, G, D = 2, 40000, 100, 4, 128
    q = torch.randn(B, G, T, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, 1, past + T, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    exact = causal_rows(q, k, v, D**-0.5)
    out = causal_attention(q, k, v, D**-0.5, "cudnn")
    assert (9, 1, 4444, D) in [shape for shape, _ in calls[1:]]
    one_call = blocked_causal_attention(q, k, v, T, functools.partial(cudnn_with_lse, scale=D**-0.5))
    assert rel_err(out, exact) < 1.5 * rel_err(one_call, exact) + 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("past, T", [(40000, 100), (300, 700), (5000, 1)])
def test_a_chunk_after_its_past_on_flash_is_one_call(past, T):
    """A mixed step's chunk on the GPU (flash, 8 KV heads of 4 query heads), T rows after `past`
    keys through causal_attention: one kernel call of FlashAttention's forward (plus its split
    combine), the rows of float64 causal attention."""
    torch.manual_seed(0)
    Hkv, G, D = 8, 4, 128
    q = torch.randn(1, Hkv * G, T, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, Hkv, past + T, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    exact = causal_rows(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), D**-0.5)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = causal_attention(q, k, v, D**-0.5, "flash")
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert 1 <= len([n for n in kernels if "flash" in n]) <= 2 and len(kernels) <= 3, kernels
    assert rel_err(out, exact) < 1e-2


def test_a_single_key_is_its_value():
    """A 1-token prompt: attention over one key returns its value for every query head."""
    q, k, v = torch.randn(2, 3, 1, 16), torch.randn(2, 1, 1, 16), torch.randn(2, 1, 1, 16)
    out = causal_attention(q, k, v, 0.25)
    torch.testing.assert_close(out, v.expand(2, 3, 1, 16))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("past, T, cpu_block", [(0, 90, 4096), (0, 90, 32), (50, 40, 4096)])
def test_a_whole_layer_in_one_call_equals_one_call_per_kv_head(monkeypatch, past, T, cpu_block):
    """causal_attention over every KV head at once (one SDPA call with GQA for a whole prompt; per
    KV head for the blocked path and after a cached prefix) gives the per-KV-head calls' result,
    also written in place over q (out=q)."""
    monkeypatch.setattr(prefill, "CPU_BLOCK", cpu_block)
    torch.manual_seed(3)
    B, Hkv, G, D = 2, 3, 2, 16
    q = torch.randn(B, Hkv * G, T, D)
    k, v = torch.randn(B, Hkv, past + T, D), torch.randn(B, Hkv, past + T, D)
    per_head = torch.cat(
        [
            causal_attention(q[:, h * G : (h + 1) * G], k[:, h : h + 1], v[:, h : h + 1], 0.3)
            for h in range(Hkv)
        ],
        1,
    )
    torch.testing.assert_close(causal_attention(q, k, v, 0.3), per_head, rtol=1e-6, atol=1e-6)
    exact = causal_rows(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), 0.3)
    torch.testing.assert_close(per_head.double(), exact, rtol=1e-5, atol=1e-5)
    in_place = q.clone()
    assert causal_attention(in_place, k, v, 0.3, out=in_place) is in_place
    torch.testing.assert_close(in_place, per_head, rtol=1e-6, atol=1e-6)

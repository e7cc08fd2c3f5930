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


@pytest.mark.gpu
def test_suffix_attention_on_each_gpu_backend():
    from minidecode.kernels.prefill import CANDIDATES

    torch.manual_seed(0)
    past, T, G, D = 3000, 700, 4, 128
    q = torch.randn(1, G, T, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 1, past + T, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q_all = torch.cat([torch.zeros(1, G, past, D, device="cuda"), q.float()], 2).double()
    exact = F.scaled_dot_product_attention(q_all, k.double(), v.double(), is_causal=True, enable_gqa=True)[
        :, :, past:
    ]
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

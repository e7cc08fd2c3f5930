"""The context-parallel merge of partial attention results (kernels/ops.py: merge_partials, and
merge_ranks' Triton path and twin) where exp overflows float32: peaked scores, so every range's
log-sum-exp is in the hundreds (exp(89) is already past float32's range), against float64
attention over the whole context."""

from __future__ import annotations

import pytest
import torch
from helpers import max_rel_err

from minidecode.kernels import ops
from minidecode.kernels.reference import decode_attention_reference


@pytest.mark.parametrize("triton", [False, True], ids=["twin", "lean"])
def test_merge_of_peaked_ranges_matches_float64(triton):
    """3 ranges of a 240-position context (the second sequence's last range empty), each range's
    (o, lse) from decode_attention in float32, lse 120-300: the merge subtracts the largest lse
    before exp, or it gives inf / NaN."""
    gen = torch.Generator().manual_seed(0)
    B, Hq, Hkv, S, D = 2, 4, 2, 240, 64
    q = torch.randn(B, Hq, D, generator=gen) * 80  # scores q.k / 8 with a spread of ~80
    k, v = torch.randn(B, Hkv, S, D, generator=gen), torch.randn(B, Hkv, S, D, generator=gen)
    lengths, scale = torch.tensor([240, 150]), D**-0.5
    exact, exact_lse = decode_attention_reference(
        q.double(), k.double(), v.double(), lengths, scale, torch.float64, return_lse=True
    )
    outs, lses = [], []
    for lo, hi in ((0, 90), (90, 160), (160, 240)):
        held = (lengths - lo).clamp(0, hi - lo).to(torch.int32)
        k_r, v_r = k[:, :, lo:hi].contiguous(), v[:, :, lo:hi].contiguous()
        o, lse = ops.decode_attention(q, k_r, v_r, held, scale, triton=triton, return_lse=True)
        valid = held > 0
        o = torch.where(valid[:, None, None], o, 0.0)  # nothing here: zeros, as merge_partials asks
        outs.append(o)
        lses.append(torch.where(valid[:, None], lse, float("-inf")))
    lse = torch.stack(lses)
    assert (
        lse[lse.isfinite()].min() > 100 and lse.max() < 1000
    )  # exp overflows float32 (and float64 past 709)
    merged = ops.merge_partials(torch.stack(outs), lse)
    assert max_rel_err(merged, exact) < 1e-5
    packed = torch.cat([torch.stack(outs), lse[..., None]], dim=-1)  # [ranges, B, Hq, D + 1]
    assert max_rel_err(ops.merge_ranks(packed, torch.float32, triton=triton), exact) < 1e-5
    union = torch.logsumexp(lse.double(), dim=0)  # the ranges' log-sum-exps add up to the whole's
    assert ((union - exact_lse) / exact_lse).abs().max() < 1e-6

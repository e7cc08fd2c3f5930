"""Multi-query lean attention (verifying speculative drafts): q_lens[b] new query positions a
sequence, causal among themselves, each over the whole cache before it, in one launch; against
float64 attention, on the CPU (Triton interpreter, fp16/fp32: its tl.dot returns garbage for
bf16) and on a GPU (bf16/fp16, marked gpu), with a model-dtype or an FP8 (e4m3) cache.
"""

import dataclasses

import pytest
import torch
from helpers import rel_err
from test_lean_attention import BLOCK, DEVICES, INTERPRETED, TOL, blocked_v, counters_zero, pack_regions

from minidecode.kernels import lean_attention as la
from minidecode.kernels import ops
from minidecode.kernels.quant import dequantize_fp8, quantize_fp8
from minidecode.kernels.reference import multi_query_attention_reference

DTYPES = {"cpu": [torch.float16, torch.float32], "cuda": [torch.bfloat16, torch.float16]}
FP8_TOL = {torch.float16: 2e-3, torch.float32: 2e-3, torch.bfloat16: 1e-2}
MMA_TOL = TOL[torch.bfloat16]  # the e4m3 tensor-core path: p in two e4m3 terms (bf16's precision)
FP8_PATHS = [  # the single-query tiers, and what multi_query_config picks for wider tiles
    pytest.param(la.FP8_TINY_CONFIG, id="fp16-decode-q-per-tile"),
    pytest.param(la.FP8_SHORT_CONFIG, id="fp16-decode"),
    pytest.param(la.FP8_CONFIG, id="e4m3-mma"),
    pytest.param(dataclasses.replace(la.FP8_CONFIG, num_warps=8, ctas_per_sm=1), id="e4m3-mma-8-warps"),
    pytest.param(la.MULTI_QUERY_FP8_64, id="fp16-decode-64"),
    pytest.param(la.MULTI_QUERY_FP8_WIDE, id="fp16-decode-128"),
]


def make_inputs(device, lengths, q_lens, hq, hkv, head_dim=64, dtype=torch.float16, seed=0, q_max=None):
    """q [B, Q_MAX, Hq, D] (Q_MAX = max(q_lens) unless given), K/V [B, Hkv, S, D] with NaN past
    each length (a read past it shows), lengths and q_lens [B] int32."""
    gen = torch.Generator(device=device).manual_seed(seed)
    batch, capacity = len(lengths), max(lengths) + 3
    q_max = q_max or max(q_lens)
    q = torch.randn(batch, q_max, hq, head_dim, generator=gen, device=device).to(dtype)
    k = torch.randn(batch, hkv, capacity, head_dim, generator=gen, device=device).to(dtype)
    v = torch.randn(batch, hkv, capacity, head_dim, generator=gen, device=device).to(dtype)
    for b, n in enumerate(lengths):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("nan")
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    qls = torch.tensor(q_lens, dtype=torch.int32, device=device)
    return q, k, v, lens, qls


def reference(q, k, v, lengths, q_lens, scale):
    """float64 math and output, [B, Q_MAX, Hq, D] and lse [B, Q_MAX, Hq]."""
    return multi_query_attention_reference(
        q.double(), k.double(), v.double(), lengths.cpu(), q_lens.cpu(), scale, torch.float64, return_lse=True
    )


def written(lengths, q_lens, q_max):
    """[B, Q_MAX] bool: the rows the kernel writes (active sequences' first q_lens positions)."""
    rows = torch.arange(q_max)[None, :] < q_lens.cpu()[:, None]
    return rows & (lengths.cpu() > 0)[:, None]


def run(q, k, v, lens, q_lens, scale, lse=True, **kw):
    """The kernel into NaN-poisoned out / lse: the rows it must write are written (and finite),
    the others are left alone, the counters are zero after it."""
    out = torch.full_like(q, float("nan"))
    lse_out = torch.full(q.shape[:-1], float("nan"), device=q.device) if lse else None
    la.lean_attention(q, k, v, lens, scale, out=out, lse=lse_out, q_lens=q_lens, **kw)
    rows = written(lens, q_lens, q.shape[1]).to(q.device)
    assert not out[rows].isnan().any(), "a query row not written (or NaN computed)"
    assert out[~rows].isnan().all(), "a row past q_lens (or of an idle sequence) was written"
    if lse:
        assert not lse_out[rows].isnan().any() and lse_out[~rows].isnan().all()
    assert counters_zero(), "ticket counters not reset"
    return out, lse_out, rows


def check(device, lengths, q_lens, hq=8, hkv=2, head_dim=64, dtype=torch.float16, seed=0, scale=None, **kw):
    q, k, v, lens, qls = make_inputs(device, lengths, q_lens, hq, hkv, head_dim, dtype, seed)
    scale = head_dim**-0.5 if scale is None else scale
    out, lse, rows = run(q, k, v, lens, qls, scale, **kw)
    ref, ref_lse = reference(q, k, v, lens, qls, scale)
    rows = rows.to(q.device)
    err = rel_err(out[rows], ref.to(device)[rows])
    assert err < TOL[dtype], f"relative error {err:.2e}"
    lse_err = (lse[rows].double() - ref_lse.to(device)[rows]).abs().max().item()
    assert lse_err < 50 * TOL[dtype], f"lse error {lse_err:.2e}"
    return q, k, v, lens, qls, out


# ---- model-dtype cache ----------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_len", range(1, 17))
def test_each_q_len(device, q_len):
    """q_len 1..16 (up to 15 drafts) for every sequence of a ragged batch: shorter than one tile,
    ending just past a tile (the last tile holds fewer positions than q_len, so the first rows see
    none of it), ending mid-tile, on a grid that splits heads over CTAs."""
    lengths = [q_len + 3, BLOCK + 1, 2 * BLOCK + q_len // 2, 3 * BLOCK - 5]
    for dtype in DTYPES[device]:
        check(device, lengths, [q_len] * 4, num_ctas=5, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_ctas", [1, 4, 7, None])
def test_mixed_q_lens_and_idle_rows(device, num_ctas):
    """Sequences with different q_len in one batch, idle slots (length 0) among them, and a
    sequence whose whole context is its new tokens (length = q_len)."""
    lengths = [2 * BLOCK + 3, 0, 9, BLOCK, 5 * BLOCK + 77, 0, 16]
    q_lens = [16, 3, 1, 7, 2, 1, 16]
    for dtype in DTYPES[device]:
        check(device, lengths, q_lens, num_ctas=num_ctas, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hq, hkv", [(4, 4), (8, 2), (32, 8), (16, 1)], ids=str)
def test_groups(device, hq, hkv):
    """GQA groups of 1, 4 and 16 query heads, so tiles of 16, 64 and 256 rows at q_len 16 (the
    group's heads for each position)."""
    check(device, [BLOCK + 9, 2 * BLOCK + 1], [16, 5], hq=hq, hkv=hkv, num_ctas=3)


@pytest.mark.parametrize("device", DEVICES)
def test_last_tile_unseen_by_first_rows_in_its_own_cta(device):
    """One tile a CTA (aligned schedule): the CTA holding the last tile, of 2 positions, writes a
    partial in which 6 of the 8 query positions saw nothing (l = 0); the merge must weigh it 0."""
    lengths, hkv = [2 * BLOCK + 2], 2
    sched = la.lean_schedule(lengths, hkv, head_dim=64, device=device, num_ctas=6)
    assert sched.aligned and sched.tiles_per_cta == 1
    for dtype in DTYPES[device]:
        check(device, lengths, [8], hq=8, hkv=hkv, num_ctas=6, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_head_dim_128_and_peaked_logits(device):
    check(device, [130, 700], [5, 16], hq=32, hkv=8, head_dim=128, num_ctas=5, dtype=torch.float32)
    for dtype in DTYPES[device]:  # scores over hundreds of nats: nearly one-hot softmax
        check(device, [3 * BLOCK + 5, 33], [9, 4], num_ctas=4, dtype=dtype, scale=40.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fan", [2, 4, 8])
def test_merge_tree(device, fan):
    """The merge tree (_tree_merge) with nodes of up to 2, 4 and 8 children over a head split
    into more CTAs than fan^2 (three levels or more, nodes of one child among them, a stream-K
    schedule whose ranges cross heads and sequences), on the tile a 12-position query takes
    (G * Q_MAX = 48 rows, padded to 64: the config multi_query_config gives such a tile)."""
    wide = la.multi_query_config(la.DEFAULT_CONFIG, 64, torch.bfloat16, fp8=False)
    config = dataclasses.replace(wide, tree_fan=fan)
    lengths = [40 * wide.block_n + 5, 3 * wide.block_n]
    sched = la.lean_schedule(lengths, 2, head_dim=128, device=device, num_ctas=29, config=config)
    assert sched.max_splits_per_head > 8 and not sched.aligned
    check(device, lengths, [12, 3], hq=8, hkv=2, head_dim=128, num_ctas=29, config=config)


@pytest.mark.parametrize("device", DEVICES)
def test_one_query_position_is_the_decode_step(device):
    """q_lens all 1 with Q_MAX 1 is the single-query kernel, bitwise; with Q_MAX > 1 the q_len 1
    rows are the same attention (a different tile shape: equal within rounding)."""
    lengths = [3 * BLOCK + 7, 40, 1]
    q, k, v, lens, qls = make_inputs(device, lengths, [1, 1, 1], 8, 2)
    single = la.lean_attention(q[:, 0], k, v, lens, 0.125, num_ctas=4)
    multi, _, _ = run(q, k, v, lens, qls, 0.125, num_ctas=4)
    assert multi.shape == q.shape and torch.equal(multi[:, 0], single)
    q4 = torch.cat([q, torch.randn_like(q).expand(-1, 3, -1, -1)], 1)  # Q_MAX 4, rows 1..3 unused
    multi4, _, _ = run(q4, k, v, lens, qls, 0.125, num_ctas=4)
    assert rel_err(multi4[:, 0], single) < TOL[q.dtype]


@pytest.mark.parametrize("device", DEVICES)
def test_bitwise_repeatable(device):
    q, k, v, lens, qls, first = check(device, [7 * BLOCK + 3, BLOCK - 2], [11, 6], num_ctas=5)
    again = run(q, k, v, lens, qls, 0.125, num_ctas=5)[0]
    assert torch.equal(first.nan_to_num(), again.nan_to_num())  # NaN: the rows left unwritten


@pytest.mark.parametrize("device", DEVICES)
def test_regions_of_one_shared_row(device):
    """Sequences in regions of one cache row (starts != 0, NaN between regions), idle slots
    included: each active sequence equals the reference on its own cache."""
    lengths, q_lens = [3 * BLOCK + 7, 0, 40, BLOCK + 1, 0], [4, 2, 16, 9, 1]
    dtype = DTYPES[device][0]
    q, k, v, _, qls = make_inputs(device, [max(n, 1) for n in lengths], q_lens, 8, 2, dtype=dtype)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    gaps = [3, 9, 0, 17, 2]
    (k_row, starts), (v_row, _) = pack_regions(k, lengths, gaps), pack_regions(v, lengths, gaps)
    out, lse, rows = run(q, k_row, v_row, lens, qls, 64**-0.5, num_ctas=5, starts=starts)
    ref, ref_lse = reference(q, k, v, lens, qls, 64**-0.5)
    rows = rows.to(device)
    assert rel_err(out[rows], ref.to(device)[rows]) < TOL[dtype]
    assert (lse[rows].double() - ref_lse.to(device)[rows]).abs().max() < 50 * TOL[dtype]


def per_row_reference(q, k, v, limits, q_lens, scale, fp8_cache=None):
    """float64 [B, Q_MAX, Hq, D] and lse: each real query row alone over the first limits[b, j]
    positions (the single-query reference); a row that sees none: 0 and -inf."""
    from minidecode.kernels.reference import decode_attention_reference

    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float64)
    for b in range(q.shape[0]):
        for j in range(int(q_lens[b])):
            n = int(limits[b, j])
            if n:
                length = torch.tensor([n])
                got = decode_attention_reference(
                    q[b : b + 1, j].double(), k[b : b + 1].double(), v[b : b + 1].double(), length, scale,
                    torch.float64, return_lse=True,
                )  # fmt: skip
                out[b, j], lse[b, j] = got[0][0], got[1][0]
    return out, lse


# A context-parallel rank's view of a step with drafts: it holds some of the new positions (here
# the rows whose limit grows), so each query's limit is given; some rows see none of its positions.
LIMIT_LENGTHS = [BLOCK + 3, 7, 2 * BLOCK + 1, 0]
LIMITS = [[BLOCK + 1, BLOCK + 1, BLOCK + 2, BLOCK + 3], [0, 0, 6, 7], [2 * BLOCK + 1] * 4, [0, 0, 0, 0]]
LIMIT_Q_LENS = [4, 4, 3, 2]


def check_limits(device, k, v, dtype, scale, kd=None, vd=None, tol=None, **kw):
    gen = torch.Generator(device=device).manual_seed(3)
    q = torch.randn(4, 4, 8, 64, generator=gen, device=device).to(dtype)
    lens = torch.tensor(LIMIT_LENGTHS, dtype=torch.int32, device=device)
    qls = torch.tensor(LIMIT_Q_LENS, dtype=torch.int32, device=device)
    limits = torch.tensor(LIMITS, dtype=torch.int32, device=device)
    out, lse, rows = run(q, k, v, lens, qls, scale, row_limits=limits, **kw)
    kd, vd = (k if kd is None else kd).cpu(), (v if vd is None else vd).cpu()
    ref, ref_lse = per_row_reference(q.cpu(), kd, vd, limits.cpu(), qls.cpu(), scale)
    rows = rows.to(device)
    tol = TOL[dtype] if tol is None else tol
    assert rel_err(out[rows], ref.to(device)[rows]) < tol
    unseen = (limits == 0) & rows
    assert unseen.any() and (out[unseen] == 0).all() and (lse[unseen] == float("-inf")).all()
    seen = rows & ~unseen
    assert (lse[seen].double() - ref_lse.to(device)[seen]).abs().max().item() < 50 * tol
    return q, lens, qls, limits, out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_ctas", [1, 3, 8])
def test_given_row_limits(device, num_ctas):
    """row_limits: each query row attends to its given number of positions, rows that see none get
    o = 0 and lse = -inf (in a whole segment and in a merge of partials), against each row alone;
    and the twin (ops.decode_attention) gives the same."""
    for dtype in DTYPES[device]:
        gen = torch.Generator(device=device).manual_seed(4)
        k = torch.randn(4, 2, 2 * BLOCK + 4, 64, generator=gen, device=device).to(dtype)
        v = torch.randn_like(k)
        for b, n in enumerate(LIMIT_LENGTHS):  # a read past a length shows
            k[b, :, n:], v[b, :, n:] = float("nan"), float("nan")
        q, lens, qls, limits, out = check_limits(device, k, v, dtype, 0.125, num_ctas=num_ctas)
        twin = ops.decode_attention(q, k, v, lens, 0.125, triton=False, q_lens=qls, row_limits=limits)
        rows = written(lens, qls, 4).to(device)
        assert rel_err(twin[rows].float(), out[rows].float()) < TOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", FP8_PATHS)
def test_given_row_limits_fp8(device, config):
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(5)
    k = torch.randn(4, 2, 2 * BLOCK + 4, 64, generator=gen, device=device).to(dtype)
    v = torch.randn_like(k)
    (k8, ks), (v8, vs) = quantize_fp8(k), quantize_fp8(v)
    kd, vd = dequantize_fp8(k8, ks, torch.float64), dequantize_fp8(v8, vs, torch.float64)
    tol = MMA_TOL if config.fp8_mma else FP8_TOL[dtype]
    kv_scale = torch.stack((ks, vs), -1)
    vt = blocked_v(v8, LIMIT_LENGTHS)
    check_limits(device, k8, vt, dtype, 0.125, kd, vd, tol, kv_scale=kv_scale, config=config, num_ctas=3)


@pytest.mark.parametrize("device", DEVICES)
def test_rejects_bad_input(device):
    q, k, v, lens, qls = make_inputs(device, [70, 20], [4, 2], 4, 2)
    with pytest.raises(ValueError, match=r"q must be \[B, Q_MAX, Hq, D\]"):
        la.lean_attention(q[:, 0], k, v, lens, 0.1, q_lens=qls)
    with pytest.raises(ValueError, match="q_lens must be"):
        la.lean_attention(q, k, v, lens, 0.1, q_lens=qls[:1])
    if device == "cpu":  # the value checks read the tensors: CPU only (on a GPU they would sync)
        with pytest.raises(ValueError, match="in \\[1, Q_MAX"):
            la.lean_attention(q, k, v, lens, 0.1, q_lens=torch.tensor([5, 1], dtype=torch.int32))
        with pytest.raises(ValueError, match="must count its q_lens"):
            la.lean_attention(q, k, v, torch.tensor([3, 20], dtype=torch.int32), 0.1, q_lens=qls)
        with pytest.raises(ValueError, match="every row limit"):
            limits = torch.tensor([[70, 71, 0, 0], [1, 2, 0, 0]], dtype=torch.int32)
            la.lean_attention(q, k, v, lens, 0.1, q_lens=qls, row_limits=limits)
    with pytest.raises(ValueError, match="row_limits must be"):
        la.lean_attention(q, k, v, lens, 0.1, q_lens=qls, row_limits=qls)
    with pytest.raises(ValueError, match="row_limits come with q_lens"):
        la.lean_attention(q[:, 0], k, v, lens, 0.1, row_limits=qls)
    with pytest.raises(ValueError, match="lse must be"):
        la.lean_attention(q, k, v, lens, 0.1, q_lens=qls, lse=torch.empty(2, 4, device=device))
    for fan in (1, 3):
        with pytest.raises(ValueError, match="tree_fan must be a power of two >= 2"):
            config = dataclasses.replace(la.DEFAULT_CONFIG, tree_fan=fan)
            la.lean_attention(q, k, v, lens, 0.1, q_lens=qls, config=config)


# ---- FP8 (e4m3) cache -------------------------------------------------------------------------


def check_fp8(
    device, lengths, q_lens, config, hq=8, hkv=2, head_dim=64, dtype=torch.float16, num_ctas=None, pick=False
):
    """The kernel on an FP8 cache against float64 attention over the dequantized cache (pick: with
    the config lean_attention picks, expected to be `config`)."""
    gen = torch.Generator(device=device).manual_seed(1)
    batch, capacity, q_max = len(lengths), max(lengths) + 3, max(q_lens)
    q = torch.randn(batch, q_max, hq, head_dim, generator=gen, device=device).to(dtype)
    k = torch.randn(batch, hkv, capacity, head_dim, generator=gen, device=device).to(dtype)
    k = k * torch.logspace(-1, 1, hkv, device=device)[:, None, None].to(dtype)  # heads of different size
    v = torch.randn(batch, hkv, capacity, head_dim, generator=gen, device=device).to(dtype)
    (k8, ks), (v8, vs) = quantize_fp8(k), quantize_fp8(v)
    for b, n in enumerate(lengths):
        ks[b, :, n:] = float("nan")
        vs[b, :, n:] = float("nan")
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    qls = torch.tensor(q_lens, dtype=torch.int32, device=device)
    kv_scale = torch.stack((ks, vs), -1)
    out, _, rows = run(
        q, k8, blocked_v(v8, lengths), lens, qls, head_dim**-0.5, kv_scale=kv_scale,
        config=None if pick else config, num_ctas=num_ctas,
    )  # fmt: skip
    kd, vd = dequantize_fp8(k8, ks, torch.float64), dequantize_fp8(v8, vs, torch.float64)
    ref, _ = reference(q, kd, vd, lens, qls, head_dim**-0.5)
    rows = rows.to(device)
    err = rel_err(out[rows], ref.to(device)[rows])
    assert err < (MMA_TOL if config.fp8_mma else FP8_TOL[dtype]), f"relative error {err:.2e}"
    # the twin (ops.decode_attention on the CPU path) gives the same attention
    vt = blocked_v(v8, lengths)
    kw = {"triton": False, "kv_scale": kv_scale, "q_lens": qls}
    twin = ops.decode_attention(q.float(), k8, vt, lens, head_dim**-0.5, **kw)
    assert rel_err(twin[rows], ref.to(device)[rows]) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", FP8_PATHS)
@pytest.mark.parametrize("num_ctas", [1, 3, 7])
def test_fp8_ragged_batch(device, config, num_ctas):
    lengths = [2, la.V_BLOCK + 1, 2 * la.FP8_SHORT_CONFIG.block_n + 3, 37, 0, 300]
    q_lens = [2, 16, 5, 1, 3, 12]
    dtypes = [torch.float16] if device == "cpu" else [torch.bfloat16, torch.float16]
    for dtype in dtypes:
        check_fp8(device, lengths, q_lens, config, num_ctas=num_ctas, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", FP8_PATHS)
def test_fp8_llama_shape(device, config):
    """32 q / 8 KV heads, head_dim 128, q_len up to 16 (tiles of 64 rows), heads split over CTAs."""
    lengths = [3 * la.FP8_SHORT_CONFIG.block_n + 17, 100] if device == "cpu" else [131_072 + 5, 999]
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    check_fp8(device, lengths, [16, 9], config, hq=32, hkv=8, head_dim=128, num_ctas=5, dtype=dtype)


def test_multi_query_configs():
    """Tiles of up to 16 rows keep the single-query config (bf16: up to 32, with early tickets);
    wider ones take the swept tiles (bf16), the fp16 decode at 32 rows, its 64-position
    tile at 64 and its q-per-tile tile at 128 (FP8); lean_attention launches what it picks."""
    bf16 = la.default_config(128, torch.bfloat16)
    assert la.multi_query_config(bf16, 16, torch.bfloat16, False) == bf16
    early = dataclasses.replace(bf16, early_ticket=True)
    assert la.multi_query_config(bf16, 32, torch.bfloat16, False) == early
    for rows, want in la.MULTI_QUERY_BF16.items():
        got = la.multi_query_config(bf16, rows, torch.bfloat16, False)
        tile = (got.block_n, got.num_warps, got.num_stages, got.ctas_per_sm, got.early_ticket, got.tree_fan)
        assert tile == want
    mma, short = la.FP8_CONFIG, la.FP8_SHORT_CONFIG
    assert la.multi_query_config(mma, 16, torch.bfloat16, True) == mma
    assert la.multi_query_config(mma, 32, torch.bfloat16, True) == short
    assert la.multi_query_config(la.FP8_TINY_CONFIG, 32, torch.bfloat16, True) == short
    assert la.multi_query_config(mma, 64, torch.bfloat16, True) == la.MULTI_QUERY_FP8_64
    assert la.multi_query_config(mma, 128, torch.bfloat16, True) == la.MULTI_QUERY_FP8_WIDE


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", [False, True], ids=["fp16", "fp8"])
def test_default_configs_of_wide_tiles(device, fp8):
    """32 / 8 heads at q_len 16 and 9 (tiles of 64 rows) and 3 (16 rows) through the configs
    lean_attention picks itself."""
    lengths, q_lens = [5 * 64 + 3, 700, 40], [16, 9, 3]
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    if fp8:
        check_fp8(device, lengths, q_lens, la.MULTI_QUERY_FP8_64, hq=32, hkv=8, head_dim=128, dtype=dtype,
                  num_ctas=7, pick=True)  # fmt: skip
    else:
        check(device, lengths, q_lens, hq=32, hkv=8, head_dim=128, dtype=dtype, num_ctas=7)


# ---- the PyTorch twin -----------------------------------------------------------------------


def test_twin_matches_reference_and_kernel():
    """ops.decode_attention's CPU twin with q_lens (regions of one row, idle slots, lse) against the
    float64 reference, and against the kernel's result through the same entry point."""
    lengths, q_lens = [3 * BLOCK + 7, 0, 40, BLOCK + 1], [4, 2, 16, 9]
    q, k, v, _, qls = make_inputs("cpu", lengths[:1] * 4, q_lens, 8, 2, dtype=torch.float32)
    lens = torch.tensor(lengths, dtype=torch.int32)
    gaps = [3, 9, 0, 17]
    (k_row, starts), (v_row, _) = pack_regions(k, lengths, gaps), pack_regions(v, lengths, gaps)
    out, lse = ops.decode_attention(
        q, k_row, v_row, lens, 0.125, triton=False, starts=starts, return_lse=True, q_lens=qls
    )
    ref, ref_lse = reference(q, k, v, lens, qls, 0.125)
    rows = written(lens, qls, q.shape[1])
    assert rel_err(out[rows], ref[rows]) < 1e-6 and out[~rows].eq(0).all()
    assert (lse[rows].double() - ref_lse[rows]).abs().max() < 1e-5 and lse[~rows].eq(float("-inf")).all()
    if INTERPRETED:
        got, got_lse = ops.decode_attention(
            q, k_row, v_row, lens, 0.125, triton=True, starts=starts, return_lse=True, q_lens=qls
        )
        assert rel_err(got[rows], ref[rows]) < TOL[torch.float32]
        assert (got_lse[rows].double() - ref_lse[rows]).abs().max() < 1e-4


# ---- CUDA graphs ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_cuda_graph_replays_for_any_q_lens(fp8):
    """Captured once with Q_MAX 16, replayed as q_lens and lengths change in place (a verification
    step per decode step: accepted drafts grow the context by a varying number of tokens)."""
    if INTERPRETED or not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    lengths, q_lens = [200_001, 5_000, 20], [16, 1, 4]
    q, k, v, lens, qls = make_inputs("cuda", [n + 64 for n in lengths], q_lens, 32, 8, 128, torch.bfloat16)
    lens.copy_(torch.tensor(lengths, dtype=torch.int32))
    kw = {}
    if fp8:
        k = k.nan_to_num(0.0)
        v = v.nan_to_num(0.0)
        (k8, ks), (v8, vs) = quantize_fp8(k), quantize_fp8(v)
        kw["kv_scale"] = torch.stack((ks, vs), -1)
        kc, vc = k8, la.to_v_blocked_t(v8)
        k, v = dequantize_fp8(k8, ks, torch.float64), dequantize_fp8(v8, vs, torch.float64)
    else:
        kc, vc = k, v
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device="cuda")
    la.lean_attention(q, kc, vc, lens, 128**-0.5, out=out, lse=lse, q_lens=qls, **kw)  # eager: compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        la.lean_attention(q, kc, vc, lens, 128**-0.5, out=out, lse=lse, q_lens=qls, **kw)
    for step_q_lens, grow in (([3, 16, 1], 4), ([16, 16, 16], 1), ([1, 2, 9], 16)):
        lens += grow
        qls.copy_(torch.tensor(step_q_lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = reference(q, k, v, lens, qls, 128**-0.5)
        rows = written(lens, qls, q.shape[1]).cuda()
        assert not out[rows].isnan().any()
        err = rel_err(out[rows], ref.cuda()[rows])
        assert err < (MMA_TOL if fp8 else TOL[torch.bfloat16]), f"relative error {err:.2e}"
        assert counters_zero()


@pytest.mark.gpu
def test_steps_whose_rows_share_a_tile_share_a_compile():
    """Q_MAX is a runtime value: at 4 query heads a KV head, 2 and 4 positions (8 and 16 rows) both
    run in the 16-row tile and compile the kernel once; 8 positions (32 rows) compile another. Each
    against float64."""
    if INTERPRETED or not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    kernels = la._lean_decode_kernel.device_caches[torch.cuda.current_device()][0]  # key -> compiled
    kernels.clear()  # this process's compiles (earlier tests'), so each new key below is counted
    compiled = []
    for q_len in (2, 4, 3, 8):
        check("cuda", [3_000, 77], [q_len, 1], hq=32, hkv=8, head_dim=128, dtype=torch.float16, seed=q_len)
        compiled.append(len(kernels))
    assert compiled == [1, 1, 1, 2], compiled

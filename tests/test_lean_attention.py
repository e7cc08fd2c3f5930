"""Lean attention against a float64 reference, on the CPU (Triton interpreter, fp16/fp32: its tl.dot
returns garbage for bf16, triton-lang/triton#11584) and on a GPU (bf16/fp16/fp32, marked gpu),
with a model-dtype or an FP8 (e4m3) cache.

tests/conftest.py picks the interpreter when no GPU is present; with a GPU the CPU cases skip.
"""

import dataclasses
import itertools

import pytest
import torch
import triton
import triton.language as tl
from helpers import kernel_devices, rel_err

from minidecode.kernels import lean_attention as la
from minidecode.kernels.quant import dequantize_fp8, quantize_fp8
from minidecode.kernels.reference import decode_attention_reference

INTERPRETED, DEVICES = kernel_devices(la._lean_decode_kernel)
BLOCK = la.DEFAULT_CONFIG.block_n  # positions per tile (fp16 / bf16)
BLOCK_FP8 = la.FP8_SHORT_CONFIG.block_n  # positions per tile of the FP8 configs' larger tiles
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-5}  # relative norm error
DTYPES = {"cpu": [torch.float16, torch.float32], "cuda": [torch.bfloat16, torch.float16]}


def make_inputs(device, lengths, hq, hkv, head_dim=64, dtype=torch.float16, seed=0, slack=3, fp8=False):
    """Random q, K, V; K/V positions past each length are NaN (FP8: NaN scales), so reading them
    shows. FP8 returns the e4m3 cache, its scales and the unquantized K/V as well."""
    gen = torch.Generator(device=device).manual_seed(seed)
    batch, capacity = len(lengths), max(lengths) + slack
    q = torch.randn(batch, hq, head_dim, generator=gen, device=device).to(dtype)
    k = torch.randn(batch, hkv, capacity, head_dim, generator=gen, device=device).to(dtype)
    v = torch.randn(batch, hkv, capacity, head_dim, generator=gen, device=device).to(dtype)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    if not fp8:
        for b, n in enumerate(lengths):
            k[b, :, n:] = float("nan")
            v[b, :, n:] = float("nan")
        return q, k, v, lens
    k = k * torch.logspace(-1, 1, hkv, device=device)[:, None, None].to(dtype)  # heads of different size
    (k8, ks), (v8, vs) = quantize_fp8(k), quantize_fp8(v)
    for b, n in enumerate(lengths):
        ks[b, :, n:] = float("nan")
        vs[b, :, n:] = float("nan")
    return q, (k8, ks), (v8, vs), lens, (k, v)


def reference(q, k, v, lengths, scale):
    """float64 inputs, math and output (not rounded back to q's dtype); K/V may be (e4m3, scale)
    pairs, dequantized in float64."""
    if isinstance(k, tuple):
        k, v = dequantize_fp8(*k, torch.float64), dequantize_fp8(*v, torch.float64)
    return decode_attention_reference(q.double(), k.double(), v.double(), lengths, scale, torch.float64)


def counters_zero() -> bool:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return all(ws.counters.eq(0).all().item() for ws in la._WORKSPACES.values())


def run_lean(q, k, v, lengths, scale, num_ctas=None, **kw):
    """Run into a NaN-poisoned output, then check it is fully written and the counters are zero.
    An FP8 cache's V (e4m3, scale) in K's layout goes to the kernel blocked (blocked_v), its K and V
    scales side by side (kv_scale)."""
    if isinstance(k, tuple):
        (k, k_scale), (v, v_scale) = k, v
        v, kw["kv_scale"] = blocked_v(v, lengths.tolist()), torch.stack((k_scale, v_scale), -1)
    out = torch.full_like(q, float("nan"))
    la.lean_attention(q, k, v, lengths, scale, num_ctas=num_ctas, out=out, **kw)
    assert not out.isnan().any(), "output not fully written (or NaN computed)"
    assert counters_zero(), "ticket counters not reset"
    return out


def check(
    device, lengths, hq, hkv, num_ctas=None, head_dim=64, dtype=torch.float16, scale=None, seed=0, **kw
):
    """The kernel (kw: lean_attention's, e.g. config) against the float64 reference."""
    q, k, v, lens = make_inputs(device, lengths, hq, hkv, head_dim, dtype, seed)
    scale = head_dim**-0.5 if scale is None else scale
    out = run_lean(q, k, v, lens, scale, num_ctas, **kw)
    err = rel_err(out, reference(q, k, v, lens, scale))
    assert err < TOL[dtype], f"relative error {err:.2e}"
    return q, k, v, lens, out


# ---- model-dtype cache ----------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 1])
@pytest.mark.parametrize("num_ctas", [1, 3, None])
def test_block_edges(device, n, num_ctas):
    for dtype in DTYPES[device]:
        check(device, [n], hq=8, hkv=2, num_ctas=num_ctas, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_fewer_tiles_than_ctas(device):
    sched = la.lean_schedule([5, 40], num_kv_heads=2, head_dim=64, device=device, num_ctas=16)
    assert sched.total_tiles < sched.grid
    check(device, [5, 40], hq=4, hkv=2, num_ctas=16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "lengths, hkv, num_ctas",
    [
        ([3 * BLOCK], 4, 5),  # CTAs start mid-segment and hold two partial segments
        ([2 * BLOCK], 8, 3),  # whole segments in the middle of a range, split ones at its ends
        ([9 * BLOCK - 7], 2, 4),  # long ranges, each head split over several CTAs
    ],
)
def test_many_tiles_per_cta(device, lengths, hkv, num_ctas):
    sched = la.lean_schedule(lengths, hkv, head_dim=64, device=device, num_ctas=num_ctas)
    assert sched.tiles_per_cta > 1 and sched.partial_segments > 0
    check(device, lengths, hq=2 * hkv, hkv=hkv, num_ctas=num_ctas)


@pytest.mark.parametrize("device", DEVICES)
def test_merge_of_more_partials_than_in_flight(device):
    """A head split over more CTAs than the merge keeps in flight (its pipeline's steady state)."""
    sched = la.lean_schedule([14 * BLOCK + 5], 2, head_dim=128, device=device, num_ctas=12)
    assert sched.max_splits_per_head > la.DEFAULT_CONFIG.merge_stages
    check(device, [14 * BLOCK + 5, 3 * BLOCK], hq=32, hkv=2, num_ctas=12, head_dim=128)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("merge_chunk", [2, 8])
def test_merge_in_chunks(device, merge_chunk):
    """The merge taking several partials an iteration (as FP8_CONFIG's does): a head split over
    more CTAs than a chunk holds, in a count that leaves the last chunk part-empty."""
    config = dataclasses.replace(la.DEFAULT_CONFIG, merge_chunk=merge_chunk, merge_stages=2)
    lengths = [14 * BLOCK + 5, 3 * BLOCK]
    splits = la.lean_schedule(lengths, 2, head_dim=128, device=device, num_ctas=29).max_splits_per_head
    assert splits > merge_chunk and splits % merge_chunk
    for dtype in DTYPES[device]:
        check(device, lengths, hq=8, hkv=2, num_ctas=29, head_dim=128, dtype=dtype, config=config)


@pytest.mark.parametrize("device", DEVICES)
def test_merge_chunk_must_be_a_power_of_two(device):
    q, k, v, lens = make_inputs(device, [70], 4, 2)
    config = dataclasses.replace(la.DEFAULT_CONFIG, merge_chunk=3)
    with pytest.raises(ValueError, match="merge_chunk must be a power of two"):
        la.lean_attention(q, k, v, lens, 0.125, config=config)


@pytest.mark.parametrize("device", DEVICES)
def test_ragged_batch(device):
    lengths = [1, BLOCK + 2, 5 * BLOCK + 3, 64, 2 * BLOCK]
    if device == "cuda":
        lengths += [1000, 5000, 100_000, 262_144]
    sched = la.lean_schedule(lengths, 2, head_dim=64, device=device, num_ctas=7)
    assert sched.max_splits_per_head > 1  # ranges cross sequence boundaries and split heads
    for dtype in DTYPES[device]:
        check(device, lengths, hq=8, hkv=2, num_ctas=7, dtype=dtype)
        check(device, lengths, hq=32, hkv=8, head_dim=128, dtype=dtype, seed=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hq, hkv", [(4, 4), (8, 2), (16, 2), (32, 2), (16, 1), (128, 8)], ids=str)
def test_gqa_groups(device, hq, hkv):
    check(device, [BLOCK + 9, 2 * BLOCK + 1], hq=hq, hkv=hkv, num_ctas=3)


@pytest.mark.parametrize("device", DEVICES)
def test_head_dim_128(device):
    check(device, [130, 700], hq=8, hkv=2, num_ctas=5, head_dim=128, dtype=torch.float32)
    check(device, [1, 257], hq=4, hkv=4, num_ctas=3, head_dim=128)


@pytest.mark.parametrize("device", DEVICES)
def test_peaked_logits(device):
    # scores spread over hundreds of nats: a naive exp overflows, the softmax is nearly one-hot
    for dtype in [*DTYPES[device], torch.float32]:
        check(device, [3 * BLOCK + 5, 33], hq=8, hkv=2, num_ctas=4, dtype=dtype, scale=40.0)


@pytest.mark.parametrize("device", DEVICES)
def test_bitwise_repeatable(device):
    lengths = [7 * BLOCK + 3, BLOCK - 2] if device == "cpu" else [123_457, 999]
    q, k, v, lens, first = check(device, lengths, hq=8, hkv=2, num_ctas=5 if device == "cpu" else None)
    for _ in range(2):
        assert torch.equal(first, run_lean(q, k, v, lens, 0.125, num_ctas=5 if device == "cpu" else None))


@pytest.mark.parametrize("device", DEVICES)
def test_growing_context_reuses_workspace(device):
    """As in a replayed CUDA graph: lengths grow in place, the workspace is reused every step."""
    q, k, v, lens = make_inputs(device, [BLOCK - 2], 8, 2, slack=4)
    for _ in range(4):
        k[:, :, lens[0]] = torch.randn_like(k[:, :, 0])  # the new token's K and V
        v[:, :, lens[0]] = torch.randn_like(v[:, :, 0])
        lens += 1
        out = run_lean(q, k, v, lens, 0.125, num_ctas=3)
        assert rel_err(out, reference(q, k, v, lens, 0.125)) < TOL[q.dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[1_048_576], [1_048_576, 3]], ids=str)
def test_one_million_positions(lengths):
    if INTERPRETED or not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    check("cuda", lengths, hq=32, hkv=8, head_dim=128, dtype=torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [32, 96, 256])
def test_rejects_other_head_dims(device, head_dim):
    q, k, v, lens = make_inputs(device, [4], 4, 2, head_dim=head_dim)
    with pytest.raises(ValueError, match="head_dim"):
        la.lean_attention(q, k, v, lens, 0.1)


@pytest.mark.parametrize("device", DEVICES)
def test_rejects_bad_group(device):
    q, k, v, lens = make_inputs(device, [4], 6, 4)
    with pytest.raises(ValueError, match="multiple"):
        la.lean_attention(q, k, v, lens, 0.1)


@pytest.mark.parametrize(
    "lengths, hkv, grid, aligned",
    [
        ([1000, 3, 77], 8, 13, False),  # ragged: the whole step is dealt at once (stream-K)
        ([4096] * 3, 2, 7, False),  # 6 segments do not divide 7 CTAs
        ([5], 1, 9, True),  # one segment: the two deals are the same
        ([4096] * 3, 2, 12, True),  # 2 CTAs a segment
        ([4096, 4000], 8, 48, True),  # the same tiles (64 positions a tile), different lengths
        ([300] * 2, 2, 264, True),  # more CTAs than tiles: most take none
    ],
)
def test_schedule_is_even(lengths, hkv, grid, aligned):
    """The ranges tile [0, total) in order, none longer than an even deal of the whole step and
    none shorter than that minus one tile (or empty when there are fewer tiles than CTAs); an
    aligned schedule's ranges never cross a segment."""
    sched = la.lean_schedule(lengths, hkv, head_dim=64, num_ctas=grid)
    ranges = list(itertools.pairwise(sched.range_starts))
    sizes = [hi - lo for lo, hi in ranges]
    assert sched.aligned == aligned
    assert sched.range_starts[0] == 0 and sched.range_starts[-1] == sched.total_tiles and min(sizes) >= 0
    assert max(sizes) == sched.tiles_per_cta == -(-sched.total_tiles // grid)
    assert min(sizes) >= sched.tiles_per_cta - 1 or sched.total_tiles < grid
    if aligned:
        seg = sched.total_tiles // (len(lengths) * hkv)  # tiles a segment
        assert all(lo // seg == (hi - 1) // seg for lo, hi in ranges if hi > lo)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "lengths, hkv, num_ctas",
    [
        ([9 * BLOCK - 7] * 2, 2, 8),  # 4 segments of 9 tiles, 2 CTAs each
        ([2 * BLOCK, BLOCK + 1], 2, 4),  # the same tiles, different lengths: one CTA a segment
        ([5, 5], 2, 12),  # more CTAs than tiles
    ],
)
def test_aligned_schedule(device, lengths, hkv, num_ctas):
    """Every segment dealt to its own CTAs (the same tiles everywhere, a grid that is a multiple of
    the segments), against the reference, and bitwise repeatable."""
    assert la.lean_schedule(lengths, hkv, head_dim=64, device=device, num_ctas=num_ctas).aligned
    for dtype in DTYPES[device]:
        q, k, v, lens, first = check(device, lengths, hq=4 * hkv, hkv=hkv, num_ctas=num_ctas, dtype=dtype)
        assert torch.equal(first, run_lean(q, k, v, lens, 64**-0.5, num_ctas=num_ctas))


# ---- FP8 (e4m3) cache -----------------------------------------------------------------------

# Against the dequantized cache: the kernel's own error. The fp16 decode (config.fp8_mma False):
# q and the dot operands in fp16, fp32 accumulation. The e4m3 tensor-core path forms its
# products from two e4m3 terms of p (about 8 bits, bf16's precision), whatever q's dtype: bf16's
# bound. Against the unquantized cache: e4m3's 3 mantissa bits (~2^-5 a value), amplified by
# peaked scores (K heads up to 10x larger); a loose bound that a mis-scaled cache (a wrong head's
# or position's scale) fails by far. bench/attention.py reports the measured error.
FP8_TOL = {torch.float16: 2e-3, torch.float32: 2e-3, torch.bfloat16: 1e-2}
MMA_TOL = TOL[torch.bfloat16]
FP8_VS_UNQUANTIZED = 0.25
V_BLOCK = la.V_BLOCK
E4M3_MAX = 0x7E  # 448, finite: what a blocked V cache may hold past a length inside its last block
# The kernel's two ways to read e4m3 (the fp16 decode with q made once a segment or every tile,
# and the e4m3 tensor-core dots), each at the config the runtime runs it with.
FP8_PATHS = [
    pytest.param(la.FP8_TINY_CONFIG, id="fp16-decode-q-per-tile"),
    pytest.param(la.FP8_SHORT_CONFIG, id="fp16-decode"),
    pytest.param(la.FP8_CONFIG, id="e4m3-mma"),
]


def fp8_tol(config, dtype):
    return MMA_TOL if config.fp8_mma else FP8_TOL[dtype]


def blocked_v(v8, lengths):
    """to_v_blocked_t of the e4m3 cache v8 [B, Hkv, S, D], its bytes past each length set to 448:
    finite, but far off, so any weight the kernel gave them would show."""
    raw = v8.view(torch.uint8).clone()
    for b, n in enumerate(lengths):
        raw[b, :, n:] = E4M3_MAX
    return la.to_v_blocked_t(raw.view(v8.dtype))


def check_fp8(device, lengths, hq, hkv, config, num_ctas=None, head_dim=64, dtype=torch.float16, scale=None):
    """The kernel on the FP8 cache against the float64 reference on the dequantized cache (its
    own error) and on the unquantized one (the quantization's)."""
    q, k, v, lens, (k_raw, v_raw) = make_inputs(device, lengths, hq, hkv, head_dim, dtype, fp8=True)
    scale = head_dim**-0.5 if scale is None else scale
    out = run_lean(q, k, v, lens, scale, num_ctas, config=config)
    err = rel_err(out, reference(q, k, v, lens, scale))
    assert err < fp8_tol(config, dtype), f"relative error {err:.2e} against the dequantized cache"
    err_raw = rel_err(out, reference(q, k_raw, v_raw, lens, scale))
    assert err_raw < FP8_VS_UNQUANTIZED, f"relative error {err_raw:.2e} against the unquantized cache"
    return q, k, v, lens, out


def fp8_dtypes(device):
    return [torch.float16] if device == "cpu" else [torch.bfloat16, torch.float16]


@triton.jit
def _convert_kernel(X, Y, DEQUANT: tl.constexpr):
    offs = tl.arange(0, 256)
    tl.store(Y + offs, la._e4m3_to_fp16(tl.load(X + offs), DEQUANT))


@pytest.mark.parametrize(
    "dequant",
    [
        pytest.param(la.DEQUANT_BITS, id="bits"),
        pytest.param(la.DEQUANT_CVT, id="cvt", marks=DEVICES[1].marks),  # the "cuda" case's
    ],
)
def test_e4m3_to_fp16_every_byte(dequant):
    """Each of the 256 e4m3 bit patterns decodes to torch's value / UNIT, in its own position."""
    device = "cpu" if INTERPRETED else "cuda"
    x = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(device)
    y = torch.empty(256, dtype=torch.float16, device=device)
    _convert_kernel[(1,)](x, y, DEQUANT=dequant)
    want = x.view(torch.float8_e4m3fn).float() / la.DEQUANT_UNIT[dequant]
    nan = want.isnan()  # 0x7F and 0xFF: never written by the quantizer
    assert torch.equal(y.float()[~nan], want[~nan])


def test_to_v_blocked_t_layout():
    """Element [c, h, p // V_BLOCK, d, p % V_BLOCK] is V[c, h, p, d]; the padding is zero bytes."""
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(1, 127, (2, 3, 2 * V_BLOCK + 5, 8), generator=gen, dtype=torch.uint8)
    vt = la.to_v_blocked_t(raw.view(torch.float8_e4m3fn))
    assert vt.dtype == torch.float8_e4m3fn and list(vt.shape) == [2, 3, 3, 8, V_BLOCK]
    got = vt.view(torch.uint8)
    for p in (0, 1, V_BLOCK - 1, V_BLOCK, 2 * V_BLOCK + 4):
        assert torch.equal(got[:, :, p // V_BLOCK, :, p % V_BLOCK], raw[:, :, p])
    assert got[:, :, 2, :, 5:].eq(0).all()
    with pytest.raises(ValueError, match="1-byte V cache"):
        la.to_v_blocked_t(raw.half())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", FP8_PATHS)
@pytest.mark.parametrize("num_ctas", [1, 3, 7])
def test_fp8_ragged_batch(device, config, num_ctas):
    lengths = [1, BLOCK_FP8 - 1, 2 * BLOCK_FP8 + 3, 37, V_BLOCK]  # ragged, not multiples of BLOCK_N
    if device == "cuda":
        lengths += [5000, 100_001]
    for dtype in [*fp8_dtypes(device), torch.float32]:
        check_fp8(device, lengths, hq=8, hkv=2, config=config, num_ctas=num_ctas, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", FP8_PATHS)
@pytest.mark.parametrize("n", [1, V_BLOCK - 1, V_BLOCK + 1, BLOCK_FP8, BLOCK_FP8 + V_BLOCK + 3])
@pytest.mark.parametrize("num_ctas", [1, 3])
def test_fp8_block_edges(device, config, n, num_ctas):
    check_fp8(device, [n], hq=8, hkv=2, config=config, num_ctas=num_ctas)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "config",
    [
        la.LeanConfig(block_n=V_BLOCK, num_warps=4, num_stages=2, ctas_per_sm=1, merge_stages=4),
        la.FP8_TINY_CONFIG,
        la.FP8_SHORT_CONFIG,
        la.FP8_CONFIG,
        la.LeanConfig(block_n=256, num_warps=8, num_stages=3, ctas_per_sm=1, merge_stages=4),
    ],
    ids=["one-block-tiles", "fp16-decode-q-per-tile", "fp16-decode", "e4m3-mma", "two-warpgroups"],
)
def test_fp8_llama_shape_and_configs(device, config):
    """32 q / 8 KV heads, head_dim 128, tiles of one, two and four V blocks (e4m3 dots: two
    warpgroups can share a tile's positions), heads split over CTAs."""
    lengths = [3 * BLOCK_FP8 + 17, 100] if device == "cpu" else [131_072 + 5, 999]
    for dtype in fp8_dtypes(device):
        check_fp8(device, lengths, hq=32, hkv=8, config=config, head_dim=128, num_ctas=5, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", FP8_PATHS)
def test_fp8_aligned_schedule(device, config):
    """32 q / 8 KV heads at head_dim 128 on a grid of 16, 2 CTAs a head (the schedule the GPU's
    2-CTA-an-SM config takes for one sequence), and 3 CTAs a head, each with several tiles."""
    n = 5 * BLOCK_FP8 + 17 if device == "cpu" else 131_072 + 5
    for num_ctas in (16, 24):
        assert la.lean_schedule([n], 8, 128, device=device, num_ctas=num_ctas, config=config).aligned
        for dtype in fp8_dtypes(device):
            check_fp8(device, [n], hq=32, hkv=8, config=config, head_dim=128, num_ctas=num_ctas, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_fp8_tensor_cores_on_peaked_heads_at_long_context(seed):
    """KV heads whose K is up to 10x larger (scores of hundreds of log2 units) over 128k positions:
    every (sequence, query head) output within bf16-level error of the float64 reference on the
    dequantized cache. Hopper's e4m3 tensor cores keep less than fp32 in their accumulator, so q's
    small terms must not be added into its large term's: that lost 1.4-3.0e-2 on such heads for
    each of these seeds, against 4-7e-3 now (H200; the kernel is deterministic)."""
    if INTERPRETED or not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: the interpreter's e4m3 dots are exact")
    lengths = [131_072, 5]
    q, k, v, lens = make_inputs("cuda", lengths, 32, 8, 128, torch.bfloat16, seed=seed, fp8=True)[:4]
    out = run_lean(q, k, v, lens, 128**-0.5, config=la.FP8_CONFIG)
    ref = reference(q, k, v, lens, 128**-0.5)
    per_head = (out.double() - ref).norm(dim=-1) / ref.norm(dim=-1)  # [B, Hq]
    assert per_head.max() < 1e-2, f"worst head {per_head.max():.2e}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", FP8_PATHS)
def test_fp8_peaked_logits(device, config):
    """Scores over hundreds of nats: the softmax is nearly one-hot. The bf16 case's lengths: at
    these scores e4m3's error against the unquantized cache grows with the context."""
    dtype = fp8_dtypes(device)[0]
    check_fp8(device, [3 * BLOCK + 5, 33], hq=8, hkv=2, config=config, num_ctas=4, dtype=dtype, scale=4.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", FP8_PATHS)
def test_fp8_query_beyond_fp16_range(device, config):
    """|q| up to ~4e5 (fp16 holds 65504) with moderate scores: the power-of-two pre-scale of q
    keeps the fp16 dot and the e4m3 terms finite, and undoing it exactly keeps the scores right."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v, lens, _ = make_inputs(device, [3 * BLOCK_FP8 + 5], 8, 2, dtype=dtype, fp8=True)
    q = q * 1e5
    out = run_lean(q, k, v, lens, 1e-6, num_ctas=4, config=config)
    assert rel_err(out, reference(q, k, v, lens, 1e-6)) < fp8_tol(config, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", FP8_PATHS)
def test_fp8_bitwise_repeatable(device, config):
    q, k, v, lens, first = check_fp8(device, [5 * BLOCK_FP8 + 1, 77], hq=8, hkv=2, config=config, num_ctas=5)
    assert torch.equal(first, run_lean(q, k, v, lens, 64**-0.5, num_ctas=5, config=config))


def test_fp8_config_follows_cache_positions(monkeypatch):
    """An FP8 cache takes the tiny-cache config up to FP8_TINY_HEAD_POSITIONS positions (all rows)
    times KV heads, the short-cache config (fp16 decode) below FP8_SHORT_POSITIONS positions and
    the e4m3 tensor-core one from there: decided by the cache's shape, so one captured graph keeps
    one config as lengths grow."""
    short, tiny = la.FP8_SHORT_POSITIONS, la.FP8_TINY_HEAD_POSITIONS
    want = {  # (positions, KV heads): config
        (1, 8): la.FP8_TINY_CONFIG,
        (tiny // 8, 8): la.FP8_TINY_CONFIG,
        (tiny // 8 + 1, 8): la.FP8_SHORT_CONFIG,
        (tiny // 8, 32): la.FP8_SHORT_CONFIG,
        (short - 1, 8): la.FP8_SHORT_CONFIG,
        (short, 8): la.FP8_CONFIG,
        (64 * short, 8): la.FP8_CONFIG,
    }
    for (positions, kv_heads), config in want.items():
        chosen = la.default_config(128, torch.bfloat16, fp8=True, positions=positions, kv_heads=kv_heads)
        assert chosen == config
    assert la.default_config(128, torch.bfloat16, positions=64 * short) == la.DEFAULT_CONFIG  # bf16: one
    seen = []
    grid_size = la._grid_size
    monkeypatch.setattr(  # records the config lean_attention launches with
        la,
        "_grid_size",
        lambda device, config, num_ctas: seen.append(config) or grid_size(device, config, num_ctas),
    )
    for s, config in (  # 2 rows x 2 KV heads x s positions
        (tiny // 4, la.FP8_TINY_CONFIG),
        (tiny // 4 + 1, la.FP8_SHORT_CONFIG),
        (short // 2 - 1, la.FP8_SHORT_CONFIG),
        (short // 2, la.FP8_CONFIG),
    ):
        k = torch.zeros(2, 2, s, 64, dtype=torch.float8_e4m3fn)
        scales = torch.ones(2, 2, s, 2, dtype=torch.bfloat16)
        la.lean_attention(
            torch.randn(2, 2, 64), k, la.to_v_blocked_t(k), torch.tensor([1, 0], dtype=torch.int32), 0.1,
            kv_scale=scales,
        )  # fmt: skip
        assert seen[-1] == config


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_rejects_bad_input(device):
    q, (k8, ks), (v8, vs), lens, (k, v) = make_inputs(device, [70], 4, 2, fp8=True)
    vt = la.to_v_blocked_t(v8)
    kv_scale = torch.stack((ks, vs), -1)  # [1, 2, S, 2]
    kw = {"kv_scale": kv_scale}
    with pytest.raises(ValueError, match="needs kv_scale"):
        la.lean_attention(q, k8, vt, lens, 0.1)
    S = k8.shape[2]
    for bad in (kv_scale[:, :1], kv_scale.float(), torch.stack((ks, vs), 0).permute(1, 2, 3, 0)):
        with pytest.raises(ValueError, match=rf"kv_scale must be \[1, 2, {S}, 2\] bfloat16 with contiguous"):
            la.lean_attention(q, k8, vt, lens, 0.1, kv_scale=bad)
    with pytest.raises(ValueError, match="q must be"):
        la.lean_attention(q.to(torch.float8_e4m3fn), k8, vt, lens, 0.1, **kw)
    with pytest.raises(ValueError, match="for a float8_e4m3fn cache"):
        la.lean_attention(q, k8.half(), v8.half(), lens, 0.1, **kw)
    with pytest.raises(ValueError, match=r"an FP8 V cache must be blocked, \[C, Hkv, ceil"):
        la.lean_attention(q, k8, v8, lens, 0.1, **kw)  # V in K's layout
    with pytest.raises(ValueError, match="expected q"):
        v16 = torch.zeros(vt.shape, dtype=q.dtype, device=device)  # the blocked shape, q's dtype
        la.lean_attention(q, k, v16, lens, 0.1)
    small = la.LeanConfig(block_n=32, num_warps=4, num_stages=2, ctas_per_sm=1, merge_stages=4)
    with pytest.raises(ValueError, match="block_n a multiple of"):
        la.lean_attention(q, k8, vt, lens, 0.1, config=small, **kw)
    if device == "cpu":
        starts = torch.tensor([V_BLOCK + 1], dtype=torch.int64)
        with pytest.raises(ValueError, match=f"multiple of {V_BLOCK}"):
            la.lean_attention(q, k8, vt, lens, 0.1, starts=starts, **kw)


# ---- CUDA graphs ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("start", [1000, BLOCK * 64 - 3, 200_001], ids=str)
def test_cuda_graph_growing_context(start, fp8):
    """Capture once at `start`, then replay while the context grows one token a step (FP8: the
    fp16 decode of short caches at 1000, the e4m3 tensor-core config at the two longer starts)."""
    if INTERPRETED or not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    steps, lengths = 6, [start, start // 3, 5]
    gen = torch.Generator(device="cuda").manual_seed(start)  # the new tokens' K/V and each step's q
    inputs = make_inputs("cuda", lengths, 32, 8, 128, torch.bfloat16, slack=steps + 1, fp8=fp8)
    q, k, v, lens = inputs[:4]
    kw = {}
    if fp8:  # the kernel reads kv_scale; the reference reads its K and V columns (views)
        kw["kv_scale"] = torch.stack((k[1], v[1]), -1)
        k, v = (k[0], kw["kv_scale"][..., 0]), (v[0], kw["kv_scale"][..., 1])
    kc, vc = (k[0], blocked_v(v[0], lengths)) if fp8 else (k, v)
    out = torch.empty_like(q)
    la.lean_attention(q, kc, vc, lens, 128**-0.5, out=out, **kw)  # eager: compile, allocate workspace
    n_workspaces = len(la._WORKSPACES)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        la.lean_attention(q, kc, vc, lens, 128**-0.5, out=out, **kw)
    assert len(la._WORKSPACES) == n_workspaces  # capture allocated no workspace
    for _ in range(steps):
        # Write the new token's K/V at each sequence's end, grow the lengths in place, replay.
        for b in range(len(lengths)):
            n = int(lens[b])
            new_k = torch.randn(8, 128, generator=gen, device="cuda")  # [Hkv, D]
            new_v = torch.randn(8, 128, generator=gen, device="cuda")
            if fp8:  # the reference reads k, v: (e4m3, scale) pairs in K's layout
                (kc[b, :, n], k[1][b, :, n]), (v[0][b, :, n], v[1][b, :, n]) = (
                    quantize_fp8(new_k),
                    quantize_fp8(new_v),
                )
                vc[b, :, n // V_BLOCK, :, n % V_BLOCK] = v[0][b, :, n]
            else:
                kc[b, :, n], vc[b, :, n] = new_k.to(kc.dtype), new_v.to(vc.dtype)
        lens += 1
        q.copy_(torch.randn(q.shape, generator=gen, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not out.isnan().any()
        err = rel_err(out, reference(q, k if fp8 else kc, v if fp8 else vc, lens, 128**-0.5))
        assert err < TOL[torch.bfloat16], f"relative error {err:.2e} at lengths {lens.tolist()}"
        assert counters_zero()


# ---- a batch in regions of one shared cache row ---------------------------------------------


def pack_regions(k, lengths, gaps):
    """The batch's per-row caches [B, Hkv, S, ...] laid out as regions of one row [1, Hkv, P, ...]
    (sequence b at starts[b], `gaps[b]` NaN positions before it, so a wrong start reads NaN; e4m3
    bytes get its NaN pattern 0x7F)."""
    nan = 0x7F if k.dtype == torch.uint8 else float("nan")
    starts, rows, at = [], [], 0
    for b, n in enumerate(lengths):
        rows.append(torch.full_like(k[b : b + 1, :, : gaps[b]], nan))
        starts.append(at + gaps[b])
        rows.append(k[b : b + 1, :, :n])
        at += gaps[b] + n
    rows.append(torch.full_like(k[:1, :, :5], nan))  # past the last region
    return torch.cat(rows, dim=2), torch.tensor(starts, dtype=torch.int64, device=k.device)


@pytest.mark.parametrize("device", DEVICES)
def test_regions_of_one_shared_row(device):
    """Sequences of different lengths in regions of one cache row (a batch with per-sequence
    `starts`), with idle slots (length 0) that must cost nothing and disturb no one: each active
    sequence equals the float64 reference of its own cache."""
    lengths = [3 * BLOCK_FP8 + 7, 0, 40, BLOCK + 1, 0]
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    q, k, v, lens = make_inputs(device, [max(n, 1) for n in lengths], 8, 2, dtype=dtype)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    active = lens > 0
    gaps = [3, 9, 0, 17, 2]
    (k_row, starts), (v_row, _) = pack_regions(k, lengths, gaps), pack_regions(v, lengths, gaps)
    out = torch.full_like(q, float("nan"))
    la.lean_attention(q, k_row, v_row, lens, 64**-0.5, num_ctas=5, out=out, starts=starts)
    assert counters_zero()
    idx = active.nonzero()[:, 0]  # the reference, on each active sequence's own cache
    ref = reference(q[idx], k[idx], v[idx], lens[idx], 64**-0.5)
    assert rel_err(out[idx], ref) < TOL[dtype]
    assert out[~active].isnan().all(), "an idle slot's output was written"


@pytest.mark.parametrize("device", DEVICES)
def test_regions_of_one_shared_row_aligned(device):
    """A batch of equal lengths in regions of one row, on a grid that is a multiple of its segments:
    each segment dealt to its own CTAs, every CTA reading its sequence's region."""
    lengths, hkv, num_ctas = [2 * BLOCK + 5] * 3, 2, 12
    assert la.lean_schedule(lengths, hkv, head_dim=64, device=device, num_ctas=num_ctas).aligned
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    q, k, v, lens = make_inputs(device, lengths, 8, hkv, dtype=dtype)
    gaps = [5, 0, 11]
    (k_row, starts), (v_row, _) = pack_regions(k, lengths, gaps), pack_regions(v, lengths, gaps)
    out = run_lean(q, k_row, v_row, lens, 64**-0.5, num_ctas, starts=starts)
    assert rel_err(out, reference(q, k, v, lens, 64**-0.5)) < TOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", FP8_PATHS)
def test_fp8_regions_of_one_shared_row(device, config):
    """Regions of one cache row starting at multiples of V_BLOCK (the layout's contract), idle
    slots included: each active sequence equals the reference of its own cache. Whole blocks
    between regions hold e4m3 NaN patterns (never read), a region's last block 448s past its end."""
    lengths = [3 * BLOCK_FP8 + 7, 0, 40, BLOCK + 1, 0]
    dtype = fp8_dtypes(device)[0]
    q, (k8, ks), (v8, vs), *_ = make_inputs(device, [max(n, 1) for n in lengths], 8, 2, dtype=dtype, fp8=True)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    gaps, at = [], 0
    for b, n in enumerate(lengths):  # each region starts at a multiple of V_BLOCK, 1-2 blocks apart
        gaps.append((-at) % V_BLOCK + (b % 2 + 1) * V_BLOCK)
        at += gaps[-1] + n
    k_row, starts = pack_regions(k8.view(torch.uint8), lengths, gaps)
    v_row = pack_regions(v8.view(torch.uint8), lengths, gaps)[0]
    for s, n in zip(starts.tolist(), lengths, strict=True):
        v_row[:, :, s + n : -(-(s + n) // V_BLOCK) * V_BLOCK] = E4M3_MAX
    kv_scale = pack_regions(torch.stack((ks, vs), -1), lengths, gaps)[0]  # [1, Hkv, P, 2]
    vt_row = la.to_v_blocked_t(v_row.view(v8.dtype))
    out = torch.full_like(q, float("nan"))
    la.lean_attention(
        q, k_row.view(k8.dtype), vt_row, lens, 64**-0.5, kv_scale=kv_scale,
        starts=starts, num_ctas=5, out=out, config=config,
    )  # fmt: skip
    assert counters_zero()
    idx = (lens > 0).nonzero()[:, 0]
    ref = reference(q[idx], (k8[idx], ks[idx]), (v8[idx], vs[idx]), lens[idx], 64**-0.5)
    assert rel_err(out[idx], ref) < fp8_tol(config, dtype)
    assert out[lens == 0].isnan().all(), "an idle slot's output was written"


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("kv_heads", [1, 2, 8, 32])
def test_config_sizes_start_every_config_the_cache_grows_into(fp8, kv_heads):
    """Each size config_sizes gives starts a config of its own, and every cache size up to 40k
    positions runs the config of the largest listed size at or below it (a warm-up stepping once
    at each compiles every kernel a growing cache launches)."""
    sizes = la.config_sizes(128, torch.bfloat16, fp8, kv_heads)
    config = lambda n: la.default_config(128, torch.bfloat16, fp8, n, kv_heads)  # noqa: E731
    assert sizes[0] == 1 and sizes == sorted(set(sizes))
    assert len({config(s) for s in sizes}) == len(sizes)
    for n in [*range(1, 40_000, 97), *(s + d for s in sizes for d in (-1, 0, 1) if s + d > 0)]:
        assert config(n) == config(max(s for s in sizes if s <= n)), n

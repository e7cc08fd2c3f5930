"""FP8 weights on CUDA (skipped without a GPU): the FP8 GEMV against float64 for every shape and
scale layout it takes (1-32 rows; per channel, per block with partial blocks, inputs per token
or per group; plain, + residual, gate/up with SiLU * up; K whole or split over CTAs), the
prefill's matmul (torch._scaled_mm, or dequantized for blocks), CUDA-graph decoding equal to
eager decoding over 256 steps, and a batch equal to each of its requests alone.
(The activation-rounding kernel in bf16 against its twin: tests/test_fp8_weights.py, marked gpu.)"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import rel_err
from test_fp8_weights import build_fp8_checkpoint, exact

from minidecode import LLM, Request
from minidecode.kernels import ops
from minidecode.kernels.fp8_weights import FP8Weight, quantize_rows
from minidecode.kernels.gemv import FP8_CONFIG, FP8_GATED_CONFIG, FP8_SPLIT_K_CONFIG, GemvConfig, gemv
from minidecode.models.llama import weights_description

pytestmark = pytest.mark.gpu

# (N, K, mode): Llama-3-8B's four projections, and shapes off every block multiple.
SHAPES = [
    (6144, 4096, "plain"),
    (4096, 4096, "residual"),
    (28672, 4096, "gated"),
    (4096, 14336, "residual"),
    (200, 1100, "plain"),
    (136, 520, "gated"),
    (72, 300, "residual"),
]
LAYOUTS = {  # (weight scales, input groups)
    "channel": ("channel", None),
    "channel-xgroup": ("channel", 128),
    "block128": ((128, 128), 128),
    "block-partial": ((48, 96), 32),
}
# bf16 results: the rounding of the output (2^-9) dominates; float32 results show the warpgroup e4m3
# dots' accumulation, summed from zero every 512 products (Hopper keeps about 14 bits inside one).
TOL = {torch.bfloat16: 8e-3, torch.float32: 2e-3}
CASES = [
    (rows, *shape, layout, torch.bfloat16)
    for rows in (1, 16, 17, 32)
    for shape in SHAPES
    for layout in LAYOUTS
]
CASES += [
    (rows, *shape, layout, torch.float32)
    for rows in (1, 32)
    for shape in SHAPES[:4]
    for layout in ("channel", "block128")
]


@functools.lru_cache(maxsize=2)
def weight(N: int, K: int, layout: str) -> FP8Weight:
    """Random e4m3 values (never NaN) and positive scales in `layout`, made on the GPU."""
    scales, group = LAYOUTS[layout]
    block_n, block_k = (1, K) if scales == "channel" else scales
    g = torch.Generator(device="cuda").manual_seed(N + K)
    values = (torch.randn(N, K, device="cuda", generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-N // block_n), -(-K // block_k), device="cuda", generator=g) / 100 + 0.005
    return FP8Weight(values, scale, block_n, block_k, group)


@pytest.mark.parametrize("rows, N, K, mode, layout, dtype", CASES)
def test_fp8_gemv_against_float64(rows, N, K, mode, layout, dtype):
    torch.manual_seed(rows + N)
    w = weight(N, K, layout)
    x = torch.randn(rows, K, dtype=dtype, device="cuda")
    x[0, :7] *= 30  # an outlier or two: the row's scale follows its largest value
    rows_q = quantize_rows(x, w)
    ref = exact(rows_q, w)
    residual = torch.randn(rows, N, dtype=dtype, device="cuda") if mode == "residual" else None
    if mode == "gated":
        gate, up = ref.chunk(2, -1)
        ref = gate * torch.sigmoid(gate) * up
    elif mode == "residual":
        ref = ref + residual.double()
    out = gemv(rows_q, w, residual=residual, gated=mode == "gated", use_pdl=True)
    err = rel_err(out, ref)
    assert out.shape == ref.shape and torch.isfinite(out).all() and err < TOL[dtype], err


@pytest.mark.parametrize(
    "config",
    [FP8_CONFIG, FP8_SPLIT_K_CONFIG, FP8_GATED_CONFIG, GemvConfig(64, 512, 4, 4, split_k=2)],
    ids=["one-part", "split2", "x-on-m", "x-on-m-split2"],
)
def test_fp8_gemv_split_k_repeats_bitwise(config):
    """The split's parts race on the GPU; the partials are summed in part order whoever is last."""
    w = weight(4096, 14336, "channel")
    rows_q = quantize_rows(torch.randn(20, 14336, device="cuda", dtype=torch.bfloat16), w)
    residual = torch.randn(20, 4096, device="cuda", dtype=torch.bfloat16)
    outs = [gemv(rows_q, w, residual=residual.clone(), config=config) for _ in range(5)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert rel_err(outs[0], exact(rows_q, w) + residual.double()) < TOL[torch.bfloat16]


@pytest.mark.parametrize("layout", ["channel", "block128"])
def test_prefill_matmul_against_float64(layout):
    """Many rows (prefill): torch._scaled_mm for per-channel weights and per-token inputs, the
    dequantized GEMM for blocks; both the W8A8 of the rounded rows."""
    w = weight(6144, 4096, layout)
    x = torch.randn(3, 300, 4096, dtype=torch.bfloat16, device="cuda")
    bias = torch.randn(6144, dtype=torch.bfloat16, device="cuda")
    out = ops.linear(x, w, bias)
    ref = exact(quantize_rows(x, w), w) + bias.double()
    assert out.shape == (3, 300, 6144) and rel_err(out.view(-1, 6144), ref) < TOL[torch.bfloat16]


@pytest.fixture(scope="module")
def model_dir(checkpoint_factory):
    return checkpoint_factory("gpu-llama-hd64", "default", max_positions=4096)


@pytest.fixture(scope="module")
def block_checkpoint(model_dir, tmp_path_factory):
    """A compressed-tensors checkpoint with 48 x 96 weight blocks and inputs per 64-group."""
    return build_fp8_checkpoint(model_dir, tmp_path_factory.mktemp("fp8-gpu"), "ct-block-tied")[0]


@pytest.mark.parametrize("source", ["quantize-on-load", "checkpoint-blocks", "with-fp8-cache"])
def test_cuda_graph_equals_eager_over_256_steps(model_dir, block_checkpoint, prompt_ids, source):
    """bf16, FP8 weights quantized on load (also with an FP8 KV cache) or a block checkpoint's."""
    path = block_checkpoint if source == "checkpoint-blocks" else model_dir
    kw = dict(device="cuda", dtype="bfloat16")
    kw |= {"quantization": "fp8"} if source != "checkpoint-blocks" else {}
    kw |= {"kv_cache_dtype": "fp8"} if source == "with-fp8-cache" else {}
    ids = prompt_ids(1500, seed=3)
    runs = {}
    for graph in (True, False):
        llm = LLM(path, cuda_graph=graph, **kw)
        assert weights_description(llm.model).startswith("fp8_e4m3")
        result = llm.generate(token_ids=ids, max_new_tokens=256, temperature=0, ignore_eos=True)
        runs[graph] = result.token_ids
    assert len(runs[True]) == 256 and runs[True] == runs[False]


def test_batch_equals_each_request_alone(model_dir, prompt_ids):
    """float32 results (no rounding ties): a ragged batch of 20 (the 32-row bucket) through graphs,
    the eager batch and each request alone give the same tokens, twice (split-K tickets reset)."""
    items = [
        Request(token_ids=prompt_ids(3 + 37 * i % 400, seed=50 + i), max_new_tokens=2 + i % 9)
        for i in range(20)
    ]
    kw = dict(temperature=0, ignore_eos=True)
    graph = LLM(model_dir, device="cuda", dtype="float32", quantization="fp8")
    eager = LLM(model_dir, device="cuda", dtype="float32", quantization="fp8", cuda_graph=False)
    a = [r.token_ids for r in graph.generate(items, **kw)]
    b = [r.token_ids for r in eager.generate(items, **kw)]
    alone = [graph.generate(x, reuse_prefix=False, **kw).token_ids for x in items]
    assert a == b == alone
    assert [r.token_ids for r in graph.generate(items, **kw)] == a

"""FP8 (e4m3) weights on the CPU: real compressed-tensors and transformers-fp8 checkpoints built
here (tiny configs, written with safetensors in exactly those formats) against transformers on
the same weights dequantized, with each quantized layer's input rounded to e4m3 as the scheme
says (a forward pre-hook); quantize-on-load; the kernels' Triton paths (interpreter) against
float64; the config parsing; and every bad checkpoint's one error line."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers import rel_err
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from minidecode import LLM, UserError
from minidecode.kernels import ops
from minidecode.kernels.fp8_activations import quantize_rows as quantize_rows_triton
from minidecode.kernels.fp8_weights import (
    FP8Weight,
    QuantizedRows,
    fp8_linear_reference,
    fuse_fp8,
    quantize_rows,
    quantize_weight,
)
from minidecode.kernels.gemv import (
    FP8_CONFIG,
    FP8_GATED_CONFIG,
    FP8_SPLIT_K_CONFIG,
    GemvConfig,
    default_fp8_config,
    gemv,
)
from minidecode.loading import build_model, weight_plan
from minidecode.models.config import ConfigError, ModelConfig, parse_quantization
from minidecode.models.llama import FP8Linear, step_weight_bytes, weight_bytes, weights_description
from minidecode_cli.cli import app

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "training"))
sys.path.insert(0, str(REPO / "bench"))  # tune_gemv.py and its siblings

import stdlib_corpus  # noqa: E402

E4M3 = torch.float8_e4m3fn
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---- checkpoints in the real formats ---------------------------------------------------------------
# name: (family, how the weights and inputs are quantized). Scales: "channel" [N, 1], "tensor" [1]
# (a scalar [] for k_proj, as older checkpoints store it), "block" (rows, cols) with partial last
# blocks along both axes (48-row blocks of 64- and 32-row weights; 96-column blocks of 64 and 128
# columns), so q/k/v fuse with a block across their boundary. Inputs: per token, per token and
# group, or static (a calibrated input scale per layer, shared by q/k/v and by gate/up).
FORMATS = {
    "ct-channel": dict(
        family="llama",
        method="compressed-tensors",
        weights="channel",
        acts="token",
        scale_dtype=torch.bfloat16,
        # layer 1's MLP stays float (ignored by a regular expression), as lm_head
        ignore=["lm_head", "re:model\\.layers\\.1\\.mlp\\..*"],
    ),
    "ct-tensor-static": dict(
        family="llama",
        method="compressed-tensors",
        weights="tensor",
        acts="static",
        scale_dtype=torch.float32,
    ),
    "ct-block-tied": dict(
        family="llama-tied",
        method="compressed-tensors",
        weights="block",
        block=(48, 96),
        acts="group",
        group=64,
        scale_dtype=torch.float16,
    ),
    "fp8-block-bias-sharded": dict(
        family="qwen2", method="fp8", weights="block", block=(32, 64), acts="group", group=64, shards=3
    ),
    "fp8-tensor-static": dict(family="qwen3", method="fp8", weights="tensor", acts="static"),
}
STATIC_INPUT_SCALE = {
    "q_proj": 0.02,
    "o_proj": 0.004,
    "gate_proj": 0.03,
    "down_proj": 0.01,
}  # k/v, up: shared


def quantized_modules(fmt: dict, names: list[str]) -> list[str]:
    """The Linear layers (module names) the format quantizes."""
    linear = [n.removesuffix(".weight") for n in names if n.endswith("_proj.weight")]
    if fmt.get("ignore") and "re:model\\.layers\\.1\\.mlp\\..*" in fmt["ignore"]:
        linear = [n for n in linear if not n.startswith("model.layers.1.mlp.")]
    if fmt.get("ignore") == [] and "lm_head.weight" in names:  # lm_head quantized too
        linear.append("lm_head")
    return linear


def _quantize(w: torch.Tensor, fmt: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 values, the scale as stored), in float64 (independent of minidecode): the
    scale of each tensor / row / block is its largest |w| / 448, stored in the format's dtype."""
    w = w.double()
    N, K = w.shape
    if fmt["weights"] == "tensor":
        scale = w.abs().max().reshape(1) / 448
    elif fmt["weights"] == "channel":
        scale = w.abs().amax(1, keepdim=True) / 448
    else:
        bn, bk = fmt["block"]
        nb, kb = -(-N // bn), -(-K // bk)
        padded = torch.nn.functional.pad(w, (0, kb * bk - K, 0, nb * bn - N))
        scale = padded.view(nb, bn, kb, bk).abs().amax((1, 3)) / 448
    scale = scale.to(fmt.get("scale_dtype", torch.float32))
    values = (w / _expand(scale, N, K, fmt)).clamp(-448, 448).float().to(E4M3)
    return values, scale


def _expand(scale: torch.Tensor, N: int, K: int, fmt: dict) -> torch.Tensor:
    """The scale of every weight element, float64 [N, K]."""
    if fmt["weights"] == "block":
        bn, bk = fmt["block"]
        return scale.double().repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
    return scale.double().reshape(-1, 1).expand(N, K)


def _dequantize(values: torch.Tensor, scale: torch.Tensor, fmt: dict) -> torch.Tensor:
    return (values.double() * _expand(scale, *values.shape, fmt)).float()


def _config(fmt: dict) -> dict:
    if fmt["method"] == "fp8":
        qc = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "static" if fmt["acts"] == "static" else "dynamic",
        }
        qc["weight_block_size"] = list(fmt["block"]) if fmt["weights"] == "block" else None
        return qc
    float8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "observer": "minmax"}
    weights = dict(float8, strategy=fmt["weights"], dynamic=False, block_structure=None)
    if fmt["weights"] == "block":
        weights["block_structure"] = list(fmt["block"])
    acts = {
        "token": dict(float8, strategy="token", dynamic=True),
        "group": dict(float8, strategy="group", dynamic=True, group_size=fmt.get("group")),
        "static": dict(float8, strategy="tensor", dynamic=False),
    }[fmt["acts"]]
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts, "output_activations": None}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": fmt.get("ignore", ["lm_head"]),
        "kv_cache_scheme": None,
    }


def _save(tensors: dict[str, torch.Tensor], out: Path, shards: int = 1) -> None:
    """One safetensors file, or `shards` files with a model.safetensors.index.json."""
    if shards == 1:
        save_file(tensors, out / "model.safetensors")
        return
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        save_file(part, out / file)
        weight_map |= dict.fromkeys(part, file)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def build_fp8_checkpoint(src: Path, out: Path, name: str, fmt: dict | None = None) -> tuple[Path, Path, dict]:
    """From the float32 checkpoint `src`: (the FP8 checkpoint in format `name` (or `fmt`, a format
    as FORMATS writes them), the same weights dequantized to float32 as a plain checkpoint, the
    input rounding of each quantized layer: module -> ("token" | "group" | "static", group size or
    static scale))."""
    fmt = FORMATS[name] if fmt is None else fmt
    tensors = load_file(src / "model.safetensors")
    fp8_dir, deq_dir = out / "fp8", out / "dequantized"
    for d in (fp8_dir, deq_dir):
        shutil.copytree(src, d)
        (d / "model.safetensors").unlink()
    fp8_tensors, deq_tensors, inputs = {}, dict(tensors), {}
    names = {"scale": "weight_scale_inv" if fmt["method"] == "fp8" else "weight_scale"}
    names["input"] = "activation_scale" if fmt["method"] == "fp8" else "input_scale"
    quantized = quantized_modules(fmt, list(tensors))
    for tensor_name, tensor in tensors.items():
        module = tensor_name.removesuffix(".weight")
        if module not in quantized:
            fp8_tensors[tensor_name] = tensor
            continue
        values, scale = _quantize(tensor, fmt)
        if fmt["weights"] == "tensor" and module.endswith("k_proj"):
            scale = scale.reshape(())  # an older checkpoint's scalar
        if fmt["method"] == "fp8" and fmt["weights"] == "tensor":
            scale = scale.reshape(())  # transformers' per-tensor weight_scale_inv is a scalar
        fp8_tensors[tensor_name], fp8_tensors[f"{module}.{names['scale']}"] = values, scale
        deq_tensors[tensor_name] = _dequantize(values, scale, fmt)
        if fmt["acts"] == "static":
            kind = module.rpartition(".")[2]
            base = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(kind, kind)
            value = STATIC_INPUT_SCALE[base]
            fp8_tensors[f"{module}.{names['input']}"] = torch.tensor([value])
            inputs[module] = ("static", value)
        else:
            inputs[module] = (fmt["acts"], fmt.get("group"))
    _save(fp8_tensors, fp8_dir, fmt.get("shards", 1))
    save_file(deq_tensors, deq_dir / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = _config(fmt)
    (fp8_dir / "config.json").write_text(json.dumps(config, indent=2))
    return fp8_dir, deq_dir, inputs


def round_input(x: torch.Tensor, kind: str, arg) -> torch.Tensor:
    """The scheme's e4m3 rounding of a Linear layer's input, in float64: per token (scale = the
    row's largest |x| / 448), per token and group of `arg` columns, or the static scale `arg`."""
    xd = x.double()
    if kind == "static":
        q = (xd / arg).clamp(-448, 448).float().to(E4M3).double()
        return (q * arg).to(x.dtype)
    K = x.shape[-1]
    group = K if kind == "token" else min(arg, K)
    groups = -(-K // group)
    padded = torch.nn.functional.pad(xd, (0, groups * group - K)).unflatten(-1, (groups, group))
    scale = padded.abs().amax(-1, keepdim=True) / 448
    scale = torch.where(scale > 0, scale, 1.0)  # an all-zero row stays zeros
    q = (padded / scale).float().to(E4M3).double()
    return (q * scale).flatten(-2)[..., :K].to(x.dtype)


def hf_w8a8(model_dir: Path, inputs: dict):
    """transformers on the dequantized weights, each quantized layer's input rounded to e4m3."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for module, (kind, arg) in inputs.items():
        model.get_submodule(module).register_forward_pre_hook(
            lambda _, args, kind=kind, arg=arg: (round_input(args[0], kind, arg),)
        )
    return model


@pytest.fixture(scope="module", params=list(FORMATS))
def fp8_checkpoint(request, checkpoint_factory, tmp_path_factory):
    name = request.param
    src = checkpoint_factory(FORMATS[name]["family"], "default", max_positions=512)
    return (name, *build_fp8_checkpoint(src, tmp_path_factory.mktemp(f"fp8-{name}"), name))


def test_checkpoint_logits_and_greedy_tokens_match_transformers_w8a8(fp8_checkpoint, prompt_ids):
    """Prefill logits (several chunks) and greedy decoding equal transformers' on the dequantized
    weights with the scheme's input rounding; without that rounding (weight-only) they do not."""
    name, fp8_dir, deq_dir, inputs = fp8_checkpoint
    llm = LLM(fp8_dir, device="cpu", dtype="float32", prefill_chunk=24)
    assert weights_description(llm.model).startswith("fp8_e4m3")
    ids = prompt_ids(60, seed=5)
    ours = llm.logits(ids)
    with torch.no_grad():
        ref = hf_w8a8(deq_dir, inputs)(torch.tensor([ids])).logits[0]
        weight_only = hf_w8a8(deq_dir, {})(torch.tensor([ids])).logits[0]
    # Rounding to e4m3 is discontinuous: float32 differences between the two runtimes can move an
    # input across a rounding boundary now and then (one element by 1/16 of itself), so the
    # bound is looser than float32 parity, and far below what skipping the rounding costs.
    err, gap = rel_err(ours, ref), rel_err(weight_only, ref)
    print(f"{name}: logits vs transformers W8A8 {err:.1e}; weight-only vs W8A8 {gap:.1e}")
    assert err < 2e-3 and gap > 10 * err

    new = 24
    with torch.no_grad():
        model = hf_w8a8(deq_dir, inputs)
        prompt = torch.tensor([ids])
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False,
            eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    ref_tokens = out.sequences[0, len(ids) :].tolist()
    ref_logits = torch.stack(out.logits)[:, 0]  # [new, V]
    result = llm.generate(token_ids=ids, max_new_tokens=new, temperature=0, ignore_eos=True)
    # equal up to a near-tie (logits agree to ~1e-6 here, so ties are rare; none in these runs)
    top2 = ref_logits.topk(2, dim=-1).values
    near_tie = next((i for i, g in enumerate((top2[:, 0] - top2[:, 1]).tolist()) if g < 1e-3), new)
    assert result.token_ids[:near_tie] == ref_tokens[:near_tie] and near_tie >= new // 2


def test_checkpoint_layers_hold_e4m3_and_count_their_bytes(fp8_checkpoint):
    name, fp8_dir, _, inputs = fp8_checkpoint
    llm = LLM(fp8_dir, device="cpu", dtype="float32")
    model, fmt = llm.model, FORMATS[name]
    fp8_layers = {n for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert fp8_layers == set(inputs)  # the ignored layers (and lm_head) stay float32
    assert not hasattr(model, "lm_head") or model.lm_head.weight.dtype == torch.float32
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_weight.values.dtype == E4M3 and layer.mlp.gate_up_weight.values.dtype == E4M3
    # weight bytes: 1 a weight, 4 a scale (per-tensor scales held per channel), 4 a float parameter
    fp8_bytes = sum(model.get_submodule(n).weight.numel() for n in fp8_layers)
    scales = sum(
        p.numel() * 4
        for n, p in model.named_parameters()
        if n.rpartition(".")[0] in fp8_layers and "scale" in n
    )
    rest = sum(p.numel() * 4 for n, p in model.named_parameters() if n.rpartition(".")[0] not in fp8_layers)
    rest += sum(
        model.get_submodule(n).bias.numel() * 4 for n in fp8_layers if model.get_submodule(n).bias is not None
    )
    assert weight_bytes(model) == fp8_bytes + scales + rest
    # the plan made before loading names the same weights and counts the same bytes, but for the
    # block scales of q/k/v that fuse mid-block (48-row blocks of 64 + 32 + 32 rows: each row its own)
    planned, description = weight_plan(llm.config, torch.float32)
    assert description == weights_description(model)
    extra = weight_bytes(model) - planned
    assert extra == 0 if name != "ct-block-tied" else 0 < extra < 0.02 * planned
    if fmt["weights"] != "block":  # one scale a row for every quantized layer
        assert scales == 4 * sum(model.get_submodule(n).out_features for n in fp8_layers) + (
            4 * len(fp8_layers) if fmt["acts"] == "static" else 0
        )


# ---- quantize on load --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(checkpoint_factory):
    return checkpoint_factory("llama", "default", max_positions=512)


def test_quantize_on_load_matches_transformers_with_per_channel_weights(tiny, tmp_path, prompt_ids):
    """quantization="fp8": each decoder Linear per output channel, inputs per token; embeddings
    and lm_head stay. Against transformers on the checkpoint's weights rounded the same way."""
    llm = LLM(tiny, device="cpu", dtype="float32", quantization="fp8")
    assert (
        weights_description(llm.model)
        == "fp8_e4m3 per-channel W8A8-dynamic per token (embeddings, lm_head float32)"
    )
    assert llm.model.lm_head.weight.dtype == torch.float32
    plan = weight_plan(llm.config, torch.float32, quantization="fp8")
    assert plan == (weight_bytes(llm.model), weights_description(llm.model))
    fmt = dict(weights="channel", scale_dtype=torch.float32)
    tensors = load_file(tiny / "model.safetensors")
    inputs = {}
    for name in list(tensors):
        if name.endswith("_proj.weight"):
            tensors[name] = _dequantize(*_quantize(tensors[name], fmt), fmt)
            inputs[name.removesuffix(".weight")] = ("token", None)
    ref_dir = tmp_path / "ref"
    shutil.copytree(tiny, ref_dir)
    save_file(tensors, ref_dir / "model.safetensors")
    ids = prompt_ids(40, seed=6)
    with torch.no_grad():
        ref = hf_w8a8(ref_dir, inputs)(torch.tensor([ids])).logits[0]
    assert rel_err(llm.logits(ids), ref) < 2e-3


def test_quantize_on_load_of_random_weights(tiny):
    """A synthetic (random-weight) model quantizes its Linear layers too, and decodes."""
    cfg = ModelConfig.from_file(tiny / "config.json")
    model = build_model(cfg, None, torch.device("cpu"), torch.float32, quantization="fp8")
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert len(layers) == 7 * cfg.num_layers and all(m.weight.dtype == E4M3 for m in layers)
    assert model.lm_head.weight.dtype == torch.float32
    with torch.no_grad():
        hidden = model.prefill(torch.tensor([[1, 2, 3]]), _cache(model, 8), 4)
    assert torch.isfinite(hidden).all()
    table = model.model.embed_tokens.weight
    assert step_weight_bytes(model) == weight_bytes(model) - (table.shape[0] - 1) * table.shape[1] * 4


def _cache(model, positions: int):
    from minidecode.models.cache import KVCache

    cfg = model.config
    return KVCache(
        cfg.num_layers, 1, cfg.num_kv_heads, positions, cfg.head_dim, torch.float32, torch.device("cpu")
    )


@pytest.fixture(scope="module")
def heldout_ids() -> list[int]:
    _, texts = stdlib_corpus.load_split("heldout", max_chars=20_000)
    return LLM(device="cpu", dtype="float32").tokenizer.encode("\n".join(texts))[:1500]


def test_shipped_model_perplexity_with_fp8_weights_within_2_percent(heldout_ids):
    ppl = {}
    for quantization in (None, "fp8"):
        llm = LLM(device="cpu", dtype="float32", quantization=quantization)
        logits = llm.logits(heldout_ids)
        ppl[quantization] = (
            torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(heldout_ids[1:])).exp().item()
        )
    print(f"held-out perplexity: float32 weights {ppl[None]:.3f}, fp8 {ppl['fp8']:.3f}")
    assert ppl["fp8"] <= 1.02 * ppl[None]


def test_decode_steps_equal_prefill_with_fp8_weights(tiny, prompt_ids):
    """Each decode step's logits (the decode ops: GEMV forms, norm fused with the rounding) equal
    a prefill over the same tokens."""
    llm = LLM(tiny, device="cpu", dtype="float32", quantization="fp8")
    ids = prompt_ids(30, seed=7)
    result = llm.generate(token_ids=ids, max_new_tokens=8, temperature=0, ignore_eos=True, logprobs=True)
    full = llm.logits(ids + result.token_ids)  # [T, V]
    ref = full[len(ids) - 1 : -1].double().log_softmax(-1)
    ref = ref.gather(1, torch.tensor(result.token_ids)[:, None])[:, 0]
    assert result.token_ids == full[len(ids) - 1 : -1].argmax(-1).tolist()
    torch.testing.assert_close(torch.tensor(result.logprobs, dtype=torch.float64), ref, rtol=0, atol=1e-4)


# ---- kernels and ops -------------------------------------------------------------------------------
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + [pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
# The GEMV's float32 results against float64: float32 rounding on the interpreter; on a GPU its
# warpgroup e4m3 dots keep about 14 bits of each chunk's sum (kernels/gemv.py).
GEMV_F32_TOL = 1e-3 if CUDA else 2e-6


def random_fp8_weight(N, K, layout, act_group=None, static=None, device=DEVICE, seed=0) -> FP8Weight:
    """Random e4m3 values with positive scales in `layout`: "channel", or (rows, cols) blocks."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    values = (torch.randn(N, K, generator=g) * 40).clamp(-448, 448).to(E4M3).to(device)
    if layout == "channel":
        block = (1, K)
    else:
        block = layout
    scale = (torch.rand(-(-N // block[0]), -(-K // block[1]), generator=g) + 0.5).to(device) / 100
    input_scale = None if static is None else torch.tensor([static], device=device)
    return FP8Weight(values, scale, block[0], block[1], act_group, input_scale)


def exact(rows: QuantizedRows, w: FP8Weight) -> torch.Tensor:
    """float64 rows @ weight^T from the e4m3 values and their scales."""
    return rows.dequantize().double() @ w.dequantize(torch.float64).T


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scheme", ["token", "group", "static"])
@pytest.mark.parametrize("norm", [False, True])
def test_quantize_rows_kernel_writes_the_twins_bits(dtype, scheme, norm):
    torch.manual_seed(0)
    K = 200  # not a multiple of the group: a last, partial group
    w = random_fp8_weight(8, K, "channel", act_group=64 if scheme == "group" else None,
                          static=0.01 if scheme == "static" else None)  # fmt: skip
    x = torch.randn(5, K, dtype=dtype, device=DEVICE) * 3
    x[1] = 0  # an all-zero row: zeros of the floor scale
    x[2, 7] = 1e3  # static: saturates at 448 * scale
    norm_w = torch.randn(K, dtype=dtype, device=DEVICE)
    rows = quantize_rows_triton(x, w, (norm_w, 1e-6) if norm else None)
    normed = ops.rms_norm(x, norm_w, 1e-6, triton=False) if norm else x
    ref = quantize_rows(normed, w)
    assert rows.group == ref.group and rows.dtype == dtype and rows.scale.shape == ref.scale.shape
    if not norm:  # the same bits
        assert torch.equal(rows.values.view(torch.uint8), ref.values.view(torch.uint8))
        assert torch.equal(rows.scale, ref.scale)
    else:  # the norms' float32 sums differ in their last bits: now and then a row's scale, or a value
        assert (rows.values.float() != ref.values.float()).float().mean() < 0.01
        assert rel_err(rows.dequantize(), ref.dequantize()) < 1e-3
    # and against float64 rounding of the same rows
    rounding = {"token": ("token", None), "group": ("group", 64), "static": ("static", 0.01)}[scheme]
    torch.testing.assert_close(
        ref.dequantize(), round_input(normed.float(), *rounding), rtol=1e-6, atol=1e-12
    )


def test_activation_rounding_multiplies_by_the_reciprocal():
    """The Triton kernel and its twin round e4m3(x * (1 / s)), as vLLM's kernels do, not
    e4m3(x / s): in a row whose largest |x| is 3.0, x = -2.892857... is a value where they differ."""
    w = random_fp8_weight(8, 64, "channel")
    x = torch.zeros(1, 64, device=DEVICE)
    x[0, 0], x[0, 1] = 3.0, -2.892857074737549
    s = torch.tensor(3.0) / torch.tensor(448.0)
    by_division, by_reciprocal = (x[0, 1].cpu() / s).to(E4M3), (x[0, 1].cpu() * s.reciprocal()).to(E4M3)
    assert by_division.float() != by_reciprocal.float()  # the input still tells the two apart
    for rows in (quantize_rows(x, w), quantize_rows_triton(x, w)):
        assert rows.values[0, 1].float().cpu() == by_reciprocal.float()


# Shapes off every block multiple; 200 outputs are several 64-row blocks for the interpreter's 4
# CTAs; 17 and 32 rows pad x to 32.
GEMV_SHAPES = [(1, 200, 384), (3, 72, 256), (17, 136, 520), (32, 64, 192)]
LAYOUTS = {  # (weight layout, activation group): scales constant along K, or not
    "channel": ("channel", None),
    "channel-xgroup": ("channel", 64),
    "block": ((48, 96), 64),
    "rowblock": ((1, 128), 128),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # bf16: tests/test_fp8_weights_gpu.py
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("B, N, K", GEMV_SHAPES)
@pytest.mark.parametrize("mode", ["plain", "residual", "gated"])
def test_fp8_gemv_against_float64(dtype, layout, B, N, K, mode):
    torch.manual_seed(1)
    wl, group = LAYOUTS[layout]
    w = random_fp8_weight(N, K, wl, act_group=group, seed=B + N)
    rows = quantize_rows(torch.randn(B, K, dtype=dtype, device=DEVICE), w)
    ref = exact(rows, w)
    residual = torch.randn(B, N, dtype=dtype, device=DEVICE) if mode == "residual" else None
    if mode == "gated":
        gate, up = ref.chunk(2, -1)
        ref = gate * torch.sigmoid(gate) * up
    elif mode == "residual":
        ref = ref + residual.double()
    out = gemv(rows, w, residual=residual, gated=mode == "gated")
    assert out.shape == ref.shape and out.dtype == dtype
    assert rel_err(out, ref) < (GEMV_F32_TOL if dtype == torch.float32 else 1e-2)
    # the op takes this kernel, and its twin computes the same function
    twin = fp8_linear_reference(rows, w, None)
    if mode == "plain":
        assert rel_err(twin, ref) < (2e-6 if dtype == torch.float32 else 1e-2)


SPLIT3_CONFIG = GemvConfig(64, 64, 4, 3, w_on_m=True, split_k=3)
X_ON_M_SPLIT3_CONFIG = GemvConfig(32, 64, 4, 3, split_k=3)  # x's rows on M (mma.sync e4m3 dots)


@pytest.mark.parametrize(
    "config",
    [FP8_CONFIG, FP8_SPLIT_K_CONFIG, SPLIT3_CONFIG, FP8_GATED_CONFIG, X_ON_M_SPLIT3_CONFIG],
    ids=["one-part", "split2", "split3", "x-on-m", "x-on-m-split3"],
)
@pytest.mark.parametrize("layout", ["channel", "block"])
def test_fp8_gemv_configs_and_split_k_repeat(config, layout):
    """K whole or split over CTAs (parts ending mid-block of scales, the last part running past
    K), several items a CTA, each result bitwise repeatable, and the tickets zero again after
    each launch. The scales are views into NaN-padded storage: a scale read past K would show."""
    from minidecode.kernels.gemv import _WORKSPACES

    wl, group = LAYOUTS[layout]
    K = 1056  # 11 blocks of 96 columns, 33 chunks of 32: a split's last chunk starts at K
    w = random_fp8_weight(200, K, wl, act_group=group, seed=3)
    rows = quantize_rows(torch.randn(20, K, device=DEVICE), w)
    w.scale, rows = _nan_padded(w.scale), rows._replace(scale=_nan_padded(rows.scale))
    residual = torch.randn(20, 200, device=DEVICE)
    outs = [gemv(rows, w, residual=residual.clone(), config=config, max_ctas=3) for _ in range(2)]
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[0], exact(rows, w) + residual.double()) < GEMV_F32_TOL
    assert all(int(c.abs().sum()) == 0 for key, (_, c) in _WORKSPACES.items() if key[0] == rows.values.device)


def _nan_padded(scale: torch.Tensor) -> torch.Tensor:
    """The same values, a view into storage with NaN columns after each row's."""
    padded = torch.full((scale.shape[0] + 1, scale.shape[1] + 4), float("nan"), device=scale.device)
    padded[: scale.shape[0], : scale.shape[1]] = scale
    return padded[: scale.shape[0], : scale.shape[1]]


def test_fp8_gemv_default_config():
    """8B shapes on 132 SMs: K split in two for the 4096-wide o_proj / down (64 blocks of 64
    rows), not for qkv (96 blocks); gate/up with x's rows on M."""
    assert default_fp8_config(4096, False, 132) is FP8_SPLIT_K_CONFIG
    assert default_fp8_config(6144, False, 132) is FP8_CONFIG
    assert default_fp8_config(14336, True, 132) is FP8_GATED_CONFIG


def _sweep_candidates() -> dict[tuple, GemvConfig]:
    """Every config bench/tune_gemv.py --fp8 times on the 8B projections (an H100 / H200: 132 SMs;
    an H100 PCIe: 114), one of each program the interpreter runs (stages and warps are the
    compiler's)."""
    import tune_gemv
    from fp8_weights import SHAPES

    configs = {}
    for sms in (132, 114):
        for N, K, mode in SHAPES.values():
            gated = mode == "gated"
            for c in tune_gemv.fp8_candidates(N // 2 if gated else N, K, gated, sms):
                configs.setdefault((c.block_n, c.block_k, c.split_k, c.early_tiles, c.w_on_m), c)
    return configs


@pytest.mark.parametrize(
    "config",
    list(_sweep_candidates().values()),
    ids=lambda c: f"N{c.block_n}K{c.block_k}x{c.split_k}" + ("w" if c.w_on_m else "x"),
)
def test_fp8_gemv_sweep_candidates_against_the_reference(config):
    """Any config the GEMV sweep may pick computes W8A8 as fp8_linear_reference does, in each
    mode (one row and 17: x padded to 16 and 32 rows), on 3 CTAs (several items a CTA; K = 1056:
    a partial last chunk, and with 8 parts of 128 columns an empty last part)."""
    torch.manual_seed(4)
    N, K = 256, 1056
    w = random_fp8_weight(N, K, "channel", seed=5)
    for B in (1, 17):
        rows = quantize_rows(torch.randn(B, K, device=DEVICE), w)
        ref = fp8_linear_reference(rows, w, None)  # [B, N] float32
        residual = torch.randn(B, N, device=DEVICE)
        for mode in ("plain", "residual", "gated"):
            out = gemv(rows, w, residual=residual.clone() if mode == "residual" else None,
                       gated=mode == "gated", config=config, max_ctas=3)  # fmt: skip
            want = {"plain": ref, "residual": ref + residual}.get(mode)
            if mode == "gated":
                gate, up = ref.chunk(2, -1)
                want = gate * torch.sigmoid(gate) * up
            assert rel_err(out, want) < GEMV_F32_TOL, (B, mode)


@pytest.mark.skipif(CUDA, reason="--smoke runs the kernels on CPU tensors: the interpreter's process")
def test_tune_gemv_fp8_smoke_runs_on_the_interpreter(tmp_path):
    """The sweep end to end on tiny shapes (the CPU: no timing): tables, JSON, a correct best."""
    import tune_gemv

    tune_gemv.main(["--fp8", "--smoke", "--check-rows", "17", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "tune-gemv-fp8.json").read_text())
    assert len(report["shapes"]) == 4
    for shape in report["shapes"]:
        checked = [c for cases in shape["check_rows"].values() for c in cases]  # the default, the best
        assert shape["best"] and all(c.get("ok") for c in shape["rows1"] + checked), shape["matrix"]
    assert "best per shape (1 row)" in (tmp_path / "tune-gemv-fp8.md").read_text()


def test_fp8_gemv_refuses_mixed_operands():
    w = random_fp8_weight(64, 64, "channel")
    with pytest.raises(ValueError, match="QuantizedRows"):
        gemv(torch.randn(1, 64, device=DEVICE), w)


@pytest.mark.parametrize("op", ["linear", "linear_residual", "gate_up_silu"])
@pytest.mark.parametrize("rows", [1, 40])  # the GEMV, and prefill's path (the twin on the CPU)
def test_ops_take_fp8_weights(op, rows):
    """ops.linear / linear_residual / gate_up_silu with an FP8 weight: the Triton path (GEMV up to
    32 rows) equals the twin, which is W8A8 in float32."""
    torch.manual_seed(2)
    w = random_fp8_weight(128, 256, (64, 128), act_group=128)
    x = torch.randn(rows, 256, device=DEVICE)
    bias = torch.randn(128, device=DEVICE)
    results = []
    for triton in (False, True):
        if op == "linear_residual":
            out = torch.ones(rows, 128, device=DEVICE)
            ops.linear_residual(x, w, bias, out, triton=triton)
        else:
            out = getattr(ops, op)(x, w, bias, triton=triton)
        results.append(out)
    if CUDA:
        assert rel_err(results[1], results[0]) < GEMV_F32_TOL
    else:
        torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)
    y = exact(quantize_rows(x, w), w) + bias.double()
    if op == "gate_up_silu":
        gate, up = y.chunk(2, -1)
        y = gate * torch.sigmoid(gate) * up
    elif op == "linear_residual":
        y = y + 1
    assert rel_err(results[0], y) < 2e-6


# ---- weights: rounding, dequantization, fusion ---------------------------------------------------
def test_quantize_weight_per_channel():
    torch.manual_seed(3)
    w = torch.randn(100, 70) * torch.rand(100, 1) * 10
    w[3] = 0
    values, scale = quantize_weight(w)
    assert values.dtype == E4M3 and scale.shape == (100, 1)
    assert torch.equal(values.float().abs().amax(1)[torch.arange(100) != 3], torch.full((99,), 448.0))
    deq = values.float() * scale
    assert (
        (deq - w).abs().le(w.abs().amax(1, keepdim=True) * 2**-4 + 1e-30).all()
    )  # half an e4m3 step of 2^-3
    assert rel_err(deq, w) < 0.04 and deq[3].eq(0).all()


def test_fuse_fp8_keeps_each_rows_scales():
    """Per-tensor scales (held per channel), aligned blocks, blocks across a part boundary: the
    fused weight dequantizes to the parts' rows stacked."""
    parts = [random_fp8_weight(n, 96, "channel", device="cpu", seed=n) for n in (64, 32, 32)]
    fused = fuse_fp8(parts)
    assert (fused.block_n, fused.block_k) == (1, 96)
    torch.testing.assert_close(fused.dequantize(), torch.cat([p.dequantize() for p in parts]), rtol=0, atol=0)
    for sizes, block in (((64, 32), (32, 64)), ((48, 40, 40), (32, 64))):
        parts = [random_fp8_weight(n, 100, block, device="cpu", seed=n) for n in sizes]
        fused = fuse_fp8(parts)
        aligned = all(n % block[0] == 0 for n in sizes[:-1])
        assert fused.block_n == (block[0] if aligned else 1)
        torch.testing.assert_close(
            fused.dequantize(), torch.cat([p.dequantize() for p in parts]), rtol=0, atol=0
        )
    static = [random_fp8_weight(8, 32, "channel", static=s, device="cpu") for s in (0.1, 0.3)]
    assert fuse_fp8(static).input_scale.item() == pytest.approx(0.3)


# ---- config parsing ------------------------------------------------------------------------------------
def test_parse_quantization_formats():
    for name, fmt in FORMATS.items():
        quant = parse_quantization(_config(fmt))
        scheme = quant.scheme_for("model.layers.0.self_attn.q_proj")
        assert scheme.weights == fmt["weights"] and scheme.activations == fmt["acts"], name
        assert scheme.block == (tuple(fmt["block"]) if fmt["weights"] == "block" else None)
        assert quant.scheme_for("lm_head") is None
    ct = parse_quantization(_config(FORMATS["ct-channel"]))  # ignores "re:model\.layers\.1\.mlp\..*"
    assert ct.scheme_for("model.layers.1.mlp.up_proj") is None
    assert ct.scheme_for("model.layers.10.mlp.up_proj") is not None
    # transformers' skip list: a prefix up to a module boundary, or a suffix; given, it replaces
    # the default (lm_head)
    fp8 = parse_quantization({"quant_method": "fp8", "modules_to_not_convert": ["model.layers.1", "o_proj"]})
    scheme = fp8.scheme_for("model.layers.0.mlp.down_proj")
    assert scheme.block == (128, 128) and scheme.act_group == 128 and scheme.scale_name == "weight_scale_inv"
    assert fp8.scheme_for("model.layers.1.mlp.down_proj") is None and fp8.scheme_for("lm_head") is not None
    assert fp8.scheme_for("model.layers.10.mlp.down_proj") is not None  # "layers.1" is not "layers.10"
    assert fp8.scheme_for("model.layers.3.self_attn.o_proj") is None
    assert (
        parse_quantization({"quant_method": "compressed-tensors", "config_groups": {}, "kv_cache_scheme": {}})
        is None
    )


UNSUPPORTED = {
    "awq": ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    "gptq": ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    "no-method": ({"bits": 4}, "no quant_method"),
    "int4-packed": (
        {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {}}},
        "format 'pack-quantized'",
    ),  # fmt: skip
    "strategy": ("group", "weight strategy 'group'"),
    "weight-only": ("weight-only", "weight-only"),
    "e5m2": ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_quantization_is_one_error_naming_it(case):
    qc, match = UNSUPPORTED[case]
    if qc == "group":
        qc = _config(FORMATS["ct-channel"])
        qc["config_groups"]["group_0"]["weights"]["strategy"] = "group"
    elif qc == "weight-only":
        qc = _config(FORMATS["ct-channel"])
        qc["config_groups"]["group_0"]["input_activations"] = None
    with pytest.raises(ConfigError, match=match) as info:
        parse_quantization(qc)
    assert "supported: FP8 checkpoints" in str(info.value) and "\n" not in str(info.value)


# ---- bad checkpoints: one error line -----------------------------------------------------------------
def _broken(fp8_dir: Path, tmp_path: Path, edit) -> Path:
    out = tmp_path / "broken"
    shutil.copytree(fp8_dir, out)
    tensors = load_file(out / "model.safetensors")
    edit(tensors)
    save_file(tensors, out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def channel_checkpoint(tiny, tmp_path_factory):
    return build_fp8_checkpoint(tiny, tmp_path_factory.mktemp("fp8-bad"), "ct-channel")[0]


SCALE = "model.layers.0.self_attn.q_proj.weight_scale"
WEIGHT = "model.layers.0.self_attn.q_proj.weight"
BAD = {
    "missing weight_scale": (lambda t: t.pop(SCALE), f"missing tensors: {SCALE}"),
    "scale of the wrong shape": (
        lambda t: t.update({SCALE: t[SCALE][:5]}),
        rf"misshapen tensors: {SCALE} \(5, 1\)",
    ),
    "float weight": (
        lambda t: t.update({WEIGHT: t[WEIGHT].float()}),
        rf"wrong dtype: {WEIGHT} float32 \(expected float8",
    ),
    "e4m3 where none belongs": (
        lambda t: t.update({"lm_head.weight": t["lm_head.weight"].to(E4M3)}),
        r"wrong dtype: lm_head.weight float8_e4m3fn \(not quantized",
    ),
    "integer scale": (
        lambda t: t.update({SCALE: t[SCALE].to(torch.int32)}),
        "expected a float32, bf16 or fp16 scale",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_fp8_checkpoint_is_one_error_line(channel_checkpoint, tmp_path, case):
    edit, match = BAD[case]
    broken = _broken(channel_checkpoint, tmp_path, edit)
    with pytest.raises(UserError, match=match):
        LLM(broken, device="cpu", dtype="float32")
    result = CliRunner().invoke(app, ["generate", str(broken), "--prompt", "x", "--device", "cpu"])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code != 0 and "Traceback" not in result.output and len(lines) == 1
    assert lines[0].startswith("error: ") and "does not match its config.json" in lines[0]


def test_unsupported_method_checkpoint_is_one_error_line(tiny, tmp_path):
    out = tmp_path / "awq"
    shutil.copytree(tiny, out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (out / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(app, ["generate", str(out), "--prompt", "x", "--device", "cpu"])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code != 0 and len(lines) == 1 and "quant_method 'awq'" in lines[0]
    with pytest.raises(UserError, match="unknown quantization 'int8'"):
        LLM(tiny, device="cpu", quantization="int8")


def test_quantized_lm_head_is_dequantized(tiny, tmp_path, prompt_ids):
    """A checkpoint that quantizes lm_head too (ignore []): its weights load dequantized to the
    model dtype (the logits stay a model-dtype GEMM: lm_head's input is not rounded)."""
    FORMATS["ct-with-lm-head"] = dict(FORMATS["ct-tensor-static"], acts="token", ignore=[])
    try:
        fp8_dir, deq_dir, inputs = build_fp8_checkpoint(tiny, tmp_path, "ct-with-lm-head")
    finally:
        del FORMATS["ct-with-lm-head"]
    assert "lm_head.weight_scale" in load_file(fp8_dir / "model.safetensors")
    llm = LLM(fp8_dir, device="cpu", dtype="float32")
    assert type(llm.model.lm_head) is torch.nn.Linear and llm.model.lm_head.weight.dtype == torch.float32
    del inputs["lm_head"]
    ids = prompt_ids(40, seed=8)
    with torch.no_grad():
        ref = hf_w8a8(deq_dir, inputs)(torch.tensor([ids])).logits[0]
    assert rel_err(llm.logits(ids), ref) < 2e-3
    assert weight_plan(llm.config, torch.float32)[0] == weight_bytes(llm.model)


def test_fused_layers_quantized_differently_are_refused(tiny, tmp_path):
    fp8_dir, _, _ = build_fp8_checkpoint(tiny, tmp_path, "ct-channel")
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"]["ignore"].append("model.layers.0.self_attn.k_proj")
    (fp8_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="q_proj, k_proj and v_proj differently"):
        LLM(fp8_dir, device="cpu", dtype="float32")

"""Checkpoint files -> weights on the device: a local folder or a hub repo id, single or sharded
safetensors, loaded tensor by tensor straight to the target device and dtype."""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import UserError

if TYPE_CHECKING:  # torch is imported by load_weights: resolving a folder (the CLI's checks) needs none
    import torch
    from torch import nn

    from minidecode.models.config import ModelConfig, Quantization
    from minidecode.models.llama import Transformer

    from .distributed import Parallel

# The small model shipped inside the package (training/train_tiny_model.py made it).
DEFAULT_MODEL = Path(__file__).parent / "assets" / "stdlib-tiny"
# What generation needs from a hub repo; never the .bin / .pth duplicates of the weights.
HUB_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "*.safetensors",
    "model.safetensors.index.json",
]
# Tensors some checkpoints carry that the model recomputes or shares: skipped quietly.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Calibrated FP8 KV-cache scales (compressed-tensors / vLLM checkpoints): one scalar per layer for
# K and one for V, named self_attn.k_scale / v_scale (older: k_proj / v_proj.output_scale).
KV_SCALE = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:(k|v)_scale|(k|v)_proj\.output_scale)")


def resolve_model_dir(model: str | Path) -> Path:
    """A local checkpoint folder, or a hub repo id resolved through huggingface_hub's cache
    (which honours HF_HUB_OFFLINE and HF_HOME)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    text = str(model)
    looks_like_repo_id = text.count("/") == 1 and not text.startswith((".", "/", "~")) and not path.exists()
    if not looks_like_repo_id:
        raise UserError(f"model path {text!r} is not a directory")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=text, allow_patterns=HUB_FILES))
    except Exception as e:  # offline, unknown repo, gated, no network: all user-fixable
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"model {text!r} is not a local directory and could not be fetched from the hub "
            f"(offline, or no such repo?): {reason}"
        ) from None


def read_config(model_dir: Path) -> ModelConfig:
    """The checkpoint's config.json as the model's ModelConfig, or the UserError its ConfigError
    says (models/config.py checks it; the message is the user's)."""
    from minidecode.models.config import ConfigError, ModelConfig

    try:
        return ModelConfig.from_file(model_dir / "config.json")
    except ConfigError as e:
        raise UserError(str(e)) from None


def read_generation_config(
    model_dir: Path, cfg: ModelConfig
) -> tuple[dict[str, float | int] | None, set[int]]:
    """generation_config.json's sampling defaults (temperature, top_k, top_p; None where it does not
    sample: greedy) and the eos ids, the config's and its own."""
    eos, sampling = set(cfg.eos_token_ids), None
    path = model_dir / "generation_config.json"
    if path.exists():
        try:
            gen = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise UserError(f"{path} is not valid JSON: {e}") from None
        ids = gen.get("eos_token_id")
        eos |= set(ids if isinstance(ids, list) else [] if ids is None else [ids])
        if gen.get("do_sample"):
            sampling = {
                "temperature": float(gen.get("temperature") or 1.0),
                "top_k": int(gen.get("top_k") or 0),
                "top_p": float(gen.get("top_p") or 1.0),
            }
    return sampling, {int(i) for i in eos}

def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise UserError(f"{index} is not a valid safetensors index: {e}") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise UserError(f"shards listed in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"no *.safetensors weights in {model_dir} (.bin/.pth checkpoints are not supported)")
    return files


def load_weights(
    model: nn.Module,
    model_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    shard: Callable[[str], tuple[int, int, int] | None] | None = None,
    quantize: bool = False,
) -> list[tuple[float, float]] | None:
    """Fill `model` (built on the meta device) with the checkpoint's tensors; return the
    checkpoint's FP8 KV-cache scales, (k, v) per layer, or None where it ships none.

    Each tensor is read from its file straight onto `device` and cast to `dtype`, so an 8B model
    never has a full copy in host memory. Every expected tensor must be present with the right
    shape and dtype, and no unexpected one may appear: a wrong checkpoint fails loudly, naming
    tensors. `shard(name)` (a tensor-parallel rank's, models/parallel.py) names the part of a
    tensor to read, (dim, start, stop), or None for all of it: only that part is read from the file.

    FP8 layers (FP8Linear) keep the checkpoint's e4m3 weights (float8_e4m3fn) and float32 scales
    (stored as bf16, fp16 or fp32; a per-tensor scale as [1] or a scalar). `quantize`
    (quantize-on-load): a float weight of an FP8 layer is rounded to e4m3 per output channel as it
    is read, its scale made alongside.
    """
    from safetensors import safe_open

    from minidecode.kernels.fp8_weights import channel_scale

    expected = {name: p.shape for name, p in model.named_parameters()}
    kinds = _param_kinds(model)
    loaded: dict[str, torch.Tensor] = {}
    unexpected, misshapen, misshapen_names, wrong_dtype = [], [], set(), []
    kv_scales: dict[tuple[int, str], float] = {}  # (layer, "k" or "v") -> scale
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    for file in weight_files(model_dir):
        try:
            # safetensors names the host "cpu" only (not "cpu:0", which torch accepts)
            where = "cpu" if device.type == "cpu" else str(device)
            with safe_open(str(file), framework="pt", device=where) as f:
                for name in f.keys():
                    if name.endswith(IGNORED_SUFFIXES) or (tied and name.startswith("lm_head.")):
                        continue
                    if (match := KV_SCALE.fullmatch(name)) is not None:
                        layer, which = int(match[1]), match[2] or match[3]
                        kv_scales[layer, which] = _scale(name, f.get_tensor(name))
                        continue
                    if name not in expected:
                        unexpected.append(name)
                        continue
                    part = None if shard is None else shard(name)
                    tensor = f.get_tensor(name) if part is None else _read_part(f.get_slice(name), *part)
                    if tensor.dim() == 0 and expected[name] == (1,):  # a per-tensor scale as a scalar
                        tensor = tensor.reshape(1)
                    if tensor.shape != expected[name]:
                        misshapen.append(f"{name} {tuple(tensor.shape)} (expected {tuple(expected[name])})")
                        misshapen_names.add(name)
                        continue
                    kind, scale = kinds.get(name, "model"), None
                    columns = part is not None and part[0] == 1
                    if quantize and kind == "fp8" and columns and _wide_float(tensor):
                        # This rank holds some columns of each row: the per-channel scales come from
                        # the whole rows, so its e4m3 values are one process's columns.
                        scale = channel_scale(_row_amax(f.get_slice(name)))
                    stored = _stored(model, name, tensor, kind, dtype, quantize, scale)
                    if isinstance(stored, str):
                        wrong_dtype.append(stored)
                    else:
                        loaded.update(stored)
        except UserError:
            raise
        except Exception as e:  # safetensors raises its own error type for bad headers / truncation
            raise UserError(f"could not read {file.name}: {str(e).strip() or type(e).__name__}") from None
    missing = [name for name in expected if name not in loaded and name not in misshapen_names]
    problems = []
    if missing:
        problems.append(f"missing tensors: {_names(missing)}")
    if misshapen:
        problems.append(f"misshapen tensors: {_names(misshapen)}")
    if wrong_dtype:
        problems.append(f"tensors of the wrong dtype: {_names(wrong_dtype)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_names(unexpected)}")
    if problems:
        raise UserError(f"checkpoint in {model_dir} does not match its config.json: " + "; ".join(problems))
    model.load_state_dict(loaded, strict=True, assign=True)
    return _kv_scales_per_layer(kv_scales, model, model_dir)


def _param_kinds(model: nn.Module) -> dict[str, str]:
    """Parameter name -> "fp8" (an FP8 layer's e4m3 weight) or "scale" (its float32 scales);
    the other parameters ("model") take the model's dtype."""
    from minidecode.models.llama import FP8Linear

    kinds = {}
    for module_name, module in model.named_modules():
        if isinstance(module, FP8Linear):
            for param, _ in module.named_parameters(recurse=False):
                kind = "fp8" if param == "weight" else "model" if param == "bias" else "scale"
                kinds[f"{module_name}.{param}" if module_name else param] = kind
    return kinds


def _stored(
    model: nn.Module,
    name: str,
    tensor: torch.Tensor,
    kind: str,
    dtype: torch.dtype,
    quantize: bool,
    scale: torch.Tensor | None = None,
) -> dict[str, torch.Tensor] | str:
    """The parameters checkpoint tensor `name` loads as (quantize-on-load: an FP8 layer's float
    weight gives its e4m3 values and per-channel scale, the given `scale` [N, 1] where it is
    computed from whole rows), or what is wrong with its dtype."""
    import torch

    from minidecode.kernels.fp8_weights import FP8_DTYPE, quantize_weight

    found = _dtype_name(tensor.dtype)
    one_byte = tensor.dtype.is_floating_point and tensor.element_size() == 1
    if kind == "fp8":
        if tensor.dtype == FP8_DTYPE:
            return {name: tensor}
        if quantize and _wide_float(tensor):
            module = name.removesuffix(".weight")
            values, scale = quantize_weight(tensor, scale)
            return {name: values, f"{module}.{model.get_submodule(module).scheme.scale_name}": scale}
        return f"{name} {found} (expected float8_e4m3fn)"
    if one_byte:  # e4m3 values of a layer config.json leaves unquantized: without a scale, wrong
        return f"{name} {found} (not quantized in config.json)"
    if kind == "scale":
        if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"{name} {found} (expected a float32, bf16 or fp16 scale)"
        return {name: tensor.float()}
    return {name: tensor.to(dtype)}


def _wide_float(tensor: torch.Tensor) -> bool:
    """A float tensor of more than one byte an element (one quantize-on-load rounds)."""
    return tensor.dtype.is_floating_point and tensor.element_size() > 1


def _row_amax(tensor_slice) -> torch.Tensor:
    """Each row's largest |value| of a 2-D safetensors slice, [rows] float32: whole rows, read
    RANDOM_BLOCK values at a time."""
    import torch

    rows, cols = tensor_slice.get_shape()
    step = max(1, RANDOM_BLOCK // cols)
    return torch.cat([tensor_slice[r : r + step].float().abs().amax(dim=1) for r in range(0, rows, step)])


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _read_part(tensor_slice, dim: int, start: int, stop: int) -> torch.Tensor:
    """Positions [start, stop) of `dim` from a safetensors slice; those past the tensor's end are
    zeros (an lm_head split into equal vocabulary parts)."""
    import torch

    size = tensor_slice.get_shape()[dim]
    index = [slice(None)] * len(tensor_slice.get_shape())
    index[dim] = slice(min(start, size), min(stop, size))
    part = tensor_slice[tuple(index)]
    missing = stop - start - part.shape[dim]
    if missing <= 0:
        return part
    pad = list(part.shape)
    pad[dim] = missing
    return torch.cat([part, part.new_zeros(pad)], dim=dim)


def _scale(name: str, tensor: torch.Tensor) -> float:
    if tensor.numel() != 1 or not math.isfinite(value := float(tensor.float().reshape(()))) or value <= 0:
        raise UserError(f"KV-cache scale {name} must be one positive finite number, got {tensor.tolist()}")
    return value


def _kv_scales_per_layer(
    found: dict[tuple[int, str], float], model: nn.Module, model_dir: Path
) -> list[tuple[float, float]] | None:
    """(k, v) scales for every layer, or None: a checkpoint that declares a static
    `kv_cache_scheme` must ship them, and scales for only some layers are refused (a layer left
    without its calibrated scale would silently quantize differently)."""
    cfg = model.config
    if not found:
        scheme = cfg.kv_cache_scheme
        if isinstance(scheme, dict) and not scheme.get("dynamic", False):
            raise UserError(
                f"config.json in {model_dir} declares a static kv_cache_scheme but the checkpoint has no "
                "self_attn.k_scale / v_scale tensors"
            )
        return None
    missing = [f"{i}.{kv}" for i in range(cfg.num_layers) for kv in "kv" if (i, kv) not in found]
    extra = [f"{i}.{kv}" for i, kv in found if i >= cfg.num_layers]
    if missing or extra:
        raise UserError(
            f"the checkpoint in {model_dir} ships KV-cache scales for some layers only: "
            + (f"missing layer.k/v {_names(missing)}" if missing else f"beyond the model: {_names(extra)}")
        )
    return [(found[i, "k"], found[i, "v"]) for i in range(cfg.num_layers)]


def _names(names: list[str], most: int = 5) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def build_model(
    cfg: ModelConfig,
    model_dir: Path | None,
    device: torch.device,
    dtype: torch.dtype,
    parallel: Parallel | None = None,
    quantization: str | None = None,
) -> Transformer:
    """The model ready for inference on `device`: the checkpoint's weights (model_dir), or random
    ones (model_dir None: a synthetic shape, for speed runs); q/k/v and gate/up fused, RoPE tables
    built. Under tensor / context parallelism (`parallel`), this rank's part only. Refuses (every
    rank, if any rank must) when the weights cannot fit the device's free memory.

    FP8 weights: a checkpoint whose config.json declares FP8 weights (quantization_config) loads
    them as they are; `quantization="fp8"` rounds a bf16 / fp16 checkpoint's (or the random)
    weights of the decoder layers' Linear layers to e4m3 on load, per output channel, their inputs
    per token (the FP8-dynamic scheme); embeddings and lm_head stay in `dtype`. A tensor-parallel
    rank loads (or rounds) its rows or columns of them with their scales, as one process's: a
    column split's per-channel scales come from the whole rows."""
    from .memory import free_memory, gib

    quant = _weight_quantization(cfg, quantization, device, parallel)
    weights, _ = _planned(cfg, quant, parallel, dtype)  # this rank's
    model = _meta_model(cfg, quant, parallel)
    free = free_memory(device)
    problem = None
    if weights > free:
        problem = (
            f"the weights need {gib(weights)} but only {gib(free)} is free on {device}; "
            "use a smaller dtype or another device"
        )
    if parallel is not None:  # any rank's problem stops every rank
        problem = parallel.first_error(problem)
    if problem is not None:
        raise UserError(problem)
    if model_dir is None:
        init_random_weights(model, device, dtype)
    else:
        shard = None if parallel is None else model.shard  # only this rank's rows
        on_load = quant is not None and quant.method == "on-load"
        kv_scales = load_weights(model, model_dir, device, dtype, shard, quantize=on_load)
        for layer, scales in zip(model.model.layers, kv_scales or [], strict=False):
            layer.self_attn.kv_static_scales = scales  # the checkpoint's calibrated FP8 scales
    if quant is not None:
        _pack_fp8(model, dtype)
    model.fuse_projections()
    model.setup_rope(device)
    model.eval().requires_grad_(False)  # inference only: no autograd bookkeeping
    return model


def weight_plan(
    cfg: ModelConfig, dtype: torch.dtype, quantization: str | None = None, tp: int = 1
) -> tuple[int, str]:
    """What the model's weights will be, with no weights loaded (for memory plans and `info`):
    their bytes (weight_bytes of the built model: FP8 layers, a checkpoint's or quantize-on-load's,
    1 byte a weight plus their float32 scales; the rest in `dtype`), and weights_description's
    words for them. tp > 1: one tensor-parallel rank's (rank 0's: every rank holds as much)."""
    import torch

    from .distributed import Parallel

    parallel = None if tp == 1 else Parallel(tp, 1, 0, torch.device("cpu"))  # no process group: shapes only
    quant = _weight_quantization(cfg, quantization, torch.device("cpu"), parallel)
    return _planned(cfg, quant, parallel, dtype)


def _meta_model(cfg: ModelConfig, quant: Quantization | None, parallel: Parallel | None) -> Transformer:
    """The model (this rank's part) on the meta device, its FP8 layers declared."""
    import torch

    from minidecode.models.llama import Transformer

    with torch.device("meta"):
        if parallel is None:
            model = Transformer(cfg)
        else:
            from minidecode.models.config import ConfigError
            from minidecode.models.parallel import ParallelTransformer

            try:
                model = ParallelTransformer(cfg, parallel)
            except ConfigError as e:  # a model that does not split tp ways
                raise UserError(str(e)) from None
        if quant is not None:
            _declare_fp8(model, quant)
    return model


def _planned(
    cfg: ModelConfig, quant: Quantization | None, parallel: Parallel | None, dtype: torch.dtype
) -> tuple[int, str]:
    """(bytes, description) of the weights as built, counted on the meta-device model (no meta
    ops: the first one costs a second of imports). FP8 layers as FP8Linear.packed_bytes counts
    them, a quantized lm_head dequantized to `dtype`, the rest in `dtype`: weight_bytes of the
    built model, but where fused q/k/v or gate/up end mid-block of their block scales (then held
    a row each: a few KiB a layer more)."""
    from minidecode.models.llama import FP8Linear, weights_description

    model = _meta_model(cfg, quant, parallel)
    fp8 = {name: m for name, m in model.named_modules() if isinstance(m, FP8Linear)}
    inside = {id(p) for m in fp8.values() for p in m.parameters()}
    size = sum(p.numel() for p in model.parameters() if id(p) not in inside) * dtype.itemsize
    for name, m in fp8.items():
        lm_head = name == "lm_head"  # dequantized on load
        size += m.out_features * m.in_features * dtype.itemsize if lm_head else m.packed_bytes(dtype)
    return size, weights_description(model, dtype)


def _weight_quantization(
    cfg: ModelConfig, quantization: str | None, device: torch.device, parallel: Parallel | None
) -> Quantization | None:
    """The FP8 weights to build: the checkpoint's (config.json), else quantize-on-load's if asked
    for, else none. FP8 needs a GPU with FP8 tensor cores (compute capability 8.9+) or the CPU;
    under tensor parallelism, a split that keeps every scale block whole on one rank."""
    import torch

    from minidecode.models.config import ON_LOAD_SCHEME, Quantization

    from .validate import QUANTIZATIONS, check_choice

    if quantization is not None:
        check_choice("quantization", quantization, QUANTIZATIONS)
    quant = cfg.quantization
    if quant is None and quantization == "fp8":
        quant = Quantization("on-load", ((("Linear",), ON_LOAD_SCHEME),))
    if quant is None:
        return None
    if parallel is not None and parallel.tp > 1:
        from minidecode.models.parallel import fp8_split_problem

        if (problem := fp8_split_problem(cfg, parallel.tp, quant.scheme_for)) is not None:
            raise UserError(problem)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise UserError(
            f"FP8 weights need a GPU with FP8 tensor cores (compute capability 8.9 or newer); "
            f"{torch.cuda.get_device_name(device)} has {major}.{minor}"
            + (": run without --quantization fp8" if cfg.quantization is None else "")
        )
    return quant


def _declare_fp8(model: nn.Module, quant: Quantization) -> None:
    """Each Linear layer that `quant` quantizes becomes an FP8Linear (on the meta device, before
    loading). q/k/v and gate/up run fused, so each set must share one scheme."""
    from torch import nn

    from minidecode.models.llama import FP8Linear
    from minidecode.models.parallel import RowParallelProjection

    for name, module in list(model.named_modules()):
        scheme = quant.scheme_for(name) if isinstance(module, nn.Linear) else None
        if scheme is not None:
            parent, _, attr = name.rpartition(".")
            if isinstance(module, RowParallelProjection):  # a tensor-parallel rank's input columns
                fp8 = module.fp8_form(scheme)
            else:
                fp8 = FP8Linear(module.in_features, module.out_features, module.bias is not None, scheme)
            setattr(model.get_submodule(parent), attr, fp8)
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for fused in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
            if len({getattr(lin, "scheme", None) for lin in fused}) > 1:
                names = "q_proj, k_proj and v_proj" if len(fused) == 3 else "gate_proj and up_proj"
                raise UserError(
                    f"config.json's quantization_config quantizes model.layers.{i}'s {names} differently; "
                    "minidecode runs them fused and needs one FP8 scheme for them"
                )


def _pack_fp8(model: nn.Module, dtype: torch.dtype) -> None:
    """After loading: each FP8 layer's FP8Weight. A checkpoint's quantized lm_head is dequantized
    to `dtype` (the logits stay a model-dtype GEMM)."""
    import torch
    from torch import nn

    from minidecode.models.llama import FP8Linear

    for module in model.modules():
        if isinstance(module, FP8Linear):
            module.pack()
    head = getattr(model, "lm_head", None)
    if isinstance(head, FP8Linear):
        with torch.device("meta"):
            plain = nn.Linear(head.in_features, head.out_features, bias=False)
        plain.weight = nn.Parameter(head.fp8.dequantize(dtype), requires_grad=False)
        if head.bias is not None:
            plain.bias = nn.Parameter(head.bias.data, requires_grad=False)
        model.lm_head = plain


# Values drawn per generator when making random weights: a block of whole rows of one tensor.
RANDOM_BLOCK = 1 << 24


def init_random_weights(model: nn.Module, device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
    """Materialise a meta-device model with random weights (std 0.02, norms at 1), the same model
    at any tensor-parallel split: each checkpoint tensor is drawn in blocks of whole rows, each
    block by its own generator seeded by (seed, tensor name, block), so a rank draws the blocks that
    hold its rows (and, for a tensor split by columns, whole blocks of which it keeps its columns).
    One block (at most RANDOM_BLOCK values) beside the weights at a time, on the device: a 70B
    shape never touches host memory nor holds a whole tensor twice.

    An FP8 layer's weight is drawn in `dtype` and rounded to e4m3 per output channel, as
    quantize-on-load rounds a checkpoint's; its scales are those of the whole rows (a rank that
    keeps some columns of each row takes them from the blocks it draws), so every split holds the
    one-process e4m3 values.

    A tensor-parallel rank's model (models/parallel.py) names its part of each tensor with
    `shard(name)` -> (dim, start, stop) or None (rows past the tensor's end are zeros: the
    lm_head's padding), and the whole tensor's shape with `checkpoint_shape(name)`."""
    import torch

    from minidecode.kernels.fp8_weights import channel_scale, quantize_weight

    shard = getattr(model, "shard", None)
    kinds = _param_kinds(model)
    weights = {}
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(p.shape, dtype=dtype, device=device)
            continue
        if kinds.get(name) == "scale":  # made with its layer's e4m3 values
            continue
        part = None if shard is None else shard(name)
        whole = p.shape if part is None else model.checkpoint_shape(name)
        if kinds.get(name) != "fp8":
            weights[name] = _random_part(name, whole, part, seed, device, dtype)
            continue
        split_columns = part is not None and part[0] == 1
        amax = torch.empty(whole[0], dtype=dtype, device=device) if split_columns else None
        drawn = _random_part(name, whole, part, seed, device, dtype, amax)
        module = name.removesuffix(".weight")
        scale_name = f"{module}.{model.get_submodule(module).scheme.scale_name}"
        scale = None if amax is None else channel_scale(amax)
        weights[name], weights[scale_name] = quantize_weight(drawn, scale)
    model.load_state_dict(weights, strict=True, assign=True)


def _random_part(
    name: str,
    shape: torch.Size,
    part: tuple[int, int, int] | None,
    seed: int,
    device: torch.device,
    dtype: torch.dtype,
    row_amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """Part (dim, start, stop) of tensor `name` of the whole `shape` (None: all of it), drawn
    block of rows by block of rows: normal(0, 0.02), zeros for rows past the end. row_amax [rows]
    (a 2-D weight split by input columns): filled with each whole row's largest |value|."""
    import torch

    rows, row_numel = shape[0], math.prod(shape[1:])
    per_block = max(1, RANDOM_BLOCK // row_numel)  # rows a block, fixed by the whole shape alone
    dim, start, stop = part or (0, 0, rows)
    first, last = (start, stop) if dim == 0 else (0, rows)  # the rows this part holds
    local = list(shape)
    local[dim] = stop - start
    out = torch.zeros(local, dtype=dtype, device=device)
    for block in range(first // per_block, -(-min(last, rows) // per_block)):
        lo, hi = block * per_block, min((block + 1) * per_block, rows)
        generator = torch.Generator(device=device).manual_seed(_block_seed(seed, name, block))
        values = torch.empty((hi - lo, *shape[1:]), dtype=dtype, device=device)
        values.normal_(0, 0.02, generator=generator)
        if dim == 0:  # the rows both hold
            a, b = max(lo, first), min(hi, last)
            out[a - first : b - first] = values[a - lo : b - lo]
        else:  # a 2-D weight split by input columns
            out[lo:hi] = values[:, start:stop]
            if row_amax is not None:
                row_amax[lo:hi] = values.abs().amax(dim=1)
    return out


def _block_seed(seed: int, name: str, block: int) -> int:
    """A generator seed for one block of one tensor (a stable hash: Python's own is per process)."""
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1

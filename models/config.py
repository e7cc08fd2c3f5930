"""Model configuration: Hugging Face config.json -> one dataclass for every supported family.

A config the model cannot run raises ConfigError (a ValueError) with the user's one-line message;
the runtime's callers (minidecode/loading.py's read_config) turn it into minidecode's UserError."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json (or a config dict) the model cannot run: the message says what to fix."""


SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


@dataclass
class RopeConfig:
    """Rotary embedding parameters, in transformers' `rope_parameters` vocabulary."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    # llama3
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    # yarn
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # longrope
    short_factor: list[float] | None = None
    long_factor: list[float] | None = None
    partial_rotary_factor: float = 1.0


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 always; Llama when attention_bias
    o_bias: bool = False  # Llama attention_bias also biases o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None  # None: full attention
    rope: RopeConfig = field(default_factory=RopeConfig)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # compressed-tensors' quantization_config.kv_cache_scheme: the checkpoint ships calibrated
    # FP8 KV scales (k_scale / v_scale per layer) unless it says dynamic
    kv_cache_scheme: dict[str, Any] | None = None
    # quantization_config's FP8 weights (None: the weights are in the model's dtype)
    quantization: Quantization | None = None

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def num_parameters(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.o_bias:
            attn += h
        if self.qk_norm:
            attn += 2 * d
        mlp = 3 * h * self.intermediate_size
        if self.mlp_bias:
            mlp += 2 * self.intermediate_size + h
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        if not isinstance(cfg, dict):
            raise ConfigError(f"config.json must hold a JSON object, not a {type(cfg).__name__}")
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            config = cls(
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
                o_bias=model_type in ("llama", "qwen3") and bool(cfg.get("attention_bias", False)),
                mlp_bias=model_type == "llama" and bool(cfg.get("mlp_bias", False)),
                qk_norm=model_type == "qwen3",
                sliding_window=_sliding_window(cfg),
                rope=_rope_config(cfg),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=_as_id_list(cfg.get("eos_token_id")),
                kv_cache_scheme=(cfg.get("quantization_config") or {}).get("kv_cache_scheme")
                or cfg.get("kv_cache_scheme"),
                quantization=parse_quantization(cfg.get("quantization_config")),
            )
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"config.json is missing or has a bad value for {e}") from None
        if config.num_heads % config.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({config.num_heads}) is not a multiple of "
                f"num_key_value_heads ({config.num_kv_heads})"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"unsupported hidden_act {cfg.get('hidden_act')!r}; only 'silu' is supported")
        return config

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        try:
            return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))
        except FileNotFoundError:
            raise ConfigError(f"no config.json in {Path(path).parent}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    window = cfg.get("sliding_window")
    # Qwen2/3 configs carry a sliding_window that is only active with use_sliding_window.
    if cfg.get("model_type") in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        return None
    return int(window) if window else None


def _rope_config(cfg: dict[str, Any]) -> RopeConfig:
    """Read RoPE settings from either `rope_parameters` (transformers >= 5) or the legacy
    `rope_theta` + `rope_scaling` keys, with transformers' defaults."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"unsupported RoPE type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    original = params.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if original is None and rope_type in ("llama3", "yarn", "longrope"):
        original = cfg.get("max_position_embeddings")
    rope = RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        factor=_opt_float(params.get("factor")),
        original_max_position_embeddings=int(original) if original else None,
        low_freq_factor=_opt_float(params.get("low_freq_factor")),
        high_freq_factor=_opt_float(params.get("high_freq_factor")),
        attention_factor=_opt_float(params.get("attention_factor")),
        beta_fast=_opt_float(params.get("beta_fast")),
        beta_slow=_opt_float(params.get("beta_slow")),
        mscale=_opt_float(params.get("mscale")),
        mscale_all_dim=_opt_float(params.get("mscale_all_dim")),
        truncate=bool(params.get("truncate", True)),
        short_factor=params.get("short_factor"),
        long_factor=params.get("long_factor"),
        partial_rotary_factor=float(
            params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        ),
    )
    if rope.partial_rotary_factor != 1.0:
        raise ConfigError("partial_rotary_factor != 1 is not supported")
    required = {
        "linear": ["factor"],
        "dynamic": ["factor"],
        "llama3": ["factor", "low_freq_factor", "high_freq_factor"],
        "longrope": ["short_factor", "long_factor"],
    }.get(rope_type, [])
    missing = [k for k in required if getattr(rope, k) is None]
    if missing:
        raise ConfigError(f"RoPE type {rope_type!r} needs {', '.join(missing)} in config.json")
    return rope


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


# ---- FP8 weights: quantization_config ------------------------------------------------------------
SUPPORTED_QUANTIZATION = (
    "FP8 checkpoints: compressed-tensors 'float-quantized' (e4m3 weights per tensor, channel or "
    "block; activations dynamic per token or group, or static) and transformers quant_method 'fp8'"
)


@dataclass(frozen=True)
class FP8Scheme:
    """How a Linear layer's FP8 (float8_e4m3fn) weights are stored and what its forward computes.

    Weights: one float32 scale per tensor ([1]), per output channel ([N, 1]) or per block of
    (rows, columns) ([ceil(N / rows), ceil(K / cols)], the last blocks partial), a multiplier:
    weight = e4m3 value * scale. Activations (W8A8): the layer's input is rounded to e4m3 too,
    with a scale per token (its largest |x| / 448), per token and group of `act_group` columns,
    or the checkpoint's static per-tensor `input scale`. `scale_name` / `input_scale_name` are the
    checkpoint's tensor names (transformers' fp8 calls the weight scale `weight_scale_inv`,
    though it multiplies all the same)."""

    weights: str  # "tensor", "channel" or "block"
    block: tuple[int, int] | None = None  # (rows, cols) of a weight scale's block
    activations: str = "token"  # "token", "group" (dynamic) or "static"
    act_group: int | None = None  # columns per activation scale ("group")
    scale_name: str = "weight_scale"
    input_scale_name: str = "input_scale"

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, ...]:
        """The shape of the checkpoint's weight scale for an [out_features, in_features] weight."""
        if self.weights == "tensor":
            return (1,)
        if self.weights == "channel":
            return (out_features, 1)
        rows, cols = self.block
        return (-(-out_features // rows), -(-in_features // cols))

    def describe(self) -> str:
        """E.g. "fp8_e4m3 per-channel W8A8-dynamic per token"."""
        weights = f"block {self.block[0]}x{self.block[1]}" if self.block else f"per-{self.weights}"
        acts = {
            "token": "W8A8-dynamic per token",
            "group": f"W8A8-dynamic per token and {self.act_group}-group",
            "static": "W8A8-static",
        }[self.activations]
        return f"fp8_e4m3 {weights} {acts}"


# The FP8-dynamic scheme that quantize-on-load (`quantization="fp8"`) gives a bf16 / fp16 model.
ON_LOAD_SCHEME = FP8Scheme(weights="channel")


@dataclass(frozen=True)
class Quantization:
    """Which Linear layers (by module name, `model.layers.0.self_attn.q_proj`, `lm_head`) hold
    FP8 weights, and their scheme: config.json's quantization_config, or quantize-on-load."""

    method: str  # "compressed-tensors", "fp8" (transformers) or "on-load"
    groups: tuple[tuple[tuple[str, ...], FP8Scheme], ...]  # (targets, scheme), the first match wins
    ignore: tuple[str, ...] = ()

    def scheme_for(self, module: str) -> FP8Scheme | None:
        """The scheme of the Linear layer named `module`, or None where it stays unquantized."""
        if self.method == "on-load":  # every Linear of the decoder layers; lm_head stays
            return self.groups[0][1] if module.startswith("model.layers.") else None
        if self.method == "fp8":  # transformers: skip-list patterns, then every other Linear
            skip = self.ignore
            return None if any(_skips(pattern, module) for pattern in skip) else self.groups[0][1]
        if any(_matches(target, module) for target in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(target == "Linear" or _matches(target, module) for target in targets):
                return scheme
        return None


def _matches(target: str, module: str) -> bool:
    """compressed-tensors' module matching: `re:` a regular expression from the name's start,
    else the exact name."""
    return re.match(target[3:], module) is not None if target.startswith("re:") else target == module


def _skips(pattern: str, module: str) -> bool:
    """transformers' modules_to_not_convert matching: a regular expression from the name's start
    up to a module boundary, or a suffix of the name."""
    return bool(re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", module)) or module.endswith(pattern)


def parse_quantization(qc: Any) -> Quantization | None:
    """config.json's quantization_config -> the FP8 weights it declares (None: none, e.g. a
    config that only declares an FP8 kv_cache_scheme). Anything else is one ConfigError naming what
    was found and what is supported."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigError(f"quantization_config must be a JSON object, not {type(qc).__name__}")
    method = qc.get("quant_method")
    if method is None and set(qc) <= {"kv_cache_scheme"}:  # an FP8 KV cache's scales only
        return None
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":
        return _transformers_fp8(qc)
    found = f"quant_method {method!r}" if method is not None else "a quantization_config with no quant_method"
    raise _unsupported(found)


def _unsupported(what: str) -> ConfigError:
    return ConfigError(
        f"unsupported quantization in config.json: {what}; supported: {SUPPORTED_QUANTIZATION}"
    )


def _compressed_tensors(qc: dict[str, Any]) -> Quantization | None:
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise _unsupported(f"compressed-tensors config_groups {groups!r}")
    parsed = []
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise _unsupported(f"compressed-tensors config group {name!r} = {group!r}")
        fmt = group.get("format") or qc.get("format")
        if fmt != "float-quantized":
            raise _unsupported(f"compressed-tensors format {fmt!r} (group {name!r})")
        targets = group.get("targets")
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise _unsupported(f"compressed-tensors targets {targets!r} (group {name!r})")
        if group.get("output_activations"):
            raise _unsupported(f"compressed-tensors output_activations (group {name!r})")
        weights = _ct_weights(group.get("weights"), name)
        parsed.append((tuple(targets), _ct_activations(group.get("input_activations"), weights, name)))
    if not parsed:
        return None
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(t, str) for t in ignore):
        raise _unsupported(f"compressed-tensors ignore {ignore!r}")
    return Quantization("compressed-tensors", tuple(parsed), tuple(ignore))


def _float8_args(args: Any, what: str, group: str) -> dict[str, Any]:
    """A compressed-tensors QuantizationArgs that is 8-bit float (e4m3), symmetric."""
    if not isinstance(args, dict):
        raise _unsupported(f"compressed-tensors {what} {args!r} (group {group!r})")
    kind, bits = args.get("type", "int"), args.get("num_bits")
    if kind != "float" or bits != 8:
        raise _unsupported(f"compressed-tensors {bits}-bit {kind} {what} (group {group!r})")
    if args.get("symmetric") is False:
        raise _unsupported(f"compressed-tensors asymmetric {what} (group {group!r})")
    return args


def _ct_weights(args: Any, group: str) -> FP8Scheme:
    if args is None:
        raise _unsupported(f"compressed-tensors group {group!r} without weights")
    args = _float8_args(args, "weights", group)
    strategy = args.get("strategy")
    if args.get("dynamic"):
        raise _unsupported(f"compressed-tensors dynamic weights (group {group!r})")
    if strategy in ("tensor", "channel"):
        return FP8Scheme(weights=strategy)
    if strategy == "block":
        return FP8Scheme(weights="block", block=_block(args.get("block_structure"), group))
    raise _unsupported(f"compressed-tensors weight strategy {strategy!r} (group {group!r})")


def _block(value: Any, group: str) -> tuple[int, int]:
    """block_structure [rows, cols] (or "RxC"): cols a multiple of 32, as the GEMV's K chunks
    must divide it."""
    if isinstance(value, str) and re.fullmatch(r"\d+x\d+", value):
        value = [int(v) for v in value.split("x")]
    pair = isinstance(value, list | tuple) and len(value) == 2
    if not pair or not all(isinstance(v, int) and v > 0 for v in value) or value[1] % 32:
        raise _unsupported(f"weight block {value!r} (group {group!r}; columns must be a multiple of 32)")
    return int(value[0]), int(value[1])


def _ct_activations(args: Any, weights: FP8Scheme, group: str) -> FP8Scheme:
    if args is None:
        raise _unsupported(f"compressed-tensors weight-only FP8 (no input_activations, group {group!r})")
    args = _float8_args(args, "input_activations", group)
    strategy, dynamic = args.get("strategy"), args.get("dynamic")
    if dynamic is True and strategy == "token":
        return _with(weights, activations="token")
    if dynamic is True and strategy == "group":
        return _with(weights, activations="group", act_group=_act_group(args.get("group_size"), group))
    if dynamic is False and strategy == "tensor":
        return _with(weights, activations="static")
    found = f"strategy {strategy!r} with dynamic={dynamic!r}"
    raise _unsupported(f"compressed-tensors input_activations {found} (group {group!r})")


def _act_group(size: Any, group: str) -> int:
    """Columns per activation scale: a power of two from 32 (the GEMV's K chunks divide it)."""
    if not isinstance(size, int) or size < 32 or size & (size - 1):
        raise _unsupported(f"activation group size {size!r} (group {group!r}; a power of two from 32)")
    return size


def _with(scheme: FP8Scheme, **changes: Any) -> FP8Scheme:
    return FP8Scheme(**{**scheme.__dict__, **changes})


def _transformers_fp8(qc: dict[str, Any]) -> Quantization:
    """transformers' FineGrainedFP8Config: weight_block_size (default [128, 128]; null: one scale
    per tensor), weight_scale_inv tensors, activation_scheme dynamic (per token and group of the
    block's columns; per token without blocks) or static (activation_scale tensors)."""
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _unsupported(f"fp8 fmt {qc.get('fmt')!r}")
    if qc.get("scale_fmt", "float") != "float":
        raise _unsupported(f"fp8 scale_fmt {qc.get('scale_fmt')!r}")
    if qc.get("modules_to_convert"):
        raise _unsupported(f"fp8 modules_to_convert {qc.get('modules_to_convert')!r}")
    block = qc.get("weight_block_size", [128, 128])
    weights = FP8Scheme("tensor") if block is None else FP8Scheme("block", block=_block(block, "fp8"))
    activation = str(qc.get("activation_scheme", "dynamic")).lower()
    names = dict(scale_name="weight_scale_inv", input_scale_name="activation_scale")
    if activation == "static":
        scheme = _with(weights, activations="static", **names)
    elif activation != "dynamic":
        raise _unsupported(f"fp8 activation_scheme {activation!r}")
    elif block is None:
        scheme = _with(weights, activations="token", **names)
    else:
        scheme = _with(weights, activations="group", act_group=_act_group(block[1], "fp8"), **names)
    skip = qc.get("modules_to_not_convert", qc.get("ignored_layers"))
    if skip is None:
        skip = ["lm_head"]  # transformers' default: the output embedding stays
    if not isinstance(skip, list) or not all(isinstance(t, str) for t in skip):
        raise _unsupported(f"fp8 modules_to_not_convert {skip!r}")
    return Quantization("fp8", ((("Linear",), scheme),), tuple(skip))

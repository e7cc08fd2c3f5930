"""Model configuration: Hugging Face config.json -> one dataclass for every supported family."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import UserError

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
            raise UserError(f"config.json must hold a JSON object, not a {type(cfg).__name__}")
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(
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
            )
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"config.json is missing or has a bad value for {e}") from None
        if config.num_heads % config.num_kv_heads:
            raise UserError(
                f"num_attention_heads ({config.num_heads}) is not a multiple of "
                f"num_key_value_heads ({config.num_kv_heads})"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise UserError(f"unsupported hidden_act {cfg.get('hidden_act')!r}; only 'silu' is supported")
        return config

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        try:
            return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))
        except FileNotFoundError:
            raise UserError(f"no config.json in {Path(path).parent}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{path} is not valid JSON: {e}") from None


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
        raise UserError(f"unsupported RoPE type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
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
        raise UserError("partial_rotary_factor != 1 is not supported")
    required = {
        "linear": ["factor"],
        "dynamic": ["factor"],
        "llama3": ["factor", "low_freq_factor", "high_freq_factor"],
        "longrope": ["short_factor", "long_factor"],
    }.get(rope_type, [])
    missing = [k for k in required if getattr(rope, k) is None]
    if missing:
        raise UserError(f"RoPE type {rope_type!r} needs {', '.join(missing)} in config.json")
    return rope


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)

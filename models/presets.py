"""Shapes of well-known checkpoints, for synthetic (random-weight) models: benchmarks and smoke
runs at real sizes with nothing to download. `synthetic:llama-3-8b` names one."""

from __future__ import annotations

from .config import ModelConfig, RopeConfig

PRESETS: dict[str, dict] = {
    # name: (published config.json values)
    "llama-3-8b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        rope=RopeConfig(theta=500000.0),
    ),
    "llama-3.1-8b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope=RopeConfig(
            rope_type="llama3",
            theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
    "llama-3.2-1b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        rope=RopeConfig(
            rope_type="llama3",
            theta=500000.0,
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
    "llama-3-70b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        rope=RopeConfig(theta=500000.0),
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        qkv_bias=True,
        rope=RopeConfig(theta=1000000.0),
    ),
}


def preset_config(name: str) -> ModelConfig:
    """The ModelConfig of a preset; KeyError for an unknown name."""
    cfg = ModelConfig(**PRESETS[name])
    cfg.eos_token_ids = []  # random weights: generation runs to max_new_tokens
    return cfg

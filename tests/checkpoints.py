"""Tiny random checkpoints and a trained tokenizer, built at test time (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Long context decoding streams the whole key-value cache once per generated token.",
    "Ünïcödé text, emoji 🙂 and CJK 漢字 must survive streaming detokenization.",
    "for i in range(10):\n    print(i * i)\n",
]

# A chat template in the Llama-3 style: it writes BOS itself.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)


def train_tokenizer(out_dir: Path, vocab_size: int = 384) -> Tokenizer:
    """Byte-level BPE with a Llama-3-style BOS post-processor, saved as HF tokenizer files."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, "<|start|>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": BOS, "eos_token": EOS, "chat_template": CHAT_TEMPLATE, "model_max_length": 4096}
        )
    )
    return tok


# Config overrides per family / RoPE type, on top of a tiny Llama-shaped base.
FAMILIES: dict[str, dict] = {
    "llama": {"model_type": "llama"},
    "llama-head-dim": {"model_type": "llama", "head_dim": 24},  # head_dim != hidden / heads
    "llama-tied": {"model_type": "llama", "tie_word_embeddings": True},
    "llama-bias": {"model_type": "llama", "attention_bias": True, "mlp_bias": True},
    "mistral": {"model_type": "mistral", "sliding_window": None},
    "qwen2": {"model_type": "qwen2"},
    "qwen3": {"model_type": "qwen3", "head_dim": 16},
}

# head_dim 64 (the lean decode kernel takes head_dim 64 or 128): for the GPU tests, kept out of
# FAMILIES so that the CPU parity matrix does not grow.
GPU_FAMILIES = {
    "gpu-llama-hd64": {"model_type": "llama", "head_dim": 64},
    "gpu-qwen2-hd64": {"model_type": "qwen2", "head_dim": 64},
    "gpu-qwen3-hd64": {"model_type": "qwen3", "head_dim": 64},
}

# More query heads per KV head than ranks split evenly (tensor-parallel tests): 8 q / 2 KV heads.
PARALLEL_FAMILIES = {"llama-8q-2kv": {"model_type": "llama", "num_attention_heads": 8, "head_dim": 16}}

ROPES: dict[str, dict] = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
    "longrope": {
        "rope_type": "longrope",
        "original_max_position_embeddings": 256,
        "short_factor": [1.0 + 0.05 * i for i in range(8)],
        "long_factor": [1.0 + 0.5 * i for i in range(8)],
    },
}


def make_checkpoint(
    out_dir: Path,
    family: str = "llama",
    rope: str = "default",
    *,
    legacy_rope_keys: bool = False,
    max_positions: int = 2048,
    shard_bytes: int | None = None,
    vocab_size: int = 384,
    seed: int = 0,
) -> Path:
    """Save a tiny random model with transformers' own save_pretrained, plus a tokenizer."""
    import transformers

    overrides = dict((FAMILIES | GPU_FAMILIES | PARALLEL_FAMILIES)[family])
    model_type = overrides.pop("model_type")
    config_cls = transformers.AutoConfig.for_model(model_type).__class__
    rope_parameters = dict(ROPES[rope], rope_theta=10000.0)
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        initializer_range=0.08,
    )
    kwargs.update(overrides)
    if rope == "longrope":
        kwargs["head_dim"] = 16  # long/short factors have head_dim / 2 entries
    if legacy_rope_keys:
        kwargs["rope_theta"] = rope_parameters.pop("rope_theta")
        kwargs["rope_scaling"] = rope_parameters if rope != "default" else None
    else:
        kwargs["rope_parameters"] = rope_parameters
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    save_kwargs = {"max_shard_size": shard_bytes} if shard_bytes else {}
    model.save_pretrained(out_dir, **save_kwargs)
    if (
        legacy_rope_keys
    ):  # save_pretrained writes the new key; put the legacy ones back as old checkpoints have them
        cfg = json.loads((out_dir / "config.json").read_text())
        params = cfg.pop("rope_parameters", None) or {}
        cfg["rope_theta"] = params.pop("rope_theta", 10000.0)
        if rope != "default":
            cfg["rope_scaling"] = params
        (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    train_tokenizer(out_dir, vocab_size)
    return out_dir


def hf_model(model_dir: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()

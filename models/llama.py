"""One decoder for Llama, Mistral, Qwen2 and Qwen3, switched by config flags.

Module names mirror Hugging Face's (`model.layers.0.self_attn.q_proj`, ...) so checkpoint
tensors load by name with no renaming. Two entry points:
- `prefill`: T new tokens per sequence, attention through PyTorch SDPA (flash on GPU);
- `decode`: one new token per sequence, attention through the lean decode kernel.
Both write K/V into the runtime's contiguous cache; without a cache, `prefill` is plain causal
self-attention (scoring and training).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from minidecode.kernels.decode import decode_attention
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from minidecode.cache import KVCache
from minidecode.config import ModelConfig

from .rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, scale in the input dtype: what transformers does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, hidden] -> rotated q [B, T, Hq, D], k [B, T, Hkv, D], and v [B, T, Hkv, D]."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def prefill(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        start: int,
        kv: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """x [B, T, hidden] at positions start..start+T-1 -> [B, T, hidden]."""
        B, T, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        q = q.transpose(1, 2)  # [B, Hq, T, D]
        if kv is None:
            assert start == 0, "without a cache, attention sees only this call's tokens"
            keys, values = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, T, D]
        else:
            k_cache, v_cache = kv  # [B, Hkv, S, D]
            k_cache[:, :, start : start + T] = k.transpose(1, 2)
            v_cache[:, :, start : start + T] = v.transpose(1, 2)
            keys, values = k_cache[:, :, : start + T], v_cache[:, :, : start + T]
        # Causal with the query block aligned to the end of the keys (lower right): a chunk at
        # `start` sees every earlier position. Never an L x L mask: flash handles both natively.
        mask = None if start == 0 else causal_lower_right(T, start + T)
        out = F.scaled_dot_product_attention(
            q,
            keys,
            values,
            attn_mask=mask,
            is_causal=start == 0,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    def decode(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """x [B, 1, hidden]; positions [B] int64 (where the new token goes) -> [B, 1, hidden]."""
        B = x.shape[0]
        q, k, v = self.project(x, cos, sin)
        k_cache, v_cache = kv  # [B, Hkv, S, D]
        batch = torch.arange(B, device=x.device)
        # index_put with device-side positions: no host sync, safe inside a CUDA graph.
        k_cache[batch, :, positions] = k[:, 0]
        v_cache[batch, :, positions] = v[:, 0]
        lengths = (positions + 1).to(torch.int32)
        out = decode_attention(q[:, 0], k_cache, v_cache, lengths, self.scale)  # [B, Hq, D]
        return self.o_proj(out.reshape(B, 1, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    """The causal LM: `model.*` backbone plus `lm_head` (absent when tied to the embedding)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope: RotaryEmbedding | None = None  # built on the weights' device by setup_rope

    def setup_rope(self, device: torch.device | str) -> None:
        self.rope = RotaryEmbedding(self.config, device)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] (already normed) -> float32 logits [..., V]."""
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def prefill(
        self, tokens: torch.Tensor, start: int = 0, cache: KVCache | None = None, rope_len: int | None = None
    ) -> torch.Tensor:
        """tokens [B, T] at positions start..start+T-1 -> final-normed hidden states [B, T, hidden].

        rope_len: the sequence length dynamic/long RoPE scale for (transformers: the longest
        position of the forward pass + 1); a chunked prefill passes the whole prompt's length.
        """
        B, T = tokens.shape
        positions = torch.arange(start, start + T, device=tokens.device).expand(B, T)
        seq_len = torch.tensor(rope_len or start + T, device=tokens.device)
        cos, sin = self.rope.cos_sin(positions, seq_len)  # [B, T, D]
        x = self.model.embed_tokens(tokens)
        for i, layer in enumerate(self.model.layers):
            kv = cache.layer(i) if cache is not None else None
            x = x + layer.self_attn.prefill(layer.input_layernorm(x), cos, sin, start, kv)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """tokens [B], positions [B] int64 on the device -> final-normed hidden [B, hidden].

        Pure device work with fixed shapes: the engine captures it in a CUDA graph."""
        cos, sin = self.rope.cos_sin(positions[:, None], positions.max() + 1)  # [B, 1, D]
        x = self.model.embed_tokens(tokens[:, None])  # [B, 1, hidden]
        for i, layer in enumerate(self.model.layers):
            x = x + layer.self_attn.decode(layer.input_layernorm(x), cos, sin, positions, cache.layer(i))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x[:, 0])

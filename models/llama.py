"""One decoder for Llama, Mistral, Qwen2 and Qwen3, switched by config flags.

Module names mirror Hugging Face's (`model.layers.0.self_attn.q_proj`, ...) so checkpoint
tensors load by name with no renaming. Two entry points, both writing K/V into the runtime's
contiguous cache:
- `prefill`: the whole prompt, layer by layer, attention through PyTorch SDPA;
- `decode`: one new token per sequence, attention through the lean decode kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from minidecode.cache import KVCache
from minidecode.config import ModelConfig
from minidecode.kernels.decode import decode_attention
from minidecode.kernels.prefill import causal_attention

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
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        chunk: int = 8192,
        rope_len: int | None = None,
        backend: str | None = None,
        last_only: bool = True,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """tokens [B, T] at positions 0..T-1 -> final-normed hidden [B, hidden] (last position) or
        [B, T, hidden]; fills cache positions 0..T-1.

        Layer-major: each layer runs over the whole prompt before the next starts. Projections
        and the MLP go `chunk` rows at a time (bounded temporaries); attention is one square
        causal SDPA call per KV head over the whole prompt, which is cuDNN's fastest case on
        Hopper, and its output overwrites that head group's queries. Beyond the weights and
        cache this holds two [B, T, hidden]-sized tensors: the residual stream and q/attn-out.
        rope_len: the sequence length dynamic/long RoPE scales for (transformers: longest
        position + 1), i.e. T unless the caller knows better.
        """
        cfg = self.config
        B, T = tokens.shape
        G, D = cfg.group_size, cfg.head_dim
        seq_len = torch.tensor(rope_len or T, device=tokens.device)
        x = self.model.embed_tokens(tokens)  # [B, T, hidden]: the residual stream
        q_all = torch.empty(B, cfg.num_heads, T, D, dtype=x.dtype, device=x.device)  # heads-major
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            k_cache, v_cache = cache.layer(i)  # [B, Hkv, S, D]
            for s in range(0, T, chunk):
                e = min(s + chunk, T)
                positions = torch.arange(s, e, device=x.device).expand(B, e - s)
                cos, sin = self.rope.cos_sin(positions, seq_len)  # [B, c, D]
                q, k, v = attn.project(layer.input_layernorm(x[:, s:e]), cos, sin)  # [B, c, H, D]
                q_all[:, :, s:e] = q.transpose(1, 2)
                k_cache[:, :, s:e] = k.transpose(1, 2)
                v_cache[:, :, s:e] = v.transpose(1, 2)
            for h in range(cfg.num_kv_heads):
                group = q_all[:, h * G : (h + 1) * G]  # [B, G, T, D]
                keys, values = k_cache[:, h : h + 1, :T], v_cache[:, h : h + 1, :T]  # [B, 1, T, D]
                group.copy_(causal_attention(group, keys, values, attn.scale, backend))
            for s in range(0, T, chunk):
                e = min(s + chunk, T)
                out = q_all[:, :, s:e].transpose(1, 2).reshape(B, e - s, -1)  # [B, c, Hq * D]
                x[:, s:e] += attn.o_proj(out)
                x[:, s:e] += layer.mlp(layer.post_attention_layernorm(x[:, s:e]))
            if on_layer is not None:
                on_layer(i)
        return self.model.norm(x[:, -1] if last_only else x)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """tokens [B], positions [B] int64 on the device -> final-normed hidden [B, hidden].

        Pure device work with fixed shapes: the engine captures it in a CUDA graph."""
        cos, sin = self.rope.cos_sin(positions[:, None], positions.max() + 1)  # [B, 1, D]
        x = self.model.embed_tokens(tokens[:, None])  # [B, 1, hidden]
        for i, layer in enumerate(self.model.layers):
            x = x + layer.self_attn.decode(layer.input_layernorm(x), cos, sin, positions, cache.layer(i))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x[:, 0])

"""Rotary position embeddings with every scaling transformers supports for Llama-family models.

Inverse frequencies follow transformers' formulas (and its float32 arithmetic) exactly; the
rotation angles position * inv_freq are then formed in float64 before cos/sin: in float32 an
angle near position 1M is off by ~0.06 rad, enough to scramble the highest frequencies.

Dynamic NTK and LongRoPE depend on the sequence length of the forward pass (transformers uses
max(position) + 1). It is passed as a device tensor so a captured decode step stays valid as
the context grows.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


class RotaryEmbedding:
    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu"):
        rope = config.rope
        self.rope = rope
        self.dim = config.head_dim
        self.max_positions = config.max_position_embeddings
        self.device = torch.device(device)
        exponents = torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim  # [D/2]
        self.base_inv_freq = 1.0 / (rope.theta**exponents)  # [D/2] float32, as transformers
        self.attention_scaling = 1.0
        self.long_inv_freq: torch.Tensor | None = None
        inv_freq = self.base_inv_freq
        if rope.rope_type == "linear":
            inv_freq = inv_freq / rope.factor
        elif rope.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(
                inv_freq,
                rope.factor,
                rope.low_freq_factor,
                rope.high_freq_factor,
                rope.original_max_position_embeddings,
            )
        elif rope.rope_type == "yarn":
            inv_freq, self.attention_scaling = _yarn_inv_freq(config)
        elif rope.rope_type == "longrope":
            factor = rope.factor or config.max_position_embeddings / rope.original_max_position_embeddings
            self.attention_scaling = rope.attention_factor or (
                1.0
                if factor <= 1.0
                else math.sqrt(1 + math.log(factor) / math.log(rope.original_max_position_embeddings))
            )
            short = torch.tensor(rope.short_factor, dtype=torch.float32)
            long = torch.tensor(rope.long_factor, dtype=torch.float32)
            inv_freq = 1.0 / (short * rope.theta**exponents)
            self.long_inv_freq = (1.0 / (long * rope.theta**exponents)).to(self.device)
        self.inv_freq = inv_freq.to(self.device)  # [D/2] float32
        self._exponents = exponents.to(self.device)

    @property
    def length_free_up_to(self) -> int | None:
        """The longest forward pass (seq_len) below which the angles do not depend on seq_len;
        None: they never do. Dynamic NTK rescales past max_position_embeddings, LongRoPE switches
        to its long factors past original_max_position_embeddings: a cached position computed
        under one length is only valid for another if both are within this bound."""
        if self.rope.rope_type == "dynamic":
            return self.max_positions
        if self.rope.rope_type == "longrope":
            return self.rope.original_max_position_embeddings
        return None

    def inv_freq_for(self, seq_len: torch.Tensor) -> torch.Tensor:
        """Inverse frequencies [D/2] (float32) for a forward pass whose longest sequence is seq_len
        (a 0-d int64 device tensor; or [B, 1], one length per sequence -> [B, D/2]): only dynamic
        NTK and LongRoPE depend on it."""
        rope = self.rope
        if rope.rope_type == "dynamic":
            # transformers: base * ((factor * L / max_pos) - (factor - 1)) ** (dim / (dim - 2)),
            # with L = max(seq_len, max_pos), so below max_pos this is the plain base frequency.
            length = torch.clamp(seq_len, min=self.max_positions).float()
            base = rope.theta * ((rope.factor * length / self.max_positions) - (rope.factor - 1)) ** (
                self.dim / (self.dim - 2)
            )
            return 1.0 / (base**self._exponents)
        if rope.rope_type == "longrope":
            return torch.where(
                seq_len > rope.original_max_position_embeddings, self.long_inv_freq, self.inv_freq
            )
        return self.inv_freq

    def cos_sin(self, positions: torch.Tensor, seq_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [..., T] int64 -> cos, sin [..., T, D] float32 (already times attention_scaling)."""
        inv_freq = self.inv_freq_for(seq_len).double()  # [D/2], or [B, D/2] per sequence
        angles = positions.double().unsqueeze(-1) * inv_freq  # [..., T, D/2] in float64
        angles = torch.cat((angles, angles), dim=-1)  # [..., T, D]: rotate-half layout
        cos = (angles.cos() * self.attention_scaling).float()
        sin = (angles.sin() * self.attention_scaling).float()
        return cos, sin


def _llama3_inv_freq(
    inv_freq: torch.Tensor,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    old_context_len: int,
) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth blend between."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; scale attention."""
    rope, dim = config.rope, config.head_dim
    original = rope.original_max_position_embeddings
    factor = rope.factor or config.max_position_embeddings / original

    def mscale_of(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(mscale_of(factor, rope.mscale) / mscale_of(factor, rope.mscale_all_dim))
        else:
            attention_factor = mscale_of(factor)
    beta_fast, beta_slow = rope.beta_fast or 32, rope.beta_slow or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: extrapolate (high frequency), 0: interpolate
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor

"""One decoder for Llama, Mistral, Qwen2 and Qwen3, switched by config flags.

Module names mirror Hugging Face's (`model.layers.0.self_attn.q_proj`, ...) so checkpoint
tensors load by name with no renaming. Three entry points, each writing K/V into the runtime's
contiguous cache:
- `prefill`: the whole prompt, layer by layer, attention through PyTorch SDPA (a rank's rows of
  it and how its attention runs are the model's `context`: every position here, a
  context-parallel rank's share in models/parallel.py);
- `decode`: one new token per sequence, attention through the lean decode kernel;
- `mixed`: a chunk of a prompt and decode rows in one forward (their projections and MLP in one
  matmul per weight), each part attending as the two above do.

FP8 weights (a checkpoint's, or quantized on load: minidecode/loading.py) live in FP8Linear layers
whose tensors carry the checkpoint's names; their projections run through the same ops, which take
an FP8Weight (kernels/fp8_weights.py) wherever they take a weight.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from minidecode.kernels import ops
from minidecode.kernels.fp8_weights import FP8_DTYPE, FP8Weight, QuantizedRows, fuse_fp8
from minidecode.kernels.prefill import causal_attention
from minidecode.kernels.quant import dequantize_fp8, quantize_fp8, read_v_rows, write_v_rows

from .cache import KVCache, LayerKV
from .config import FP8Scheme, ModelConfig
from .rope import RotaryEmbedding
from .temporaries import prefill_attention_kv_heads, rope_bytes


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, pdl: bool = False, feeds: torch.Tensor | FP8Weight | None = None):
        """x [..., dim] normalised; `feeds`: the weight the result goes into (an FP8 weight makes the
        result its e4m3 input rows, normalised and rounded in one launch)."""
        return ops.rms_norm(x, self.weight, self.eps, pdl=pdl, quantize_for=feeds)


class NormAfter(NamedTuple):
    """The norm that reads the residual stream next, after a projection added into it, and the
    weight its result feeds: Projection.add_to returns it (a tensor-parallel projection computes
    it in the kernel of its all-reduce)."""

    norm: RMSNorm
    feeds: torch.Tensor | FP8Weight | None

    def __call__(self, residual: torch.Tensor, pdl: bool) -> torch.Tensor | QuantizedRows:
        return self.norm(residual, pdl, self.feeds)


class Projection(nn.Linear):
    """A linear layer whose decode form adds its output to the residual stream in place; the
    tensor-parallel row split (models/parallel.py) overrides both forms with an all-reduce."""

    def add_to(
        self, residual: torch.Tensor, x: torch.Tensor, pdl: bool, then: NormAfter
    ) -> torch.Tensor | QuantizedRows:
        """residual [B, out] += self(x [B, in]), in place -> then(residual)."""
        ops.linear_residual(x, self.weight, self.bias, residual, pdl=pdl)
        return then(residual, pdl)


class FP8Linear(nn.Module):
    """A Linear layer with FP8 (e4m3) weights, its tensors named as in the checkpoint: `weight`
    [out, in] float8_e4m3fn, the float32 scale in the scheme's shape (`weight_scale`, or
    transformers' `weight_scale_inv`), a static scheme's input scale [1], and `bias` in the model
    dtype. After loading, `pack` makes `fp8`, the FP8Weight the ops take. Its decode form adds
    into the residual stream in place, as Projection's does."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: FP8Scheme):
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.weight = _frozen(torch.empty(out_features, in_features, dtype=FP8_DTYPE))
        scale = torch.empty(scheme.scale_shape(out_features, in_features), dtype=torch.float32)
        self.register_parameter(scheme.scale_name, _frozen(scale))
        if scheme.activations == "static":
            self.register_parameter(scheme.input_scale_name, _frozen(torch.empty(1)))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.fp8: FP8Weight | None = None  # set by pack()

    def pack(self) -> None:
        """After loading: the FP8Weight of this layer. A per-tensor scale becomes one per channel
        (each row its tensor's), so that fused q/k/v or gate/up with different scales stay one
        matrix; the parameter holds that form (the bytes a decode step reads)."""
        scale = getattr(self, self.scheme.scale_name).data
        N, K = self.out_features, self.in_features
        if self.scheme.weights == "tensor":
            scale = scale.reshape(1, 1).expand(N, 1).contiguous()
            setattr(self, self.scheme.scale_name, _frozen(scale))
        input_scale = None
        if self.scheme.activations == "static":
            input_scale = getattr(self, self.scheme.input_scale_name).data.float().reshape(1)
        block_n, block_k = self.scheme.block or (1, K)
        self.fp8 = FP8Weight(self.weight.data, scale, block_n, block_k, self.scheme.act_group, input_scale)

    def packed_bytes(self, dtype: torch.dtype) -> int:
        """This layer's bytes once packed, known on the meta device: 1 a weight, the float32 scales
        (a per-tensor one held per channel), a static input scale, the bias in `dtype`."""
        N, K = self.out_features, self.in_features
        scales = N if self.scheme.weights == "tensor" else math.prod(self.scheme.scale_shape(N, K))
        scales += self.scheme.activations == "static"
        return N * K + 4 * scales + (0 if self.bias is None else N * dtype.itemsize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] (W8A8: x rounded to e4m3 first)."""
        return ops.linear(x, self.fp8, self.bias)

    def add_to(
        self, residual: torch.Tensor, x: torch.Tensor, pdl: bool, then: NormAfter
    ) -> torch.Tensor | QuantizedRows:
        """residual [B, out] += self(x [B, in]), in place -> then(residual)."""
        ops.linear_residual(x, self.fp8, self.bias, residual, pdl=pdl)
        return then(residual, pdl)


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class Attention(nn.Module):
    # The decode step's attention op; a context-parallel rank sets its own on the instance (the
    # ranks' partials merged by log-sum-exp: models/parallel.py).
    attend = staticmethod(ops.decode_attention)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = Projection(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm, self.norm_eps = cfg.qk_norm, cfg.rms_norm_eps
        # (k, v) FP8 cache scales a checkpoint calibrated (set by the loader), else None: each
        # row then gets its own scale when written (kernels/quant.py).
        self.kv_static_scales: tuple[float, float] | None = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def fuse(self) -> None:
        """One [(Hq + 2 Hkv) * D, hidden] weight for q, k and v, so each step runs one GEMV; the
        q/k/v parameters become views into it (checkpoint names and state_dict unchanged)."""
        linears = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight, self.qkv_bias = _fuse(linears, "weight"), _fuse(linears, "bias")

    def project_into(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_out: torch.Tensor,
        k_out: torch.Tensor,
        v_out: torch.Tensor,
    ) -> None:
        """Prefill: x [B, T, hidden] (normed), cos/sin [B, T, D] -> rotated q into q_out [B, Hq, T, D],
        rotated k into k_out and v into v_out [B, Hkv, T, D] (heads-major views: prefill's query
        buffer and the cache)."""
        qkv = ops.linear(x, self.qkv_weight, self.qkv_bias)  # [B, T, (Hq + 2 Hkv) * D]
        norms = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
        ops.rope_into(qkv, cos, sin, q_out, k_out, v_out, *norms, self.norm_eps)

    def decode(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        written: torch.Tensor,
        lengths: torch.Tensor,
        kv: LayerKV,
        pdl: bool,
        then: NormAfter,
        starts: torch.Tensor | None = None,
        q_lens: torch.Tensor | None = None,
        row_limits: torch.Tensor | None = None,
    ) -> torch.Tensor | QuantizedRows:
        """x [B, hidden] is the residual stream and h = input_layernorm(x): x += o_proj(attention(h))
        in place -> then(x). cos/sin [B, D]; written [B] int64: the cache positions the new K/V go to
        (region start + position in a batch); lengths [B] int32 = positions + 1 (0: an idle batch
        slot); starts [B] int64: where each sequence's region begins in a cache of one shared row
        (kv [1, Hkv, S, D]); pdl chains the kernels (ops.py).

        q_lens [S] int32 (verifying drafts): the B rows are S sequences' Q = B / S query positions
        each, sequence-major; sequence s has q_lens[s] of them and lengths, starts are [S]
        (decode_attention's multi-query contract); row_limits [S, Q] int32: each query row's causal
        limit, where lengths alone do not give it (a context-parallel rank's share)."""
        B = x.shape[0]
        k_cache, v_cache, kv_scale = kv  # [B, Hkv, S, D]; FP8: V blocked, scales [B, Hkv, S, 2]
        qkv = ops.linear(h, self.qkv_weight, self.qkv_bias, pdl=pdl)  # [B, (Hq + 2 Hkv) * D]
        norms = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
        q = ops.rope_and_cache(
            qkv, cos, sin, written, k_cache, v_cache, self.num_heads, *norms, self.norm_eps, pdl=pdl,
            kv_scale=kv_scale, static_scales=self.kv_static_scales,
        )  # fmt: skip
        if q_lens is None:
            out = self.attend(
                q, k_cache, v_cache, lengths, self.scale, pdl=pdl, kv_scale=kv_scale, starts=starts
            )  # [B, Hq, D]
        else:
            queries = q.view(q_lens.shape[0], -1, *q.shape[1:])  # [S, Q, Hq, D]
            out = self.attend(
                queries, k_cache, v_cache, lengths, self.scale, pdl=pdl, kv_scale=kv_scale, starts=starts,
                q_lens=q_lens, row_limits=row_limits,
            )  # fmt: skip
        return self.o_proj.add_to(x, out.view(B, -1), pdl, then)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Projection(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def fuse(self) -> None:
        """One [2 * intermediate, hidden] weight for gate and up (one GEMV per step)."""
        linears = (self.gate_proj, self.up_proj)
        self.gate_up_weight, self.gate_up_bias = _fuse(linears, "weight"), _fuse(linears, "bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] -> down(silu(gate(x)) * up(x)) [..., hidden]."""
        return self.down_proj(ops.silu_mul(ops.linear(x, self.gate_up_weight, self.gate_up_bias)))

    def decode(
        self, x: torch.Tensor, h: torch.Tensor, pdl: bool, then: NormAfter
    ) -> torch.Tensor | QuantizedRows:
        """x [B, hidden] is the residual stream and h = post_attention_layernorm(x): x += mlp(h)
        in place -> then(x)."""
        inner = ops.gate_up_silu(h, self.gate_up_weight, self.gate_up_bias, pdl=pdl)  # [B, I]
        return self.down_proj.add_to(x, inner, pdl, then)


def _fuse(linears: tuple[nn.Linear | FP8Linear, ...], name: str) -> torch.Tensor | FP8Weight | None:
    """The linears' `name` ("weight" or "bias") stacked by rows; each parameter becomes a view of
    its rows of the fused tensor. None where the linears have no bias. FP8 weights: _fuse_fp8."""
    if getattr(linears[0], name) is None:
        return None
    if name == "weight" and isinstance(linears[0], FP8Linear):
        return _fuse_fp8(linears)
    fused = torch.cat([getattr(lin, name).data for lin in linears])
    begin = 0
    for lin in linears:
        rows = getattr(lin, name).shape[0]
        setattr(lin, name, nn.Parameter(fused[begin : begin + rows], requires_grad=False))
        begin += rows
    return fused


def _fuse_fp8(linears: tuple[FP8Linear, ...]) -> FP8Weight:
    """The FP8 linears' weights as one FP8Weight (kernels/fp8_weights.fuse_fp8); each layer's
    weight and scale parameters become views of their rows of it."""
    fused = fuse_fp8([lin.fp8 for lin in linears])
    begin = 0
    for lin in linears:
        rows = lin.out_features
        lin.weight = _frozen(fused.values[begin : begin + rows])
        first, last = begin // fused.block_n, -(-(begin + rows) // fused.block_n)  # the fused scale's rows
        setattr(lin, lin.scheme.scale_name, _frozen(fused.scale[first:last]))
        lin.fp8 = None  # the fused weight replaces it (and its tensors are freed)
        begin += rows
    return fused


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
        # An explicit (empty) weight skips nn.Embedding's normal_ init: on the meta device that
        # init imports torch._dynamo, about 1 s, for values the checkpoint overwrites anyway.
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass(frozen=True)
class PromptRows:
    """The prompt positions one rank prefills: `runs` of consecutive positions [lo, hi), in the
    order of its rows, row r going to cache position first_slot + r; `start` and `end`, the
    positions every rank prefills (start: after a cached prefix; end: RoPE's length, and the keys
    the last position reads)."""

    runs: tuple[tuple[int, int], ...]
    start: int
    first_slot: int
    end: int
    # The rows every rank's loop goes over (>= count: the longest rank's share), so that every
    # rank yields the same units of work, in which the same collectives run (a plan runs a number
    # of units on every rank); the rows past count are skipped.
    padded: int

    @property
    def count(self) -> int:
        return sum(hi - lo for lo, hi in self.runs)

    def positions(self, device: torch.device) -> torch.Tensor:
        """[count] int64: each row's position."""
        parts = [torch.arange(lo, hi, device=device) for lo, hi in self.runs]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=device)

    def take(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """tokens [B, T] at positions start.. -> the rows' [B, count] (one run: a view)."""
        if not self.runs:  # a context-parallel rank with no position of a short prompt
            return tokens[:, :0]
        parts = [tokens[:, lo - start : hi - start] for lo, hi in self.runs]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


@dataclass
class PromptChunk:
    """A prompt chunk of a mixed step (Transformer.mixed). `ids` [C] int64 on the device: its first
    `count` are positions lo..lo+count-1 of a prompt of `length` positions, whose region begins at
    cache position `start`; the rest pad the chunk to its CUDA graph's size, and their K/V go to
    cache position `spare`. `where` [4] int64 on the device holds (lo, count, start, length), which
    is all the forward reads of them, so one captured graph serves every chunk of its size.

    `host`: the same four as ints where the forward runs eagerly (None in a graph: nothing may
    depend on them), with `region` the sequence's region, `backend` the prefill attention's,
    `copy_rows` the rows an FP8 staging copy takes at a time and `staging` the FP8 cache's
    model-dtype K/V of the prompt (Transformer.chunk_staging), else None. `splits`: how many
    key ranges a graph's chunk attention cuts each block of its rows' keys into
    (kernels/chunk_attention.py chunk_splits)."""

    ids: torch.Tensor
    where: torch.Tensor
    spare: int
    host: tuple[int, int, int, int] | None = None
    region: KVCache | None = None
    backend: str | None = None
    copy_rows: int = 0
    staging: tuple[torch.Tensor, torch.Tensor] | None = None
    splits: int = 1


class WholeContext:
    """The prefill context of a model that holds every position (one process, or tensor-parallel
    ranks): its rows are the prompt's positions in order, at cache positions start..start+T-1,
    and a layer's attention reads them all from the cache. Context parallelism deals the
    positions over ranks instead (models/parallel.py's ContextParallelAttention: the same
    methods)."""

    def __init__(self, cfg: ModelConfig):
        self.config = cfg

    def rows(self, prompt_len: int, start: int) -> PromptRows:
        return PromptRows(((start, start + prompt_len),), start, start, start + prompt_len, prompt_len)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rows: PromptRows,
        scale: float,
        backend: str | None,
        chunk: int,
    ) -> Iterator[float]:
        """A layer's causal attention of the rows' queries q [B, Hq, T, D] over the cache's keys
        k/v [B, Hkv, >= end, D], the output overwriting q; yields each call's FLOPs once queued.

        Square causal SDPA over the whole prompt, which is cuDNN's fastest case on Hopper, for as
        many KV heads a call as its temporaries fit in one chunk's (temporaries.
        prefill_attention_kv_heads: a whole layer in one GQA call up to long prompts, else
        fewer). Calls per KV head would be most of a short prompt's time (each too small to fill
        the GPU; bench/NOTES-prefill.md)."""
        cfg, (B, _, T, D) = self.config, q.shape
        G, Hkv, end = cfg.group_size, cfg.num_kv_heads, rows.end
        heads = prefill_attention_kv_heads(cfg, B, T, end, chunk, q.dtype, backend == "fp8")
        for h in range(0, Hkv, heads):
            kv = slice(h, min(h + heads, Hkv))  # these KV heads and their query heads, in one call
            group = q[:, kv.start * G : kv.stop * G]  # [B, n G, T, D], overwritten
            causal_attention(group, k[:, kv, :end], v[:, kv, :end], scale, backend, out=group)
            yield 4 * B * group.shape[1] * D * T * end

    def output(self, x: torch.Tensor, rows: PromptRows, last_only: bool) -> torch.Tensor:
        """The residual stream of the rows x [B, T, hidden] -> the last position's [B, hidden], or
        every position's [B, T, hidden]."""
        return x[:, -1] if last_only else x


class Transformer(nn.Module):
    """The causal LM: `model.*` backbone plus `lm_head` (absent when tied to the embedding)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope: RotaryEmbedding | None = None  # built on the weights' device by setup_rope
        # Which prompt positions this rank prefills and how its layers' prefill attention runs
        # (context parallelism sets its own: models/parallel.py).
        self.context: WholeContext = WholeContext(cfg)

    def cache_len(self, context: int) -> int:
        """Cache positions this model's ranks each hold for a context (context parallelism splits it)."""
        return context

    @property
    def context_ranks(self) -> int:
        """The ranks a sequence's positions are dealt over (context parallelism; 1: none)."""
        return 1

    def held_positions(self, count: int) -> int:
        """How many of a sequence's positions 0..count-1 this rank holds, at the start of its region
        (context parallelism deals them over the ranks: a prefix's copy or cache file is each
        rank's share of it)."""
        return count

    def setup_rope(self, device: torch.device | str) -> None:
        self.rope = RotaryEmbedding(self.config, device)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] (already normed) -> float32 logits [..., V]."""
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def prefill(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """prefill_units(...) (the same arguments) run to the end -> its final-normed hidden."""
        units = self.prefill_units(*args, **kwargs)
        while True:
            try:
                next(units)
            except StopIteration as done:
                return done.value

    def prefill_units(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        chunk: int,
        backend: str | None = None,
        last_only: bool = True,
        on_progress: Callable[[int, int], None] | None = None,
        start: int = 0,
    ) -> Generator[float, None, torch.Tensor]:
        """tokens [B, T] at positions start..start+T-1 -> (the generator's value) final-normed
        hidden [B, hidden] (last position) or [B, T, hidden]; fills this rank's cache positions of
        them. start > 0 prefills a suffix after a prefix already in the cache: the new rows attend
        causally to themselves and fully to positions 0..start-1.

        Which positions this rank's rows are and how a layer's attention runs over them are the
        model's `context` (PromptRows, WholeContext): one process holds every position, at
        cache positions start..start+T-1; a context-parallel rank (models/parallel.py) its share
        of them, after its share of the prefix (held_positions(start)) at cache positions of its
        own. Everything else runs the same on each row.

        A resumable prefill: it yields each unit of work's FLOPs (about) once the unit is queued (a
        chunk of projections, an attention call, a chunk of o_proj + MLP), so its owner (the
        engine, running a step plan) can return to its loop between units or drop it. (A prompt
        prefilled beside running sequences goes chunk by chunk through `mixed` instead.)

        Layer-major: each layer runs over the whole prompt before the next starts. Projections
        and the MLP go `chunk` rows at a time (bounded temporaries); attention is the context's
        (WholeContext: square causal SDPA over the whole prompt). RoPE cos/sin are made once for
        every layer where together they take no more than the one chunk's float64 angles the
        memory plan counts (a prompt of up to two chunks), else per layer. Beyond the weights and
        cache this holds two [B, rows, hidden]-sized tensors: the residual stream and
        q/attn-out. Dynamic / long RoPE scale for start + T positions (transformers: longest
        position + 1).

        FP8 cache: attention reads the layer's unquantized K/V from a model-dtype staging buffer
        (so the output is exactly the model-dtype cache's; a cached prefix enters it dequantized),
        and the new positions are then quantized into the cache.
        """
        cfg = self.config
        B, T = tokens.shape
        D, Hkv = cfg.head_dim, cfg.num_kv_heads
        rows = self.context.rows(T, start)  # this rank's rows: their positions and cache positions
        n, first = rows.count, rows.first_slot
        seq_len = torch.tensor(rows.end, device=tokens.device)
        x = self.model.embed_tokens(rows.take(tokens, start))  # [B, n, hidden]: the residual stream
        q_all = torch.empty(B, cfg.num_heads, n, D, dtype=x.dtype, device=x.device)  # heads-major
        quantized = cache.kv_scale is not None
        if quantized:  # one layer's K and V, [B, Hkv, first + n, D] each, reused by every layer
            shape = (B, Hkv, first + n, D)
            staging = [torch.empty(shape, dtype=x.dtype, device=x.device) for _ in "kv"]
        qkv_row, out_row = self.flops_per_row()  # a row through q/k/v; through o_proj and the MLP
        # The projection chunks (rows), over the rows every rank runs (rows.padded: empty past n)
        spans = [(min(s, n), min(s + chunk, n)) for s in range(0, rows.padded, chunk)]
        positions = rows.positions(x.device)  # [n] int64

        def angles(s: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin [B, e - s, D] float32
            return self.rope.cos_sin(positions[s:e].expand(B, e - s), seq_len)

        # Every chunk's cos/sin (B x n x D float32 each) made once for all layers where together
        # they take no more than the one chunk's float64 angles the memory plan counts.
        angles_for_all_layers = B * n * D * 8 <= rope_bytes(cfg, min(chunk, n))
        chunk_angles = [angles(s, e) if e > s else None for s, e in spans] if angles_for_all_layers else None
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            k_cache, v_cache = staging if quantized else cache.layer(i)[:2]  # [B, Hkv, S or first + n, D]
            if quantized and first:
                _dequantize_prefix(cache.layer(i), staging, first, chunk)
            for j, (s, e) in enumerate(spans):
                if e > s:
                    cos, sin = chunk_angles[j] if angles_for_all_layers else angles(s, e)  # [B, c, D]
                    at = slice(first + s, first + e)  # the chunk's cache positions
                    normed = layer.input_layernorm(x[:, s:e])
                    attn.project_into(
                        normed, cos, sin, q_all[:, :, s:e], k_cache[:, :, at], v_cache[:, :, at]
                    )
                yield B * (e - s) * qkv_row
            # q_all's heads overwritten by their attention output, call by call
            context = (rows, attn.scale, backend, chunk)
            yield from self.context.attention(q_all, k_cache, v_cache, *context)
            if quantized:
                _quantize_into(cache.layer(i), staging, first, chunk, attn.kv_static_scales)
            for s, e in spans:
                if e > s:
                    out = q_all[:, :, s:e].transpose(1, 2).reshape(B, e - s, -1)  # [B, c, Hq * D]
                    x[:, s:e] += attn.o_proj(out)
                    x[:, s:e] += layer.mlp(layer.post_attention_layernorm(x[:, s:e]))
                    if on_progress is not None:  # (layer-rows done, layer-rows in all), per chunk
                        on_progress(i * n + e, cfg.num_layers * n)
                yield B * (e - s) * out_row
        return self.model.norm(self.context.output(x, rows, last_only))

    def chunk_staging(self, region: KVCache, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What `mixed` reads a prompt chunk's attention from in an FP8 cache: one layer's K and V
        of a `length`-position prompt, [1, Hkv, length, D] each in the model dtype, reused by every
        layer and chunk (the one the whole prefill holds); None for a model-dtype cache."""
        if region.kv_scale is None:
            return None
        cfg, like = self.config, self.model.embed_tokens.weight
        shape = (1, cfg.num_kv_heads, length, cfg.head_dim)
        return tuple(torch.empty(shape, dtype=like.dtype, device=like.device) for _ in "kv")

    def mixed(
        self,
        chunk: PromptChunk,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        starts: torch.Tensor,
        active: torch.Tensor,
        cache: KVCache,
    ) -> torch.Tensor:
        """One forward of a mixed step: a prompt chunk's C rows and B decode rows together ->
        final-normed hidden [1 + B, hidden]: the chunk's last real position, then the decode rows.

        The decode rows are `decode`'s batch: tokens, positions, starts [B] int64 and active [B]
        int32 0/1 on the device, each sequence's region at starts[b].. of the cache's one shared
        row (an idle row, active 0, reads nothing and writes the spare position its start points
        to). Each layer normalises every row, projects them in one matmul per weight (q/k/v,
        o_proj, gate/up, down: the weights read once for both parts), rotates them and writes
        every row's K/V at its cache position in one launch (as the decode step does), and
        attends each part its own way: the chunk causally after its past (`_chunk_attention`),
        the decode rows through the decode attention op over their regions. RoPE per row at its
        own position, with the whole prompt's length for the chunk's (dynamic NTK / LongRoPE as
        its prefill in one pass) and its own position + 1 for a decode row's. So each part gets
        what it gets alone, up to rounding (the matmuls' row counts differ).

        Fixed shapes, nothing read on the host where chunk.host is None: the engine captures it
        as a CUDA graph per (C, B) and replays it for every chunk of that size. One process or
        tensor-parallel ranks (context parallelism runs no mixed steps: a prefill beside decode
        rows goes a unit of its whole prefill a step)."""
        C, B, device = chunk.ids.shape[0], tokens.shape[0], tokens.device
        lo, count, start, length = chunk.where.unbind()  # 0-d int64 device tensors
        rows = torch.arange(C, device=device)
        at = torch.cat((lo + rows, positions))  # [C + B]: each row's sequence position
        seq_len = torch.cat((length.expand(C), positions + 1))[:, None]  # [C + B, 1]: RoPE's length
        cos, sin = self.rope.cos_sin(at, seq_len)  # [C + B, D]
        chunk_at = torch.where(rows < count, start + lo + rows, chunk.spare)  # padding rows: the spare
        written = torch.cat((chunk_at, starts + positions))  # [C + B]: each row's cache position
        lengths = ((positions + 1) * active).to(torch.int32)  # [B]: 0 for an idle row
        x = self.model.embed_tokens(torch.cat((chunk.ids, tokens)))  # [C + B, hidden]: the residual stream
        for i, layer in enumerate(self.model.layers):
            attn, kv = layer.self_attn, cache.layer(i)
            norms = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else (None, None)
            h = layer.input_layernorm(x)
            qkv = ops.linear(h, attn.qkv_weight, attn.qkv_bias)  # [C + B, (Hq + 2 Hkv) D]
            q = ops.rope_and_cache(
                qkv, cos, sin, written, kv.k, kv.v, attn.num_heads, *norms, attn.norm_eps,
                kv_scale=kv.kv_scale, static_scales=attn.kv_static_scales,
            )  # fmt: skip  # [C + B, Hq, D]
            out = [self._chunk_attention(i, q[:C], qkv[:C], cos[:C], sin[:C], chunk, kv).view(C, -1)]
            if B:
                out.append(
                    attn.attend(q[C:], kv.k, kv.v, lengths, attn.scale, kv_scale=kv.kv_scale, starts=starts)
                    .view(B, -1)
                )  # [B, Hq D]
            x += attn.o_proj(torch.cat(out))
            x += layer.mlp(layer.post_attention_layernorm(x))
        last = torch.cat(((count - 1).view(1), C + torch.arange(B, device=device)))  # [1 + B]
        return self.model.norm(x.index_select(0, last))

    def _chunk_attention(
        self,
        i: int,
        q: torch.Tensor,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        chunk: PromptChunk,
        kv: LayerKV,
    ) -> torch.Tensor:
        """Layer i's attention of the chunk's queries q [C, Hq, D] (rotated; its K/V already in the
        cache) -> [C, Hq, D], padding rows zero. In a graph (chunk.host None): the chunk attention
        kernel over the cache row, bounded by chunk.where on the device. Eagerly: the
        prefill's suffix attention (WholeContext.attention) over the region's positions
        0..lo+count-1; an FP8 cache's chunk reads chunk.staging, its past dequantized into it and
        its own rows rotated into it from qkv [C, ...] (cos/sin [C, D]) in the model dtype, as a
        prefill after a cached prefix reads them."""
        attn = self.model.layers[i].self_attn
        if chunk.host is None:  # the cache row [Hkv, P, D], bounded by chunk.where
            from minidecode.kernels.chunk_attention import chunk_attention  # (imports triton)

            return chunk_attention(q, kv.k[0], kv.v[0], chunk.where, chunk.splits, attn.scale)
        lo, count, _, _ = chunk.host
        hi = lo + count
        heads = q[:count].transpose(0, 1)[None]  # [1, Hq, count, D]: overwritten by the output
        if chunk.staging is not None:
            k, v = chunk.staging  # [1, Hkv, length, D]
            if lo:
                _dequantize_prefix(chunk.region.layer(i), chunk.staging, lo, chunk.copy_rows)
            norms = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else (None, None)
            own = (qkv[None, :count], cos[None, :count], sin[None, :count])  # [1, count, ...]
            ops.rope_into(*own, heads, k[:, :, lo:hi], v[:, :, lo:hi], *norms, attn.norm_eps)
        else:
            k, v = chunk.region.layer(i)[:2]  # [1, Hkv, size, D]
        rows = PromptRows(((lo, hi),), lo, lo, hi, count)  # the chunk's attention reads keys 0..hi-1
        for _ in self.context.attention(heads, k, v, rows, attn.scale, chunk.backend, chunk.copy_rows):
            pass  # (the heads overwritten by their output, call by call)
        q[count:] = 0
        return q

    def run_projections(self, rows: int) -> None:
        """One layer's projections (q/k/v, o_proj, gate/up, down) once on `rows` rows of zeros: the
        matmul library's choice of kernel for that row count made, so that a CUDA graph captured at
        a new row count does not wait for it (bench/NOTES-engine.md). One process only (a
        tensor-parallel projection's all-reduce is a collective)."""
        attn, mlp = self.model.layers[0].self_attn, self.model.layers[0].mlp
        embed, cfg = self.model.embed_tokens.weight, self.config
        like = {"device": embed.device, "dtype": embed.dtype}
        x = torch.zeros(rows, cfg.hidden_size, **like)  # [rows, hidden]
        ops.linear(x, attn.qkv_weight, attn.qkv_bias)
        attn.o_proj(torch.zeros(rows, cfg.num_heads * cfg.head_dim, **like))
        mlp(x)

    def flops_per_row(self) -> tuple[float, float]:
        """Multiply-adds x 2 of one prompt row through one layer's q/k/v projection, and through its
        o_proj and MLP: a prefill's two passes over each chunk, weighed apart (8B: 50 and 386
        MFLOP; attention is weighed by its own calls, `key_flops` a key)."""
        cfg = self.config
        qkv = cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        out = cfg.num_heads * cfg.head_dim * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
        return 2.0 * qkv, 2.0 * out

    def key_flops(self) -> float:
        """Multiply-adds x 2 of one query row's attention to one key in one layer (q.k and the
        weighted sum of v, each query head): what a prompt row pays per earlier position (8B:
        16 kFLOP, so at 128k keys 2.1 GFLOP a layer, 5x its projections and MLP)."""
        cfg = self.config
        return 4.0 * cfg.num_heads * cfg.head_dim

    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        pdl: bool = False,
        starts: torch.Tensor | None = None,
        active: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [B], positions [B] int64 on the device -> final-normed hidden [B, hidden].

        A batch of B sequences: with `starts` [B] int64, sequence b's positions 0.. live at cache
        positions starts[b].. of a cache with one shared row (contiguous regions, one per
        sequence); `active` [B] int32 0/1 marks idle slots, whose attention reads nothing (their
        K/V row is still written at starts + positions: the caller points them at a spare
        position). Each sequence gets exactly what it gets alone: RoPE's length for dynamic NTK /
        LongRoPE is its own position + 1 (transformers: the longest position + 1 of the pass).

        Pure device work with fixed shapes (the engine captures it in a CUDA graph): the residual
        stream x is updated in place by o_proj and down_proj; eight launches per layer on CUDA up to
        32 sequences (nine above: kernels/ops.py), chained by programmatic dependent launch when
        `pdl`."""
        lengths = (positions + 1).to(torch.int32)  # [B] context after this token
        if active is not None:
            lengths = lengths * active
        # once a step, not once a layer: cache positions in the shared row
        written = positions if starts is None else starts + positions
        return self.decode_layers(tokens, positions, written, lengths, cache, pdl, starts)

    def decode_drafts(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        q_lens: torch.Tensor,
        cache: KVCache,
        spare: int,
        pdl: bool = False,
        starts: torch.Tensor | None = None,
        active: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decode step with several tokens a sequence (verifying speculative drafts): tokens
        [B, Q] on the device, sequence b's first q_lens[b] ([B] int32, 1..Q) of them at positions
        positions[b] ([B] int64) + 0, 1, ... -> final-normed hidden [B, Q, hidden].

        As `decode` (starts, active) for the B * Q rows, run as one batch: each real row's K/V is
        written at its position, each query attends causally to its sequence's cache up to its
        own position (decode_attention with q_lens), and RoPE's length for dynamic NTK / LongRoPE
        is each row's own position + 1, as decoding them one at a time would. Padding rows (j >=
        q_lens[b], and every row of an idle sequence) write their ignored K/V at cache position
        `spare` (the engine's spare granule), so no region beyond a sequence's real rows is
        touched. Fixed shapes, no host sync: graph-capturable like `decode`."""
        B, Q = tokens.shape
        at = positions[:, None] + torch.arange(Q, device=tokens.device)  # [B, Q] sequence positions
        real = at < (positions + q_lens)[:, None]  # [B, Q]
        lengths = (positions + q_lens).to(torch.int32)  # [B] context after the last real row
        if active is not None:
            lengths = lengths * active
            real = real & (active[:, None] > 0)
        written = at if starts is None else starts[:, None] + at
        written = torch.where(real, written, spare)  # [B, Q] cache positions in the shared row
        hidden = self.decode_layers(
            tokens.reshape(-1), at.reshape(-1), written.reshape(-1), lengths, cache, pdl, starts, q_lens
        )  # [B * Q, hidden]
        return hidden.view(B, Q, -1)

    def decode_layers(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        written: torch.Tensor,
        lengths: torch.Tensor,
        cache: KVCache,
        pdl: bool,
        starts: torch.Tensor | None = None,
        q_lens: torch.Tensor | None = None,
        row_limits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layers of a decode step: RoPE at `positions` [B], the new K/V written at cache
        positions `written` [B] (in the cache's row: region starts included), attention over
        `lengths` [B] (from `starts`) -> final-normed hidden. q_lens [S]: the B rows are S
        sequences' queries, row_limits [S, Q] their causal limits where given (Attention.decode)."""
        cos, sin = self.rope.cos_sin(positions, (positions + 1).unsqueeze(-1))  # [B, D]
        x = self.model.embed_tokens(tokens)  # [B, hidden]: the residual stream
        layers = self.model.layers

        def input_norm(i: int) -> NormAfter:
            """What reads the residual stream before layer i (FP8 weights: rounded to e4m3 for its
            qkv); after the last layer, the final norm."""
            if i == len(layers):
                return NormAfter(self.model.norm, None)
            return NormAfter(layers[i].input_layernorm, layers[i].self_attn.qkv_weight)

        h = input_norm(0)(x, pdl)
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            then = NormAfter(layer.post_attention_layernorm, mlp.gate_up_weight)
            h = attn.decode(
                x, h, cos, sin, written, lengths, cache.layer(i), pdl, then, starts, q_lens, row_limits
            )
            h = mlp.decode(x, h, pdl, input_norm(i + 1))
        return h  # the final norm's

    def fuse_projections(self) -> None:
        """After the weights are loaded: fuse q/k/v and gate/up into single GEMV weights."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()


def _quantize_into(
    kv: LayerKV,
    staging: list[torch.Tensor],
    start: int,
    chunk: int,
    static_scales: tuple[float, float] | None,
) -> None:
    """Quantize a layer's new K and V (staging [B, Hkv, start + T, D], model dtype) into its FP8
    cache positions start..start+T-1, `chunk` positions at a time (bounded float32 temporaries);
    V goes into its blocks (kernels/quant.py's layout)."""
    (k_stage, v_stage), end = staging, staging[0].shape[2]
    k_static, v_static = static_scales or (None, None)
    for s in range(start, end, chunk):
        e = min(s + chunk, end)
        kv.k[:, :, s:e], kv.kv_scale[:, :, s:e, 0] = quantize_fp8(k_stage[:, :, s:e], k_static)
        v8, kv.kv_scale[:, :, s:e, 1] = quantize_fp8(v_stage[:, :, s:e], v_static)  # [B, Hkv, e - s, D]
        write_v_rows(kv.v, s, v8)


def _dequantize_prefix(kv: LayerKV, staging: list[torch.Tensor], start: int, chunk: int) -> None:
    """Fill staging positions 0..start-1 with the cached prefix, dequantized (what decode reads)."""
    k_stage, v_stage = staging
    for s in range(0, start, chunk):
        e = min(s + chunk, start)
        k_stage[:, :, s:e] = dequantize_fp8(kv.k[:, :, s:e], kv.kv_scale[:, :, s:e, 0], k_stage.dtype)
        v_stage[:, :, s:e] = dequantize_fp8(read_v_rows(kv.v, s, e), kv.kv_scale[:, :, s:e, 1], v_stage.dtype)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter (the weights a decode step reads once per token): FP8 weights
    count 1 byte a weight plus their float32 scales."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def step_weight_bytes(model: Transformer) -> int:
    """The weight bytes one decode step reads: every parameter, but of the embedding table one
    row (a tied lm_head reads the whole table: counted once, as the lm_head)."""
    table = model.model.embed_tokens.weight
    if model.config.tie_word_embeddings:
        return weight_bytes(model)
    return weight_bytes(model) - (table.shape[0] - 1) * table.shape[1] * table.element_size()


def weights_description(model: nn.Module, dtype: torch.dtype | None = None) -> str:
    """Which weights a model runs: its dtype ("bfloat16"), or its FP8 schemes, e.g.
    "fp8_e4m3 per-channel W8A8-dynamic per token (embeddings, lm_head bfloat16)". `dtype`: the
    model dtype, for a model on the meta device (default: the embedding's)."""
    dtype = str(dtype or model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    schemes = sorted({m.scheme.describe() for m in model.modules() if isinstance(m, FP8Linear)})
    return f"{' + '.join(schemes)} (embeddings, lm_head {dtype})" if schemes else dtype

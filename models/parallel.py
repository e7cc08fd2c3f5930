"""The decoder split over tp x cp ranks (each rank's share: models/sharding.py; the ranks are set up
by the runtime, minidecode/distributed.py, whose Parallel is the Collectives the model calls).

Tensor parallel (tp): each rank builds the modules of its share (rank_config: its query and KV
heads, its MLP rows) and loads only those rows or columns of each checkpoint tensor (`shard`).
q/k/v and gate/up are split by output rows (column parallel: no communication), o_proj and
down_proj by input columns (row parallel): each rank's product is a partial sum, all-reduced once
per projection, with the bias added once after the sum (in the decode step on GPUs, over
symmetric memory in the projection's own GEMV launch; at tp 2 rank 0 folds the residual into its
part, so the sum lands in the residual stream: minidecode/distributed.py's OneShot). FP8 layers
split the same way, their scales with their rows or columns (per-channel scales with the rows, whole
under a column split; block scales by whole blocks: fp8_split_problem refuses a split inside one);
a row-parallel layer's per-token input scale is that of the rank's columns (RowParallelFP8Projection).
The lm_head is split by vocabulary rows and the logits all-gathered ([B, V] per step, 0.5 MB at V =
128k): replicating it would add the whole [V, hidden] matrix (2.1 GB for Llama-3-70B) to every rank's
per-step reads, about 6% of a 70B rank's weights at tp 4. The embedding stays whole (a step
reads one row of it).

Context parallel (cp): rank c holds cache positions [c * span, (c + 1) * span) plus one scratch
row, span = ceil(context / cp). A decode step writes the new token's K/V on the rank whose range
holds its position (the others write the scratch row), every rank attends over its own range,
and the per-head (o, lse) partials are all-gathered and merged exactly (ops.merge_ranks): one
B x Hq x (D + 1) float32 gather per layer, whatever the context. Prefill runs every rank's range
at once, layer by layer: after its projections, each rank broadcasts the layer's K/V of its range
to the later ranks, and attends causally over its own keys and fully over the earlier ranges',
merged by log-sum-exp (exact; memory: one layer's K/V of the earlier ranges at a time).
"""

from __future__ import annotations

from collections.abc import Callable, Generator

import torch
import torch.nn.functional as F
from torch import nn

from minidecode.kernels import ops
from minidecode.kernels.fp8_weights import FP8Weight, QuantizedRows
from minidecode.kernels.prefill import BLOCK, CPU_BLOCK, cpu_flash_with_lse, cudnn_with_lse

from .cache import KVCache
from .config import ConfigError, FP8Scheme, ModelConfig
from .llama import FP8Linear, NormAfter, Projection, Transformer, _quantize_into
from .sharding import Collectives, ShardPlan, rank_config, rank_positions, shard_plan


class RowParallelProjection(Projection):
    """A projection split by input columns: each tensor-parallel rank multiplies its columns, the
    partial sums are all-reduced, and the (whole, replicated) bias is added once after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, parallel: Collectives):
        super().__init__(in_features, out_features, bias=bias)
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        self.parallel.all_reduce_tp(y)
        return y if self.bias is None else y + self.bias

    def add_to(
        self, residual: torch.Tensor, x: torch.Tensor, pdl: bool, then: NormAfter
    ) -> torch.Tensor | QuantizedRows:
        return _row_parallel_add_to(self.parallel, self.weight, self.bias, residual, x, pdl, then)

    def fp8_form(self, scheme: FP8Scheme) -> RowParallelFP8Projection:
        """This projection with FP8 weights of `scheme` (declared on the meta device, before loading)."""
        bias = self.bias is not None
        return RowParallelFP8Projection(self.in_features, self.out_features, bias, scheme, self.parallel)


class RowParallelFP8Projection(FP8Linear):
    """RowParallelProjection with FP8 weights: this rank's input columns of the e4m3 weight, with
    their scales (per output channel: every rank the whole [N, 1], as one process's; blocks: the
    columns' blocks, whole ones: models/parallel.fp8_split_problem). Its input, the rank's columns
    of the attention output or MLP activation, is rounded to e4m3 per token over those columns
    (each rank its own scale, as vLLM's row-parallel FP8 layers do: one scale over every rank's
    columns would cost a collective before each projection); a group or static scale rounds as one
    process does."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, scheme: FP8Scheme, parallel: Collectives
    ):
        super().__init__(in_features, out_features, bias, scheme)
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.linear(x, self.fp8, None)  # [..., out]: this rank's partial sum
        self.parallel.all_reduce_tp(y)
        return y if self.bias is None else y + self.bias

    def add_to(
        self, residual: torch.Tensor, x: torch.Tensor, pdl: bool, then: NormAfter
    ) -> torch.Tensor | QuantizedRows:
        return _row_parallel_add_to(self.parallel, self.fp8, self.bias, residual, x, pdl, then)


def _row_parallel_add_to(
    par: Collectives,
    weight: torch.Tensor | FP8Weight,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    x: torch.Tensor,
    pdl: bool,
    then: NormAfter,
) -> torch.Tensor | QuantizedRows:
    """A row-parallel projection's decode form: residual [B, out] += the sum over the ranks of
    x [B, in] (this rank's columns) times `weight` (its columns, model dtype or FP8), the bias
    once -> then(residual)."""
    if par.tp == 2 and (one_shot := par.one_shot_tp(residual)) is not None:
        # The residual stream (the same on every rank) folded into rank 0's partial sum, bias
        # included, so the one-shot sum is the new residual, written in place, by the GEMV's own
        # launch where it takes x (ops.linear_summed; an FP8 weight's input rounded to e4m3 first).
        # It rounds the residual twice (x + y0, then + y1) where the unfolded sum rounds it once; at
        # tp > 2 each further rank would add one more.
        norm = None
        if not isinstance(then.feeds, FP8Weight) and one_shot.can_norm(residual, then.norm.weight):
            # The next norm in the same kernel (its input rows need no e4m3 rounding): one
            # launch fewer in the step's chain.
            norm = (then.norm.weight, then.norm.eps, torch.empty_like(residual))
        first = par.tp_rank == 0
        one_shot.sum_of_linear(
            x, weight, bias if first else None, residual,
            residual=residual if first else None, norm=norm, pdl=pdl,
        )  # fmt: skip
        return then(residual, pdl) if norm is None else norm[2]
    y = ops.linear(x, weight, None, pdl=pdl)  # [B, out]: this rank's partial sum
    par.all_reduce_tp(y)
    residual += y if bias is None else y + bias
    return then(residual, pdl)


class ContextParallelAttention:
    """Attention.attend for a context-parallel rank: attention over this rank's range of the
    cache (lengths are per range: 0 where the range is still empty), merged with the other
    ranks' by log-sum-exp. Same arguments and result as ops.decode_attention."""

    def __init__(self, parallel: Collectives):
        self.parallel = parallel

    def __call__(self, q, k_cache, v_cache, lengths, scale, **kwargs) -> torch.Tensor:  # [B, Hq, D]
        o, lse = ops.decode_attention(q, k_cache, v_cache, lengths, scale, return_lse=True, **kwargs)
        return self.merge(o, lse, lengths, q.dtype, kwargs.get("triton"), kwargs.get("pdl", False))

    def merge(
        self, o: torch.Tensor, lse: torch.Tensor, lengths: torch.Tensor, dtype: torch.dtype,
        triton: bool | None = None, pdl: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """This rank's attention over its range, o [B, Hq, D] and lse [B, Hq], merged with every
        other rank's: [B, Hq, D] of dtype. lengths [B]: this range's valid positions; where it has
        none the kernel wrote neither o nor lse, and the range goes out as o 0, lse -inf."""
        packed = ops.pack_partials(o, lse, lengths, triton, pdl)  # [B, Hq, D + 1] float32
        parts = self.parallel.all_gather_cp(packed)  # [cp, B, Hq, D + 1]
        return ops.merge_ranks(parts, dtype, triton, pdl)


class ParallelTransformer(Transformer):
    """This rank's part of the model: `config` is the rank's (its heads and MLP rows), so the
    engine sizes the cache for the rank's KV heads; `full_config` is the checkpoint's."""

    def __init__(self, cfg: ModelConfig, parallel: Collectives):
        plan = shard_plan(cfg, parallel.tp, parallel.tp_rank)
        super().__init__(rank_config(cfg, plan))
        self.full_config, self.parallel, self.plan = cfg, parallel, plan
        self._checkpoint_shapes: dict[str, torch.Size] | None = None  # built on first use
        if parallel.tp > 1:
            for layer in self.model.layers:
                attn, mlp = layer.self_attn, layer.mlp
                attn.o_proj = RowParallelProjection(
                    attn.o_proj.in_features, cfg.hidden_size, cfg.o_bias, parallel
                )
                mlp.down_proj = RowParallelProjection(
                    mlp.down_proj.in_features, cfg.hidden_size, cfg.mlp_bias, parallel
                )
            if not cfg.tie_word_embeddings:
                self.lm_head = nn.Linear(cfg.hidden_size, plan.vocab_rows, bias=False)
        if parallel.cp > 1:
            for layer in self.model.layers:
                layer.self_attn.attend = ContextParallelAttention(parallel)

    # ---- loading --------------------------------------------------------------------------------
    def shard(self, name: str) -> tuple[int, int, int] | None:
        """The part of checkpoint tensor `name` this rank holds: (dim, start, stop), rows past the
        tensor's end read as zeros (the lm_head's padding); None: the whole tensor. A split
        weight's bias goes with its rows (a row-parallel one is whole); an FP8 layer's scales
        with the weight's rows or columns (_scale_part)."""
        if self.parallel.tp == 1:
            return None
        module, _, param = name.rpartition(".")
        part = _weight_part(self.plan, self.config.head_dim, module)
        if part is None or param == "weight":
            return part
        layer = self.get_submodule(module)
        if isinstance(layer, FP8Linear) and param != "bias":
            return _scale_part(layer.scheme, param, part)
        return part if part[0] == 0 else None

    def checkpoint_shape(self, name: str) -> torch.Size:
        """The whole checkpoint tensor `name`'s shape (this rank holds the part `shard` names)."""
        if self._checkpoint_shapes is None:
            with torch.device("meta"):
                whole = Transformer(self.full_config)
            self._checkpoint_shapes = {n: p.shape for n, p in whole.named_parameters()}
        return self._checkpoint_shapes[name]

    # ---- logits ---------------------------------------------------------------------------------
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] -> float32 logits [..., V]: each tensor-parallel rank's vocabulary
        rows, all-gathered."""
        if self.parallel.tp == 1:
            return super().logits(hidden)
        plan, vocab = self.plan, self.full_config.vocab_size
        if self.config.tie_word_embeddings:  # this rank's rows of the (whole) embedding: a view
            weight = self.model.embed_tokens.weight[plan.vocab_lo : plan.vocab_lo + plan.vocab_rows]
        else:
            weight = self.lm_head.weight
        part = F.linear(hidden.reshape(-1, hidden.shape[-1]), weight)  # [N, rows (fewer at the end)]
        if part.shape[1] < plan.vocab_rows:
            part = F.pad(part, (0, plan.vocab_rows - part.shape[1]))
        parts = self.parallel.all_gather_tp(part)  # [tp, N, rows]
        logits = parts.permute(1, 0, 2).reshape(*hidden.shape[:-1], -1)[..., :vocab]
        return logits.float()

    # ---- context parallel -------------------------------------------------------------------------
    def cache_len(self, context: int) -> int:
        return rank_positions(context, self.parallel.cp)

    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        pdl: bool = False,
        starts: torch.Tensor | None = None,
        active: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As Transformer.decode; with cp > 1, the new K/V go to the rank whose range holds the
        position (the scratch row elsewhere) and attention runs over each rank's range. Under cp a
        sequence owns the whole row (the engine runs one sequence at a time under cp, in a cache of
        exactly its positions), so `starts` (all 0) is not read."""
        if self.parallel.cp == 1:
            return super().decode(tokens, positions, cache, pdl, starts, active)
        span = cache.max_len - 1
        local = positions - self.parallel.cp_rank * span  # [B]
        held = (local >= 0) & (local < span)
        if active is not None:  # an idle row (a graph's warm-up) writes only the scratch row
            held = held & (active > 0)
        write_at = torch.where(held, local, span)  # [B] int64: the scratch row when not ours
        lengths = local.add(1).clamp(0, span).to(torch.int32)  # [B] our valid positions
        if active is not None:
            lengths = lengths * active
        return self.decode_layers(tokens, positions, write_at, lengths, cache, pdl)

    def prefill_units(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        chunk: int,
        backend: str | None = None,
        last_only: bool = True,
        on_progress: Callable[[int, int], None] | None = None,
        start: int = 0,
        unit_flops: float | None = None,
    ) -> Generator[float, None, torch.Tensor]:
        """As Transformer.prefill_units (every rank runs the same units: the step plans say how
        many); with cp > 1 one unit of all the work: every rank prefills the prompt positions of
        its range (a fresh prompt: start must be 0, prefix reuse is off under cp), and every rank
        returns the final-normed hidden of the last position (or of every position)."""
        if self.parallel.cp == 1:
            args = (tokens, cache, chunk, backend, last_only, on_progress, start, unit_flops)
            return (yield from super().prefill_units(*args))
        hidden = self._prefill_ranges(tokens, cache, chunk, backend, last_only, on_progress, start)
        yield 0.0
        return hidden

    def _prefill_ranges(self, tokens, cache, chunk, backend, last_only, on_progress, start) -> torch.Tensor:
        """Context-parallel prefill: every rank's range at once, layer by layer (the module docstring)."""
        if start:
            raise ValueError("context-parallel prefill starts at position 0 (no prefix reuse)")
        cfg, par = self.config, self.parallel
        B, T = tokens.shape
        G, D = cfg.group_size, cfg.head_dim
        span = cache.max_len - 1
        ranges = [(c * span, min(T, (c + 1) * span)) for c in range(par.cp)]  # empty where lo >= T
        lo, hi = ranges[par.cp_rank]
        n = max(hi - lo, 0)
        seq_len = torch.tensor(T, device=tokens.device)
        x = self.model.embed_tokens(tokens[:, lo : lo + n])  # [B, n, hidden]: our rows' residual stream
        q_all = torch.empty(B, cfg.num_heads, n, D, dtype=x.dtype, device=x.device)
        quantized = cache.kv_scale is not None
        if quantized:  # our range's K and V in the model dtype; quantized into the cache after attention
            staging = [torch.empty(B, cfg.num_kv_heads, n, D, dtype=x.dtype, device=x.device) for _ in "kv"]
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            k_own, v_own = staging if quantized else (t[:, :, :n] for t in cache.layer(i)[:2])
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                positions = torch.arange(lo + s, lo + e, device=x.device).expand(B, e - s)
                cos, sin = self.rope.cos_sin(positions, seq_len)
                normed = layer.input_layernorm(x[:, s:e])
                attn.project_into(normed, cos, sin, q_all[:, :, s:e], k_own[:, :, s:e], v_own[:, :, s:e])
            earlier = self._earlier_ranges(k_own, v_own, ranges)  # [(k, v) [B, Hkv, span, D]]
            for h in range(cfg.num_kv_heads if n else 0):
                group = q_all[:, h * G : (h + 1) * G]  # [B, G, n, D], overwritten by its output
                sources = [(k[:, h : h + 1], v[:, h : h + 1]) for k, v in earlier]
                own = k_own[:, h : h + 1], v_own[:, h : h + 1]
                group.copy_(_ranged_causal_attention(group, *own, sources, attn.scale, backend))
            if quantized:
                _quantize_into(cache.layer(i), staging, 0, chunk, attn.kv_static_scales)
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                out = q_all[:, :, s:e].transpose(1, 2).reshape(B, e - s, -1)  # [B, c, Hq * D]
                x[:, s:e] += attn.o_proj(out)
                x[:, s:e] += layer.mlp(layer.post_attention_layernorm(x[:, s:e]))
            if on_progress is not None:
                on_progress((i + 1) * T, cfg.num_layers * T)
        return self.model.norm(self._gather_rows(x, ranges, last_only))

    def _earlier_ranges(self, k_own: torch.Tensor, v_own: torch.Tensor, ranges: list[tuple[int, int]]):
        """Each range's K/V of this layer, broadcast by its rank to the later ranks (every rank takes
        part in every broadcast); -> the ranges before ours, in order."""
        par, (B, Hkv, _, D) = self.parallel, k_own.shape
        last_active = max(c for c, (lo, hi) in enumerate(ranges) if hi > lo)
        earlier = []
        for c in range(last_active):  # the last active range is needed by nobody
            lo, hi = ranges[c]
            if c == par.cp_rank:
                k, v = k_own.contiguous(), v_own.contiguous()
            else:
                k, v = (torch.empty(B, Hkv, hi - lo, D, dtype=k_own.dtype, device=k_own.device) for _ in "kv")
            par.broadcast_cp(k, c)
            par.broadcast_cp(v, c)
            if c < par.cp_rank:
                earlier.append((k, v))
        return earlier

    def _gather_rows(self, x: torch.Tensor, ranges: list[tuple[int, int]], last_only: bool) -> torch.Tensor:
        """The residual stream of the last prompt position [B, hidden], or of every position
        [B, T, hidden], from the ranks that hold them, on every rank."""
        par, B, hidden = self.parallel, x.shape[0], x.shape[-1]
        if last_only:
            owner = max(c for c, (lo, hi) in enumerate(ranges) if hi > lo)
            last = x[:, -1].contiguous() if par.cp_rank == owner else x.new_empty(B, hidden)
            par.broadcast_cp(last, owner)
            return last
        rows = []
        for c, (lo, hi) in enumerate(ranges):
            if hi > lo:
                part = x.contiguous() if c == par.cp_rank else x.new_empty(B, hi - lo, hidden)
                par.broadcast_cp(part, c)
                rows.append(part)
        return torch.cat(rows, dim=1)


def _ranged_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    earlier: list[tuple[torch.Tensor, torch.Tensor]],
    scale: float,
    backend: str | None,
) -> torch.Tensor:
    """q [B, G, n, D] at the positions of k/v [B, 1, n, D], after the earlier ranges' keys
    [(k, v) [B, 1, m, D]] -> [B, G, n, D]: per block of queries, causal over its own keys, full
    over the block's earlier own keys and over every earlier range, merged by log-sum-exp."""
    if q.device.type == "cpu":
        block, attend = CPU_BLOCK, cpu_flash_with_lse
    elif backend in ("cudnn", "flash"):
        block, attend = BLOCK, cudnn_with_lse if backend == "cudnn" else _flash_with_lse
    else:  # neither runs this dtype / head size (float32 in the GPU tests): plain math, small blocks
        block, attend = CPU_BLOCK, _math_with_lse
    out = torch.empty_like(q)
    for s in range(0, q.shape[2], block):
        e = min(s + block, q.shape[2])
        qb = q[:, :, s:e]
        parts = [attend(qb, k[:, :, s:e], v[:, :, s:e], True, scale=scale)]
        if s:
            parts.append(attend(qb, k[:, :, :s], v[:, :, :s], False, scale=scale))
        parts += [attend(qb, k_c, v_c, False, scale=scale) for k_c, v_c in earlier]
        o = torch.stack([p[0] for p in parts])  # [parts, B, G, e - s, D]
        lse = torch.stack([p[1][..., 0] for p in parts])  # [parts, B, G, e - s]
        out[:, :, s:e] = ops.merge_partials(o, lse)
    return out


def _flash_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """PyTorch's CUDA flash attention with its log-sum-exp; the one KV head is broadcast to the G
    query heads (a stride-0 view, no copy)."""
    group = q.shape[1]
    k, v = k.expand(-1, group, -1, -1), v.expand(-1, group, -1, -1)
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    out, lse = flash(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return out, lse.reshape(*q.shape[:3], 1)


def _math_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """Attention in float32 PyTorch ops with its log-sum-exp: q [B, G, t, D], k/v [B, 1, m, D]
    (causal: t == m, aligned) -> out [B, G, t, D] in q's dtype, lse [B, G, t, 1] float32."""
    scores = q.float() @ k.float().transpose(-1, -2) * scale  # [B, G, t, m]
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores[0, 0], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return (torch.exp(scores - lse) @ v.float()).to(q.dtype), lse


def _weight_part(plan: ShardPlan, head_dim: int, module: str) -> tuple[int, int, int] | None:
    """The part (dim, start, stop) of linear layer `module`'s weight [out, in] that the rank of
    `plan` holds: output rows (column parallel: q/k/v, gate/up, lm_head) or input columns (row
    parallel: o_proj, down_proj); None: a module held whole."""
    D, kind = head_dim, module.rpartition(".")[2]
    if kind == "q_proj":
        return 0, plan.q_lo * D, plan.q_hi * D
    if kind in ("k_proj", "v_proj"):
        return 0, plan.kv_lo * D, plan.kv_hi * D
    if kind in ("gate_proj", "up_proj"):
        return 0, plan.mlp_lo, plan.mlp_hi
    if kind == "o_proj":
        return 1, plan.q_lo * D, plan.q_hi * D
    if kind == "down_proj":
        return 1, plan.mlp_lo, plan.mlp_hi
    if module == "lm_head":
        return 0, plan.vocab_lo, plan.vocab_lo + plan.vocab_rows
    return None


def _scale_part(scheme: FP8Scheme, param: str, part: tuple[int, int, int]) -> tuple[int, int, int] | None:
    """The part of an FP8 layer's scale tensor `param` that goes with its weight's `part`: per
    channel [N, 1], the rows' (a column split keeps every row: whole); blocks, the blocks the part
    covers (it starts and ends on block boundaries: fp8_split_problem); a per-tensor or input scale
    whole."""
    dim, start, stop = part
    if param != scheme.scale_name or scheme.weights == "tensor":
        return None
    if scheme.weights == "channel":
        return part if dim == 0 else None
    size = scheme.block[dim]
    return dim, start // size, -(-stop // size)


def fp8_split_problem(cfg: ModelConfig, tp: int, scheme_for: Callable[[str], FP8Scheme | None]) -> str | None:
    """Why `tp` ranks cannot split these FP8 weights (None: they can): a rank's rows or columns
    of a layer that start or end inside a block of its weight scales, or (columns) inside a group
    of its input's scales, would need scales no rank has. `scheme_for(module)` is the layer's FP8
    scheme (None: not FP8). Every rank's part is checked, so every rank gives the same answer."""
    if (found := _fp8_cut(cfg, tp, scheme_for)) is None:
        return None
    module, dim, at, size, scheme = found
    what = "weight block" if scheme.block is not None and size == scheme.block[dim] else "input group"
    ways = [n for n in _tp_ways(cfg) if n != tp and _fp8_cut(cfg, n, scheme_for) is None]  # 1 at least
    instead = f"use --tp {' or '.join(map(str, ways))}"
    return (
        f"--tp {tp} splits {module}'s FP8 weights at {('row', 'column')[dim]} {at}, inside a {what} of "
        f"{size} {('rows', 'columns')[dim]} ({scheme.describe()}); {instead}"
    )


def _fp8_cut(
    cfg: ModelConfig, tp: int, scheme_for: Callable[[str], FP8Scheme | None]
) -> tuple[str, int, int, int, FP8Scheme] | None:
    """The first place a rank's part cuts a scale block of an FP8 layer: (module, dim, where, the
    block's size, the scheme); None where no part does."""
    if tp == 1:
        return None
    plans = [shard_plan(cfg, tp, rank) for rank in range(tp)]
    for module, shape in _whole_shapes(cfg).items():
        if (scheme := scheme_for(module)) is None:
            continue
        for plan in plans:
            dim, start, stop = _weight_part(plan, cfg.head_dim, module)
            sizes = [] if scheme.block is None else [scheme.block[dim]]
            if dim == 1 and scheme.act_group is not None:
                sizes.append(scheme.act_group)
            for size in sizes:
                if start % size:
                    return module, dim, start, size, scheme
                if stop % size and stop < shape[dim]:
                    return module, dim, stop, size, scheme
    return None


def _whole_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """[out, in] of every linear layer a tensor-parallel rank holds part of, by module name."""
    hidden, D, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {}
    for i in range(cfg.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        shapes[f"{attn}.q_proj"] = (cfg.num_heads * D, hidden)
        shapes[f"{attn}.k_proj"] = shapes[f"{attn}.v_proj"] = (cfg.num_kv_heads * D, hidden)
        shapes[f"{attn}.o_proj"] = (hidden, cfg.num_heads * D)
        shapes[f"{mlp}.gate_proj"] = shapes[f"{mlp}.up_proj"] = (inter, hidden)
        shapes[f"{mlp}.down_proj"] = (hidden, inter)
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, hidden)
    return shapes


def _tp_ways(cfg: ModelConfig) -> list[int]:
    """The tensor-parallel sizes this model's heads and MLP split into (shard_plan's)."""
    ways = []
    for n in range(1, cfg.num_heads + 1):
        try:
            shard_plan(cfg, n, 0)
        except ConfigError:
            continue
        ways.append(n)
    return ways

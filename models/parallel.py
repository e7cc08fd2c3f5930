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

Context parallel (cp): the context's positions are dealt over the ranks (sharding.deal: chunks of
CP_CHUNK positions by rounds, ranks 0..cp-1 in even rounds and cp-1..0 in odd ones, so that every
rank has the same causal work and a position's rank depends on the position alone: a cached prefix
or a cache file is every rank's share of it, where a longer prompt would put it), each rank holding
its positions' K/V compactly and in order in each sequence's region (its share of the region's
positions), and attention runs as ContextParallelAttention: in prefill, the one prefill loop
(Transformer.prefill_units) computes each rank's rows, and a layer's attention gathers the
context's K/V and attends each run of the rank's positions over the keys before it; in decode, the
new token's K/V go to the one rank that holds its position and every rank's partial result over its
positions is merged exactly by log-sum-exp. ParallelTransformer has no prefill of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from minidecode.kernels import ops
from minidecode.kernels.fp8_weights import FP8Weight, QuantizedRows
from minidecode.kernels.prefill import causal_attention

from . import sharding
from .cache import KVCache
from .config import ConfigError, FP8Scheme, ModelConfig
from .llama import FP8Linear, NormAfter, Projection, PromptRows, Transformer
from .sharding import (
    CP_CHUNK,
    Collectives,
    ShardPlan,
    deal,
    held,
    owner,
    rank_config,
    rank_positions,
    shard_plan,
)


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


# The context (positions) from which a context-parallel prefill runs its runs after a past through
# cuDNN rather than flash: one rank's layer at 512k on 4 ranks (8 KV heads, H200) took 1.0 s through
# cuDNN and 1.6 s through flash, and the first through cuDNN 5.0 s (65 key lengths' graphs built);
# the saving grows as T^2 and the builds as T, so over 32 layers they break even near 128k
# (bench/NOTES-distributed.md).
CP_CUDNN_FROM = 131072


class ContextParallelAttention:
    """Attention over a context dealt over the context-parallel ranks (sharding.deal: chunks of
    `chunk` positions by rounds, whatever the context's length): each rank holds its positions'
    K/V compactly and in order in each sequence's region (a batch's sequences each in a region of
    their own); each rank attends over what it holds and the partial results are merged exactly
    by log-sum-exp. RoPE was applied at the true positions before the K/V were cached.

    Decode (`__call__`, ops.decode_attention's form: Attention.attend): the new token's K/V go to
    the one rank that holds its position (`slots`), the spare position elsewhere; every rank attends
    over its positions and the per-head (o, lse) partials are all-gathered and merged
    (ops.merge_ranks): one B x Hq x (D + 1) float32 gather per layer, whatever the context. A step
    with drafts (`draft_slots`) writes each row's K/V on the rank that holds its position, and each
    query row attends to the first row_limits of the rank's positions (those up to its own): its
    part is packed and merged as a row of its own.

    Prefill (`rows`, `attention`, `output`: the Transformer's context, as models/llama.py's
    WholeContext): each rank computes the rows of its new positions (projections, MLP) in the one
    prefill loop (Transformer.prefill_units), after a cached prefix as well (each rank holds its
    share of the prefix where the prompt's dealing puts it); a layer's attention gathers every
    rank's K/V of the context, prefix included, puts it in position order, and attends each run of
    the rank's consecutive positions causally over its own keys and fully over every earlier one
    (kernels/prefill.py's causal_attention with the run's start as its past: the same calls, and
    the same backends, FP8 included, as a suffix after a cached prefix in one process)."""

    def __init__(self, parallel: Collectives, chunk: int = CP_CHUNK):
        self.parallel, self.chunk = parallel, chunk
        self._order: tuple[tuple[int, int, torch.device], torch.Tensor, int] | None = None

    # ---- decode -----------------------------------------------------------------------------------
    def slots(
        self, positions: torch.Tensor, spare: int, starts: torch.Tensor | None = None,
        active: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B] int64 of the new tokens, each sequence's region at cache position starts
        [B] int64 (None: 0) -> (written [B] int64: this rank's cache position of the token where it
        holds it (sharding.owner), else `spare`; lengths [B] int32: how many of positions 0..p it
        holds (sharding.held)). active [B] int32 0/1: an idle row (a graph's warm-up) writes only
        `spare` and reads nothing. Device ops only (a decode graph captures them)."""
        cp, rank, chunk = self.parallel.cp, self.parallel.cp_rank, self.chunk
        holder, slot = owner(positions, cp, chunk)
        mine = holder == rank
        if active is not None:
            mine = mine & (active > 0)
        written = torch.where(mine, slot if starts is None else starts + slot, spare)
        lengths = held(positions + 1, cp, rank, chunk).to(torch.int32)
        return written, lengths if active is None else lengths * active

    def draft_slots(
        self, positions: torch.Tensor, q_lens: torch.Tensor, queries: int, spare: int,
        starts: torch.Tensor | None = None, active: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`slots` for a step with drafts: sequence b's q_lens[b] ([B] int32, 1..queries) new tokens
        at positions positions[b] ([B] int64) + 0, 1, ... -> (written [B, Q = queries]
        int64: this rank's cache position of each real row it holds, else `spare`; lengths [B]
        int32: how many of positions 0..positions[b] + q_lens[b] - 1 it holds; row_limits [B, Q]
        int32: how many of those query j sees (held(positions[b] + j + 1)), 0 for padding rows and
        idle sequences). The drafts of one step may fall on several ranks (a chunk boundary
        between them). Device ops only."""
        cp, rank, chunk = self.parallel.cp, self.parallel.cp_rank, self.chunk
        at = positions[:, None] + torch.arange(queries, device=positions.device)  # [B, Q]
        real = at < (positions + q_lens)[:, None]
        if active is not None:
            real = real & (active[:, None] > 0)
        holder, slot = owner(at, cp, chunk)
        mine = real & (holder == rank)
        written = torch.where(mine, slot if starts is None else starts[:, None] + slot, spare)
        limits = held(at + 1, cp, rank, chunk).to(torch.int32) * real  # [B, Q]
        lengths = held(positions + q_lens, cp, rank, chunk).to(torch.int32)
        return written, lengths if active is None else lengths * active, limits

    def __call__(self, q, k_cache, v_cache, lengths, scale, **kwargs) -> torch.Tensor:
        """This rank's attention over its positions, merged with every other rank's: q [B, Hq, D]
        -> [B, Hq, D]; with q_lens and row_limits (a step with drafts) q [B, Q, Hq, D] -> [B, Q,
        Hq, D], each query row packed and merged as a row of its own."""
        o, lse = ops.decode_attention(q, k_cache, v_cache, lengths, scale, return_lse=True, **kwargs)
        triton, pdl = kwargs.get("triton"), kwargs.get("pdl", False)
        if kwargs.get("q_lens") is None:
            return self.merge(o, lse, lengths, q.dtype, triton, pdl)
        rows = kwargs["row_limits"].reshape(-1)  # [B * Q]: a row that sees nothing here is packed empty
        merged = self.merge(o.flatten(0, 1), lse.flatten(0, 1), rows, q.dtype, triton, pdl)
        return merged.view(q.shape)

    def merge(
        self, o: torch.Tensor, lse: torch.Tensor, lengths: torch.Tensor, dtype: torch.dtype,
        triton: bool | None = None, pdl: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """This rank's attention over its positions, o [B, Hq, D] and lse [B, Hq], merged with every
        other rank's: [B, Hq, D] of dtype. lengths [B]: this rank's valid positions; where it has
        none the kernel wrote neither o nor lse, and the part goes out as o 0, lse -inf."""
        packed = ops.pack_partials(o, lse, lengths, triton, pdl)  # [B, Hq, D + 1] float32
        parts = self.parallel.all_gather_cp(packed)  # [cp, B, Hq, D + 1]
        return ops.merge_ranks(parts, dtype, triton, pdl)

    # ---- prefill ----------------------------------------------------------------------------------
    def held_positions(self, count: int) -> int:
        """How many of positions 0..count-1 this rank holds (at its cache positions 0..)."""
        return held(count, self.parallel.cp, self.parallel.cp_rank, self.chunk)

    def rows(self, prompt_len: int, start: int) -> PromptRows:
        """This rank's positions of start..start+prompt_len-1 (sharding.deal), at its cache positions
        from held(start) on; padded to the longest share."""
        end = start + prompt_len
        shares = deal(start, end, self.parallel.cp, self.chunk)
        most = max(_count(runs) for runs in shares)
        return PromptRows(tuple(shares[self.parallel.cp_rank]), start, self.held_positions(start), end, most)

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
        """A layer's causal attention of this rank's queries q [B, Hq, n, D] (its rows, in their
        order) over the whole context's keys, the output overwriting q; k/v [B, Hkv, >= held(end),
        D]: this rank's K/V of positions 0..end-1 (the cache, or the FP8 cache's staging buffer).

        The layer's keys and values gathered in position order [B, Hkv, end, D] (every rank takes
        part), then per run [lo, hi) of the rank's rows one causal call over every head with past
        lo (below CP_CUDNN_FROM, cuDNN's only for a run without one), one unit each: a chunk's 1024
        rows of every query head fill a GPU where one head's would not. Every rank yields as many
        units (the most runs any rank has; the others pad with empty units), so that the gathers
        fall in the same unit on every rank. `chunk` (the one-process grouping of KV heads) is not needed."""
        B, Hq, n, D = q.shape
        end, own = rows.end, rows.first_slot + n
        shares = deal(rows.start, end, self.parallel.cp, self.chunk)
        units = max(len(runs) for runs in shares)
        keys = self._gather_in_order(k[:, :, :own], 0, end)  # [B, Hkv, end, D]
        values = self._gather_in_order(v[:, :, :own], 0, end)
        row = 0
        for lo, hi in rows.runs:  # positions lo..hi-1, rows row..
            part = q[:, :, row : row + hi - lo]  # overwritten by its output
            # A run after a past reads keys of a length of its own, for which cuDNN builds a graph
            # the first time (~75 ms a shape on an H200; later prompts reuse the chunk-aligned
            # ones). Below CP_CUDNN_FROM those builds cost more than cuDNN saves over SDPA's flash
            # forward (one call over every head, as a mixed step's chunk runs), above it less.
            call = "flash" if backend == "cudnn" and lo and end < CP_CUDNN_FROM else backend
            causal_attention(part, keys[:, :, :hi], values[:, :, :hi], scale, call, out=part)
            yield 4 * B * Hq * D * (hi - lo) * hi
            row += hi - lo
        for _ in range(units - len(rows.runs)):
            yield 0.0

    def output(self, x: torch.Tensor, rows: PromptRows, last_only: bool) -> torch.Tensor:
        """This rank's residual stream x [B, n, hidden] -> the last position's [B, hidden] (from the
        rank that holds it), or every new position's [B, end - start, hidden] in order, on every
        rank."""
        if not last_only:
            return self._gather_in_order(x, rows.start, rows.end)
        holder = owner(rows.end - 1, self.parallel.cp, self.chunk)[0]
        mine = self.parallel.cp_rank == holder
        last = x[:, -1].contiguous() if mine else x.new_empty(x.shape[0], x.shape[-1])
        self.parallel.broadcast_cp(last, holder)
        return last

    def _gather_in_order(self, own: torch.Tensor, lo: int, end: int) -> torch.Tensor:
        """own [..., n, E]: this rank's rows of positions lo..end-1 on dim -2 -> every rank's, in
        position order [..., end - lo, E] (an all-gather of the parts padded to the longest)."""
        order, most = self._positions_order(lo, end, own.device)
        part = F.pad(own, (0, 0, 0, most - own.shape[-2]))  # [..., most, E]
        every = self.parallel.all_gather_cp(part)  # [cp, ..., most, E]
        every = every.movedim(0, -3).flatten(-3, -2)  # [..., cp * most, E]: rank c's rows from c * most
        return every.index_select(-2, order)

    def _positions_order(self, lo: int, end: int, device: torch.device) -> tuple[torch.Tensor, int]:
        """-> (for each position lo..end-1, its row in the gathered parts [cp * most] int64; most, the
        longest share): kept for the last (every layer of a prefill gathers with it)."""
        key = (lo, end, device)
        if self._order is None or self._order[0] != key:
            cp = self.parallel.cp
            first = [held(lo, cp, c, self.chunk) for c in range(cp)]
            most = max(held(end, cp, c, self.chunk) - first[c] for c in range(cp))
            order = torch.empty(end - lo, dtype=torch.long)
            for c, runs in enumerate(deal(lo, end, cp, self.chunk)):
                row = c * most
                for a, b in runs:
                    order[a - lo : b - lo] = torch.arange(row, row + b - a)
                    row += b - a
            self._order = (key, order.to(device), most)
        return self._order[1], self._order[2]


class ParallelTransformer(Transformer):
    """This rank's part of the model: `config` is the rank's (its heads and MLP rows), so the
    engine sizes the cache for the rank's KV heads; `full_config` is the checkpoint's."""

    def __init__(self, cfg: ModelConfig, parallel: Collectives):
        plan = shard_plan(cfg, parallel.tp, parallel.tp_rank)
        super().__init__(rank_config(cfg, plan))
        self.full_config, self.parallel, self.plan = cfg, parallel, plan
        # The positions a dealt chunk holds (models/sharding.py), read when the model is built: a
        # test's ranks may deal a small model's short prompts in smaller chunks.
        self.cp_chunk = sharding.CP_CHUNK
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
        if parallel.cp > 1:  # the prefill's rows and attention, and each layer's decode attention
            self.context = ContextParallelAttention(parallel, self.cp_chunk)
            for layer in self.model.layers:
                layer.self_attn.attend = self.context

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
        return rank_positions(context, self.parallel.cp, self.cp_chunk)

    @property
    def context_ranks(self) -> int:
        return self.parallel.cp

    def held_positions(self, count: int) -> int:
        return count if self.parallel.cp == 1 else self.context.held_positions(count)

    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        pdl: bool = False,
        starts: torch.Tensor | None = None,
        active: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As Transformer.decode; with cp > 1, the new K/V go to the rank that holds the position
        (elsewhere to the cache's last position, in the spare granule after every region, where
        idle rows write too) and attention runs over each rank's positions of each sequence's
        region (ContextParallelAttention.slots)."""
        if self.parallel.cp == 1:
            return super().decode(tokens, positions, cache, pdl, starts, active)
        written, lengths = self.context.slots(positions, cache.max_len - 1, starts, active)
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
        """As Transformer.decode_drafts; with cp > 1, each real row's K/V go to the rank that holds
        its position (the others write `spare`), and each query row attends over each rank's
        positions up to its own (ContextParallelAttention.draft_slots), merged by log-sum-exp."""
        if self.parallel.cp == 1:
            return super().decode_drafts(tokens, positions, q_lens, cache, spare, pdl, starts, active)
        B, Q = tokens.shape
        written, lengths, limits = self.context.draft_slots(positions, q_lens, Q, spare, starts, active)
        at = positions[:, None] + torch.arange(Q, device=tokens.device)  # [B, Q] sequence positions
        rows = (tokens.reshape(-1), at.reshape(-1), written.reshape(-1))  # B * Q rows, sequence-major
        hidden = self.decode_layers(*rows, lengths, cache, pdl, starts, q_lens, limits)  # [B * Q, hidden]
        return hidden.view(B, Q, -1)


def _count(runs: list[tuple[int, int]]) -> int:
    return sum(hi - lo for lo, hi in runs)


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

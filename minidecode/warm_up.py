"""Compiling before the first request arrives, so that neither its TTFT nor the running streams'
steps pay for it: the prefill's kernels on a short prompt, a mixed step's beside each decode batch
bucket, the FP8 prefill attention kernel where it is the user's choice, and the decode step of
every batch bucket at every cache size where the decode kernel changes its launch config (an FP8
cache's configs, which a request's cache grows into); with the LLM's speculate default, the steps
with drafts too (their multi-query attention and prompt lookup). A kernel compiled on first use
instead holds up every running stream, or a request's first token, for its compile
(bench/NOTES-engine.md). Each cache made here is freed after. LLM runs warm_up on every rank once
the model is loaded (GPUs only)."""

from __future__ import annotations

import torch

from minidecode.kernels import ops
from minidecode.kernels.prefill import FP8_MIN_KEYS, causal_attention

from .decode import bucket
from .engine import Engine
from .plan import DecodeKind
from .sampling import SamplingParams
from .scheduler import step_graphs


def warm_up(engine: Engine, speculate: int = 0) -> None:
    """Compile every kernel a request will run before one arrives (its TTFT then pays none):
    the prefill's on a short prompt, a mixed step's (warm_up_mixed), the FP8 prefill attention
    kernel (when it is the user's choice) on a problem it takes, and the decode steps of every
    batch bucket up to max_batch (each bucket's kernels are specialized to its rows) at each
    cache size where the decode kernel changes its launch config (warm_up_sizes: an FP8 cache
    has up to three, which a request's cache grows into): decode_steps, the plain step's and,
    where requests speculate up to `speculate` drafts, the steps they take. Each cache is freed
    after; a size that does not fit beside the weights is left to its first use."""
    if engine.device.type != "cuda":
        return
    for i, capacity in enumerate(warm_up_sizes(engine)):
        try:
            engine.resize(capacity)
            if i == 0:
                engine.prefill(list(range(1, 17)), 0, capacity, 0)
                if not engine.context_parallel:  # (which runs no mixed steps)
                    warm_up_mixed(engine)
            for rows, kind, queries in decode_steps(engine, speculate):
                engine.prepare(rows, kind, queries)
            torch.cuda.synchronize(engine.device)
        except torch.OutOfMemoryError:
            pass
        finally:
            engine.release()
    if engine.attention_backend() == "fp8":
        cfg, like = engine.config, {"device": engine.device, "dtype": engine.dtype}
        q = torch.randn(1, cfg.num_heads, FP8_MIN_KEYS, cfg.head_dim, **like)  # [1, Hq, T, D]
        k, v = (torch.randn(1, cfg.num_kv_heads, FP8_MIN_KEYS, cfg.head_dim, **like) for _ in range(2))
        causal_attention(q, k, v, cfg.head_dim**-0.5, "fp8")
        torch.cuda.synchronize(engine.device)


def warm_up_mixed(engine: Engine) -> None:
    """A mixed step's kernels run once, eagerly, in the form its steps take (their graphs' form
    where the engine captures them: their compiles, and the chunk attention's first call and
    imports, kept out of the first step beside running streams): a chunk of positions 16..31
    after a 16-position prefill at the cache's start, beside no decode rows and beside each batch
    bucket's idle rows (the decode attention is specialized to its rows); and, where its steps are
    graphs, the projections at every row count those graphs take (their matmuls' kernel choice,
    which a capture at a new row count would otherwise wait for)."""
    region = engine.region(0, 32)
    staging = engine.model.chunk_staging(region, 32)
    chunk = engine.mixed.chunk(list(range(17, 33)), 16, 0, 32, region, staging, engine.spare_start)
    engine.mixed.warm_up(chunk, batch_buckets(engine), engine.cache)
    if engine.mixed.graphed:
        for rows in mixed_rows(engine):
            engine.model.run_projections(rows)


def mixed_rows(engine: Engine) -> list[int]:
    """The row counts of a mixed-step graph's matmuls, smallest first: each chunk bucket's rows
    beside no decode rows and beside each batch bucket's (mixed.chunk_bucket)."""
    chunks = [16, *range(32, engine.mixed.max_chunk_rows + 1, 32)]
    return sorted({c + b for c in chunks for b in [0, *batch_buckets(engine)]})


def decode_steps(engine: Engine, speculate: int) -> list[tuple[int, DecodeKind, int]]:
    """The decode steps warm_up compiles, (rows, kind, query rows a sequence): each batch bucket's
    plain step, and where requests speculate up to `speculate` drafts the steps the scheduler
    prepares for them (scheduler.step_graphs: each step size such rows can take, with the lookup,
    and the plain step with and without it)."""
    kind = DecodeKind(SamplingParams().mode, lookup=speculate > 0)  # scheduler.step_kind of such rows
    steps = step_graphs(kind, [speculate], engine.draft_sizes)
    return [(rows, step, queries) for rows in batch_buckets(engine) for step, queries in steps]


def batch_buckets(engine: Engine) -> list[int]:
    """The row counts the engine's decode graphs take (Engine.prepare's buckets), smallest first."""
    return sorted({min(bucket(n), engine.max_batch) for n in range(1, engine.max_batch + 1)})


def warm_up_sizes(engine: Engine) -> list[int]:
    """Cache capacities (region positions, whole granules) at which the decode step runs each
    launch config the decode kernel takes for this cache (ops.decode_cache_sizes: the positions
    it reads decide, the regions and the spare granule after them), smallest first; the first
    also holds a short prompt's prefill."""
    cfg, granule = engine.config, engine.granule
    fp8 = engine.kv_dtype == torch.float8_e4m3fn
    sizes = ops.decode_cache_sizes(cfg.head_dim, engine.dtype, fp8, cfg.num_kv_heads)
    capacities = [-(-max(size - granule, 1) // granule) * granule for size in sizes]
    return [max(capacities[0], engine.region_size(64)), *capacities[1:]]

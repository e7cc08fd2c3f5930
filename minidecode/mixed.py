"""The mixed step's side of the engine: its budget (STEP_TOKENS), its chunk's inputs and its CUDA
graphs (MixedSteps).

A mixed step carries a prompt chunk and the running sequences' decode rows in one forward
(Transformer.mixed). Run eagerly, each of its ~15 launches a layer costs the host more than the
GPU's work (a 384-row step of an 8B: ~40 ms of launching against ~16 ms of work on an H200;
bench/NOTES-engine.md), so on CUDA with a model-dtype cache it is a graph: one per (chunk rows,
decode rows) bucket, captured when first used and dropped with the cache (its addresses are in
it). The chunk is padded to chunk_bucket rows and its ids and where it lies go in a device tensor
(ChunkInputs), so one graph serves every chunk of its size. Eagerly (the CPU, float32, an FP8
cache, tensor-parallel ranks) the same forward runs with those values on the host too.
"""

from __future__ import annotations

import math
import time

import torch

from minidecode.kernels.device import sm_count
from minidecode.models.cache import KVCache
from minidecode.models.llama import PromptChunk, Transformer

from .decode import DecodeState, bucket, capture, launch_config

# A mixed step's work, in rows through the weights: its decode rows plus its chunk's prompt rows,
# each prompt row's attention to its earlier positions counted as the rows of projections its time
# would run (`rows_per_key`), so that a step's time stays about the same as the prefill advances. The
# budget is set by the streams' gap: on an H200 a steady step of 8 rows at 4k-12k of context takes
# 5.6 ms, a mixed step's fixed part (every weight read, the decode rows' attention, the small
# kernels) ~7 ms, and a row of projections and MLP ~21 us (an 8B's 14 GFLOP at ~680 TFLOP/s). With
# 448 rows the streams' gaps stayed within three steady steps at p99 (2.8) beside a 128k prefill;
# 512-704 rows prefill faster and pass three steps more often (bench/NOTES-engine.md: the budgets
# swept). On the CPU (~1e11 FLOP/s against ~2e10 B/s of float32 weights: ~10 rows a read) 32 rows
# are about three steps.
STEP_TOKENS = {"cuda": 448, "cpu": 32}

# A prompt row's attention to one key against the same FLOPs in its projections: on an H200 the
# chunk kernel runs at ~480 TFLOP/s (64-384 rows after a 32k-512k past: chunk-attention-h200.md)
# where a mixed step's projections run at ~680. The CPU's is not measured.
ATTENTION_SLOWDOWN = {"cuda": 1.4, "cpu": 1.0}

# The fewest prompt rows a mixed step's chunk takes, whatever its budget: a tensor-core tile of rows
# (fewer cost a GPU's matmuls as much), so that the prefill always advances.
MIN_CHUNK = 16

# A chunk longer than this ends on a multiple of it: the graph pads its rows to one (chunk_bucket),
# and the chunk kernel's row block is 32 queries of a group of 4 (128 packed rows), all of whose
# attention is paid however few of them are real (at 124k of past a 66-row chunk took 411 us a
# layer, a 64-row one 289).
CHUNK_MULTIPLE = 32


def rows_per_key(model: Transformer, device: torch.device) -> float:
    """A prompt row's attention to one key, in rows through the weights (Transformer.key_flops over
    flops_per_row, weighed by ATTENTION_SLOWDOWN)."""
    qkv, out = model.flops_per_row()
    return model.key_flops() / (qkv + out) * ATTENTION_SLOWDOWN[device.type]


def chunk_end(lo: int, end: int, room: int, key_rows: float) -> int:
    """The end of a mixed step's chunk of prompt positions lo.. (at most `end`): the most rows c
    whose work fits `room` rows through the weights, each row counting 1 and key_rows for each of
    the lo + j + 1 keys it reads: c + key_rows (c lo + c (c + 1) / 2) <= room; past CHUNK_MULTIPLE
    rows, down to a multiple of it; at least MIN_CHUNK rows."""
    b = 1 + key_rows * (lo + 0.5)
    c = int(2 * room / (b + math.sqrt(b * b + 2 * key_rows * room))) if room > 0 else 0  # the root
    if c > CHUNK_MULTIPLE:
        c -= c % CHUNK_MULTIPLE
    return min(end, lo + max(MIN_CHUNK, c))


def chunk_bucket(count: int) -> int:
    """The rows of the mixed-step graph that takes a chunk of `count` prompt rows: 16, then multiples
    of 32 (padding a chunk by at most 31 rows: 8% of a 384-row step's projections). Multiples of 16
    all, so that a step's row counts (chunk + decode rows) fall in the same Triton specialization
    for every chunk size (MixedSteps._replay's warm-up)."""
    return 16 if count <= 16 else -(-count // 32) * 32


class ChunkInputs:
    """A mixed step's chunk on the device, set each step with no wait for the device: one int64
    tensor [4 + rows] of (lo, count, start, length) (`where`) then the chunk's prompt ids (`ids`),
    copied from a ring of pinned host rows, each written again only once its copy, RING steps back
    and long since run, is done. Only the chunk's ids cross: a 128k prompt made one device tensor
    at its first chunk cost ~15 ms of the host's list conversion, and a copy that waited for the
    queued steps, in the plan that admits it beside running streams."""

    RING = 4

    def __init__(self, device: torch.device, rows: int):
        self.values = torch.zeros(4 + rows, dtype=torch.long, device=device)
        self.where, self.ids = self.values[:4], self.values[4:]  # [4], [rows]
        cuda = device.type == "cuda"
        self._host = torch.zeros(self.RING, 4 + rows, dtype=torch.long, pin_memory=cuda)
        self._copied = [torch.cuda.Event() if cuda else None for _ in range(self.RING)]
        self._turn = 0

    def put(self, ids: list[int], lo: int, start: int, length: int) -> None:
        """Positions lo.. of a `length`-position prompt (ids: their tokens, at most `rows`) whose
        region begins at cache position `start`."""
        slot, self._turn = self._turn, (self._turn + 1) % self.RING
        if self._copied[slot] is not None:
            self._copied[slot].synchronize()
        n = 4 + len(ids)
        self._host[slot, :n] = torch.tensor([lo, len(ids), start, length, *ids])
        self.values[:n].copy_(self._host[slot, :n], non_blocking=True)
        if self._copied[slot] is not None:
            self._copied[slot].record()


class MixedSteps:
    """One engine's mixed steps: the inputs of a step's chunk (`chunk`) and the step's logits
    (`logits`), through its bucket's graph where `graphed`. Runs on the engine's thread."""

    def __init__(
        self,
        model: Transformer,
        device: torch.device,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        step_tokens: int,
        use_cuda_graph: bool,
        max_batch: int,
        prefill_chunk: int,
    ):
        self.model, self.device, self.max_batch, self.prefill_chunk = model, device, max_batch, prefill_chunk
        self.dtype = dtype
        half = dtype in (torch.float16, torch.bfloat16)
        # The graphs' chunk attention (kernels/chunk_attention.py) reads the cache itself, not an FP8
        # cache's dequantized staging; a tensor-parallel rank's collectives stay eager.
        one_process = getattr(model, "parallel", None) is None
        self.graphed = use_cuda_graph and kv_dtype == dtype and one_process
        # A chunk's prefill attention, eagerly: on a GPU SDPA's flash backend, whatever the prefill's
        # choice: each chunk is a call of a new shape (its rows after a longer past), for which cuDNN
        # would build a new graph (~0.4 s), and the FP8 kernel's few query blocks would not fill the
        # GPU. float32 (no flash kernel) and the CPU: PyTorch's choice.
        self.backend = "flash" if device.type == "cuda" and half else None
        self.max_chunk_rows = chunk_bucket(max(16, step_tokens))  # the largest graph's chunk rows
        self._inputs = ChunkInputs(device, self.max_chunk_rows)
        self._pool = torch.cuda.graph_pool_handle() if self.graphed else None
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # (decode bucket, launch config) whose step has run in this process (kept over resets):
        # the kernels compiled for it, the decode attention's workspace made
        self.warmed: set[tuple[int, int]] = set()
        self.captures, self.capture_seconds = 0, 0.0

    def reset(self) -> None:
        """The cache was reallocated or freed: its graphs go with it, and the next ones are captured
        into a new pool. (Once its last graph is gone, PyTorch's allocator refuses a capture into
        the old pool until an empty_cache() frees it, which decode.capture skips: a server whose
        cache grew between two chunk sizes failed its requests on that check.)"""
        self._graphs = {}
        if self._pool is not None:
            self._pool = torch.cuda.graph_pool_handle()

    def chunk(
        self,
        ids: list[int],
        lo: int,
        start: int,
        length: int,
        region: KVCache,
        staging: tuple[torch.Tensor, torch.Tensor] | None,
        spare: int,
    ) -> PromptChunk:
        """The PromptChunk of prompt positions lo..lo+len(ids)-1 (ids: their tokens, at most
        max_chunk_rows) of a `length`-position prompt whose region, at cache position `start`, is
        `region`; padding rows write cache position `spare`. For a graph (the ids padded in the
        graphs' buffer, no host values), or eager."""
        count = len(ids)
        self._inputs.put(ids, lo, start, length)
        where, rows = self._inputs.where, chunk_bucket(count)
        if self.graphed and rows <= self.max_chunk_rows:
            from minidecode.kernels.chunk_attention import chunk_splits, default_config  # (imports triton)

            cfg, sms = self.model.config, sm_count(self.device)
            splits = chunk_splits(rows, cfg.num_heads, cfg.num_kv_heads, sms, default_config(self.dtype))
            return PromptChunk(self._inputs.ids[:rows], where, spare, splits=splits)
        host = (lo, count, start, length)
        chunk_ids = self._inputs.ids[:count]
        return PromptChunk(chunk_ids, where, spare, host, region, self.backend, self.prefill_chunk, staging)

    def logits(self, chunk: PromptChunk, state: DecodeState, n: int, cache: KVCache) -> torch.Tensor:
        """The step of `chunk` beside decode rows 0..n-1 of `state` -> float32 logits [1 + n, V]: the
        chunk's last position, then the decode rows."""
        if chunk.host is None:
            return self._replay(chunk, state, 0 if n == 0 else min(bucket(n), self.max_batch), cache)[: 1 + n]
        rows = state.rows(n)
        hidden = self.model.mixed(chunk, rows.tokens, rows.positions, rows.starts, rows.active, cache)
        return self.model.logits(hidden)

    def warm_up(self, chunk: PromptChunk, buckets: list[int], cache: KVCache) -> None:
        """Run `chunk`'s step eagerly beside no decode rows and beside each bucket's idle rows (which
        write only the spare granule): every kernel its graphs will launch compiled and its
        workspaces made, so that no later capture beside those rows needs a warm-up run."""
        for rows in [0, *buckets]:
            idle = DecodeState.idle(rows, self.device, chunk.spare)
            hidden = self.model.mixed(chunk, idle.tokens, idle.positions, idle.starts, idle.active, cache)
            self.model.logits(hidden)
            if self.graphed:
                self.warmed.add((rows, launch_config(self.model, self.dtype, cache)))

    def _replay(self, chunk: PromptChunk, state: DecodeState, b: int, cache: KVCache) -> torch.Tensor:
        """Replay the graph of chunk's rows beside decode rows 0..b-1 (idle past the running ones),
        captured on first use -> its logits [1 + b, V]."""
        key = (chunk.ids.shape[0], b)
        if key not in self._graphs:
            rows, out = state.rows(b), {}
            decode_rows = (rows.tokens, rows.positions, rows.starts, rows.active)

            def forward() -> None:
                out["logits"] = self.model.logits(self.model.mixed(chunk, *decode_rows, cache))

            # A warm-up only where no step beside b rows has run on a cache of this launch config in
            # this process (warm_up at load runs them all): then it is the step itself (it writes
            # the K/V the replay writes again), before the capture. Every chunk size's kernels
            # share one specialization (row counts alike mod 16: chunk_bucket); an eager run is ~40
            # ms of an 8B's launches, which the streams would wait for again after each resize.
            warm = (b, launch_config(self.model, self.dtype, cache))
            t0 = time.perf_counter()
            graph = capture(forward, (lambda: None) if warm in self.warmed else forward, pool=self._pool)
            self.warmed.add(warm)
            self._graphs[key] = graph, out["logits"]
            self.captures += 1
            self.capture_seconds += time.perf_counter() - t0
        graph, logits = self._graphs[key]
        graph.replay()
        return logits

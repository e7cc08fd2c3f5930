"""Timing of GPU work for the bench scripts: calls cycled inside one CUDA graph, so that
microsecond kernels are timed without launch gaps (imported by the scripts in this folder, which
run as scripts: their folder is on the import path)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    median: float  # microseconds per call, over the replays
    low: float
    high: float


def time_graph(calls: list[Callable[[], object]], target_us: float = 3000.0, replays: int = 15) -> Timing:
    """Microseconds per call, median and min-max of `replays` replays: `calls` (one per input set)
    cycled inside one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: compilation, workspaces, plans
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for fn in calls[:4]:
        fn()
    end.record()
    end.synchronize()
    estimate_us = start.elapsed_time(end) * 1e3 / min(4, len(calls))
    n_calls = max(len(calls), min(1000, math.ceil(target_us / max(estimate_us, 1.0))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n_calls):
            calls[i % len(calls)]()
    graph.replay()
    graph.replay()
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n_calls)
    del graph
    return Timing(statistics.median(times), min(times), max(times))


def event_ms(fn: Callable[[], object], repeats: int) -> list[float]:
    """Milliseconds of `repeats` calls of fn, each between CUDA events, after one warm-up call
    (work long enough that launch gaps do not matter: a whole layer's attention, a cache save)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def start_filled(engine, context: int, steps: int):
    """For timing decode alone, on an idle engine (minidecode.engine.Engine, no requests in its
    loop): a cache of one region for context + steps positions, whose contents the caller fills
    (fill_cache), and row 0 decoding it greedily from position `context` with no prefill;
    `engine.step(1, ...)` then runs its steps. -> the cache (a KVCache). The LLM's loop must forget
    the cache afterwards (LLM.release_cache)."""
    from minidecode.sampling import SamplingParams

    engine.resize(engine.region_size(context + steps))
    engine.start_row(0, 0, context, SamplingParams())
    return engine.cache


def fill_cache(cache) -> None:
    """A decode benchmark's cache (minidecode.models.cache.KVCache) filled with random values, a layer
    at a time (no cache-sized temporary): normal values, or for an FP8 cache finite positive e4m3
    bit patterns (0x7F is NaN) with every scale 0.01."""
    fp8 = cache.kv_scale is not None
    for t in (cache.k, cache.v):
        for layer in t:
            if fp8:
                layer.view(torch.uint8).random_(0, 0x7E)
            else:
                layer.normal_()
    if fp8:
        cache.kv_scale.fill_(0.01)

"""Batched decode throughput (`minidecode bench --batch SPEC`): many sequences decoded together,
through the public API, against the batched roofline and a peer measured in the same run.

Batched roofline: a step reads the weights once for the whole batch plus every sequence's K/V
(its own context), so tok/s <= B x read ceiling / (weights + sum of the contexts x KV bytes per
position), with the contexts at each window's mean.

Peer: `transformers` is transformers' greedy `generate` on the left-padded batch (SDPA, dynamic
cache).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from minidecode.benchmarks.e2e import (
    Ceilings,
    Spread,
    StepBytes,
    TokenClock,
    _free,
    benchmark_prompt,
    check_lengths,
    import_transformers,
    measure_ceilings,
    out_of_memory_message,
    pad_id_for,
    special_token_ids,
    transformers_peer,
    window_contexts,
    window_rates,
)
from minidecode.errors import UserError
from minidecode.llm import LLM
from minidecode.models.llama import step_weight_bytes

BATCH_PEERS = {
    "transformers": "transformers generate, left-padded batch (sdpa, dynamic cache)",
}
WARM_STEPS = 4  # decode steps before the first timed window (graph capture for the bucket)
NO_PEER = "none"  # --batch-peer none: minidecode alone


def batch_peers(text: str) -> tuple[str, ...]:
    """--batch-peer's comma-separated peers (none, or nothing: no peer), each checked."""
    peers = tuple(p.strip() for p in text.split(",") if p.strip() and p.strip() != NO_PEER)
    unknown = [p for p in peers if p not in BATCH_PEERS]
    if unknown:
        known = ", ".join([*BATCH_PEERS, NO_PEER])
        raise UserError(f"unknown batch peer {unknown[0]!r}; known: {known}")
    return peers


def import_peers(peers: tuple[str, ...]) -> None:
    """Refuse peers that cannot run here before anything is loaded or measured."""
    if "transformers" in peers:
        hint = ", or run minidecode alone: --batch-peer none"
        import_transformers("--batch-peer transformers (the default)", hint)


def parse_batch_spec(spec: str) -> list[int]:
    """ "8x32k" -> 8 prompts of 32768 tokens; "256k,4k,8k" -> one prompt per length."""

    def tokens(text: str) -> int:
        m = re.fullmatch(r"(\d+)([kKmM]?)", text.strip())
        if not m or int(m.group(1)) < 1:
            raise UserError(f"bad length {text!r} in --batch {spec!r} (like 4096, 32k or 1m)")
        return int(m.group(1)) * {"": 1, "k": 1024, "m": 1024**2}[m.group(2).lower()]

    m = re.fullmatch(r"(\d+)x(.+)", spec.strip())
    if m:
        if int(m.group(1)) < 1:
            raise UserError(f"--batch {spec!r}: the batch size must be >= 1")
        return [tokens(m.group(2))] * int(m.group(1))
    lengths = [tokens(part) for part in spec.split(",")]
    return lengths


@dataclass
class BatchPeerResult:
    peer: str  # a BATCH_PEERS key
    decode_tokens_per_s: Spread | None = None
    error: str | None = None


@dataclass
class BatchResult:
    spec: str
    lengths: list[int]
    window: int
    prefill_seconds: float  # every prompt, one after another
    decode_tokens_per_s: Spread  # all sequences together
    roofline_tokens_per_s: Spread
    percent_of_roofline: Spread
    bytes_per_step: Spread
    peak_memory_gib: float | None
    peers: list[BatchPeerResult] = field(default_factory=list)


def timed_batch(
    llm: LLM, prompts: list[list[int]], new_tokens: int, allow_extrapolation: bool = False
) -> tuple[float, list[float]]:
    """Greedy decode of exactly new_tokens for every prompt, all in one batch: (prefill seconds,
    host time of each step's hand-out; the first is the prefilled tokens')."""
    t0, times, seen = time.perf_counter(), [], 0
    stream = llm.stream_batch(
        prompts, temperature=0, max_new_tokens=new_tokens, ignore_eos=True,
        allow_extrapolation=allow_extrapolation,
    )  # fmt: skip
    for event in stream.events():
        if event.error is not None:
            raise UserError(f"request {event.index} was refused: {event.error}")
        if event.token is not None:
            seen += 1
            if seen % len(prompts) == 0:  # every sequence has its token of this step
                times.append(time.perf_counter())
    return times[0] - t0, times


def transformers_batch_rates(
    model, prompts: list[list[int]], new_tokens: int, pad_id: int, window: int
) -> list[float]:
    """transformers' greedy generate on the left-padded batch: decode tok/s (all sequences) per window."""
    longest = max(map(len, prompts))
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, longest - len(p) :] = torch.tensor(p)
        mask[b, longest - len(p) :] = 1
    device = next(model.parameters()).device
    clock = TokenClock(device)
    with torch.inference_mode():
        model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            streamer=clock,
        )
    return [len(prompts) * r for r in window_rates(clock.times[1:], window)]


def run_batch_bench(
    llm: LLM,
    specs: list[str],
    window: int = 32,
    repeats: int = 3,
    peers: tuple[str, ...] = ("transformers",),
    peer_max_batch_tokens: int = 300_000,
    log: Callable[[str], None] = print,
    allow_extrapolation: bool = False,
) -> tuple[list[BatchResult], Ceilings]:
    """Each batch spec: minidecode's batched decode (median and range of `repeats` windows of
    `window` steps), its batched roofline, and the peers (transformers only where the padded
    batch holds at most peer_max_batch_tokens tokens). Everything that would refuse the run
    (the specs, the peers, a batch the model or the memory cannot take) is checked before
    anything is measured."""
    peers = batch_peers(",".join(peers))
    batches = [(spec, parse_batch_spec(spec)) for spec in specs]
    import_peers(peers)
    new_tokens = 1 + WARM_STEPS + repeats * window
    for spec, lengths in batches:
        check_batch(llm, spec, lengths, new_tokens, allow_extrapolation, log)
    ceilings = measure_ceilings(llm.device, 2.0 if llm.device.type == "cuda" else 0.25)
    # the weights a step reads as loaded (FP8 weights: 1 byte a weight and their scales)
    per_step = StepBytes(step_weight_bytes(llm.model), llm.engine.planner.kv_bytes_per_token)
    special = special_token_ids(llm)
    pad_id = pad_id_for(special)
    excluded = special | {pad_id}
    short = benchmark_prompt(llm.config.vocab_size, 64, 1, excluded)
    results = []
    for spec, lengths in batches:
        # Compile and warm up at this batch's size first: the kernels for its row count would
        # otherwise compile inside the timed prefill (32 x 4k: 7.2 s instead of 4.0).
        timed_batch(llm, [short] * len(lengths), 8)
        prompts = [
            benchmark_prompt(llm.config.vocab_size, n, 1000 * i + n, excluded) for i, n in enumerate(lengths)
        ]
        if llm.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(llm.device)
        prefill, times = timed_batch(llm, prompts, new_tokens, allow_extrapolation)
        B = len(prompts)
        rates = [B * r for r in window_rates(times[WARM_STEPS:], window)]
        contexts = [
            sum(window_contexts(n + WARM_STEPS, window, repeats)[r] for n in lengths) for r in range(repeats)
        ]
        step = [per_step.at(c) for c in contexts]
        roofline = [B * ceilings.read_bytes_per_s / b for b in step]
        result = BatchResult(
            spec=spec,
            lengths=lengths,
            window=window,
            prefill_seconds=prefill,
            decode_tokens_per_s=Spread.of(rates),
            roofline_tokens_per_s=Spread.of(roofline),
            percent_of_roofline=Spread.of([100 * r / f for r, f in zip(rates, roofline, strict=True)]),
            bytes_per_step=Spread.of(step),
            peak_memory_gib=torch.cuda.max_memory_allocated(llm.device) / 2**30
            if llm.device.type == "cuda"
            else None,
        )
        log(
            f"minidecode batch {spec}: decode {result.decode_tokens_per_s.format()} tok/s, "
            f"{result.percent_of_roofline.median:.1f}% of the batched roofline "
            f"({result.roofline_tokens_per_s.median:,.0f} tok/s), prefill {prefill:.2f} s"
        )
        results.append(result)
    if "transformers" in peers:
        llm.release_cache()
        _free(llm.device)
        model = transformers_peer(llm)
        for result in results:
            peer = BatchPeerResult("transformers")
            if len(result.lengths) * max(result.lengths) > peer_max_batch_tokens:
                peer.error = f"not run (padded batch over {peer_max_batch_tokens:,} tokens)"
            else:
                prompts = [
                    benchmark_prompt(llm.config.vocab_size, n, 1000 * i + n, excluded)
                    for i, n in enumerate(result.lengths)
                ]
                try:
                    rates = transformers_batch_rates(model, prompts, new_tokens, pad_id, window)
                    peer.decode_tokens_per_s = Spread.of(rates[1:] if len(rates) > 1 else rates)
                except torch.OutOfMemoryError as e:
                    peer.error = out_of_memory_message(e)
                _free(llm.device)
            result.peers.append(peer)
            log(f"  {BATCH_PEERS['transformers']} {result.spec}: {_summary(peer)}")
    return results, ceilings


def check_batch(
    llm: LLM, spec: str, lengths: list[int], new_tokens: int, allow_extrapolation: bool, log: Callable
) -> None:
    """A batch the runtime would refuse, refused now: its longest sequence past the model's
    positions, or its sequences' cache (their contexts together, on the longest prefill) past
    the memory (bench.check_lengths)."""
    total = sum(n + new_tokens for n in lengths)
    try:
        check_lengths(llm, max(lengths), max(lengths) + new_tokens, allow_extrapolation, log)
        llm.check_fits(total, max(lengths))
    except UserError as e:
        raise UserError(f"--batch {spec}: {e}") from None


def _summary(peer: BatchPeerResult) -> str:
    return peer.error or f"decode {peer.decode_tokens_per_s.format()} tok/s"


def format_batch_table(results: list[BatchResult], ceilings: Ceilings) -> str:
    """The markdown table of a batch run; peer cells say the ratio minidecode / peer."""
    peers = [p.peer for p in results[0].peers] if results else []
    head = ["batch", "sequences x context", "decode tok/s (all)", "% of batched roofline", "prefill s"]
    head += [BATCH_PEERS[p] for p in peers]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in results:
        shape = (
            f"{len(r.lengths)} ({min(r.lengths):,}-{max(r.lengths):,})"
            if len(set(r.lengths)) > 1
            else f"{len(r.lengths)} x {r.lengths[0]:,}"
        )
        cells = [
            r.spec,
            shape,
            r.decode_tokens_per_s.format(),
            f"{r.percent_of_roofline.median:.1f}%",  # one decimal: the goal (85%) is near
            f"{r.prefill_seconds:.2f}",
        ]
        for p in r.peers:
            if p.error:
                cells.append(p.error)
            else:
                ratio = r.decode_tokens_per_s.median / p.decode_tokens_per_s.median
                cells.append(f"{p.decode_tokens_per_s.format()} ({ratio:.2f}x)")
        rows.append("| " + " | ".join(cells) + " |")
    rows.append("")
    rows.append(f"Read ceiling measured in the run: {ceilings.read_bytes_per_s / 1e9:,.0f} GB/s.")
    return "\n".join(rows)

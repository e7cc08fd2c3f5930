"""The server under load (GPU, synthetic:llama-3-8b): 1, 8 and 32 concurrent clients with 4k-token
prompts through the `openai` client against the same load through the Python API in the same run
(throughput, time to first token, inter-token latency p50 / p99), and the running streams'
inter-token latency before and during a long prompt's prefill.

Usage: python bench/serve.py [--out bench/results/serve] [--model synthetic:llama-3-8b]
Prints a markdown table last; --out also writes OUT.md and OUT.json.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from minidecode import LLM, Request
from minidecode.bench import benchmark_prompt, special_token_ids

PROMPT_TOKENS = 4096
NEW_TOKENS = 128
CLIENTS = (1, 8, 32)


@dataclass
class Load:
    """One load's figures: every request's TTFT and gaps between its tokens, and the wall time."""

    path: str  # "http" or "python"
    clients: int
    seconds: float = 0.0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def summary(self) -> dict:
        return {
            "path": self.path,
            "clients": self.clients,
            "tokens_per_s": round(self.tokens_per_s, 1),
            "ttft_p50_s": round(percentile(self.ttft, 50), 4),
            "ttft_p99_s": round(percentile(self.ttft, 99), 4),
            "itl_p50_ms": round(1e3 * percentile(self.gaps, 50), 2),
            "itl_p99_ms": round(1e3 * percentile(self.gaps, 99), 2),
        }


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def timed(load: Load, arrivals: list[float], start: float) -> None:
    """Token arrival times of one request -> its TTFT and gaps, counted into the load."""
    load.ttft.append(arrivals[0] - start)
    load.gaps += [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    load.tokens += len(arrivals)


def run_clients(clients: int, one) -> float:
    """`clients` threads each running one(i) at once; -> the wall seconds of them all."""
    barrier = threading.Barrier(clients + 1)
    threads = [threading.Thread(target=lambda i=i: (barrier.wait(), one(i))) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def http_load(base: str, prompts: list[list[int]], clients: int) -> Load:
    import openai

    load, lock = Load("http", clients), threading.Lock()

    def one(i: int) -> None:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
        start, arrivals = time.perf_counter(), []
        stream = client.completions.create(
            model="bench", prompt=prompts[i], max_tokens=NEW_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason is None:
                arrivals.append(time.perf_counter())
        with lock:
            timed(load, arrivals, start)

    load.seconds = run_clients(clients, one)
    return load


def python_load(llm: LLM, prompts: list[list[int]], clients: int) -> Load:
    load, lock = Load("python", clients), threading.Lock()

    def one(i: int) -> None:
        start, arrivals = time.perf_counter(), []
        stream = llm.stream(token_ids=prompts[i], max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        for event in stream.events():
            if event.token is not None:
                arrivals.append(time.perf_counter())
        with lock:
            timed(load, arrivals, start)

    load.seconds = run_clients(clients, one)
    return load


def prefill_stall(llm: LLM, prompts: list[list[int]], long_prompt: list[int]) -> dict:
    """8 streams decoding 4k-token contexts; then a long prompt arrives: the streams' gaps between
    tokens before it (steady state) and while it prefills (until its first token)."""
    arrivals: queue.SimpleQueue = queue.SimpleQueue()  # (stream, event, host time)
    streams = []
    for k, ids in enumerate(prompts[:8]):
        request = Request(token_ids=ids, max_new_tokens=100_000, temperature=0, ignore_eos=True).check()
        streams.append(llm.submit(request, lambda event, k=k: arrivals.put((k, event, time.perf_counter()))))
    times: dict[int, list[float]] = {k: [] for k in range(8)}
    first = threading.Event()

    def pull(until: float | None = None) -> None:
        while (until is None or time.perf_counter() < until) and not (until is None and first.is_set()):
            try:
                k, event, t = arrivals.get(timeout=0.01)
            except queue.Empty:
                continue
            if event.token is not None:
                times[k].append(t)

    pull(until=time.perf_counter() + 5.0)  # every stream admitted and decoding
    steady_from = time.perf_counter()
    pull(until=steady_from + 3.0)
    submitted = time.perf_counter()
    request = Request(token_ids=long_prompt, max_new_tokens=2, temperature=0).check()
    long_seq = llm.submit(request, lambda event: event.token is not None and first.set())
    pull()  # until the long prompt's first token: its prefill is done
    prefilled = time.perf_counter()
    llm.loop.abort([*streams, long_seq])

    def gaps(lo: float, hi: float) -> list[float]:
        out = []
        for stamps in times.values():
            window = [t for t in stamps if lo <= t <= hi]
            out += [b - a for a, b in zip(window, window[1:], strict=False)]
        return out

    before, during = gaps(steady_from, submitted), gaps(submitted, prefilled)
    step = percentile(before, 50)
    return {
        "long_prompt_tokens": len(long_prompt),
        "prefill_seconds_with_streams": round(prefilled - submitted, 2),
        "steady_itl_p50_ms": round(1e3 * step, 2),
        "steady_itl_p99_ms": round(1e3 * percentile(before, 99), 2),
        "during_itl_p50_ms": round(1e3 * percentile(during, 50), 2),
        "during_itl_p99_ms": round(1e3 * percentile(during, 99), 2),
        "during_p99_over_steady_step": round(percentile(during, 99) / step, 2),
        "stream_tokens_during_prefill": len(during),
    }


def serve_in_thread(llm: LLM):
    import socket

    import uvicorn

    from minidecode.server import ServerSettings, create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(
        create_app(llm, ServerSettings("bench")), host="127.0.0.1", port=port, log_level="error"
    )
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="synthetic:llama-3-8b")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--long", type=int, default=131072, help="the long prompt of the stall measurement")
    args = parser.parse_args()
    llm = LLM(args.model)
    excluded = special_token_ids(llm)
    prompts = [
        benchmark_prompt(llm.config.vocab_size, PROMPT_TOKENS, 100 + i, excluded) for i in range(max(CLIENTS))
    ]
    server, base = serve_in_thread(llm)
    llm.generate(token_ids=prompts[0][:512], max_new_tokens=8)  # compile, capture
    rows = []
    for clients in CLIENTS:
        for order in ("python", "http", "python", "http"):  # alternating: drift hits both alike
            llm.release_cache()  # no prefix reuse between repeats
            run = (
                python_load(llm, prompts, clients) if order == "python" else http_load(base, prompts, clients)
            )
            rows.append(run.summary())
            print(json.dumps(rows[-1]), flush=True)
    llm.release_cache()
    long_prompt = benchmark_prompt(llm.config.vocab_size, args.long, 7, excluded)
    stall = prefill_stall(llm, prompts, long_prompt)
    print(json.dumps(stall), flush=True)
    server.should_exit = True
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    table = ["| clients | path | tok/s (all clients) | TTFT p50 / p99 s | inter-token p50 / p99 ms |",
             "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for clients in CLIENTS:
        for path in ("python", "http"):
            mine = [r for r in rows if r["clients"] == clients and r["path"] == path]
            rate = statistics.median(r["tokens_per_s"] for r in mine)
            spread = (
                f"{min(r['tokens_per_s'] for r in mine):,.1f}-{max(r['tokens_per_s'] for r in mine):,.1f}"
            )
            last = mine[-1]
            table.append(
                f"| {clients} | {path} | {rate:,.1f} ({spread}) | "
                f"{last['ttft_p50_s']:.3f} / {last['ttft_p99_s']:.3f} | "
                f"{last['itl_p50_ms']:.1f} / {last['itl_p99_ms']:.1f} |"
            )
    overhead = []
    for clients in CLIENTS:
        py = statistics.median(
            r["tokens_per_s"] for r in rows if r["clients"] == clients and r["path"] == "python"
        )
        http = statistics.median(
            r["tokens_per_s"] for r in rows if r["clients"] == clients and r["path"] == "http"
        )
        overhead.append(f"{clients} clients: HTTP at {100 * http / py:.1f}% of the Python API's throughput")
    text = "\n".join(table) + "\n\n" + "; ".join(overhead) + "\n\nprefill stall: " + json.dumps(stall)
    print(f"{device}, {args.model}, {PROMPT_TOKENS}-token prompts, {NEW_TOKENS} new tokens each")
    print(text)
    if args.out is not None:
        args.out.with_suffix(".json").write_text(
            json.dumps({"device": device, "runs": rows, "stall": stall}, indent=1)
        )
        args.out.with_suffix(".md").write_text(f"# Serving\n\n{device}, {args.model}\n\n{text}\n")


if __name__ == "__main__":
    main()

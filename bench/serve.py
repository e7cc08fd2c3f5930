"""The server under load (GPU, synthetic:llama-3-8b): 1, 8 and 32 concurrent clients with 4k-token
prompts through the `openai` client against the same load through the Python API (throughput,
time to first token, inter-token latency p50 / p99), and the running streams' inter-token latency
before and during a long prompt's prefill.

Each phase runs in a process of its own, alternating python / http (three times by default,
--alternations): the Python API's load
in a process that holds the model, and the HTTP load against `minidecode serve` in another, from
client processes of CLIENTS_PER_PROCESS clients each (their parsing of the chunks shares neither
the server's interpreter nor one client interpreter for all), each given its prompts on its stdin
(a client process imports only the `openai` client). The moment every request is sent is set once
every client process has reported ready (its clients made): a process still starting at a fixed
moment would send late and stretch its load's wall time with its own start-up (up to 2.3 s of
8-32 concurrently starting processes that imported torch for their prompts, on an H100,
bench/NOTES-engine.md). Every level of clients runs once untimed first (its decode graphs
captured), on prompts of their own (no prefix reuse of the timed prompts).

Usage: python bench/serve.py [--out bench/results/serve-h100] [--model synthetic:llama-3-8b]
Prints a markdown table last; --out also writes OUT.md and OUT.json.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

STARTED = time.monotonic()  # this process's start: a client process reports its start-up from it
PROMPT_TOKENS = 4096  # defaults of the options below
NEW_TOKENS = 128
CLIENTS = (1, 8, 32)
CLIENTS_PER_PROCESS = 4
# Seconds from a load's setup to its start, on both paths: the HTTP clients' processes start in
# it, and the Python API's load waits as long, so each timed load finds the GPU as idle (an idle
# GPU lowers its clocks, which the first request would pay on one path only). Where the client
# processes take longer to be ready, the start is READY_MARGIN_S after the last one is.
START_DELAY_S = 5.0
READY_MARGIN_S = 0.5


@dataclass
class Load:
    """One load's figures: every request's TTFT and gaps between its tokens, and the wall time."""

    path: str  # "http" or "python"
    clients: int
    seconds: float = 0.0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    engine_ttft: float = float("nan")  # mean, by the engine's clock: from submission to the first token
    late: float = 0.0  # HTTP: how long after the common start the last client process sent (s)
    setup: float = 0.0  # HTTP: the slowest client process's start-up, to ready (s)
    errors: list[str] = field(default_factory=list)  # what each failed client raised (its run is void)
    stops: dict = field(default_factory=dict)  # the engine's cache reallocations and graph captures in it

    def summary(self) -> dict:
        return {
            "path": self.path,
            "clients": self.clients,
            "tokens_per_s": round(self.tokens / self.seconds, 1),
            "ttft_p50_s": round(percentile(self.ttft, 50), 4),
            "ttft_p99_s": round(percentile(self.ttft, 99), 4),
            "engine_ttft_mean_s": round(self.engine_ttft, 4),
            "clients_late_s": round(self.late, 4),
            "clients_setup_s": round(self.setup, 3),
            "client_errors": len(self.errors),
            "first_error": self.errors[0] if self.errors else None,
            **self.stops,
            "itl_p50_ms": round(1e3 * percentile(self.gaps, 50), 2),
            "itl_p99_ms": round(1e3 * percentile(self.gaps, 99), 2),
        }


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def prompts(model: str, count: int, seed: int, length: int) -> list[list[int]]:
    """`count` random prompts of `length` ids that avoid the model's special ids."""
    from minidecode.benchmarks.e2e import benchmark_prompt
    from minidecode.info import SYNTHETIC, synthetic_config
    from minidecode.models.config import ModelConfig

    # (a local checkpoint folder too: a small model makes a CPU run of the harness)
    if model.startswith(SYNTHETIC):
        cfg = synthetic_config(model)
    else:
        cfg = ModelConfig.from_file(Path(model) / "config.json")
    special = {cfg.bos_token_id, *cfg.eos_token_ids} - {None}
    return [benchmark_prompt(cfg.vocab_size, length, seed + i, special) for i in range(count)]


def run_clients(path: str, clients: int, one: Callable[[int, Load, threading.Lock], None]) -> Load:
    """`clients` threads each running one(i, load, lock) at once; -> the load, its wall time set, and
    what any client raised in load.errors (a thread's exception would otherwise only be printed,
    and the load would count that client's tokens as none)."""
    load, lock = Load(path, clients), threading.Lock()
    barrier = threading.Barrier(clients + 1)

    def client(i: int) -> None:
        barrier.wait()
        try:
            one(i, load, lock)
        except Exception as e:
            with lock:
                load.errors.append(f"{type(e).__name__}: {e}"[:300])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    load.seconds = time.perf_counter() - t0
    return load


def record(load: Load, lock: threading.Lock, start: float, arrivals: list[float]) -> None:
    with lock:
        load.ttft.append(arrivals[0] - start)
        load.gaps += [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
        load.tokens += len(arrivals)


def http_clients(base: str, batch: list[list[int]], new: int, ready: Callable[[], float]) -> Load:
    """(a client process) One openai client a prompt, made and used once before the start; then
    ready() reports the process ready and returns the start, a time.monotonic() at which every
    client sends its streamed request at once; -> the load, `seconds` from the start to its last
    token."""
    import openai

    clients = [
        openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600) for _ in batch
    ]
    for client in clients:  # each one's connection open and its first-request work done, as a
        client.models.list()  # client that has talked to the server before

    def one(i: int, load: Load, lock: threading.Lock) -> None:
        start, arrivals = time.perf_counter(), []
        # The ids go in extra_body, as the same JSON body: given as `prompt`, the openai client's
        # typed-params transform walks every id first (~40 ms for 4,096 ids on the client's CPU, ~180
        # ms with 4 clients in one process), a cost of the client library, not of the server.
        stream = clients[i].completions.create(
            model="bench", prompt="", max_tokens=new, temperature=0, stream=True,
            extra_body={"prompt": batch[i], "ignore_eos": True},
        )  # fmt: skip
        for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason is None:
                arrivals.append(time.perf_counter())
        record(load, lock, start, arrivals)

    start_at = ready()
    time.sleep(max(0.0, start_at - time.monotonic()))
    late = time.monotonic() - start_at  # > 0: this process woke after the start
    load = run_clients("http", len(batch), one)
    load.late = late
    load.seconds = time.monotonic() - start_at
    return load


def start_together(procs: list[subprocess.Popen], earliest: float) -> tuple[float, float]:
    """Each client process's first line (its start-up, once its clients are made), then one start
    for all: a time.monotonic() at `earliest` or READY_MARGIN_S after the last is ready, sent to
    every process before any is waited on; -> (the slowest start-up, the start)."""
    setup = 0.0
    for proc in procs:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a client process failed before it was ready ({proc.wait()})")
        setup = max(setup, json.loads(line)["ready_s"])
    start_at = max(earliest, time.monotonic() + READY_MARGIN_S)
    for proc in procs:
        proc.stdin.write(f"{start_at!r}\n")
        proc.stdin.flush()
    return setup, start_at


def http_load(base: str, model: str, seed: int, length: int, clients: int, new: int, delay: float) -> Load:
    """`clients` streamed requests through the openai client, CLIENTS_PER_PROCESS a client process
    (one process's interpreter would add its own parsing of every client's chunks to the gaps),
    all sent at one moment once every process is ready (`delay` from now at the earliest); -> the
    load, its wall time from that moment to the last token."""
    earliest = time.monotonic() + delay
    batch = prompts(model, clients, seed, length)
    before = server_metrics(base)
    command = [sys.executable, __file__, "--phase", "clients", "--base", base, "--new-tokens", str(new)]
    parts = [batch[first : first + CLIENTS_PER_PROCESS] for first in range(0, clients, CLIENTS_PER_PROCESS)]
    pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    procs = [subprocess.Popen(command, **pipes) for _ in parts]
    for proc, part in zip(procs, parts, strict=True):  # all started first: a pipe takes 64 KiB unread
        proc.stdin.write(json.dumps(part) + "\n")
        proc.stdin.flush()
    load = Load("http", clients)
    load.setup, _ = start_together(procs, earliest)
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"a client process failed ({proc.returncode})")
        part = json.loads(out.strip().splitlines()[-1])
        load.ttft += part["ttft"]
        load.gaps += part["gaps"]
        load.tokens += part["tokens"]
        load.seconds = max(load.seconds, part["seconds"])
        load.late = max(load.late, part["late"])
        load.errors += part["errors"]
    after = server_metrics(base)
    requests = max(after["ttft_count"] - before["ttft_count"], 1)
    load.engine_ttft = (after["ttft_sum"] - before["ttft_sum"]) / requests
    load.stops = stops_in(before, after)
    return load


STOPS = ("cache_reallocations", "graph_captures", "graph_capture_seconds")


def engine_stops(engine) -> dict:
    """The engine's counts of work outside prefill and decode so far (the server's /metrics)."""
    return dict(zip(STOPS, (engine.resizes, engine.captures, engine.capture_seconds), strict=True))


def stops_in(before: dict, after: dict) -> dict:
    return {name: round(after[name] - before[name], 3) for name in STOPS}


def python_load(llm, batch: list[list[int]], new: int) -> Load:
    engine_ttft = []
    before = engine_stops(llm.engine)

    def one(i: int, load: Load, lock: threading.Lock) -> None:
        start, arrivals = time.perf_counter(), []
        stream = llm.stream(token_ids=batch[i], max_new_tokens=new, temperature=0, ignore_eos=True)
        for event in stream.events():
            if event.token is not None:
                arrivals.append(time.perf_counter())
        record(load, lock, start, arrivals)
        engine_ttft.append(stream.result.stats.time_to_first_token)

    load = run_clients("python", len(batch), one)
    load.engine_ttft = statistics.mean(engine_ttft)
    load.stops = stops_in(before, engine_stops(llm.engine))
    return load


def server_metrics(base: str) -> dict:
    """From the server's /metrics so far: its time-to-first-token histogram's sum and count (its own
    clock: from a request's submission to the engine to its first token), and the engine's stops."""
    import urllib.request

    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    found = {name: float(values[f"minidecode_{name}_total"]) for name in STOPS}
    found["ttft_sum"] = float(values["minidecode_time_to_first_token_seconds_sum"])
    found["ttft_count"] = float(values["minidecode_time_to_first_token_seconds_count"])
    return found


@contextmanager
def server_process(model: str):
    """`minidecode serve MODEL` in a process of its own; -> its base URL."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "minidecode",
        "serve",
        model,
        "--port",
        str(port),
        "--served-model-name",
        "bench",
        "--no-access-log",  # its stderr is a pipe read only on failure: a line a request would fill it
    ]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited: {proc.stderr.read()[-2000:]}")
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def seeds(level: int) -> tuple[int, int]:
    """The first prompt seeds of a level's (untimed, timed) loads: every load's prompts its own, so
    that neither path reuses a cached prefix (the server keeps finished requests' K/V as prefixes,
    and so does the Python API's engine loop)."""
    return 1000 * level + 500, 1000 * level + 100


def phase(path: str, model: str, length: int, new: int, levels: tuple[int, ...], delay: float) -> None:
    """One phase in this process: each level of clients untimed (graphs captured, other prompts),
    then timed; a JSON line per timed run. Both paths keep their cache between loads."""
    if path == "python":
        from minidecode import LLM

        llm = LLM(model)
        for clients in levels:
            untimed, timed = (prompts(model, clients, seed, length) for seed in seeds(clients))
            python_load(llm, untimed, new=4)
            time.sleep(delay)
            print(json.dumps(python_load(llm, timed, new).summary()), flush=True)
        return
    with server_process(model) as base:
        for clients in levels:
            untimed, timed = seeds(clients)
            http_load(base, model, untimed, length, clients, 4, delay)
            load = http_load(base, model, timed, length, clients, new, delay)
            print(json.dumps(load.summary()), flush=True)


def prefill_stall(model: str, long: int, length: int, step_tokens: int | None) -> dict:
    """8 streams decoding 4k-token contexts; then a `long`-token prompt arrives: the streams' gaps
    between tokens before it (the steady state) and while it prefills (until its first token), with
    a mixed step's budget of `step_tokens` rows (None: the runtime's default)."""
    from minidecode import LLM, Request
    from minidecode.benchmarks.e2e import benchmark_prompt

    llm = LLM(model, step_tokens=step_tokens)
    arrivals: queue.SimpleQueue = queue.SimpleQueue()  # (stream, event, host time)
    streams = []
    # Room for 8k new tokens each, or the rest of a small model's context: the long prefill of the
    # 8B interleaves some 2,000 of their steps (and the cache must grow beside them for the long
    # prompt: 8 x 12k + 128k positions).
    new = min(8192, llm.config.max_position_embeddings - length)
    for k, ids in enumerate(prompts(model, 8, 100, length)):
        request = Request(token_ids=ids, max_new_tokens=new, temperature=0, ignore_eos=True).check()
        streams.append(llm.submit(request, lambda event, k=k: arrivals.put((k, event, time.perf_counter()))))
    times: dict[int, list[float]] = {k: [] for k in range(8)}
    first = threading.Event()

    def pull(until: float | None) -> None:
        while not (first.is_set() if until is None else time.perf_counter() >= until):
            try:
                k, event, t = arrivals.get(timeout=0.01)
            except queue.Empty:
                continue
            if event.token is not None:
                times[k].append(t)

    pull(time.perf_counter() + 5.0)  # every stream admitted and decoding
    steady_from = time.perf_counter()
    pull(steady_from + 3.0)
    submitted = time.perf_counter()
    request = Request(
        token_ids=benchmark_prompt(llm.config.vocab_size, long, 7, set()), max_new_tokens=2
    ).check()
    failed: list[str] = []

    def long_sink(event) -> None:  # its first token (its prefill is done), or its failure
        if event.error is not None:
            failed.append(event.error)
        if event.token is not None or event.done:
            first.set()

    long_seq = llm.submit(request, long_sink)
    pull(None)  # until the long prompt's first token
    prefilled = time.perf_counter()
    llm.loop.abort([*streams, long_seq])
    if failed:
        raise RuntimeError(f"the long prompt failed: {failed[0]}")
    # The same length alone (other ids: nothing reused), for what the streams cost the prefill.
    alone = llm.generate(
        token_ids=benchmark_prompt(llm.config.vocab_size, long, 8, set()), max_new_tokens=1
    ).stats.prefill_seconds

    def gaps(lo: float, hi: float) -> list[float]:
        out = []
        for stamps in times.values():
            window = [t for t in stamps if lo <= t <= hi]
            out += [b - a for a, b in zip(window, window[1:], strict=False)]
        return out

    before, during = gaps(steady_from, submitted), gaps(submitted, prefilled)
    step = percentile(before, 50)
    return {
        "long_prompt_tokens": long,
        "step_tokens": llm.engine.step_tokens,
        "prefill_seconds_with_streams": round(prefilled - submitted, 2),
        "prefill_seconds_alone": round(alone, 2),
        "steady_itl_p50_ms": round(1e3 * step, 2),
        "steady_itl_p99_ms": round(1e3 * percentile(before, 99), 2),
        "during_itl_p50_ms": round(1e3 * percentile(during, 50), 2),
        "during_itl_p99_ms": round(1e3 * percentile(during, 99), 2),
        "during_p99_over_steady_step": round(percentile(during, 99) / step, 2),
        "during_itl_max_ms": round(1e3 * max(during), 1),
        "during_gaps_over_3_steps": sum(gap > 3 * step for gap in during),
        "during_seconds_in_gaps_over_3_steps": round(sum(gap for gap in during if gap > 3 * step), 2),
        "stream_tokens_during_prefill": len(during),
    }


def table(rows: list[dict], levels: tuple[int, ...]) -> str:
    lines = [
        "| clients | path | tok/s (all clients) | TTFT p50 / p99 s | engine's TTFT, mean s "
        "| inter-token p50 / p99 ms | cache reallocations, graph captures (s) "
        "| client processes' start-up / late, most s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for clients in levels:
        rates = {}
        for path in ("python", "http"):
            runs = [r for r in rows if r["clients"] == clients and r["path"] == path]
            mine = [r for r in runs if not r["client_errors"]]
            void = [r for r in runs if r["client_errors"]]
            for r in void:  # a client failed: its tokens are missing from the run's figures
                lines.append(
                    f"| {clients} | {path} | void (alternation {r['alternation'] + 1}: {r['client_errors']} "
                    f"clients failed: {r['first_error']}) | | | | | |"
                )
            if not mine:
                continue
            rate = rates[path] = statistics.median(r["tokens_per_s"] for r in mine)
            spread = (
                f"{min(r['tokens_per_s'] for r in mine):,.1f}-{max(r['tokens_per_s'] for r in mine):,.1f}"
            )
            ttft = statistics.median(r["ttft_p50_s"] for r in mine), max(r["ttft_p99_s"] for r in mine)
            itl = statistics.median(r["itl_p50_ms"] for r in mine), max(r["itl_p99_ms"] for r in mine)
            engine_ttft = statistics.median(r["engine_ttft_mean_s"] for r in mine)
            stops = "; ".join(
                f"{r['cache_reallocations']:g}, {r['graph_captures']:g} ({r['graph_capture_seconds']:.2f})"
                for r in mine
            )  # each run's
            setup, late = (max(r[key] for r in mine) for key in ("clients_setup_s", "clients_late_s"))
            late = f"{setup:.2f} / {late:.3f}" if path == "http" else ""
            lines.append(
                f"| {clients} | {path} | {rate:,.1f} ({spread}, n={len(mine)}) | "
                f"{ttft[0]:.3f} / {ttft[1]:.3f} | {engine_ttft:.3f} | {itl[0]:.1f} / {itl[1]:.1f} | {stops} "
                f"| {late} |"
            )
        if len(rates) == 2:
            # Each alternation's pair (python then http, one after the other), for the worst of them.
            level = [r for r in rows if r["clients"] == clients]
            pairs = [
                [r["tokens_per_s"] for path in ("python", "http") for r in level
                 if r["path"] == path and r["alternation"] == k and not r["client_errors"]]
                for k in sorted({r["alternation"] for r in level})
            ]  # fmt: skip
            each = ", ".join(f"{h / p:.3f}" for p, h in (pair for pair in pairs if len(pair) == 2))
            lines.append(
                f"| {clients} | http / python | {rates['http'] / rates['python']:.3f} "
                f"(each alternation: {each}) | | | | | |"
            )
    return "\n".join(lines)


def stall_table(stalls: list[dict]) -> str:
    """The prefill-stall runs, one line each: the long prompt's prefill beside the 8 streams against
    alone, and the streams' gaps while it prefilled, in steady steps (their median gap before)."""
    lines = [
        "| step_tokens | prefill with streams / alone (s) | ratio | steady step ms | gap p50 / p99 ms "
        "| p99 / step | longest gap (steps) | gaps > 3 steps (s in them) | stream tokens during it |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in stalls:
        step = s["steady_itl_p50_ms"]
        lines.append(
            f"| {s['step_tokens']} | {s['prefill_seconds_with_streams']} / {s['prefill_seconds_alone']} | "
            f"{s['prefill_seconds_with_streams'] / s['prefill_seconds_alone']:.2f}x | {step} | "
            f"{s['during_itl_p50_ms']} / {s['during_itl_p99_ms']} | {s['during_p99_over_steady_step']} | "
            f"{s['during_itl_max_ms']} ({s['during_itl_max_ms'] / step:.1f}) | "
            f"{s['during_gaps_over_3_steps']} ({s['during_seconds_in_gaps_over_3_steps']}) | "
            f"{s['stream_tokens_during_prefill']:,} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="synthetic:llama-3-8b")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--long", type=int, default=131072, help="the long prompt of the stall measurement")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--clients", type=int, nargs="+", default=list(CLIENTS))
    parser.add_argument(
        "--start-delay", type=float, default=START_DELAY_S, help="seconds from a load's setup to its start"
    )
    phases = ("python", "http", "stall", "clients")
    parser.add_argument(
        "--stall-step-tokens", type=int, nargs="+", default=[0],
        help="the stall measurement once per mixed-step budget (0: the runtime's default)",
    )  # fmt: skip
    parser.add_argument("--parts", nargs="+", choices=("loads", "stall"), default=["loads", "stall"])
    parser.add_argument("--alternations", type=int, default=3, help="python / http phase pairs")
    parser.add_argument("--phase", choices=phases, help="(internal) run one phase here")
    parser.add_argument("--base", help="(internal) the server's URL, for --phase clients")
    args = parser.parse_args()
    if args.phase == "clients":
        batch = json.loads(sys.stdin.readline())  # this process's prompts, from the load's process

        def ready() -> float:  # this process ready: its start-up to the parent, the start from it
            print(json.dumps({"ready_s": time.monotonic() - STARTED}), flush=True)
            return float(sys.stdin.readline())

        load = http_clients(args.base, batch, args.new_tokens, ready)
        part = {"ttft": load.ttft, "gaps": load.gaps, "tokens": load.tokens, "seconds": load.seconds}
        part["late"], part["errors"] = load.late, load.errors
        print(json.dumps(part))
        return
    if args.phase == "stall":
        budget = args.stall_step_tokens[0] or None
        print(json.dumps(prefill_stall(args.model, args.long, args.prompt_tokens, budget)), flush=True)
        return
    if args.phase is not None:
        levels = tuple(args.clients)
        phase(args.phase, args.model, args.prompt_tokens, args.new_tokens, levels, args.start_delay)
        return
    rows, stalls = [], []
    alternations = range(args.alternations) if "loads" in args.parts else ()
    runs = [(name, 0, k) for k in alternations for name in ("python", "http")]
    runs += [("stall", budget, None) for budget in args.stall_step_tokens if "stall" in args.parts]
    for name, budget, alternation in runs:
        command = [sys.executable, __file__, "--phase", name, "--model", args.model, "--long", str(args.long)]
        command += ["--stall-step-tokens", str(budget)]
        command += ["--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens)]
        command += ["--clients", *map(str, args.clients), "--start-delay", str(args.start_delay)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            print(f"!! phase {name} failed: {done.stderr[-1500:]}", flush=True)
        for line in done.stdout.splitlines():
            if not line.startswith("{"):
                continue
            print(line, flush=True)
            if name == "stall":
                stalls.append(json.loads(line))
            else:
                rows.append(json.loads(line) | {"alternation": alternation})
    import torch

    from minidecode.benchmarks.e2e import provenance

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    commit, date = provenance()["commit"], time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    head = (
        f"{device} · {date} · commit {commit} · torch {torch.__version__} · {args.model}, "
        f"{args.prompt_tokens}-token prompts, {args.new_tokens} new tokens each"
    )
    text = "\n\n".join([table(rows, tuple(args.clients))] * bool(rows) + [stall_table(stalls)] * bool(stalls))
    print(head)
    print(text)
    if args.out is not None:
        report = {"device": device, "date": date, "commit": commit, "runs": rows, "stalls": stalls}
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
        args.out.with_suffix(".md").write_text(f"# Serving\n\n{head}\n\n{text}\n")


if __name__ == "__main__":
    main()

"""The `minidecode` command: generate / info / bench. Parses, calls the Python API, prints.

Text goes to stdout as it is decoded; progress and stats go to stderr, so
`minidecode generate ... > out.txt` captures exactly the generated text. torch is imported only
inside a command that needs it, after its arguments were checked: `--help`, `--version` and a
mistyped option answer at once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from minidecode import __version__
from minidecode.batch_file import BatchReport, batch_stats_line, read_requests, result_fields
from minidecode.errors import UserError
from minidecode.request import DEFAULT_MAX_BATCH, DEFAULT_MAX_NEW_TOKENS


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"minidecode {__version__}")
        raise typer.Exit()


app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain click help: no type column (`<bool>` on flags), and no rich import
    help="Long-context text generation for Llama-family models.",
)


@app.callback()
def _main_options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_show_version, is_eager=True, metavar="", help="Print the version and exit"
        ),
    ] = False,
) -> None:
    """Long-context text generation for Llama-family models."""


ModelArg = Annotated[
    str | None,
    typer.Argument(
        help="Checkpoint folder, hub repo id, or synthetic:NAME (default: the model shipped with minidecode)"
    ),
]
DeviceOpt = Annotated[str | None, typer.Option(help="cpu, cuda or cuda:N (default: cuda if available)")]
DtypeOpt = Annotated[
    str | None, typer.Option(help="bfloat16, float16 or float32 (default: bf16 on GPU, fp32 on CPU)")
]

KvCacheDtypeOpt = Annotated[
    str,
    typer.Option(
        "--kv-cache-dtype",
        metavar="[auto|fp8]",
        help="KV cache storage: auto (the model's dtype) or fp8 (e4m3 with a scale per token and KV "
        "head: half the bytes, slightly less accurate)",
    ),
]


QuantizationOpt = Annotated[
    str,
    typer.Option(
        "--quantization",
        metavar="[none|fp8]",
        help="Weights: none (the checkpoint's) or fp8 (a bf16/fp16 checkpoint's Linear layers rounded to "
        "e4m3 per output channel on load: half the weight bytes; FP8 checkpoints load as they are)",
    ),
]
PrefillAttentionOpt = Annotated[
    str,
    typer.Option(
        "--prefill-attention",
        metavar="[auto|fp8]",
        help="Prefill attention: auto (SDPA's faster kernel) or fp8 (an e4m3 flash-attention kernel on "
        "Ada / Hopper GPUs: faster at long prompts, slightly less accurate)",
    ),
]
MaxNewTokensOpt = Annotated[int, typer.Option("--max-new-tokens", "-n", help="Most tokens to generate")]
TemperatureOpt = Annotated[float | None, typer.Option(help="0 = greedy (default: the model's)")]
TopKOpt = Annotated[int | None, typer.Option(help="0 = off")]
TopPOpt = Annotated[float | None, typer.Option(help="1 = off")]
StopOpt = Annotated[
    list[str] | None,
    typer.Option(
        metavar="TEXT",
        help=r'Stop before this text (repeatable); backslash escapes such as "\n" are interpreted',
    ),
]
TpOpt = Annotated[
    int,
    typer.Option(
        "--tp", help="Tensor parallel: split heads, MLP and vocabulary over this many GPUs (under torchrun)"
    ),
]
CpOpt = Annotated[
    int,
    typer.Option(
        "--cp", help="Context parallel: split the KV cache's positions over this many GPUs (under torchrun)"
    ),
]


def rank() -> int:
    """This process's rank under torchrun (0 otherwise): only rank 0 prints."""
    return int(os.environ.get("RANK", "0") or 0)


RANK0_GRACE_S = 5.0  # how long the other ranks of a failing torchrun launch let rank 0 print


def fail(message: str, code: int = 2) -> None:
    if rank() == 0:  # every rank of a torchrun launch fails alike; one line is enough
        typer.echo(f"error: {message}", err=True)
    else:
        # torchrun stops every worker as soon as one exits with an error: a rank that got here
        # first would kill rank 0 before its line is out (seen once in CI: no error line at all)
        time.sleep(RANK0_GRACE_S)
    raise typer.Exit(code)


def _on_interrupt(signum, frame) -> None:
    """Ctrl-C: one line on stderr (from rank 0 only: a terminal's Ctrl-C reaches every rank of a
    torchrun launch), then KeyboardInterrupt unwinds (typer exits with 130). Written with
    os.write: the signal may arrive in the middle of another write to sys.stderr."""
    if rank() == 0:
        os.write(2, b"\nerror: interrupted\n" if sys.stderr.isatty() else b"error: interrupted\n")
    raise KeyboardInterrupt


class Progress:
    """Prefill progress on stderr, with tokens/s: a one-line bar on a terminal; in a log (stderr
    not a terminal), a plain line every 10% for prompts long enough to be worth watching."""

    def __init__(self, enabled: bool):
        self.enabled, self.start = enabled, time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.logged = -1  # the last tenth written as a plain line

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or (total < 16384 and not self.tty):
            return
        elapsed = time.perf_counter() - self.start
        rate = done / elapsed if elapsed > 0 else 0.0
        counts = f"{done:,}/{total:,} tok {rate:,.0f} tok/s"
        if not self.tty:
            tenth = 10 * done // total
            if tenth > self.logged:
                self.logged = tenth
                sys.stderr.write(f"prefill {10 * tenth}% {counts}\n")
                sys.stderr.flush()
            return
        width = 30
        filled = int(width * done / total)
        sys.stderr.write(f"\rprefill [{'#' * filled}{'.' * (width - filled)}] {counts}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    """The prompt text from --prompt, --prompt-file or stdin; not valid UTF-8 is an error."""
    if prompt is not None and prompt_file is not None:
        fail("give either --prompt or --prompt-file, not both")
    if prompt_file is not None:
        try:
            return prompt_file.read_text(encoding="utf-8")
        except FileNotFoundError:
            fail(f"prompt file {prompt_file} does not exist")
        except (OSError, UnicodeDecodeError) as e:
            fail(f"could not read prompt file {prompt_file}: {e}")
    if prompt is not None:
        return prompt  # undecodable argv bytes arrive as lone surrogates: check_text names them
    if sys.stdin is None or sys.stdin.isatty():
        fail("no prompt: use --prompt, --prompt-file, or pipe text on stdin")
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        fail(f"stdin is not valid UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start}")


_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|[\\nrt0'\"])")
_SIMPLE_ESCAPES = {"\\": "\\", "n": "\n", "r": "\r", "t": "\t", "0": "\0", "'": "'", '"': '"'}


def unescape(text: str) -> str:
    r"""Backslash escapes as in a Python string: \n \t \r \0 \\ \" \' \xHH \uHHHH (others stay as
    written). A shell passes "\n\n" as backslash-n twice, which would never match generated text."""

    def replace(match: re.Match) -> str:
        code = match.group(1)
        return chr(int(code[1:], 16)) if code[0] in "xu" else _SIMPLE_ESCAPES[code]

    return _ESCAPE.sub(replace, text)


def runtime_checks(
    device: str | None,
    dtype: str | None,
    kv_cache_dtype: str,
    quantization: str = "none",
    prefill_attention: str = "auto",
) -> None:
    """The device, dtype, weight and attention arguments, checked without torch."""
    from minidecode.validate import (
        check_choice,
        check_device_name,
        check_dtype_name,
        check_kv_cache_dtype_name,
    )

    check_device_name(device)
    check_dtype_name(dtype)
    check_kv_cache_dtype_name(kv_cache_dtype)
    check_choice("--quantization", quantization, ("none", "fp8"))
    check_choice("--prefill-attention", prefill_attention, ("auto", "fp8"))


def world_size() -> int | None:
    """torchrun's WORLD_SIZE (None when not under torchrun)."""
    return int(os.environ["WORLD_SIZE"]) if os.environ.get("WORLD_SIZE") else None


def check_generate_args(
    model: str | None,
    text: str | None,
    prompt_tokens: int | None,
    chat: bool,
    settings,
    device: str | None,
    dtype: str | None,
    kv_cache_dtype: str = "auto",
    quantization: str = "none",
    prefill_attention: str = "auto",
    load_cache: Path | None = None,
    save_cache: Path | None = None,
    tp: int = 1,
    cp: int = 1,
) -> None:
    """Every argument of `generate` that can be checked without the model (and without torch);
    text None: a rank other than 0 of a torchrun launch, which uses rank 0's prompt."""
    from minidecode.validate import check_parallel

    if check_parallel(tp, cp, world_size()) > 1 and (load_cache is not None or save_cache is not None):
        raise UserError("--load-cache / --save-cache are not supported with --tp / --cp")
    if load_cache is not None and load_cache.is_dir():
        raise UserError(
            f"cache file {load_cache} is a directory; give the path of a file that --save-cache wrote"
        )
    if load_cache is not None and not load_cache.is_file():
        raise UserError(f"cache file {load_cache} does not exist")
    if save_cache is not None:
        check_writable(save_cache)  # before minutes of prefill, not after
    runtime_checks(device, dtype, kv_cache_dtype, quantization, prefill_attention)
    settings.check(need_prompt=False)
    if prompt_tokens is not None:
        if prompt_tokens < 1:
            raise UserError("--prompt-tokens must be >= 1")
        if chat:
            raise UserError("--chat needs a text prompt, not --prompt-tokens")
        return
    if text is None:
        return
    from minidecode.request import check_text

    check_text(text)
    if not text:
        raise UserError("the prompt is empty")
    if chat:
        from minidecode.loading import DEFAULT_MODEL, resolve_model_dir
        from minidecode.tokenizer import read_chat_template

        if model is not None and model.startswith("synthetic:"):
            raise UserError("synthetic models have no chat template")
        if read_chat_template(resolve_model_dir(DEFAULT_MODEL if model is None else model)) is None:
            raise UserError("this model has no chat template (tokenizer_config.json or chat_template.jinja)")


MaxContextOpt = Annotated[
    int | None, typer.Option(help="KV cache positions to reserve (default: prompt + new tokens)")
]
AllowExtrapolationOpt = Annotated[
    bool, typer.Option(metavar="", help="Allow contexts beyond the model's max_position_embeddings")
]
IgnoreEosOpt = Annotated[
    bool, typer.Option(metavar="", help="Run to --max-new-tokens past the end-of-sequence token")
]
LogprobsOpt = Annotated[
    bool, typer.Option(metavar="", help="Return log p of each new token (in --json / the results)")
]
GraphOpt = Annotated[
    bool, typer.Option(metavar="", help="Replay decode steps as a CUDA graph (--no-graph: eager)")
]


def request_settings(
    max_new_tokens,
    temperature,
    top_k,
    top_p,
    seed,
    stop,
    max_context,
    allow_extrapolation,
    logprobs,
    ignore_eos,
):
    """The command's sampling and limit options as the one Request of the API (unchecked)."""
    from minidecode.request import Request

    return Request(
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        stop=[unescape(s) for s in stop or []], max_context=max_context,
        allow_extrapolation=allow_extrapolation, logprobs=logprobs, ignore_eos=ignore_eos,
    )  # fmt: skip


@app.command()
def generate(
    model: ModelArg = None,
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="Prompt text")] = None,
    prompt_file: Annotated[
        Path | None, typer.Option("--prompt-file", "-f", help="Read the prompt from a file (UTF-8)")
    ] = None,
    max_new_tokens: MaxNewTokensOpt = DEFAULT_MAX_NEW_TOKENS,
    temperature: TemperatureOpt = None,
    top_k: TopKOpt = None,
    top_p: TopPOpt = None,
    seed: Annotated[
        int | None, typer.Option(help="Random seed for sampling and --prompt-tokens (default: random)")
    ] = None,
    stop: StopOpt = None,
    chat: Annotated[
        bool,
        typer.Option(metavar="", help="Wrap the prompt as a user message in the chat template"),
    ] = False,
    max_context: MaxContextOpt = None,
    allow_extrapolation: AllowExtrapolationOpt = False,
    ignore_eos: IgnoreEosOpt = False,
    logprobs: LogprobsOpt = False,
    prompt_tokens: Annotated[
        int | None,
        typer.Option(help="Use a prompt of exactly this many tokens (random ids; for synthetic models)"),
    ] = None,
    graph: GraphOpt = True,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    kv_cache_dtype: KvCacheDtypeOpt = "auto",
    quantization: QuantizationOpt = "none",
    prefill_attention: PrefillAttentionOpt = "auto",
    json_output: Annotated[
        bool,
        typer.Option("--json", metavar="", help="Print one JSON object (text, token ids, stats) to stdout"),
    ] = False,
    load_cache: Annotated[
        Path | None,
        typer.Option(help="Start from a cache saved by --save-cache (its part of the prompt is reused)"),
    ] = None,
    save_cache: Annotated[
        Path | None,
        typer.Option(help="After generating, save the cache (prompt + answer) here, for --load-cache"),
    ] = None,
    tp: TpOpt = 1,
    cp: CpOpt = 1,
) -> None:
    """Generate a continuation of a prompt; text streams to stdout, stats to stderr. With --tp /
    --cp, under torchrun: rank 0 reads the prompt and prints, every rank computes its part."""
    settings = request_settings(
        max_new_tokens, temperature, top_k, top_p, seed, stop, max_context, allow_extrapolation, logprobs,
        ignore_eos,
    )  # fmt: skip
    first = rank() == 0
    try:
        text = None
        if prompt_tokens is None and (first or prompt is not None or prompt_file is not None):
            text = read_prompt(prompt, prompt_file)  # stdin: rank 0 only
        elif prompt is not None or prompt_file is not None:
            fail("--prompt-tokens replaces --prompt / --prompt-file")
        check_generate_args(
            model, text, prompt_tokens, chat, settings, device, dtype, kv_cache_dtype, quantization,
            prefill_attention, load_cache, save_cache, tp, cp,
        )  # fmt: skip
        from minidecode.llm import LLM

        llm = LLM(
            model, device=device, dtype=dtype, cuda_graph=graph, kv_cache_dtype=kv_cache_dtype, tp=tp, cp=cp,
            quantization=quantization, prefill_attention=prefill_attention,
        )  # fmt: skip
        if llm.synthetic and first:
            typer.echo(f"note: {llm.name} has RANDOM weights: its text is noise, its speed is real", err=True)
        if load_cache is not None:
            llm.load_cache(load_cache)
        if prompt_tokens is not None:
            # Refuse a prompt the memory plan cannot hold before making its random ids.
            context = max_context or prompt_tokens + settings.new_tokens
            if llm.parallel is None:
                llm.check_fits(context, prompt_tokens)
            else:  # a rank short of memory stops every rank
                llm.parallel.agree(lambda: llm.check_fits(context, prompt_tokens))
            settings.token_ids = llm.random_prompt(prompt_tokens, seed=seed or 0)
        elif chat:
            settings.messages = [{"role": "user", "content": text}]
        else:
            settings.prompt = text
        stream = llm.stream(settings, on_prefill_progress=Progress(enabled=not json_output and first))
        for piece in stream:
            if not json_output and first:
                sys.stdout.write(piece)
                sys.stdout.flush()
        result = stream.result
        if save_cache is not None:
            start = time.perf_counter()
            size = llm.save_cache(save_cache)
            seconds = time.perf_counter() - start
            saved = f"saved the cache ({size / 2**30:.2f} GiB) to {save_cache} in {seconds:.2f} s"
            typer.echo(saved, err=True)
    except UserError as e:
        fail(str(e))
    if not first:
        return
    if json_output:
        typer.echo(json.dumps({"model": llm.name, **result_fields(result)}))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
        typer.echo(f"[{result.finish_reason}] {result.stats.summary()}", err=True)


@app.command()
def batch(
    model: ModelArg = None,
    requests: Annotated[
        str | None,
        typer.Argument(
            help="JSONL file, one request a line, or - for stdin (the only argument: the shipped model)",
            show_default=False,
        ),
    ] = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write the results here (default: stdout)")
    ] = None,
    max_batch: Annotated[int, typer.Option(help="Most requests decoded at once")] = DEFAULT_MAX_BATCH,
    max_new_tokens: MaxNewTokensOpt = DEFAULT_MAX_NEW_TOKENS,
    temperature: TemperatureOpt = None,
    top_k: TopKOpt = None,
    top_p: TopPOpt = None,
    seed: Annotated[int | None, typer.Option(help="Random seed for sampling (default: random)")] = None,
    stop: StopOpt = None,
    max_context: MaxContextOpt = None,
    allow_extrapolation: AllowExtrapolationOpt = False,
    ignore_eos: IgnoreEosOpt = False,
    logprobs: LogprobsOpt = False,
    graph: GraphOpt = True,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    kv_cache_dtype: KvCacheDtypeOpt = "auto",
    quantization: QuantizationOpt = "none",
    prefill_attention: PrefillAttentionOpt = "auto",
    no_progress: Annotated[
        bool, typer.Option("--no-progress", metavar="", help="No progress line on stderr")
    ] = False,
) -> None:
    """Run many requests as one continuously refilled batch. The requests file holds one JSON object a line:
    "prompt", "messages" or "token_ids"; optionally "id" (default: the line number) and its own
    max_new_tokens, temperature, top_k, top_p, seed, stop, max_context, allow_extrapolation,
    logprobs, ignore_eos, reuse_prefix (the options are the defaults). One JSON result a line is
    written as each request ends: {"id", "line", "text", "finish_reason", "token_ids",
    "prompt_tokens", "stats"}, or {"id", "line", "error"} for a request that was refused. Exit
    code 1 if any was."""
    if requests is None:  # one argument: the requests file, with the shipped model
        if model is None:
            fail("give a requests file (JSONL, one JSON object a line), or - for stdin")
        model, requests = None, model
    defaults = request_settings(
        max_new_tokens, temperature, top_k, top_p, seed, stop, max_context, allow_extrapolation, logprobs,
        ignore_eos,
    )  # fmt: skip
    try:
        if (world_size() or 1) > 1:
            raise UserError(
                "batch runs in one process: start it without torchrun (--tp / --cp are for generate)"
            )
        runtime_checks(device, dtype, kv_cache_dtype, quantization, prefill_attention)
        defaults.check(need_prompt=False)
        from minidecode.engine import check_max_batch

        check_max_batch(max_batch)
    except UserError as e:
        fail(str(e))
    if output is not None:
        check_writable(output)
        if requests != "-" and output.resolve() == Path(requests).resolve():
            fail(f"--output {output} is the requests file: give another file")
    try:
        entries = read_requests(requests)
    except UserError as e:
        fail(str(e))
    good = [entry for entry in entries if entry.error is None]
    report = BatchReport(output, entries, progress=not no_progress)
    stream = None
    if good:  # no model is needed when every line was refused as read
        try:
            from minidecode.llm import LLM

            llm = LLM(
                model, device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype, cuda_graph=graph,
                max_batch=max_batch, quantization=quantization, prefill_attention=prefill_attention,
            )  # fmt: skip
            if llm.synthetic:
                typer.echo(f"note: {llm.name} has RANDOM weights: its text is noise", err=True)
            given = {k: v for k, v in asdict(defaults).items() if v is not None}
            stream = llm.stream_batch(
                [entry.fields for entry in good],
                on_result=lambda i, result: report.write(good[i], result),
                **given,
            )
        except UserError as e:
            fail(str(e))
        report.progress = stream.progress
    with report:  # opens --output only now: a refused command leaves an existing file as it was
        if stream is not None:
            with stream:
                for _ in stream:
                    report.draw()
    report.draw(final=True)
    counts = report.counts()
    typer.echo(batch_stats_line(counts, time.perf_counter() - counts.started), err=True)
    if counts.failed:
        raise typer.Exit(1)


@app.command()
def serve(
    model: ModelArg = None,
    host: Annotated[str, typer.Option(help="Address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on")] = 8000,
    served_model_name: Annotated[
        str | None, typer.Option(help="The model id clients name (default: the model argument)")
    ] = None,
    max_tokens_default: Annotated[
        int, typer.Option(help="Cap of a chat completion's default max_tokens (the rest of the context)")
    ] = 4096,
    max_waiting: Annotated[int, typer.Option(help="Queued requests beyond this get HTTP 503")] = 256,
    max_batch: Annotated[int, typer.Option(help="Most requests decoded at once")] = DEFAULT_MAX_BATCH,
    graph: GraphOpt = True,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    kv_cache_dtype: KvCacheDtypeOpt = "auto",
    quantization: QuantizationOpt = "none",
    prefill_attention: PrefillAttentionOpt = "auto",
) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models) plus /health,
    /metrics, /tokenize and /detokenize; every request feeds the one engine loop (concurrent clients
    decode as one batch). Needs the serve extra: pip install "minidecode[serve]"."""
    import importlib.util

    try:
        if (world_size() or 1) > 1:
            raise UserError("serve runs in one process: start it without torchrun (no --tp / --cp yet)")
        runtime_checks(device, dtype, kv_cache_dtype, quantization, prefill_attention)
        from minidecode.request import check_int

        check_int("--port", port, 0)
        if port > 65535:
            raise UserError(f"--port must be at most 65535, got {port}")
        check_int("--max-tokens-default", max_tokens_default, 1)
        check_int("--max-waiting", max_waiting, 1)
        missing = [
            m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None
        ]
        if missing:
            raise UserError(f'serve needs {", ".join(missing)}: pip install "minidecode[serve]"')
        from minidecode.engine import check_max_batch

        check_max_batch(max_batch)
        check_port_free(host, port)
        from minidecode.llm import LLM
        from minidecode.server import ServerSettings, serve

        llm = LLM(
            model, device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype, cuda_graph=graph,
            max_batch=max_batch, quantization=quantization, prefill_attention=prefill_attention,
        )  # fmt: skip
        settings = ServerSettings(
            served_model_name or model or "stdlib-tiny", max_tokens_default, max_waiting
        )
        typer.echo(f"serving {settings.model_name} on http://{host}:{port}/v1 (Ctrl-C stops)", err=True)
        serve(llm, settings, host, port)
    except UserError as e:
        fail(str(e))


def check_port_free(host: str, port: int) -> None:
    """Refuse an address in use (or not ours) before the model loads."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UserError(f"cannot listen on {host}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            raise UserError(f"cannot listen on {host}:{port}: {e.strerror}") from None


@app.command()
def info(
    model: ModelArg = None,
    context: Annotated[
        int | None, typer.Option(help="Context length for the memory plan (default: max positions)")
    ] = None,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    kv_cache_dtype: KvCacheDtypeOpt = "auto",
    quantization: QuantizationOpt = "none",
    tp: TpOpt = 1,
    cp: CpOpt = 1,
) -> None:
    """Architecture, parameter count, context length and the memory plan, without loading weights
    (with --tp / --cp: the plan of each GPU)."""
    try:
        runtime_checks(device, dtype, kv_cache_dtype, quantization)
        if context is not None and context < 1:
            raise UserError(f"context must be >= 1, got {context}")
        for name, value in (("--tp", tp), ("--cp", cp)):
            if value < 1:
                raise UserError(f"{name} must be >= 1, got {value}")
        from minidecode.info import describe

        plan = describe(
            model, context=context, dtype=dtype, device=device, kv_cache_dtype=kv_cache_dtype, tp=tp, cp=cp,
            quantization=quantization,
        )  # fmt: skip
        typer.echo(plan)
    except UserError as e:
        fail(str(e))


@app.command()
def bench(
    ctx: typer.Context,
    model: Annotated[
        str, typer.Argument(help="Checkpoint folder, hub repo id, or synthetic:NAME")
    ] = "synthetic:llama-3-8b",
    prompt_tokens: Annotated[list[int] | None, typer.Option(help="Prompt length (repeatable)")] = None,
    new_tokens: Annotated[
        int, typer.Option(help="Decode steps per timed window (one generation makes 1 + repeats x this)")
    ] = 64,
    repeats: Annotated[
        int,
        typer.Option(
            help="Samples per figure: decode windows, and full prefills up to --prefill-repeat-max-tokens"
        ),
    ] = 3,
    prefill_repeat_max_tokens: Annotated[
        int, typer.Option(help="Longer prompts are prefilled once (n=1)")
    ] = 32768,
    compare: Annotated[
        str | None, typer.Option(help="Also run this peer in the same process: transformers")
    ] = None,
    peer: Annotated[
        str,
        typer.Option(
            help="transformers settings to run, comma-separated: eager (sdpa, dynamic cache), "
            "compiled (static cache + torch.compile; its compile warm-up is reported apart)"
        ),
    ] = "eager,compiled",
    peer_max_tokens: Annotated[
        int | None, typer.Option(help="Run the peers only on prompts up to this length")
    ] = None,
    compiled_max_tokens: Annotated[
        int | None, typer.Option(help="Run the compiled peer only on prompts up to this length")
    ] = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    kv_cache_dtype: KvCacheDtypeOpt = "auto",
    quantization: QuantizationOpt = "none",
    prefill_attention: PrefillAttentionOpt = "auto",
    json_output: Annotated[
        bool, typer.Option("--json", help="Print the results as one JSON object on stdout (like generate)")
    ] = False,
    out: Annotated[
        Path | None,
        typer.Option(help="Write the results to OUT.json and OUT.md (e.g. --out bench/results/e2e)"),
    ] = None,
    plot_file: Annotated[
        bool, typer.Option("--plot", help="Also write OUT.png (needs --out and matplotlib: the bench extra)")
    ] = False,
    batch: Annotated[
        list[str] | None,
        typer.Option(
            help="Batched decode instead: 8x32k (8 prompts of 32k) or 256k,4k,8k (a prompt each); repeatable"
        ),
    ] = None,
    batch_peer: Annotated[
        str, typer.Option(help="Peers for --batch, comma-separated: transformers")
    ] = "transformers",
) -> None:
    """Prefill and decode speed per prompt length against the read roofline, with the median and
    range over repeats (and transformers' eager and compiled settings with --compare). With
    --batch: aggregate decode speed of batches against the batched roofline and peers."""
    import importlib.util

    if batch:
        args = (batch, batch_peer, new_tokens, repeats, device, dtype, kv_cache_dtype, out, command_line(ctx))
        if (quantization, prefill_attention) != ("none", "auto"):
            fail("--batch runs the default weights and prefill: drop --quantization / --prefill-attention")
        bench_batches(model, *args)
        return

    lengths = prompt_tokens or [1024, 131072]
    if plot_file and out is None:
        fail("--plot writes OUT.png: give --out too")
    outputs = [] if out is None else [out.with_name(out.name + s) for s in (".json", ".md", ".png")]
    for path in outputs[: 3 if plot_file else 2]:
        check_writable(path)
    if plot_file and importlib.util.find_spec("matplotlib") is None:
        fail('--plot needs matplotlib: pip install "minidecode[bench]"')
    if compare not in (None, "transformers"):
        fail(f"unknown --compare {compare!r}; only 'transformers' is supported")
    peers = [p.strip() for p in peer.split(",") if p.strip()] if compare else []
    command = command_line(ctx)
    try:
        from minidecode import LLM, UserError
        from minidecode.bench import BenchSettings, run_bench
        from minidecode.validate import check_kv_cache_dtype_name

        check_kv_cache_dtype_name(kv_cache_dtype)

        settings = BenchSettings(
            prompt_lengths=lengths,
            window=new_tokens,
            repeats=repeats,
            prefill_repeat_max_tokens=prefill_repeat_max_tokens,
            peers=peers,
            peer_max_tokens=peer_max_tokens,
            compiled_max_tokens=compiled_max_tokens,
        )
        settings.validate()
        runtime_checks(device, dtype, kv_cache_dtype, quantization, prefill_attention)
        if quantization != "none" and peers:
            raise UserError(
                "--compare runs transformers on the checkpoint's weights: drop it with --quantization fp8"
            )
        llm = LLM(
            model,
            device=device,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            quantization=quantization,
            prefill_attention=prefill_attention,
        )
        if llm.synthetic:
            typer.echo(f"note: {llm.name} has random weights (speed only)", err=True)
        results, ceilings = run_bench(llm, settings, log=lambda m: typer.echo(m, err=True))
    except UserError as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted", code=130)
    from minidecode.bench_report import e2e_report, write_e2e

    report = e2e_report(llm, settings, results, ceilings, command)
    typer.echo(report.header, err=json_output)  # with --json the tables go to stderr
    typer.echo(report.tables, err=json_output)
    if json_output:
        typer.echo(report.json_text)
    if outputs:
        write_e2e(report, llm, results, command, outputs, plot_file)


def bench_batches(model, specs, peer, window, repeats, device, dtype, kv_cache_dtype, out, command) -> None:
    """`bench --batch`: the batch table on stdout, and OUT.json / OUT.md with --out."""
    outputs = [] if out is None else [out.with_name(out.name + s) for s in (".json", ".md")]
    for path in outputs:
        check_writable(path)
    try:
        from minidecode import LLM, UserError
        from minidecode.bench_batch import format_batch_table, parse_batch_spec, run_batch_bench

        for spec in specs:
            parse_batch_spec(spec)  # a typo fails before the model loads
        llm = LLM(model, device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
        peers = tuple(p.strip() for p in peer.split(",") if p.strip())
        results, ceilings = run_batch_bench(
            llm, specs, window, repeats, peers, log=lambda m: typer.echo(m, err=True)
        )
    except UserError as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted", code=130)
    table = format_batch_table(results, ceilings)
    typer.echo(table)
    if outputs:
        from minidecode.bench_report import write_batch

        write_batch(llm, results, ceilings, window, table, command, outputs)


def command_line(ctx: typer.Context) -> str:
    """The command as it was given (options with their values, defaults left out), for results files."""
    import shlex

    words = ["minidecode", ctx.info_name or ""]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if value is None or value == param.default or param.name == "ctx":
            continue
        if param.param_type_name == "option" and getattr(param, "is_flag", False):
            words += [param.opts[0]] if value else param.secondary_opts[:1]  # --plot, --no-graph
            continue
        for v in value if isinstance(value, list | tuple) else [value]:
            words += [str(v)] if param.param_type_name == "argument" else [param.opts[0], str(v)]
    return shlex.join(words)


def check_writable(path: Path) -> None:
    """Fail now, before a long run, if `path` cannot be written: a file is made in its folder
    and removed (a read-only file system refuses even root)."""
    import tempfile

    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        fail(f"{path} is a directory; give a file name")
    if not folder.is_dir():
        fail(f"cannot write {path}: folder {folder} does not exist")
    if path.exists() and not os.access(path, os.W_OK):
        fail(f"cannot write {path}: permission denied")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        fail(f"cannot write {path}: {e.strerror or e}")


def main() -> None:
    """The console script. Ctrl-C is handled from here on, before any command imports torch."""
    signal.signal(signal.SIGINT, _on_interrupt)
    try:
        app()
    except KeyboardInterrupt:  # outside a command (typer turns one inside into exit 130)
        sys.exit(130)


if __name__ == "__main__":
    main()

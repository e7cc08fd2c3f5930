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
from minidecode.errors import UserError


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


def fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _on_interrupt(signum, frame) -> None:
    """Ctrl-C: one line on stderr, then KeyboardInterrupt unwinds (typer exits with 130). Written
    with os.write: the signal may arrive in the middle of another write to sys.stderr."""
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


def check_generate_args(
    model: str | None,
    text: str | None,
    prompt_tokens: int | None,
    chat: bool,
    max_new_tokens: int,
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    seed: int | None,
    stops: list[str],
    max_context: int | None,
    device: str | None,
    dtype: str | None,
) -> None:
    """Every argument of `generate` that can be checked without the model (and without torch)."""
    from minidecode.validate import check_device_name, check_dtype_name, check_request, check_text

    check_device_name(device)
    check_dtype_name(dtype)
    check_request(max_new_tokens, temperature, top_k, top_p, seed, stops)
    if max_context is not None and max_context < 1:
        raise UserError(f"--max-context must be >= 1, got {max_context}")
    if prompt_tokens is not None:
        if prompt_tokens < 1:
            raise UserError("--prompt-tokens must be >= 1")
        if chat:
            raise UserError("--chat needs a text prompt, not --prompt-tokens")
        return
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


@app.command()
def generate(
    model: ModelArg = None,
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="Prompt text")] = None,
    prompt_file: Annotated[
        Path | None, typer.Option("--prompt-file", "-f", help="Read the prompt from a file (UTF-8)")
    ] = None,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", "-n", help="Most tokens to generate")
    ] = 128,
    temperature: Annotated[float | None, typer.Option(help="0 = greedy (default: the model's)")] = None,
    top_k: Annotated[int | None, typer.Option(help="0 = off")] = None,
    top_p: Annotated[float | None, typer.Option(help="1 = off")] = None,
    seed: Annotated[
        int | None, typer.Option(help="Random seed for sampling and --prompt-tokens (default: random)")
    ] = None,
    stop: Annotated[
        list[str] | None,
        typer.Option(
            metavar="TEXT",
            help=r'Stop before this text (repeatable); backslash escapes such as "\n" are interpreted',
        ),
    ] = None,
    chat: Annotated[
        bool,
        typer.Option(metavar="", help="Wrap the prompt as a user message in the chat template"),
    ] = False,
    max_context: Annotated[
        int | None, typer.Option(help="KV cache size in tokens (default: prompt + new)")
    ] = None,
    allow_extrapolation: Annotated[
        bool,
        typer.Option(metavar="", help="Allow contexts beyond the model's max_position_embeddings"),
    ] = False,
    prompt_tokens: Annotated[
        int | None,
        typer.Option(help="Use a prompt of exactly this many tokens (random ids; for synthetic models)"),
    ] = None,
    graph: Annotated[
        bool, typer.Option(metavar="", help="Replay decode steps as a CUDA graph (--no-graph: eager)")
    ] = True,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    json_output: Annotated[
        bool,
        typer.Option("--json", metavar="", help="Print one JSON object (text, token ids, stats) to stdout"),
    ] = False,
) -> None:
    """Generate a continuation of a prompt; text streams to stdout, stats to stderr."""
    stops = [unescape(s) for s in stop or []]
    try:
        text = None
        if prompt_tokens is None:
            text = read_prompt(prompt, prompt_file)
        elif prompt is not None or prompt_file is not None:
            fail("--prompt-tokens replaces --prompt / --prompt-file")
        check_generate_args(
            model, text, prompt_tokens, chat, max_new_tokens, temperature, top_k, top_p, seed,
            stops, max_context, device, dtype,
        )  # fmt: skip
        from minidecode.llm import LLM

        llm = LLM(model, device=device, dtype=dtype, cuda_graph=graph)
        if llm.synthetic:
            typer.echo(f"note: {llm.name} has RANDOM weights: its text is noise, its speed is real", err=True)
        request = {}
        if prompt_tokens is not None:
            # Refuse a prompt the memory plan cannot hold before making its random ids.
            plan = llm.engine.plan(max_context or prompt_tokens + max_new_tokens, prompt_tokens)
            if not plan.fits:
                fail(
                    f"a {prompt_tokens:,}-token prompt needs {plan.needed_bytes / 2**30:,.2f} GiB for its KV "
                    f"cache and activations but only {plan.free_bytes / 2**30:,.2f} GiB is free on "
                    f"{plan.device}; lower --prompt-tokens"
                )
            request["token_ids"] = llm.random_prompt(prompt_tokens, seed=seed or 0)
        elif chat:
            request["messages"] = [{"role": "user", "content": text}]
        else:
            request["prompt"] = text
        stream = llm.stream(
            **request,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop=stops,
            max_context=max_context,
            allow_extrapolation=allow_extrapolation,
            on_prefill_progress=Progress(enabled=not json_output),
        )
        for piece in stream:
            if not json_output:
                sys.stdout.write(piece)
                sys.stdout.flush()
        result = stream.result
    except UserError as e:
        fail(str(e))
    if json_output:
        typer.echo(
            json.dumps(
                {
                    "model": llm.name,
                    "text": result.text,
                    "finish_reason": result.finish_reason,
                    "token_ids": result.token_ids,
                    "stats": asdict(result.stats),
                }
            )
        )
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
        typer.echo(f"[{result.finish_reason}] {result.stats.summary()}", err=True)


@app.command()
def info(
    model: ModelArg = None,
    context: Annotated[
        int | None, typer.Option(help="Context length for the memory plan (default: max positions)")
    ] = None,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
) -> None:
    """Architecture, parameter count, context length and the memory plan, without loading weights."""
    try:
        from minidecode.validate import check_device_name, check_dtype_name

        check_device_name(device)
        check_dtype_name(dtype)
        if context is not None and context < 1:
            raise UserError(f"context must be >= 1, got {context}")
        from minidecode.llm import describe

        typer.echo(describe(model, context=context, dtype=dtype, device=device))
    except UserError as e:
        fail(str(e))


@app.command()
def bench(
    model: Annotated[
        str, typer.Argument(help="Checkpoint folder, hub repo id, or synthetic:NAME")
    ] = "synthetic:llama-3-8b",
    prompt_tokens: Annotated[list[int] | None, typer.Option(help="Prompt length (repeatable)")] = None,
    new_tokens: Annotated[int, typer.Option(help="Tokens to decode per length")] = 64,
    compare: Annotated[
        str | None, typer.Option(help="Also run this peer in the same process: transformers")
    ] = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    json_output: Annotated[Path | None, typer.Option("--json", help="Write the rows as JSON here")] = None,
    plot_file: Annotated[
        Path | None, typer.Option("--plot", help="Write a PNG plot here (needs matplotlib)")
    ] = None,
) -> None:
    """Prefill and decode speed per prompt length, against the bandwidth roofline (and transformers)."""
    from minidecode import LLM, UserError
    from minidecode.bench import format_table, plot, run_bench

    lengths = prompt_tokens or [1024, 131072]
    try:
        if any(n < 1 for n in lengths):
            fail("--prompt-tokens must be >= 1")
        llm = LLM(model, device=device, dtype=dtype)
        if llm.synthetic:
            typer.echo(f"note: {llm.name} has random weights (speed only)", err=True)
        rows, bandwidth = run_bench(llm, lengths, new_tokens, compare, log=lambda m: typer.echo(m, err=True))
    except UserError as e:
        fail(str(e))
    device_name = torch_device_name(llm.device)
    typer.echo(
        f"{llm.name} on {device_name}, {str(llm.dtype)[6:]}, batch 1, "
        f"prefill attention: SDPA {llm.engine.prefill_backend}"
    )
    typer.echo(format_table(rows, bandwidth))
    if json_output:
        json_output.write_text(
            json.dumps(
                {
                    "model": llm.name,
                    "device": device_name,
                    "dtype": str(llm.dtype),
                    "bandwidth_bytes_per_s": bandwidth,
                    "prefill_backend": llm.engine.prefill_backend,
                    "rows": [asdict(r) for r in rows],
                },
                indent=2,
            )
        )
    if plot_file:
        plot(rows, str(plot_file), f"{llm.name} on {device_name}")


def torch_device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def main() -> None:
    """The console script. Ctrl-C is handled from here on, before any command imports torch."""
    signal.signal(signal.SIGINT, _on_interrupt)
    try:
        app()
    except KeyboardInterrupt:  # outside a command (typer turns one inside into exit 130)
        sys.exit(130)


if __name__ == "__main__":
    main()

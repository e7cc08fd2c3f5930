"""The `minidecode` command: generate / info / bench. Parses, calls the Python API, prints.

Text goes to stdout as it is decoded; progress and stats go to stderr, so
`minidecode generate ... > out.txt` captures exactly the generated text.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Long-context text generation for Llama-family models.",
)

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


class Progress:
    """A one-line prefill progress bar on stderr, with tokens/s: on a terminal, or in a log when
    the prompt is long enough to be worth watching."""

    def __init__(self, enabled: bool):
        self.enabled, self.start = enabled, time.perf_counter()
        self.tty = sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or (total < 16384 and not self.tty):
            return
        elapsed = time.perf_counter() - self.start
        width = 30
        filled = int(width * done / total)
        rate = done / elapsed if elapsed > 0 else 0.0
        sys.stderr.write(
            f"\rprefill [{'#' * filled}{'.' * (width - filled)}] {done:,}/{total:,} tok {rate:,.0f} tok/s"
        )
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
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
        return prompt
    if sys.stdin is None or sys.stdin.isatty():
        fail("no prompt: use --prompt, --prompt-file, or pipe text on stdin")
    return sys.stdin.read()


@app.command()
def generate(
    model: ModelArg = None,
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="Prompt text")] = None,
    prompt_file: Annotated[
        Path | None, typer.Option("--prompt-file", "-f", help="Read the prompt from a file")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n")] = 128,
    temperature: Annotated[float | None, typer.Option(help="0 = greedy (default: the model's)")] = None,
    top_k: Annotated[int | None, typer.Option(help="0 = off")] = None,
    top_p: Annotated[float | None, typer.Option(help="1 = off")] = None,
    seed: Annotated[int | None, typer.Option()] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable)")] = None,
    chat: Annotated[
        bool, typer.Option(help="Wrap the prompt as a user message in the chat template")
    ] = False,
    max_context: Annotated[
        int | None, typer.Option(help="KV cache size in tokens (default: prompt + new)")
    ] = None,
    allow_extrapolation: Annotated[
        bool, typer.Option(help="Allow contexts beyond the model's max_position_embeddings")
    ] = False,
    prompt_tokens: Annotated[
        int | None,
        typer.Option(help="Use a prompt of exactly this many tokens (random ids; for synthetic models)"),
    ] = None,
    graph: Annotated[
        bool, typer.Option(help="Replay decode steps as a CUDA graph (--no-graph: eager)")
    ] = True,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print one JSON object (text and stats)")
    ] = False,
) -> None:
    """Generate a continuation of a prompt; text streams to stdout, stats to stderr."""
    from minidecode import LLM, UserError

    try:
        if prompt_tokens is None:
            text = read_prompt(prompt, prompt_file)
        elif prompt is not None or prompt_file is not None:
            fail("--prompt-tokens replaces --prompt / --prompt-file")
        llm = LLM(model, device=device, dtype=dtype, cuda_graph=graph)
        if llm.synthetic:
            typer.echo(f"note: {llm.name} has RANDOM weights: its text is noise, its speed is real", err=True)
        request = {}
        if prompt_tokens is not None:
            if prompt_tokens < 1:
                fail("--prompt-tokens must be >= 1")
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
            stop=stop,
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
    except KeyboardInterrupt:
        fail("interrupted", code=130)
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
    from minidecode import UserError
    from minidecode.llm import describe

    try:
        typer.echo(describe(model, context=context, dtype=dtype, device=device))
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
    json_output: Annotated[
        Path | None, typer.Option("--json", help="Write the results as JSON to this file")
    ] = None,
    markdown: Annotated[
        Path | None, typer.Option(help="Write the results as a markdown page to this file")
    ] = None,
    plot_file: Annotated[
        Path | None,
        typer.Option("--plot", help="Write a PNG plot to this file (needs matplotlib: the bench extra)"),
    ] = None,
) -> None:
    """Prefill and decode speed per prompt length against the read roofline, with the median and
    range over repeats (and transformers' eager and compiled settings with --compare)."""
    import importlib.util

    lengths = prompt_tokens or [1024, 131072]
    outputs = [p for p in (json_output, markdown, plot_file) if p is not None]
    for path in outputs:
        check_writable(path)
    if plot_file is not None and importlib.util.find_spec("matplotlib") is None:
        fail('--plot needs matplotlib: pip install "minidecode[bench]"')
    if compare not in (None, "transformers"):
        fail(f"unknown --compare {compare!r}; only 'transformers' is supported")
    peers = [p.strip() for p in peer.split(",") if p.strip()] if compare else []
    command = command_line(ctx)
    try:
        from minidecode import LLM, UserError
        from minidecode.bench import BenchSettings, run_bench

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
        llm = LLM(model, device=device, dtype=dtype)
        if llm.synthetic:
            typer.echo(f"note: {llm.name} has random weights (speed only)", err=True)
        results, ceilings = run_bench(llm, settings, log=lambda m: typer.echo(m, err=True))
    except UserError as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted", code=130)
    write_bench_results(llm, settings, results, ceilings, command, json_output, markdown, plot_file)


def command_line(ctx: typer.Context) -> str:
    """The command as it was given (options with their values, defaults left out), for results files."""
    import shlex

    words = ["minidecode", ctx.info_name or ""]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if value is None or value == param.default or param.name == "ctx":
            continue
        for v in value if isinstance(value, list | tuple) else [value]:
            words += [str(v)] if param.param_type_name == "argument" else [param.opts[0], str(v)]
    return shlex.join(words)


def check_writable(path: Path) -> None:
    """Fail now, before a long run, if `path` cannot be written."""
    import os

    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        fail(f"{path} is a directory; give a file name")
    if not folder.is_dir():
        fail(f"cannot write {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        fail(f"cannot write {path}: permission denied")


def write_bench_results(llm, settings, results, ceilings, command, json_output, markdown, plot_file) -> None:
    """The tables on stdout, and the JSON / markdown / plot files, each with device, date, commit,
    the exact command and the roofline formula."""
    from minidecode.bench import FORMULA, finite_or_none, format_tables, plot

    about = bench_metadata(llm, command)
    header = (
        f"{llm.name} on {about['device']}, {about['dtype']}, batch 1; {about['date']}, "
        f"commit {about['commit']}; torch {about['torch']}"
    )
    tables = format_tables(results, ceilings)
    typer.echo(header)
    typer.echo(tables)
    if json_output:
        data = {
            **about,
            "formula": FORMULA,
            "settings": asdict(settings),
            "read_ceiling_bytes_per_s": ceilings.read_bytes_per_s,
            "copy_ceiling_bytes_per_s": ceilings.copy_bytes_per_s,
            "ceiling_buffer_bytes": ceilings.buffer_bytes,
            "results": [asdict(r) for r in results],
        }
        json_output.write_text(json.dumps(finite_or_none(data), indent=2, allow_nan=False) + "\n")
    if markdown:
        markdown.write_text(
            f"# End-to-end benchmark\n\n{header}\n\ncommand: `{command}`\n\nroofline: {FORMULA}\n\n{tables}\n"
        )
    if plot_file:
        plot(results, str(plot_file), f"{llm.name} on {about['device']} ({about['date']}, {about['commit']})")


def bench_metadata(llm, command: str) -> dict:
    import datetime
    import subprocess

    import torch

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        commit += "+changes" if dirty else ""
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return {
        "model": llm.name,
        "device": torch_device_name(llm.device),
        "dtype": str(llm.dtype).removeprefix("torch."),
        "prefill_backend": getattr(llm.engine, "prefill_backend", None),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "torch": torch.__version__,
        "command": command,
    }


def torch_device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def main() -> None:
    app()


if __name__ == "__main__":
    main()

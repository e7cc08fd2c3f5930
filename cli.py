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
    app()


if __name__ == "__main__":
    main()

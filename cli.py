"""The `minidecode` command: generate / batch / serve / info / bench. Parses, calls the Python API,
prints.

Text goes to stdout as it is decoded; progress and stats go to stderr, so
`minidecode generate ... > out.txt` captures exactly the generated text. torch is imported only
inside a command that needs it, after its arguments were checked: `--help`, `--version` and a
mistyped option answer at once.

The options several commands share are defined once, in two tables: RUNTIME_OPTIONS (how the
model runs: device, dtypes, weights, kernels, processes) and REQUEST_OPTIONS (a `Request`'s
fields, by the Python API's names and with its defaults). `shared_options` adds a command's pick
of them and hands them to it gathered: a `Runtime`, which `Runtime.check` checks without torch and
`Runtime.load` turns into the `LLM`, and an unchecked `Request`, which `Request.check` checks (the
one place a request's values are checked).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import typer.core

from minidecode import __version__
from minidecode.batch_file import BatchReport, batch_stats_line, read_requests, result_fields
from minidecode.errors import UserError
from minidecode.kernels.choices import PREFILL_ATTENTION
from minidecode.request import DEFAULT_MAX_BATCH, DEFAULT_MAX_NEW_TOKENS, Request, check_int
from minidecode.validate import (
    DEVICES,
    DTYPE_NAMES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    check_choice,
    check_device_name,
    check_dtype_name,
    check_kv_cache_dtype_name,
)

if TYPE_CHECKING:
    from minidecode.llm import LLM


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"minidecode {__version__}")
        raise typer.Exit()


def _click_class(name: str) -> type:
    """A class of the click that typer runs on (newer typers carry their own copy of click)."""
    return next(c for c in typer.BadParameter.__mro__ if c.__name__ == name)


UsageError_ = _click_class("UsageError")
NoArgsIsHelpError_ = getattr(sys.modules[UsageError_.__module__], "NoArgsIsHelpError", ())


class OneLineUsageError(_click_class("ClickException")):
    """A mistyped command line (an unknown option, a value of the wrong type) as the one `error:`
    line every other mistake prints (click would print the usage and its message), exit 2."""

    exit_code = 2

    def show(self, file=None) -> None:
        if rank() == 0:
            typer.echo(f"error: {self.message} (see --help)", err=True)


@contextlib.contextmanager
def one_line_usage_errors() -> Iterator[None]:
    try:
        yield
    except NoArgsIsHelpError_:
        raise  # `minidecode` alone: the help
    except UsageError_ as e:
        raise OneLineUsageError(e.format_message()) from None


class Group(typer.core.TyperGroup):
    """The command group, whose own and whose commands' parse errors are one line each."""

    def make_context(self, *args, **kwargs):
        with one_line_usage_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        with one_line_usage_errors():
            return super().invoke(ctx)


app = typer.Typer(
    cls=Group,
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


def rank() -> int:
    """This process's rank under torchrun (0 otherwise): only rank 0 prints."""
    return int(os.environ.get("RANK", "0") or 0)


def world_size() -> int | None:
    """torchrun's WORLD_SIZE (None when not under torchrun)."""
    return int(os.environ["WORLD_SIZE"]) if os.environ.get("WORLD_SIZE") else None


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


# ---- the shared options: one definition each ---------------------------------------------------
@dataclass(frozen=True)
class Opt:
    """One option of a table: its type with typer's Option (`Annotated`), its default, and for a
    request option how its value becomes the Request field's (parse)."""

    annotation: Any
    default: Any = None
    parse: Callable[[Any], Any] | None = None


def choices(values) -> str:
    """A list of choices as an option's metavar: [auto|fp8]."""
    return "[" + "|".join(values) + "]"


ModelArg = Annotated[
    str | None,
    typer.Argument(
        help="Checkpoint folder, hub repo id, or synthetic:NAME (default: the model shipped with minidecode)"
    ),
]
RUNTIME_OPTIONS = {  # Runtime's fields: the LLM's settings
    "max_batch": Opt(
        Annotated[int, typer.Option(help="Most requests decoded at once")], DEFAULT_MAX_BATCH
    ),
    "graph": Opt(
        Annotated[
            bool, typer.Option(metavar="", help="Replay decode steps as a CUDA graph (--no-graph: eager)")
        ],
        True,
    ),
    "device": Opt(Annotated[str | None, typer.Option(help=f"{DEVICES} (default: cuda if available)")]),
    "dtype": Opt(
        Annotated[
            str | None,
            typer.Option(
                metavar=choices(DTYPE_NAMES),
                help="Weights and activations (default: bf16 on GPU, fp32 on CPU)",
            ),
        ]
    ),
    "kv_cache_dtype": Opt(
        Annotated[
            str,
            typer.Option(
                "--kv-cache-dtype",
                metavar=choices(KV_CACHE_DTYPES),
                help="KV cache storage: auto (the model's dtype) or fp8 (e4m3 with a scale per token and KV "
                "head: half the bytes, slightly less accurate)",
            ),
        ],
        KV_CACHE_DTYPES[0],
    ),
    "quantization": Opt(
        Annotated[
            str,
            typer.Option(
                "--quantization",
                metavar=choices(QUANTIZATIONS),
                help="Weights: none (the checkpoint's) or fp8 (a bf16/fp16 checkpoint's Linear layers "
                "rounded to e4m3 per output channel on load: half the weight bytes; FP8 checkpoints load as "
                "they are)",
            ),
        ],
        QUANTIZATIONS[0],
    ),
    "prefill_attention": Opt(
        Annotated[
            str,
            typer.Option(
                "--prefill-attention",
                metavar=choices(PREFILL_ATTENTION),
                help="Prefill attention: auto (SDPA's faster kernel) or fp8 (an e4m3 flash-attention kernel "
                "on Ada / Hopper GPUs: faster at long prompts, slightly less accurate)",
            ),
        ],
        PREFILL_ATTENTION[0],
    ),
    "tp": Opt(
        Annotated[
            int,
            typer.Option(
                "--tp",
                help="Tensor parallel: split heads, MLP and vocabulary over this many GPUs (under torchrun)",
            ),
        ],
        1,
    ),
    "step_tokens": Opt(
        Annotated[
            int | None,
            typer.Option(
                help="Rows a step takes through the weights while a prompt prefills beside running "
                "requests (its chunk beside their decode rows; default: the device's)"
            ),
        ]
    ),
    "cp": Opt(
        Annotated[
            int,
            typer.Option(
                "--cp",
                help="Context parallel: split the KV cache's positions over this many GPUs (under torchrun)",
            ),
        ],
        1,
    ),
}


def parse_stops(stops: list[str]) -> list[str] | None:
    return [unescape(s) for s in stops] or None


def parse_logit_bias(pairs: list[str]) -> dict[str, float] | None:
    """--logit-bias ID=BIAS (repeatable) -> {ID: BIAS}: the biases read as numbers, the ids as
    written (Request.check reads them, as it reads a JSON object's keys)."""
    bias: dict[str, float] = {}
    for pair in pairs:
        token, equals, value = (part.strip() for part in pair.partition("="))
        try:
            number = float(value)
        except ValueError:
            number = None
        if not equals or number is None:
            raise UserError(f"--logit-bias takes ID=BIAS (a token id and a number), got {pair!r}")
        if token in bias:
            raise UserError(f"--logit-bias gives token {token} more than once")
        bias[token] = number
    return bias or None


def flag(text: str) -> Any:
    return Annotated[bool, typer.Option(metavar="", help=text)]


def number(kind: type, text: str, *decls: str, **kw: Any) -> Any:
    return Annotated[kind | None, typer.Option(*decls, help=text, **kw)]


REQUEST_OPTIONS = {  # Request's fields (their API names), each option's default the API's
    "max_new_tokens": Opt(
        Annotated[int, typer.Option("--max-new-tokens", "-n", help="Most tokens to generate")],
        DEFAULT_MAX_NEW_TOKENS,
    ),
    "min_tokens": Opt(
        number(int, "Fewest tokens to generate (end-of-sequence and --stop-token-id held back until then)")
    ),
    "temperature": Opt(number(float, "0 = greedy (default: the model's)")),
    "top_k": Opt(number(int, "0 = off")),
    "top_p": Opt(number(float, "1 = off")),
    "repetition_penalty": Opt(
        number(float, "Divide the logits of the prompt's and answer's tokens by this (1: off; transformers')")
    ),
    "presence_penalty": Opt(number(float, "Lower the logit of each token already generated by this (-2..2)")),
    "frequency_penalty": Opt(
        number(float, "Lower the logit of each generated token by this times its count (-2..2)")
    ),
    "logit_bias": Opt(
        Annotated[
            list[str] | None,
            typer.Option(metavar="ID=BIAS", help="Add BIAS (-100..100) to token ID's logit (repeatable)"),
        ],
        parse=parse_logit_bias,
    ),
    "seed": Opt(number(int, "Random seed for sampling (and generate's --prompt-tokens; default: random)")),
    "stop": Opt(
        Annotated[
            list[str] | None,
            typer.Option(
                metavar="TEXT",
                help=r'Stop before this text (repeatable); backslash escapes such as "\n" are interpreted',
            ),
        ],
        parse=parse_stops,
    ),
    "stop_token_ids": Opt(
        number(list[int], "End when this token is sampled (repeatable; not returned)", "--stop-token-id",
               metavar="ID"),
        parse=lambda ids: list(ids) or None,
    ),
    "max_context": Opt(number(int, "KV cache positions to reserve (default: prompt + new tokens)")),
    "allow_extrapolation": Opt(flag("Allow contexts beyond the model's max_position_embeddings"), False),
    "ignore_eos": Opt(flag("Run to --max-new-tokens past the end-of-sequence token"), False),
    "logprobs": Opt(flag("Return log p of each new token (in --json / the results)"), False),
    "top_logprobs": Opt(
        number(int, "Also return each new token's most likely alternatives, this many (0..20; with log p)")
    ),
    "speculate": Opt(
        number(int, "Verify up to this many draft tokens a step, copied from the prompt (0..16; 0 = off)")
    ),
}
AllowExtrapolationOpt = REQUEST_OPTIONS["allow_extrapolation"].annotation


@dataclass
class Runtime:
    """How the model runs: RUNTIME_OPTIONS' values (their defaults the API's)."""

    max_batch: int = DEFAULT_MAX_BATCH
    graph: bool = True
    device: str | None = None
    dtype: str | None = None
    kv_cache_dtype: str = KV_CACHE_DTYPES[0]
    quantization: str = QUANTIZATIONS[0]
    prefill_attention: str = PREFILL_ATTENTION[0]
    tp: int = 1
    cp: int = 1
    step_tokens: int | None = None

    def check(self) -> Runtime:
        """Every value that can be checked without the model, and without torch (UserError)."""
        check_device_name(self.device)
        check_dtype_name(self.dtype)
        check_kv_cache_dtype_name(self.kv_cache_dtype)
        check_choice("--quantization", self.quantization, QUANTIZATIONS)
        check_choice("--prefill-attention", self.prefill_attention, PREFILL_ATTENTION)
        check_int("--tp", self.tp, 1)
        check_int("--cp", self.cp, 1)
        if self.step_tokens is not None:
            check_int("--step-tokens", self.step_tokens, 1)
        if self.max_batch != DEFAULT_MAX_BATCH:  # the engine's limit (the default needs no torch import)
            from minidecode.decode import check_max_batch

            check_max_batch(self.max_batch)
        return self

    def load(self, model: str | None, speculate: int | None = None) -> LLM:
        """Check these settings, then load `model` with them (one rank's part under torchrun) and
        `speculate` as its requests' default (--speculate: its steps compiled at load); rank 0
        notes a synthetic model's random weights on stderr."""
        from minidecode.llm import LLM

        self.check()
        with slow_load_note():
            llm = LLM(
                model, device=self.device, dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype,
                quantization=self.quantization, prefill_attention=self.prefill_attention,
                cuda_graph=self.graph, max_batch=self.max_batch, tp=self.tp, cp=self.cp,
                step_tokens=self.step_tokens, speculate=speculate or 0,
            )  # fmt: skip
        if llm.synthetic and rank() == 0:
            typer.echo(f"note: {llm.name} has RANDOM weights: its text is noise, its speed is real", err=True)
        return llm


SLOW_LOAD_S = 20.0  # a load still running after this long says why on stderr


@contextlib.contextmanager
def slow_load_note() -> Iterator[None]:
    """Print one line on stderr (rank 0) if the load inside takes longer than SLOW_LOAD_S: on an
    empty Triton cache a GPU load compiles every step's kernels, minutes of silence otherwise."""
    note = "note: still loading (the weights; on a GPU, each step's kernels compiled once: Triton keeps them)"
    timer = threading.Timer(SLOW_LOAD_S, typer.echo, args=(note,), kwargs={"err": True})
    timer.daemon = True
    if rank() == 0:
        timer.start()
    try:
        yield
    finally:
        timer.cancel()


def request_from_options(values: dict[str, Any]) -> Request:
    """REQUEST_OPTIONS' values as the one Request of the API, unchecked (Request.check checks it):
    each parsed as its option says (--stop's escapes, --logit-bias's ID=BIAS)."""
    fields = {}
    for name, value in values.items():
        parse = REQUEST_OPTIONS[name].parse
        fields[name] = parse(value) if parse is not None and value is not None else value
    return Request(**fields)


def shared_options(runtime: tuple[str, ...] = (), request: bool = False) -> Callable:
    """Decorate a command with the RUNTIME_OPTIONS named in `runtime` and (request) every
    REQUEST_OPTIONS entry: typer sees each as an option of its own, after the command's own; the
    command gets them gathered, as its keyword-only parameters `runtime: Runtime` and
    `request: Request` (a --logit-bias that does not parse is one error line here)."""
    added = {**(REQUEST_OPTIONS if request else {}), **{name: RUNTIME_OPTIONS[name] for name in runtime}}

    def decorate(command: Callable) -> Callable:
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name not in ("runtime", "request")]
        keyword = inspect.Parameter.KEYWORD_ONLY
        params = own + [
            inspect.Parameter(name, keyword, annotation=opt.annotation, default=opt.default)
            for name, opt in added.items()
        ]

        def wrapper(**kwargs: Any) -> Any:
            values = {name: kwargs.pop(name) for name in added}
            if runtime:
                kwargs["runtime"] = Runtime(**{name: values[name] for name in runtime})
            if request:
                try:
                    kwargs["request"] = request_from_options({name: values[name] for name in REQUEST_OPTIONS})
                except UserError as e:
                    fail(str(e))
            return command(**kwargs)

        wrapper.__signature__ = signature.replace(parameters=params)
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        wrapper.__name__, wrapper.__qualname__ = command.__name__, command.__qualname__
        wrapper.__doc__, wrapper.__module__ = command.__doc__, command.__module__
        return wrapper

    return decorate


def check_launch(runtime: Runtime) -> None:
    """Refuse a torchrun launch whose size is not --tp x --cp (every rank would run the whole
    command, and write its output), and --tp / --cp without torchrun."""
    from minidecode.validate import check_parallel

    check_parallel(runtime.tp, runtime.cp, world_size())


def serve_rank0(llm: LLM) -> None:
    """A rank other than 0 of a torchrun launch: run rank 0's step plans until it closes; a dead
    rank 0 is one error line and exit code 1."""
    try:
        llm.serve_plans()
    except RuntimeError as e:
        typer.echo(f"error: rank {rank()}: {e}", err=True)
        raise typer.Exit(1) from None


# ---- generate ----------------------------------------------------------------------------------
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


def generate_text(
    prompt: str | None, prompt_file: Path | None, prompt_tokens: int | None, first: bool
) -> str | None:
    """The prompt text; None with --prompt-tokens, and on a rank other than 0 of a torchrun
    launch reading stdin (it uses rank 0's prompt)."""
    if prompt_tokens is not None:
        if prompt is not None or prompt_file is not None:
            fail("--prompt-tokens replaces --prompt / --prompt-file")
        return None
    if first or prompt is not None or prompt_file is not None:
        return read_prompt(prompt, prompt_file)  # stdin: rank 0 only
    return None


def check_generate_args(
    model: str | None,
    text: str | None,
    prompt_tokens: int | None,
    chat: bool,
    request: Request,
    runtime: Runtime,
    load_cache: Path | None = None,
    save_cache: Path | None = None,
) -> None:
    """Every argument of `generate` that can be checked without the model (and without torch);
    text None: --prompt-tokens, or a rank other than 0 of a torchrun launch."""
    from minidecode.validate import check_parallel

    runtime.check()
    check_parallel(runtime.tp, runtime.cp, world_size())
    if load_cache is not None and load_cache.is_dir():
        raise UserError(
            f"cache file {load_cache} is a directory; give the path of a file that --save-cache wrote"
        )
    if load_cache is not None and not load_cache.is_file():
        raise UserError(f"cache file {load_cache} does not exist")
    if save_cache is not None:
        check_writable(save_cache)  # before minutes of prefill, not after
    request.check(need_prompt=False)
    if prompt_tokens is not None:
        if prompt_tokens < 1:
            raise UserError("--prompt-tokens must be >= 1")
        if chat:
            raise UserError("--chat needs a text prompt, not --prompt-tokens")
        return
    if text is None:
        return
    Request(prompt=text).check()  # valid, non-empty UTF-8
    if chat:
        from minidecode.loading import DEFAULT_MODEL, resolve_model_dir
        from minidecode.tokenizer import read_chat_template

        if model is not None and model.startswith("synthetic:"):
            raise UserError("synthetic models have no chat template")
        if read_chat_template(resolve_model_dir(DEFAULT_MODEL if model is None else model)) is None:
            raise UserError("this model has no chat template (tokenizer_config.json or chat_template.jinja)")


def set_prompt(llm: LLM, request: Request, text: str | None, prompt_tokens: int | None, chat: bool) -> None:
    """The request's prompt: --prompt-tokens' random ids (a prompt the memory plan cannot hold is
    refused before they are made), the text as a chat message, or the text."""
    if prompt_tokens is not None:
        context = request.max_context or prompt_tokens + request.new_tokens
        llm.check_fits(context, prompt_tokens)  # (the least free memory of any rank)
        request.token_ids = llm.random_prompt(prompt_tokens, seed=request.seed or 0)
    elif chat:
        request.messages = [{"role": "user", "content": text}]
    else:
        request.prompt = text


@app.command()
@shared_options(
    runtime=("graph", "device", "dtype", "kv_cache_dtype", "quantization", "prefill_attention", "tp", "cp"),
    request=True,
)
def generate(
    model: ModelArg = None,
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="Prompt text")] = None,
    prompt_file: Annotated[
        Path | None, typer.Option("--prompt-file", "-f", help="Read the prompt from a file (UTF-8)")
    ] = None,
    chat: Annotated[
        bool,
        typer.Option(metavar="", help="Wrap the prompt as a user message in the chat template"),
    ] = False,
    prompt_tokens: Annotated[
        int | None,
        typer.Option(help="Use a prompt of exactly this many tokens (random ids; for synthetic models)"),
    ] = None,
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
    *,
    runtime: Runtime,
    request: Request,
) -> None:
    """Generate a continuation of a prompt; text streams to stdout, stats to stderr. With --tp /
    --cp, under torchrun: rank 0 reads the prompt and prints, every rank computes its part."""
    first = rank() == 0
    try:
        text = generate_text(prompt, prompt_file, prompt_tokens, first)
        check_generate_args(model, text, prompt_tokens, chat, request, runtime, load_cache, save_cache)
        llm = runtime.load(model, request.speculate)
        if not first:
            serve_rank0(llm)
            return
        if load_cache is not None:
            llm.load_cache(load_cache)
        set_prompt(llm, request, text, prompt_tokens, chat)
        stream = llm.stream(request, on_prefill_progress=Progress(enabled=not json_output and first))
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


# ---- batch -------------------------------------------------------------------------------------
# the runtime options of the commands that run an engine loop (batch, serve)
SERVE_RUNTIME = (
    "max_batch", "graph", "device", "dtype", "kv_cache_dtype", "quantization", "prefill_attention", "tp",
    "cp", "step_tokens",
)  # fmt: skip


@app.command()
@shared_options(runtime=SERVE_RUNTIME, request=True)
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
    no_progress: Annotated[
        bool, typer.Option("--no-progress", metavar="", help="No progress line on stderr")
    ] = False,
    *,
    runtime: Runtime,
    request: Request,
) -> None:
    """Run many requests as one continuously refilled batch. The requests file holds one JSON object a line:
    "prompt", "messages" or "token_ids"; optionally "id" (default: the line number) and any
    request option by its API name (max_new_tokens, temperature, stop, logprobs, reuse_prefix,
    ...: the options are the defaults). One JSON result a line is written as each request ends:
    {"id", "line", "text", "finish_reason", "token_ids", "prompt_tokens", "stats"}, or {"id",
    "line", "error"} for a request that was refused. Exit code 1 if any was. With --tp / --cp,
    under torchrun: rank 0 reads and writes, every rank computes its part."""
    if requests is None:  # one argument: the requests file, with the shipped model
        if model is None:
            fail("give a requests file (JSONL, one JSON object a line), or - for stdin")
        model, requests = None, model
    try:
        runtime.check()
        check_launch(runtime)
        request.check(need_prompt=False)
        if rank() != 0:  # rank 0 reads and writes; the others run its plans
            serve_rank0(runtime.load(model, request.speculate))
            return
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
    report = BatchReport(output, entries, progress=not no_progress)
    run_batch(model, runtime, request, report)


def run_batch(model: str | None, runtime: Runtime, defaults: Request, report: BatchReport) -> None:
    """The batch's good lines through one LLM (none is loaded when every line was refused as
    read), each result written as it ends; the stats line; exit code 1 if any request failed."""
    good = [entry for entry in report.entries if entry.error is None]
    stream = None
    if good or (world_size() or 1) > 1:  # (under torchrun the other ranks wait for the model)
        try:
            llm = runtime.load(model, defaults.speculate)
            given = {k: v for k, v in asdict(defaults).items() if v is not None}
            if good:
                stream = llm.stream_batch(
                    [entry.fields for entry in good],
                    on_result=lambda i, result: report.write(good[i], result),
                    **given,
                )
        except UserError as e:
            fail(str(e))
        if stream is not None:
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


# ---- serve -------------------------------------------------------------------------------------


@app.command()
@shared_options(runtime=SERVE_RUNTIME)
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
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="MINIDECODE_API_KEY",
            show_envvar=True,
            help="Require `Authorization: Bearer KEY` on every endpoint but /health",
        ),
    ] = None,
    allow_extrapolation: AllowExtrapolationOpt = False,
    access_log: Annotated[bool, typer.Option(help="One line per request on stderr")] = True,
    speculate: Annotated[
        int, typer.Option(help="A request's default speculate: the most draft tokens a step (0..16; 0 = off)")
    ] = 0,
    *,
    runtime: Runtime,
) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models) plus /health,
    /metrics, /tokenize and /detokenize; every request feeds the one engine loop (concurrent clients
    decode as one batch). Ctrl-C stops new requests and lets the running ones finish; a second
    Ctrl-C aborts them. With --tp / --cp, under torchrun: rank 0 listens, every rank computes its
    part. Needs the serve extra: pip install "minidecode[serve]"."""
    import importlib.util

    try:
        runtime.check()
        Request(speculate=speculate).check(need_prompt=False, names={"speculate": "--speculate"})
        check_launch(runtime)
        check_int("--port", port, 0)
        if port > 65535:
            raise UserError(f"--port must be at most 65535, got {port}")
        check_int("--max-tokens-default", max_tokens_default, 1)
        check_int("--max-waiting", max_waiting, 1)
        if api_key is not None and not api_key.strip():
            raise UserError("--api-key (MINIDECODE_API_KEY) is empty")
        missing = [
            m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None
        ]
        if missing:
            raise UserError(f'serve needs {", ".join(missing)}: pip install "minidecode[serve]"')
        if rank() != 0:  # rank 0 listens; the others run its plans
            serve_rank0(runtime.load(model, speculate))
            raise typer.Exit(0)
        check_port_free(host, port)
        from minidecode.server import ServerSettings, serve

        llm = runtime.load(model, speculate)
        settings = ServerSettings(
            served_model_name or model or "stdlib-tiny", max_tokens_default, max_waiting,
            api_key=api_key, allow_extrapolation=allow_extrapolation, access_log=access_log,
        )  # fmt: skip
        typer.echo(f"serving {settings.model_name} on http://{host}:{port}/v1 (Ctrl-C stops)", err=True)
        code = serve(llm, settings, host, port)
    except UserError as e:
        fail(str(e))
    raise typer.Exit(code)


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


# ---- info --------------------------------------------------------------------------------------
@app.command()
@shared_options(runtime=("device", "dtype", "kv_cache_dtype", "quantization", "tp", "cp"))
def info(
    model: ModelArg = None,
    context: Annotated[
        int | None, typer.Option(help="Context length for the memory plan (default: max positions)")
    ] = None,
    *,
    runtime: Runtime,
) -> None:
    """Architecture, parameter count, context length and the memory plan, without loading weights
    (with --tp / --cp: the plan of each GPU)."""
    try:
        runtime.check()
        if context is not None and context < 1:
            raise UserError(f"context must be >= 1, got {context}")
        from minidecode.info import describe

        plan = describe(
            model, context=context, dtype=runtime.dtype, device=runtime.device,
            kv_cache_dtype=runtime.kv_cache_dtype, tp=runtime.tp, cp=runtime.cp,
            quantization=runtime.quantization,
        )  # fmt: skip
        typer.echo(plan)
    except UserError as e:
        fail(str(e))


# ---- bench -------------------------------------------------------------------------------------
BATCH_ONLY = ("batch_peer",)  # bench's options of --batch alone, and of the prompt-length table alone:
LENGTHS_ONLY = (
    "prompt_tokens", "prefill_repeat_max_tokens", "compare", "peer", "peer_max_tokens", "compiled_max_tokens",
    "json_output", "plot_file", "quantization", "prefill_attention", "speculate",
)  # fmt: skip


@app.command()
@shared_options(runtime=("device", "dtype", "kv_cache_dtype", "quantization", "prefill_attention"))
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
        int, typer.Option(help="Samples: decode windows, and prefills up to --prefill-repeat-max-tokens")
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
    allow_extrapolation: AllowExtrapolationOpt = False,
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
        typer.Option(help="Batched decode: 8x32k (8 prompts of 32k), 256k,4k,8k (one each); repeatable"),
    ] = None,
    batch_peer: Annotated[
        str, typer.Option(help="Peers for --batch, comma-separated: transformers, or none")
    ] = "transformers",
    speculate: Annotated[
        int, typer.Option(help="Speculate: the most draft tokens a step of the timed generations (0..16)")
    ] = 0,
    *,
    runtime: Runtime,
) -> None:
    """Prefill and decode speed per prompt length against the read roofline, with the median and
    range over repeats (and transformers' eager and compiled settings with --compare); with
    --speculate K, the drafts kept and the tokens a step. With --batch: aggregate decode speed
    of batches against the batched roofline and peers. Every setting is checked, and every peer
    imported, before the model loads."""
    try:
        runtime.check()
        if batch:
            refuse_options(ctx, LENGTHS_ONLY, "to bench --batch")
            args = (batch, batch_peer, new_tokens, repeats, allow_extrapolation, out, command_line(ctx))
            return bench_batches(model, runtime, *args)
        refuse_options(ctx, BATCH_ONLY, "without --batch")
        from minidecode.benchmarks.e2e import BenchSettings

        settings = BenchSettings(
            prompt_lengths=prompt_tokens or [1024, 131072], window=new_tokens, repeats=repeats,
            prefill_repeat_max_tokens=prefill_repeat_max_tokens,
            peers=[p.strip() for p in peer.split(",") if p.strip()] if compare else [],
            peer_max_tokens=peer_max_tokens, compiled_max_tokens=compiled_max_tokens,
            allow_extrapolation=allow_extrapolation, speculate=speculate,
        )  # fmt: skip
        check_bench_args(settings, runtime, compare, out, plot_file)
    except UserError as e:
        fail(str(e))
    bench_lengths(model, runtime, settings, command_line(ctx), json_output, out, plot_file)


def refuse_options(ctx: typer.Context, names: tuple[str, ...], where: str) -> None:
    """Options of `names` given on the command line (they do not apply `where`): one error."""
    flags = {param.name: param.opts[0] for param in ctx.command.params}
    sources = {n: getattr(ctx.get_parameter_source(n), "name", "DEFAULT") for n in names}
    given = [flags[n] for n in names if sources[n] not in ("DEFAULT", "DEFAULT_MAP")]
    if given:
        raise UserError(f"{' / '.join(given)} {'does' if len(given) == 1 else 'do'} not apply {where}")


def check_bench_args(settings, runtime: Runtime, compare: str | None, out: Path | None, plot: bool) -> None:
    """Everything the prompt-length bench needs, checked before the model loads: its settings,
    the output files, matplotlib for --plot, and the peer, imported."""
    import importlib.util

    from minidecode.benchmarks.e2e import import_transformers

    settings.validate()
    if compare not in (None, "transformers"):
        raise UserError(f"unknown --compare {compare!r}; only 'transformers' is supported")
    if runtime.quantization != "none" and settings.peers:
        raise UserError(
            "--compare runs transformers on the checkpoint's weights: drop it with --quantization fp8"
        )
    if plot and out is None:
        raise UserError("--plot writes OUT.png: give --out too")
    for path in output_paths(out, (".json", ".md", ".png")[: 3 if plot else 2]):
        check_writable(path)
    if plot and importlib.util.find_spec("matplotlib") is None:
        raise UserError('--plot needs matplotlib: pip install "minidecode[bench]"')
    if settings.peers:
        import_transformers("--compare transformers")


def bench_lengths(model, runtime: Runtime, settings, command: str, json_output: bool, out, plot) -> None:
    """`bench` per prompt length: the tables on stdout (stderr with --json, whose object goes to
    stdout), and OUT.json / OUT.md (/ OUT.png) with --out."""
    from minidecode.benchmarks.e2e import run_bench

    try:
        llm = runtime.load(model)
        log = functools.partial(typer.echo, err=True)
        results, ceilings = run_bench(llm, settings, log=log, progress=lambda: Progress(enabled=True))
    except UserError as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted", code=130)
    from minidecode.benchmarks.report import e2e_report, write_e2e

    report = e2e_report(llm, settings, results, ceilings, command)
    typer.echo(report.header, err=json_output)  # with --json the tables go to stderr
    typer.echo(report.tables, err=json_output)
    if json_output:
        typer.echo(report.json_text)
    if out is not None:
        write_e2e(report, llm, results, command, output_paths(out, (".json", ".md", ".png")), plot)


def bench_batches(model, runtime: Runtime, specs, peer, window, repeats, allow_extrapolation, out, command):
    """`bench --batch`: the batch table on stdout, and OUT.json / OUT.md with --out; the specs,
    the peers and the output files checked before the model loads."""
    outputs = output_paths(out, (".json", ".md"))
    for path in outputs:
        check_writable(path)
    try:
        from minidecode.benchmarks.batch import (
            batch_peers,
            format_batch_table,
            import_peers,
            parse_batch_spec,
            run_batch_bench,
        )

        for spec in specs:
            parse_batch_spec(spec)  # a typo fails before the model loads
        peers = batch_peers(peer)
        import_peers(peers)
        llm = runtime.load(model)
        results, ceilings = run_batch_bench(
            llm, specs, window, repeats, peers, log=lambda m: typer.echo(m, err=True),
            allow_extrapolation=allow_extrapolation,
        )  # fmt: skip
    except UserError as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted", code=130)
    table = format_batch_table(results, ceilings)
    typer.echo(table)
    if outputs:
        from minidecode.benchmarks.report import write_batch

        write_batch(llm, results, ceilings, window, table, command, outputs)


def output_paths(out: Path | None, suffixes: tuple[str, ...]) -> list[Path]:
    """OUT.json, OUT.md, ... for --out OUT (none without it)."""
    return [] if out is None else [out.with_name(out.name + s) for s in suffixes]


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

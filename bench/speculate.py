"""Speculative decoding end to end (prompt lookup, `speculate`): decode tok/s with and without it
on input-grounded tasks, the tokens each decode step made, and the output checked to be the same,
through the public API only (LLM.generate), in one process.

Tasks (each names its model; greedy, eos ignored, every prefill in full: no prefix reuse):
  code    the shipped model (--model) shown functions of a standard-library module twice, then
          their first line again: the answer re-emits code the prompt holds
  long    the shipped model on a long document (--long-tokens of a standard-library module), then
          its first lines again: an answer that repeats the document
  random  random token ids (--random-model, synthetic:llama-3-8b by default; --random-tokens):
          nothing in the prompt to match, so what speculation costs where it finds no draft (the
          drafts it finds where the model's own output repeats itself are counted)

Each task runs each mode once untimed (kernels compiled, graphs captured), then --repeats pairs
alternated (plain then speculating, the order flipped every pair). A speculating run's token ids
must be the plain run's (greedy decoding is exact): a difference voids that task's figures
(named, and the bench exits 1).
Decode tok/s is the result's own (first new token to last, prefill excluded); the ratio is each
pair's speculating / plain, median and range; tokens per step = (decode steps + accepted drafts) /
decode steps of a speculating run.

    python bench/speculate.py --out bench/results/speculate-h200   # .md and .json, table last
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import sys
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from minidecode import LLM
from minidecode.benchmarks.e2e import Spread, benchmark_prompt, pad_id_for, special_token_ids
from minidecode.benchmarks.report import run_metadata

TASKS = ("code", "long", "random")
CODE_MODULE, CODE_FUNCTION = "colorsys.py", "def rgb_to_hls"  # a function the code task repeats
LONG_MODULE = "heapq.py"  # the long task's document (a few thousand tokens of the shipped model)


class OutputMismatch(Exception):
    """A speculating run's output differs from the plain run's (greedy decoding must be exact) from
    new token `at` on."""

    def __init__(self, message: str, at: int):
        super().__init__(message)
        self.at = at


def check_same(task: str, plain: list[int], speculating: list[int]) -> None:
    """Raise OutputMismatch unless the two runs made the same token ids, naming the first new token
    where they part."""
    if plain == speculating:
        return
    pairs = zip(plain, speculating, strict=False)
    at = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(plain), len(speculating)))
    raise OutputMismatch(
        f"{task}: speculation changed the output at new token {at} of {len(plain)} "
        f"(plain {plain[at : at + 4]}, speculating {speculating[at : at + 4]})",
        at,
    )


def top_two_gap(llm: LLM, prompt: list[int], at: int) -> float:
    """How far apart (in log-probability, nats) the plain run's two likeliest tokens are at new token
    `at`: near 0 is a rounding tie, which the step with drafts' other kernels may round the other
    way; a wide gap is a wrong token. (A request with log-probs makes no drafts: a plain run.)"""
    run = llm.generate(
        token_ids=prompt, max_new_tokens=at + 1, temperature=0, ignore_eos=True, reuse_prefix=False,
        top_logprobs=2,
    )  # fmt: skip
    (_, first), (_, second) = run.top_logprobs[at][:2]
    return first - second


@dataclass
class Task:
    name: str
    model: str  # what LLM() loads: a folder or a synthetic preset
    prompt: list[int]
    about: str  # where the prompt came from


@dataclass
class TaskResult:
    task: str
    model: str
    about: str
    prompt_tokens: int
    new_tokens: int
    speculate: int
    plain_tok_s: list[float] = field(default_factory=list)  # decode tok/s of each timed run
    speculating_tok_s: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)  # each pair's speculating / plain
    decode_steps: int = 0  # of a speculating run (each is the same: greedy, deterministic drafts)
    plain_decode_steps: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    same_output: bool = False

    @property
    def tokens_per_step(self) -> float:
        return (self.decode_steps + self.accepted_tokens) / max(self.decode_steps, 1)

    def summary(self) -> dict:
        out = asdict(self)
        out["plain_tok_s_spread"] = asdict(Spread.of(self.plain_tok_s))
        out["speculating_tok_s_spread"] = asdict(Spread.of(self.speculating_tok_s))
        out["ratio_spread"] = asdict(Spread.of(self.ratios))
        out["tokens_per_step"] = round(self.tokens_per_step, 3)
        out["acceptance"] = (
            round(self.accepted_tokens / self.proposed_tokens, 3) if self.proposed_tokens else None
        )
        return out


# ---- the tasks' prompts -------------------------------------------------------------------------


def stdlib_text(module: str) -> str:
    return (Path(sysconfig.get_paths()["stdlib"]) / module).read_text()


def code_prompt(llm: LLM) -> tuple[list[int], str]:
    """Standard-library functions (up to the module's next section) shown twice, then their first
    line: their third copy is the answer."""
    text = stdlib_text(CODE_MODULE)
    start = text.index(CODE_FUNCTION)
    block = text[start : text.index("\n\n\n", start)] + "\n\n\n"
    first = block[: block.index("\n") + 1]
    about = f"{CODE_MODULE} from {CODE_FUNCTION.split()[1]} to its next section, twice, then its first line"
    return llm.tokenizer.encode(block * 2 + first), about


def long_prompt(llm: LLM, tokens: int) -> tuple[list[int], str]:
    """The first `tokens` tokens of a standard-library module (whole lines), a blank line, then its
    first lines again: the answer repeats the document."""
    ids = llm.tokenizer.encode(stdlib_text(LONG_MODULE))[:tokens]
    doc = llm.tokenizer.decode(ids)
    doc = doc[: doc.rindex("\n") + 1]
    head = doc[: doc.index("\n", min(100, len(doc) - 1)) + 1]
    about = f"{LONG_MODULE}: its first {tokens:,} tokens, then its first lines again"
    return llm.tokenizer.encode(doc + "\n\n" + head), about


def random_prompt(llm: LLM, tokens: int) -> tuple[list[int], str]:
    special = special_token_ids(llm)
    excluded = special | {pad_id_for(special)}
    return benchmark_prompt(llm.config.vocab_size, tokens, 53, excluded), f"{tokens:,} random ids"


# ---- the runs ------------------------------------------------------------------------------------


def generate(llm: LLM, ids: list[int], new_tokens: int, speculate: int):
    return llm.generate(
        token_ids=ids, max_new_tokens=new_tokens, temperature=0, ignore_eos=True, reuse_prefix=False,
        speculate=speculate,
    )  # fmt: skip


def run_task(llm: LLM, task: Task, args: argparse.Namespace, log) -> TaskResult:
    """One task: each mode once untimed, then `repeats` pairs, the order flipped every pair; every
    speculating run's output checked against the plain run's (OutputMismatch)."""
    k, new = args.speculate, args.new_tokens
    result = TaskResult(task.name, task.model, task.about, len(task.prompt), new, k)
    reference = generate(llm, task.prompt, new, 0)
    try:
        check_same(task.name, reference.token_ids, generate(llm, task.prompt, new, k).token_ids)
    except OutputMismatch as e:
        gap = top_two_gap(llm, task.prompt, e.at)
        raise OutputMismatch(
            f"{e}; the plain run's top two log-probs there are {gap:.4f} nats apart", e.at
        ) from None
    for pair in range(args.repeats):
        rates = {}
        for mode in (0, k) if pair % 2 == 0 else (k, 0):
            run = generate(llm, task.prompt, new, mode)
            check_same(task.name, reference.token_ids, run.token_ids)
            rates[mode] = run.stats.decode_tokens_per_s
            if mode:
                stats = run.stats
                result.decode_steps, result.proposed_tokens = stats.decode_steps, stats.proposed_tokens
                result.accepted_tokens = stats.accepted_tokens
            else:
                result.plain_decode_steps = run.stats.decode_steps
        result.plain_tok_s.append(rates[0])
        result.speculating_tok_s.append(rates[k])
        result.ratios.append(rates[k] / rates[0])
        log(
            f"{task.name} pair {pair + 1}: plain {rates[0]:,.1f} tok/s, speculate {k} {rates[k]:,.1f} tok/s "
            f"({rates[k] / rates[0]:.3f}x), {result.tokens_per_step:.2f} tok/step"
        )
    result.same_output = True
    return result


def load(model: str, args: argparse.Namespace) -> LLM:
    return LLM(None if model == "shipped" else model, device=args.device, dtype=args.dtype)


def make_tasks(llm: LLM, model: str, names: list[str], args: argparse.Namespace) -> list[Task]:
    tasks = []
    for name in names:
        if name == "code":
            ids, about = code_prompt(llm)
        elif name == "long":
            ids, about = long_prompt(llm, args.long_tokens)
        else:
            ids, about = random_prompt(llm, args.random_tokens)
        tasks.append(Task(name, model, ids, about))
    return tasks


def free(llm: LLM) -> None:
    llm.close()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- the report ----------------------------------------------------------------------------------


def table(results: list[TaskResult]) -> str:
    head = (
        "task", "model", "prompt tok", "new tok", "plain decode tok/s", "speculating tok/s",
        "speculating / plain", "tokens / step", "drafts accepted / proposed", "same output",
    )  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in results:
        model = Path(r.model).name if r.model != "shipped" else "shipped (stdlib-tiny)"
        cells = (
            r.task, model, f"{r.prompt_tokens:,}", f"{r.new_tokens:,}",
            Spread.of(r.plain_tok_s).format(), Spread.of(r.speculating_tok_s).format(),
            Spread.of(r.ratios).format(3), f"{r.tokens_per_step:.2f}",
            f"{r.accepted_tokens:,} / {r.proposed_tokens:,}", "yes" if r.same_output else "NO",
        )  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    ap.add_argument("--model", default="shipped", help="the code and long tasks' model (default: shipped)")
    ap.add_argument("--random-model", default="synthetic:llama-3-8b", help="the random task's model")
    ap.add_argument("--long-tokens", type=int, default=3000, help="the long task's document, in tokens")
    ap.add_argument("--random-tokens", type=int, default=32768, help="the random task's prompt, in tokens")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--speculate", type=int, default=8, help="the most draft tokens a step (1..16)")
    ap.add_argument("--repeats", type=int, default=3, help="timed (plain, speculating) pairs a task")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--out", type=Path, default=None, help="prefix of the .md/.json results")
    args = ap.parse_args()
    if not 1 <= args.speculate <= 16 or args.repeats < 1 or args.new_tokens < 2:
        ap.error("need 1 <= --speculate <= 16, --repeats >= 1 and --new-tokens >= 2")
    command = shlex.join(["python", "bench/speculate.py", *sys.argv[1:]])
    by_model: dict[str, list[str]] = {}
    for name in args.tasks:
        by_model.setdefault(args.random_model if name == "random" else args.model, []).append(name)
    results, about, failures = [], None, []
    for model, names in by_model.items():
        llm = load(model, args)
        if about is None:
            about = run_metadata(llm, command)
            print(json.dumps(about), flush=True)
        try:
            for task in make_tasks(llm, model, names, args):
                try:
                    results.append(run_task(llm, task, args, lambda line: print(line, flush=True)))
                except OutputMismatch as e:  # that task's figures are void; the others still run
                    failures.append(str(e))
                    print(f"!! {e}", flush=True)
        finally:
            free(llm)
    about = {**about, "model": "per task", "models": list(by_model)}
    header = (
        f"Device: {about['device']} · date {about['date']} · commit {about['commit']} · "
        f"torch {about['torch']} · {about['dtype']}, KV cache {about['kv_cache_dtype']} · "
        f"speculate {args.speculate} · {args.new_tokens} new tokens, greedy · "
        f"timed pairs a task: {args.repeats}"
    )
    text = table(results)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        data = {"env": about, "settings": vars(args) | {"out": str(args.out)}, "failures": failures}
        data["tasks"] = [r.summary() for r in results]
        args.out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
        tasks = __doc__.split("\n\n")[1]  # the docstring's list of the tasks
        args.out.with_suffix(".md").write_text(
            f"# Speculative decoding end to end\n\n{header}\n\ncommand: `{command}`\n\n{tasks}\n\n{text}\n"
        )
    print(f"\n{header}\n\n{text}")
    if failures:
        print("\n".join(f"!! {f}" for f in failures), flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()

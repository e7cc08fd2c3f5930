"""Run README.md's user commands, as written, in an install made the README's way.

.ci/readme_install.sh installs the project as the README's Setup says (PyTorch's CPU build, then
`pip install -e ".[serve]"`: no test extra) in a fresh venv and runs this script with that venv's
python; it needs nothing but the standard library. The commands are read from the README's code
blocks, so this follows the README as it is written, and each runs in a scratch folder. A command
fails the stage when it exits non-zero, prints a traceback or prints torch's "Failed to initialize
NumPy" (what a dependency missing from the install looks like); so does an expected command that
is no longer found in the README (update this script with the README).

Run (bash blocks): every `minidecode generate` line on the shipped model (no model argument), the
`--save-cache` / `--load-cache` pair among them (book.txt and notes.py are small stand-ins made
here), `minidecode --version`, `minidecode batch` after the line that writes its requests file,
`minidecode info` on the shipped model and the README's `info` lines on a `synthetic:` model (a
memory plan; nothing is allocated). Python blocks: those on the shipped model, among them the
prefix-reuse one (`llm.save_cache(...)`), then a second process that loads the file it saved
(`LLM().load_cache`) and reuses it.
Skipped by design: lines that need a GPU (`--device cuda`), torchrun, a hub download or a local
checkpoint (a model argument that is not `synthetic:`), generate and bench on `synthetic:` models
(billions of random weights: GPU-sized work), `--compare transformers` (transformers is not in
this install), `serve` and the OpenAI client block (a server and the openai package; tests/ cover
the server), and the install and test commands themselves (the stage is the install).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
INSTALL_LINE = 'pip install -e ".[serve]"'  # what .ci/readme_install.sh runs
BAD_OUTPUT = ("Failed to initialize NumPy", "Traceback (most recent call last)")
TIMEOUT_S = 300  # a command; the slowest takes a few seconds
ENV = dict(os.environ, HF_HUB_OFFLINE="1")  # the shipped model needs no download: prove it
SEPARATORS = {"|", "||", "&&", ";", "(", ")", "&"}
REDIRECTS = {">", ">>", "<", "2>", "&>"}
# stand-ins for the files a user brings, by the names the README gives them
INPUTS = {
    "book.txt": (
        "stdlib-tiny is the small model that ships with minidecode. The minidecode project trained it "
        "on the sources of the CPython 3.11 standard library, on one GPU, in about a minute. It has six "
        "layers, a hidden size of 256 and a byte-level BPE vocabulary of 4096 tokens. It writes code "
        "that looks like Python; it is not an assistant and has no chat template.\n"
    )
    * 4,
    "notes.py": (
        "import os\n\n\ndef list_python_files(folder):\n"
        '    return sorted(name for name in os.listdir(folder) if name.endswith(".py"))\n\n\n'
        "def main():\n    for name in list_python_files("
    ),
}
# Python blocks that import one of these are skipped: they need more than the install gives
PYTHON_SKIP = {"openai": "the OpenAI client talks to a running `minidecode serve` (tests/ cover it)"}

failures: list[str] = []
Done = subprocess.CompletedProcess | None  # a command's result, None when it failed


def fail(what: str) -> None:
    print(f"FAIL: {what}", flush=True)
    failures.append(what)


# ---- the README's code blocks --------------------------------------------------------------------
def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    blocks, lang, body = [], None, []
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if lang is None:
                lang, body = line.lstrip()[3:].strip(), []
            else:
                blocks.append((lang, "\n".join(body) + "\n"))
                lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def shell_lines(body: str) -> list[str]:
    """A bash block's command lines (backslash continuations joined), comments and blanks left out."""
    lines, pending = [], ""
    for raw in body.splitlines():
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        line = (pending + raw).strip()
        pending = ""
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def tokens(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def minidecode_args(line: str) -> list[str] | None:
    """The arguments of the `minidecode` command a shell line runs (as a pipeline's stage too), or
    None if it runs none (`torchrun ... -m minidecode` included: skipped by design)."""
    words = tokens(line)
    for i, word in enumerate(words):
        if word == "minidecode" and (i == 0 or words[i - 1] in SEPARATORS):
            args = []
            for w in words[i + 1 :]:
                if w in SEPARATORS or w in REDIRECTS:
                    break
                args.append(w)
            return args
    return None


def positionals(args: list[str]) -> list[str]:
    """The arguments before the first option (the README writes MODEL, and REQUESTS, first)."""
    out = []
    for a in args:
        if a.startswith("-"):
            break
        out.append(a)
    return out


# ---- running -------------------------------------------------------------------------------------
def run(name: str, argv: list[str], cwd: Path, stdin: str | None = None) -> Done:
    """Run one command; None (and a failure recorded) if it exits non-zero or prints BAD_OUTPUT."""
    print(f"$ {name}", flush=True)
    start = time.monotonic()
    try:
        done = subprocess.run(
            argv, cwd=cwd, input=stdin, capture_output=True, text=True, timeout=TIMEOUT_S, env=ENV
        )
    except subprocess.TimeoutExpired:
        fail(f"{name}: still running after {TIMEOUT_S} s")
        return None
    output = done.stdout + done.stderr
    print(f"  exit {done.returncode} in {time.monotonic() - start:.1f} s", flush=True)
    bad = [b for b in BAD_OUTPUT if b in output]
    if done.returncode != 0 or bad:
        tail = "\n".join(output.splitlines()[-30:])
        print(f"  output (last lines):\n{tail}", flush=True)
        fail(f"{name}: exit {done.returncode}" + "".join(f', printed "{b}"' for b in bad))
        return None
    return done


def shell(line: str, cwd: Path) -> Done:
    return run(line, ["bash", "-o", "pipefail", "-c", line], cwd)


def check_bash(blocks: list[tuple[str, str]], work: Path) -> None:
    lines = [line for lang, body in blocks if lang in ("bash", "sh", "shell") for line in shell_lines(body)]
    if INSTALL_LINE not in lines:
        fail(f"the README no longer installs with `{INSTALL_LINE}`: update .ci/readme_install.sh and this")
    names = {  # what each expected command looks like
        "as written": "minidecode generate --prompt TEXT",
        "--save-cache": "minidecode generate ... --save-cache FILE",
        "--load-cache": "minidecode generate ... --load-cache FILE",
        "--version": "minidecode --version",
        "batch": "minidecode batch REQUESTS ... (after a line that writes REQUESTS)",
        "info": "minidecode info [synthetic:MODEL] ...",
    }
    found = dict.fromkeys(names, False)
    for line in lines:
        args = minidecode_args(line)
        if args is None or not args:
            continue  # install, test, torchrun and file lines: not a user's minidecode command
        command, model = args[0], next(iter(positionals(args[1:])), None)
        if command == "--version":
            found["--version"] = True
            done = shell(line, work)
            if done and not re.search(r"\d+\.\d+", done.stdout):
                fail(f"{line}: no version in {done.stdout!r}")
        elif command == "generate":
            if model is not None or any(a.startswith("cuda") for a in args):
                continue  # a hub id, a local checkpoint, a GPU-sized synthetic model, or a GPU
            as_written = len(args) == 3 and args[1] == "--prompt"
            found["as written"] |= as_written
            saves = args[args.index("--save-cache") + 1] if "--save-cache" in args else None
            loads = "--load-cache" in args
            if saves:
                found["--save-cache"] = True
                (work / saves).unlink(missing_ok=True)
            found["--load-cache"] |= loads
            done = shell(line, work)
            if done is None:
                continue
            if as_written and not done.stdout.strip():
                fail(f"{line}: generated no text")
            if saves and not (work / saves).is_file():
                fail(f"{line}: wrote no {saves}")
            if loads and "from the cache" not in done.stderr:
                fail(f"{line}: the stats line says nothing came from the cache:\n{done.stderr}")
        elif command == "batch":
            named = positionals(args[1:])  # [MODEL] REQUESTS
            if len(named) != 1:
                continue  # a model of the user's (or no requests file: the expected check says so)
            found["batch"] = True
            requests, writes = named[0], None
            for other in lines:
                words = tokens(other)
                if any(w == ">" and words[i + 1] == requests for i, w in enumerate(words[:-1])):
                    writes = other
            if writes is None:
                fail(f"{line}: no README line writes its requests file {requests}")
                continue
            output = args[args.index("--output") + 1] if "--output" in args else None
            if shell(writes, work) is None or (done := shell(line, work)) is None:
                continue
            wanted = [json.loads(r) for r in (work / requests).read_text().splitlines() if r.strip()]
            results = (work / output).read_text() if output else done.stdout
            got = [json.loads(r) for r in results.splitlines() if r.strip()]
            if len(got) != len(wanted) or any("error" in r for r in got):
                fail(f"{line}: {len(got)} results for {len(wanted)} requests: {got}")
        elif command == "info":
            if model is None or model.startswith("synthetic:"):
                found["info"] = True
                shell(line, work)
    if not any(minidecode_args(line) == ["info"] for line in lines):
        shell("minidecode info", work)  # the shipped model's plan, whether or not the README shows it
    for what, seen in found.items():
        if not seen:
            fail(f"the README has no `{names[what]}` line that runs here: update this script")


def check_python(blocks: list[tuple[str, str]], work: Path) -> None:
    saved = None
    for number, (lang, body) in enumerate(blocks, 1):
        if lang != "python":
            continue
        tree = ast.parse(body)
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.split(".")[0])
        if imported & PYTHON_SKIP.keys():
            continue
        models = [
            node.args[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "LLM" and node.args
        ]
        if models:
            continue  # a checkpoint of the user's, or a GPU-sized synthetic model
        match = re.search(r"""\.save_cache\(\s*["']([^"']+)["']""", body)
        name = f"python < the README's code block {number}" + (" (prefix reuse, save_cache)" if match else "")
        if match:
            saved = match.group(1)
            (work / saved).unlink(missing_ok=True)
        done = run(name, [sys.executable, "-"], work, stdin=body)
        if done and match and not (work / saved).is_file():
            fail(f"{name}: wrote no {saved}")
    if saved is None:
        fail("the README has no Python block with `llm.save_cache(...)`: update this script")
    elif (work / saved).is_file():
        # another process loads it and reuses it: the saved tokens (prompt and answer) plus one more
        ids = saved_token_ids(work / saved)
        load = (
            "from minidecode import LLM\n"
            "llm = LLM()\n"
            f"held = llm.load_cache({saved!r})\n"
            f"result = llm.generate(token_ids={ids + ids[-1:]!r}, max_new_tokens=4)\n"
            "assert held > 0 and result.stats.reused_tokens > 0, (held, result.stats.reused_tokens)\n"
            "print(held, result.stats.reused_tokens)\n"
        )
        name = f"python: LLM().load_cache({saved!r}), then a prompt that starts with its tokens"
        run(name, [sys.executable, "-"], work, stdin=load)


def saved_token_ids(path: Path) -> list[int]:
    """The token ids a cache file holds (a safetensors file: an 8-byte header length, a JSON
    header, then the data; token_ids is int64)."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8 : 8 + n])["token_ids"]["data_offsets"]
    ids = array("q", data[8 + n + begin : 8 + n + end])
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tolist()


def main() -> int:
    start = time.monotonic()
    executable = shutil.which("minidecode")
    if executable is None or Path(executable).parent != Path(sys.executable).parent:
        print(f"FAIL: `minidecode` is {executable}, not this venv's ({Path(sys.executable).parent})")
        return 1
    if importlib.util.find_spec("transformers") or importlib.util.find_spec("pytest"):
        print("FAIL: this venv has the test extra's packages: run it in a venv with the serve install only")
        return 1
    blocks = code_blocks(README.read_text())
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        for name, text in INPUTS.items():
            (work / name).write_text(text)
        check_bash(blocks, work)
        check_python(blocks, work)
    print(f"README commands: {len(failures)} failure(s), {time.monotonic() - start:.0f} s")
    for what in failures:
        print(f"  {what}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

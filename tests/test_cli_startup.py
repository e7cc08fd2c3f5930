"""The `minidecode` entry point as a real process: no torch import for --help, --version or a
bad argument (checked before the model loads), Ctrl-C as one line with exit 130, non-UTF-8
input as one error line, and the README's commands exactly as written."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import minidecode
from minidecode_cli.cli import unescape

REPO = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONIOENCODING="utf-8")
CLI = [sys.executable, "-m", "minidecode_cli.cli"]


@pytest.fixture(scope="module")
def model_dir(checkpoint_factory):
    return checkpoint_factory("llama", "default", max_positions=512)


def torch_imported_by(*args: str) -> tuple[bool, int]:
    """Run the CLI in a fresh interpreter: (was torch imported, exit code)."""
    code = (
        "import sys\nfrom minidecode_cli.cli import app\ntry:\n    app(sys.argv[1:])\n"
        "except SystemExit as e:\n    code = e.code\n"
        "print('torch' in sys.modules, code, file=sys.stderr)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=ENV, timeout=120
    )
    imported, exit_code = proc.stderr.strip().splitlines()[-1].split()
    return imported == "True", int(exit_code or 0)


def test_importing_the_cli_does_not_import_torch():
    code = "import sys, minidecode_cli.cli; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    assert proc.stdout.strip() == "False", proc.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["--version"],
        ["generate", "--help"],
        ["generate", "--no-such-option"],
        ["generate", "-p", "hi", "--temperature", "-1"],
        ["generate", "-p", "hi", "--top-p", "2"],
        ["generate", "-p", "hi", "-n", "0"],
        ["generate", "-p", ""],
        ["generate", "-p", "hi", "--dtype", "int8"],
        ["generate", "-p", "hi", "--device", "tpu"],
        ["generate", "-p", "hi", "--stop", ""],
        ["generate", "synthetic:llama-3-8b", "-p", "hi", "--chat"],
        ["info", "--context", "0"],
    ],
)
def test_answers_without_torch(args):
    imported, code = torch_imported_by(*args)
    assert not imported
    assert code == (0 if args[-1] in ("--help", "--version") else 2)


@pytest.mark.parametrize(
    "args, match",
    [
        (["generate", "--no-such-option"], r"^error: No such option: --no-such-option"),
        (["generate", "-p", "hi", "--top-k", "abc"], r"^error: Invalid value for '--top-k'"),
        (["bench", "--logit-bias", "1=2"], r"^error: No such option: --logit-bias"),  # generate / batch only
        (["no-such-command"], r"^error: No such command 'no-such-command'"),
    ],
)
def test_a_mistyped_command_line_is_one_error_line(args, match):
    """click's own refusals too: one line (not the usage and a message), exit 2."""
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, env=ENV, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    one_error_line(proc.stderr, match)


def test_chat_without_template_is_refused_before_loading(model_dir, tmp_path):
    no_template = tmp_path / "ckpt"
    shutil.copytree(model_dir, no_template)
    config = json.loads((no_template / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    assert torch_imported_by("generate", str(no_template), "-p", "hi", "--chat") == (False, 2)
    # ...while a good request does load the model
    good = ("generate", str(model_dir), "-p", "hi", "-n", "2", "--device", "cpu")
    assert torch_imported_by(*good) == (True, 0)


def test_version():
    proc = subprocess.run([*CLI, "--version"], capture_output=True, text=True, env=ENV, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"minidecode {minidecode.__version__}"


def test_help_describes_every_option():
    import typer.main

    from minidecode_cli.cli import app

    group = typer.main.get_command(app)
    for name in ("generate", "batch", "info"):
        for param in group.commands[name].params:
            assert param.help, f"{name} {param.name} has no help text"
        proc = subprocess.run([*CLI, name, "--help"], capture_output=True, text=True, env=ENV, timeout=60)
        assert proc.returncode == 0 and "<bool>" not in proc.stdout
        assert "--seed <int>" in proc.stdout or name == "info"


def one_error_line(stderr: str, match: str) -> None:
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and re.search(match, lines[0]), stderr


def test_non_utf8_stdin_and_argument(model_dir):
    proc = subprocess.run(
        [*CLI, "generate", str(model_dir), "--device", "cpu"], input=b"\xff\xfe hello", capture_output=True,
        env=ENV, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == b""
    one_error_line(proc.stderr.decode(), r"stdin is not valid UTF-8 text: byte 0xff at offset 0")
    # argv bytes that are not UTF-8 reach Python as lone surrogates
    proc = subprocess.run(
        [*(a.encode() for a in CLI), b"generate", str(model_dir).encode(), b"-p", b"ok \xff"],
        capture_output=True, env=ENV, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == b""
    one_error_line(proc.stderr.decode(), r"the prompt is not valid UTF-8 text: .*byte 0xff")


def interrupt(proc: subprocess.Popen) -> tuple[str, str]:
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    return out, err


def wait_for_torch_import(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Until the child maps libtorch (it is importing torch: past the CLI's start, where the
    handler is installed, and before any model loads); a fixed sleep is too short on a loaded
    machine and too long on a fast one."""
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if "libtorch" in maps.read_text():
                return
        except OSError:  # no /proc (not Linux): fall back to a pause
            time.sleep(1.0)
            return
        time.sleep(0.005)


def test_ctrl_c_during_startup_is_one_line():
    """SIGINT while the command is still importing torch: no traceback, exit 130."""
    proc = subprocess.Popen(
        [*CLI, "generate", "-p", "hi", "-n", "100000", "--allow-extrapolation", "--device", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
    )  # fmt: skip
    wait_for_torch_import(proc)
    assert proc.poll() is None, "finished before the interrupt"
    out, err = interrupt(proc)
    assert proc.returncode == 130
    one_error_line(err, r"^error: interrupted$")


def test_ctrl_c_during_generation_keeps_the_text():
    proc = subprocess.Popen(
        [*CLI, "generate", "-p", "import os\n", "-n", "100000", "--allow-extrapolation", "--device", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
    )  # fmt: skip
    first = proc.stdout.read(1)  # text is streaming: generation is under way
    out, err = interrupt(proc)
    assert proc.returncode == 130
    assert first and (first + out).strip()
    one_error_line(err, r"^error: interrupted$")


def test_ctrl_c_on_a_rank_other_than_0_is_silent():
    """A terminal's Ctrl-C reaches every rank of a torchrun launch: only rank 0 writes its line."""
    proc = subprocess.Popen(
        [*CLI, "generate", "-p", "import os\n", "-n", "100000", "--ignore-eos", "--allow-extrapolation",
         "--device", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(ENV, RANK="1"),
    )  # fmt: skip
    wait_for_torch_import(proc)
    time.sleep(3)  # loading the model or generating (rank 1 prints no text to wait for)
    out, err = interrupt(proc)
    assert proc.returncode == 130 and "error" not in err and "Traceback" not in err, err


def test_unescape():
    assert unescape(r"\n\n") == "\n\n"
    assert unescape(r"a\tb\\n\x41\u00e9\"") == 'a\tb\\nAé"'
    assert unescape(r"\q stays") == r"\q stays"
    assert unescape("🙂\n") == "🙂\n"


def readme_commands(prefix: str) -> list[str]:
    block = (REPO / "README.md").read_text().split("## Command line", 1)[1].split("```", 2)[1]
    return [line for line in block.splitlines() if line.startswith(prefix)]


def test_readme_stop_command(tmp_path):
    """The README's --stop "\\n\\n" example, exactly as written, through a shell: it stops at the
    first blank line (before escapes were interpreted it never did)."""
    (command,) = readme_commands("cat notes.py |")
    (tmp_path / "notes.py").write_text("def add(a, b):\n    return a + b\n")
    env = dict(ENV, PATH=f"{Path(sys.executable).parent}{os.pathsep}{ENV.get('PATH', '')}")
    proc = subprocess.run(
        ["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith("[stop]"), proc.stderr
    assert "\n\n" not in proc.stdout and proc.stdout.strip()


def test_readme_version_command(tmp_path):
    (command,) = readme_commands("minidecode --version")
    env = dict(ENV, PATH=f"{Path(sys.executable).parent}{os.pathsep}{ENV.get('PATH', '')}")
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"minidecode {minidecode.__version__}"


def test_prefill_progress_per_chunk_and_plain_lines_in_logs(model_dir):
    """stderr not a terminal: plain lines (no carriage returns), several per layer-major prefill
    (chunks of 1,024 rows over a 16,384-token prompt: 16 chunks x 2 layers)."""
    code = (
        "import sys\nfrom minidecode import LLM\nfrom minidecode_cli.cli import Progress\n"
        f"llm = LLM({str(model_dir)!r}, device='cpu', prefill_chunk=1024)\n"
        "llm.generate(token_ids=[5] * 16384, max_new_tokens=1, allow_extrapolation=True,\n"
        "             on_prefill_progress=Progress(enabled=True))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("prefill ")]
    percents = [int(line.split()[1].rstrip("%")) for line in lines]
    assert percents == list(range(0, 101, 10))[-len(percents) :] and len(percents) >= 10, proc.stderr
    assert lines[-1].startswith("prefill 100% 16,384/16,384 tok")

"""What an install needs and gives: `python -m minidecode` is the command, and the CPU runtime
(import, LLM(), generate, an FP8 cache, the command) runs with triton not importable at all, so a
CPU-only install does not need triton, which only the test extra brings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import minidecode
from minidecode import LLM

REPO = Path(__file__).resolve().parent.parent
PROMPT, NEW = "def fibonacci(n):", 12
# A user's environment: no interpreter switch for Triton (the tests' conftest sets one on the CPU).
ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {
    "HF_HUB_OFFLINE": "1",
    "PYTHONIOENCODING": "utf-8",
}


def greedy(kv_cache_dtype: str = "auto") -> str:
    """The shipped model's greedy continuation of PROMPT through the API, in this process."""
    llm = LLM(device="cpu", kv_cache_dtype=kv_cache_dtype)
    return llm.generate(PROMPT, max_new_tokens=NEW, temperature=0).text


@pytest.fixture(scope="module")
def greedy_text() -> str:
    return greedy()


def run(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, *(["-c", code] if code else []), *args]
    return subprocess.run(command, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=300)


def test_python_m_minidecode_is_the_command(greedy_text):
    version = run("-m", "minidecode", "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"minidecode {minidecode.__version__}"
    args = ["generate", "--prompt", PROMPT, "-n", str(NEW), "--temperature", "0", "--device", "cpu"]
    generated = run("-m", "minidecode", *args)
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.rstrip("\n") == greedy_text.rstrip("\n")
    assert "decode" in generated.stderr


BLOCK_TRITON = """
import importlib.abc, sys

class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError(f"No module named {name!r} (blocked: a CPU-only install)")

sys.meta_path.insert(0, NoTriton())
try:
    import triton
except ImportError:
    pass
else:
    raise SystemExit("the block did not work")
"""

WITHOUT_TRITON = (
    BLOCK_TRITON
    + """
from minidecode import LLM
for kv in ("auto", "fp8"):
    llm = LLM(device="cpu", kv_cache_dtype=kv)
    result = llm.generate(sys.argv[1], max_new_tokens=int(sys.argv[2]), temperature=0)
    print(repr(result.text))
from minidecode_cli.cli import main
sys.argv = ["minidecode", "generate", "--prompt", sys.argv[1], "-n", sys.argv[2], "--temperature", "0",
            "--device", "cpu"]
main()
"""
)


def test_cpu_runtime_never_imports_triton(greedy_text):
    """With every `import triton` failing: the shipped model through the API (model-dtype and FP8
    caches) and through the command, each the same greedy text as this process's."""
    proc = run(PROMPT, str(NEW), code=WITHOUT_TRITON)
    assert proc.returncode == 0, proc.stderr
    model_dtype, fp8, command = proc.stdout.split("\n", 2)
    assert model_dtype == repr(greedy_text) and fp8 == repr(greedy("fp8"))
    assert command.rstrip("\n") == greedy_text.rstrip("\n")


def test_triton_is_a_test_dependency_only():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("triton")]
    assert [d for d in project["optional-dependencies"]["test"] if d.startswith("triton")]


WITHOUT_TRITON_PARALLEL = (
    BLOCK_TRITON
    + """
import torch
import minidecode.distributed, minidecode.models.parallel
from minidecode.kernels import ops
o, lse = torch.randn(2, 1, 4, 8), torch.randn(2, 1, 4)
held = torch.ones(1, dtype=torch.int32)
parts = torch.stack([ops.pack_partials(o[r], lse[r], held) for r in range(2)])
print(tuple(ops.merge_ranks(parts, torch.bfloat16).shape))
"""
)


def test_parallel_cpu_ranks_never_import_triton():
    """With every `import triton` failing: what CPU ranks under torchrun (gloo) import, and the
    context-parallel merge's CPU path."""
    proc = run(code=WITHOUT_TRITON_PARALLEL)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "(1, 4, 8)"

"""The shipped model through minidecode's own runtime: logits against transformers on held-out
text, greedy generation, the Python API with no model argument, and the README's run command
from an installed wheel in a fresh virtual environment."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

import minidecode
from minidecode.llm import DEFAULT_MODEL

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "training"))

import stdlib_corpus  # noqa: E402
from helpers import rel_err  # noqa: E402


@pytest.fixture(scope="module")
def llm() -> minidecode.LLM:
    return minidecode.LLM(device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def heldout_ids(llm) -> list[int]:
    _, texts = stdlib_corpus.load_split("heldout", max_chars=20_000)
    return llm.tokenizer.encode("\n".join(texts))[:1500]


def test_logits_match_transformers_on_heldout_text(llm, hf, heldout_ids):
    ours = llm.logits(heldout_ids)  # [T, V] float32
    with torch.no_grad():
        ref = hf(torch.tensor([heldout_ids])).logits[0]
    rel = rel_err(ours, ref)
    assert rel <= 1e-4, rel
    # and the perplexity both imply, for the record
    nll = torch.nn.functional.cross_entropy(ours[:-1], torch.tensor(heldout_ids[1:]))
    print(f"held-out perplexity through minidecode: {nll.exp().item():.2f} (relative logit error {rel:.1e})")
    assert nll.exp().item() < 50  # a random model of this vocabulary sits near 4096


def test_greedy_generation_matches_transformers(llm, hf):
    prompt = "def fibonacci(n):"
    result = llm.generate(prompt, max_new_tokens=40, temperature=0)
    ids = torch.tensor([llm.tokenizer.encode(prompt)])
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=1)[0, ids.shape[1] :].tolist()
    eos = next((i for i, t in enumerate(ref) if t == 1), len(ref))
    assert result.token_ids == ref[:eos]
    assert "\n" in result.text  # it continues the function over several lines


def test_module_level_generate_uses_the_shipped_model():
    result = minidecode.generate("import os\n", max_new_tokens=12, seed=0, device="cpu")
    assert result.stats.new_tokens >= 1 and result.stats.prompt_tokens > 1
    assert result.stats.decode_tokens_per_s >= 0 and result.stats.prefill_seconds > 0


@pytest.mark.slow
def test_readme_run_command_in_a_fresh_virtualenv(tmp_path):
    """Build the wheel, install it (no dependencies) into a new virtual environment that borrows
    this interpreter's packages, and run the README's command from outside the checkout."""
    wheel_dir = tmp_path / "wheel"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheel_dir),
            str(REPO),
        ],
        check=True,
        capture_output=True,
    )
    wheel = next(wheel_dir.glob("minidecode-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    venv_python = venv / "bin" / "python"
    purelib = subprocess.run(
        [venv_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # The new environment sees torch, tokenizers, ... from this one (they are not under test here).
    borrowed = [p for p in {*site.getsitepackages(), sysconfig.get_paths()["purelib"]} if Path(p).is_dir()]
    Path(purelib, "borrowed.pth").write_text("\n".join(borrowed) + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv_python), "install", "--no-deps", "-q", str(wheel)],
        check=True,
        capture_output=True,
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    run = subprocess.run(
        [
            venv / "bin" / "minidecode",
            "generate",
            "--prompt",
            "def fibonacci(n):",
            "--max-new-tokens",
            "24",
            "--device",
            "cpu",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip(), "no text generated"
    assert "decode" in run.stderr and "tok/s" in run.stderr

    def printed(code: str) -> str:
        """What `code` prints in the new environment."""
        argv = [venv_python, "-c", code]
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    installed = printed("import minidecode.kernels.lean_attention as m; print(m.__file__)")
    assert str(venv) in installed  # the wheel's copy, not the checkout's
    # `minidecode bench` runs from the wheel too: its measurements install as minidecode.benchmarks.
    shipped = printed("from minidecode.loading import DEFAULT_MODEL; print(DEFAULT_MODEL)")
    for args, out in (
        (["--prompt-tokens", "20", "--new-tokens", "3", "--repeats", "1"], tmp_path / "e2e"),
        (
            ["--batch", "2x16", "--batch-peer", "none", "--new-tokens", "2", "--repeats", "1"],
            tmp_path / "batch",
        ),
    ):
        bench = subprocess.run(
            [venv / "bin" / "minidecode", "bench", shipped, *args, "--device", "cpu", "--out", str(out)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert bench.returncode == 0, bench.stderr
        assert out.with_suffix(".json").is_file() and out.with_suffix(".md").is_file()

"""Shared fixtures: tiny checkpoints built once per session, and GPU tests skipped without CUDA."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors through the interpreter; it must be chosen before any
    # @triton.jit function is defined, i.e. before the kernel modules are imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))  # tests/checkpoints.py

from checkpoints import make_checkpoint  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """checkpoint_factory(family, rope, **kw) -> Path of a saved tiny model (cached per arguments)."""
    made: dict = {}

    def make(family: str = "llama", rope: str = "default", **kwargs) -> Path:
        key = (family, rope, tuple(sorted(kwargs.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"ckpt-{family}-{rope}")
            made[key] = make_checkpoint(out, family, rope, **kwargs)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(checkpoint_factory) -> Path:
    return checkpoint_factory("llama", "default")


# ---- transformers references (appended for the parity / API / CLI tests) -------------------------


class HFReference:
    """What transformers computes for a checkpoint: the ground truth of the parity tests.

    Every call loads a fresh model: transformers' dynamic-NTK rotary embedding keeps the
    longest sequence it has seen, so a reused model would not be a clean reference."""

    def model(self, model_dir: Path):
        from checkpoints import hf_model

        return hf_model(model_dir)

    def tokenizer(self, model_dir: Path):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)

    @torch.no_grad()
    def logits(self, model_dir: Path, ids: list[int]) -> torch.Tensor:
        """float32 logits [T, V] of every position, in one forward pass."""
        return self.model(model_dir)(torch.tensor([ids])).logits[0].float()

    @torch.no_grad()
    def greedy(self, model_dir: Path, ids: list[int], max_new_tokens: int, eos: bool = False) -> list[int]:
        """transformers' greedy `generate`: the new tokens. eos=False runs to max_new_tokens;
        eos=True stops at the checkpoint's eos ids (generation_config.json) and drops the eos token."""
        model = self.model(model_dir)
        eos_ids = model.generation_config.eos_token_id if eos else None
        if not eos:
            model.generation_config.eos_token_id = None
        prompt = torch.tensor([ids])
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_ids,
            pad_token_id=0,
        )
        new = out[0, len(ids) :].tolist()
        if eos and eos_ids is not None:
            stop = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids)
            cut = next((i for i, t in enumerate(new) if t in stop), len(new))
            new = new[:cut]
        return new


@pytest.fixture(scope="session")
def hf() -> HFReference:
    return HFReference()


def greedy_reference(hf: HFReference, model_dir: Path):
    """transformers' greedy new tokens of (prompt ids, max_new_tokens) on model_dir, each pair
    computed once (a module's greedy fixture)."""
    made: dict = {}

    def tokens(ids: list[int], new: int) -> list[int]:
        if (tuple(ids), new) not in made:
            made[tuple(ids), new] = hf.greedy(model_dir, ids, new)
        return made[tuple(ids), new]

    return tokens


def random_ids(n: int, seed: int = 0, vocab_size: int = 384) -> list[int]:
    """A reproducible prompt of n token ids (specials included: they are ordinary rows here)."""
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="session")
def prompt_ids():
    return random_ids


@pytest.fixture(scope="session")
def chat_model(checkpoint_factory):
    """A tiny Llama with a chat template (the server's chat tests)."""
    return checkpoint_factory("llama", "default", max_positions=1024)


@pytest.fixture(scope="session")
def long_model(checkpoint_factory):
    """A tiny model with room for requests that would run for minutes (until aborted)."""
    return checkpoint_factory("llama", "default", max_positions=65536)


@pytest.fixture(scope="module")
def shipped_server():
    """`minidecode serve` of the shipped model in a subprocess (tests/test_server.py's `started`)."""
    from test_server import started

    with started(None) as served:
        yield served


@pytest.fixture(scope="module")
def shipped(shipped_server):
    """That server's base URL."""
    return shipped_server.base

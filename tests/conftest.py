"""Shared fixtures: tiny checkpoints built once per session, and GPU tests skipped without CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

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

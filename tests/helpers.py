"""Error measures shared by the tests, computed in float64; the device parameters of a Triton
kernel's tests."""

from pathlib import Path

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """||ours - ref|| / ||ref||: the error relative to the reference's size."""
    ours, ref = ours.double(), ref.double()
    return ((ours - ref).norm() / ref.norm()).item()


def max_rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|: a worst-element error, scaled by the reference's magnitude."""
    ours, ref = ours.double(), ref.double()
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def kernel_devices(kernel) -> tuple[bool, list]:
    """(interpreted, [cpu, cuda]) for tests of a Triton `kernel`: "cpu" runs where the kernel is
    interpreted (tests/conftest.py picks the interpreter when no GPU is present), "cuda" (marked
    gpu) where it is compiled and a GPU is present."""
    interpreted = isinstance(kernel, InterpretedFunction)
    cpu = pytest.param(
        "cpu", marks=pytest.mark.skipif(not interpreted, reason="kernel compiled for the GPU in this process")
    )
    cuda = pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(interpreted or not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    )
    return interpreted, [cpu, cuda]


def wait_healthy(proc, base: str, log: Path, wait: float) -> None:
    """Until `base`/health answers 200 (a server subprocess started): fails with its log if it
    exits first or does not come up within `wait` seconds."""
    import time
    import urllib.request

    deadline = time.monotonic() + wait
    while True:
        assert proc.poll() is None, f"the server exited: {log.read_text()}"
        try:
            if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"the server did not come up: {log.read_text()}"
        time.sleep(0.2)

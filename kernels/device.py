"""What a kernel launch needs to know about the device: how many SMs its CTAs spread over."""

from __future__ import annotations

import functools

import torch

# CPU tensors run the kernels under TRITON_INTERPRET (tests): a few CTAs exercise the same
# multi-CTA schedules (ranges that split heads, blocks dealt round-robin) as a GPU's grid.
INTERPRETER_CTAS = 4


@functools.cache
def sm_count(device: torch.device) -> int:
    """The SMs of a CUDA device (looked up once per device: launches read it every step)."""
    return torch.cuda.get_device_properties(device).multi_processor_count

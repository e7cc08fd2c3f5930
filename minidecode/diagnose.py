"""Where non-finite values come from: a diagnostic pass, run only after a generation has already
produced NaN or inf logits (the normal path pays one check after prefill and nothing per step)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .errors import UserError


def first_nonfinite_module(model: nn.Module, run: Callable[[], object]) -> str | None:
    """Run `run` (a forward pass of `model`) with hooks on every submodule; the name of the first
    one, in call order, whose output holds NaN or inf (None if none does)."""
    names = {module: name for name, module in model.named_modules()}
    found: list[str] = []

    def check(module: nn.Module, inputs, output) -> None:
        if not found and isinstance(output, torch.Tensor) and not bool(torch.isfinite(output).all()):
            found.append(names[module])

    handles = [module.register_forward_hook(check) for module in names]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return found[0] if found else None


def nonfinite_logits_error(model: nn.Module, run: Callable[[], object]) -> UserError:
    """The error for NaN/inf logits, naming the first layer that produced them."""
    where = first_nonfinite_module(model, run)
    if where is None:
        origin = "the final projection (lm_head)"
    else:
        parts = where.split(".")
        layer = f"layer {parts[2]} " if parts[:2] == ["model", "layers"] and len(parts) > 2 else ""
        origin = f"{layer}({where})"
    return UserError(
        f"the model produced NaN/inf logits, first in {origin}: the checkpoint's weights hold NaN/inf "
        "values there, or the dtype overflows (try --dtype float32)"
    )

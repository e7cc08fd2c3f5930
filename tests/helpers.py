"""Error measures shared by the tests, computed in float64."""

import torch


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """||ours - ref|| / ||ref||: the error relative to the reference's size."""
    ours, ref = ours.double(), ref.double()
    return ((ours - ref).norm() / ref.norm()).item()


def max_rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|: a worst-element error, scaled by the reference's magnitude."""
    ours, ref = ours.double(), ref.double()
    return ((ours - ref).abs().max() / ref.abs().max()).item()

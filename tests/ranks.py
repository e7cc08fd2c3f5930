"""Ranks for the distributed tests, spawned as processes that cannot outlive their test: a rank
that hangs (a collective that never completes) fails the test after a deadline, and every rank
still running then, or when the test is stopped by its own timeout, is killed."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

RANKS_TIMEOUT = 120  # seconds for one spawned job's ranks (the slowest: ~10 s on 2 busy cores)


def as_torchrun_rank(rank: int, world: int, port: int) -> None:
    """This spawned process as torchrun starts rank `rank` of `world` (its environment, the
    rendezvous on a local port), on one CPU thread: the ranks share the machine's cores."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)


def run_ranks(fn: Callable, args: tuple, world: int, timeout: float = RANKS_TIMEOUT) -> None:
    """fn(rank, *args) on `world` spawned processes. Raises as torch's start_processes does when
    a rank fails (the others are then ended), TimeoutError after `timeout` seconds."""
    context = mp.start_processes(fn, args, nprocs=world, start_method="spawn", join=False)
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                alive = [rank for rank, p in enumerate(context.processes) if p.is_alive()]
                raise TimeoutError(f"ranks {alive} of {world} still running after {timeout:.0f} s: killed")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
                p.join()

"""The distributed tests' rank spawner: a hanging rank fails its test after the deadline and is
killed, and a failing rank's error reaches the test."""

from __future__ import annotations

import time

import pytest
from ranks import run_ranks
from torch.multiprocessing import ProcessRaisedException


def _hang_on_rank_1(rank: int, pid_file: str) -> None:
    with open(f"{pid_file}.{rank}", "w") as f:
        f.write("started")
    if rank == 1:
        time.sleep(3600)  # a collective that never completes


def _fail_on_rank_0(rank: int) -> None:
    if rank == 0:
        raise ValueError("rank 0 went wrong")
    time.sleep(3600)


def test_a_hanging_rank_is_killed_after_the_deadline(tmp_path):
    start = time.monotonic()
    # rank 0 may still be starting (importing torch) at the deadline; rank 1 never ends. 15 s: on a
    # loaded 2-core machine a spawned rank takes several seconds to import torch and start.
    with pytest.raises(TimeoutError, match=r"ranks \[(0, )?1\] of 2 still running after 15 s: killed"):
        run_ranks(_hang_on_rank_1, (str(tmp_path / "pid"),), 2, timeout=15)
    assert time.monotonic() - start < 60
    assert (tmp_path / "pid.1").read_text() == "started"  # it ran, then hung


def test_a_failing_rank_ends_the_others_and_reports_its_error():
    start = time.monotonic()
    with pytest.raises(ProcessRaisedException, match="rank 0 went wrong"):
        run_ranks(_fail_on_rank_0, (), 2, timeout=120)
    assert time.monotonic() - start < 60

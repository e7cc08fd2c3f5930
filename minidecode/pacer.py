"""How long a prompt's prefill runs between two decode steps of the running sequences.

While a prompt prefills beside running streams, its work comes in units (a chunk of one layer's
projections, an attention call; at most `Engine.prefill_unit_flops` each) and the streams step
between them. The pacer lets them step once the units since their last step have taken about
PREFILL_SHARE x that step's device time: a stream then waits about (1 + PREFILL_SHARE) steps
between tokens, whatever the GPU, the model, the prompt's length or the batch, where a fixed
count of FLOPs a gap gave 3.6 steps on an H200 (bench/NOTES-engine.md).

The decision is the scheduler's: each step plan runs one unit of the prefill, and the pacer says
from the unit's timing whether the next plan holds a decode step, so under torchrun every rank runs
the same units and steps (rank 0 decides). Times are the device's own (DeviceClock, marked by the
engine): CUDA events on a GPU, the host clock on the CPU. One unit stays queued ahead of the host,
which waits for the unit before it, so the device never idles for the host's decision.
"""

from __future__ import annotations

import time

import torch

# Prefill device time between two steps of the running sequences, in steps: the prefill gets about
# half of the device while streams run, and a stream's gap is about two steps (p99 within three).
PREFILL_SHARE = 1.0


# Slots of the pacer's CUDA events, recorded again and again (no allocation per step): three for
# units (the one queued, the one before it, and the one before that, whose end is the start of the
# one before), and the last step's start and end.
UNIT_SLOTS, STEP_START, STEP_END = 3, 3, 4


class DeviceClock:
    """Points in the device's queue, for the pacer: CUDA events recorded in a few slots again and
    again (no allocation per step), or the host clock on the CPU (where work runs as it is called).
    The engine marks its decode steps and prefill units with it; the pacer reads the marks."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(5)] if self.cuda else []
        self._units = 0  # units marked so far: the next one's slot

    def mark(self, slot: int):
        """The event of `slot` recorded now, or the host clock on the CPU."""
        if not self.cuda:
            return time.perf_counter()
        event = self._events[slot]
        event.record()
        return event

    def unit(self):
        """A mark after a prefill unit (a slot that the pacer's last two unit marks do not use)."""
        mark = self.mark(self._units % UNIT_SLOTS)
        self._units += 1
        return mark

    def wait(self, mark) -> None:
        """Until the device has reached `mark`."""
        if self.cuda:
            mark.synchronize()

    def seconds(self, a, b) -> float:
        """Device time from mark a to mark b (both reached)."""
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


class Pacer:
    """Decides after each prefill unit whether the running sequences step in the next plan (the
    scheduler's side: one decision for every rank). It reads the engine's marks: `stepped` with
    each decode step's (start, end), `unit_done(flops, end)` after each unit."""

    def __init__(self, clock: DeviceClock):
        self.clock = clock
        self._step_marks = None  # (start, end) of the last step
        self._step_seconds: float | None = None  # its device time, once it has run
        self._pending = None  # (start, end, flops) of the last thing queued: a unit, or the step (0)
        self._rate: float | None = None  # FLOP/s of the last unit timed (kept across steps)

    def stepped(self, start, end) -> None:
        """A decode step was queued between these marks."""
        self._step_marks, self._step_seconds = (start, end), None
        self._pending = (start, end, 0.0)

    def unit_done(self, flops: float, end) -> bool:
        """A prefill unit of `flops` was just queued, `end` its mark -> whether the running sequences
        step after it: where the units since their last step, this one included, end closest to
        PREFILL_SHARE x the step (the next unit is taken to be as long as this one)."""
        if self._pending is None:  # no step yet
            return False
        clock = self.clock
        start, prev_end, prev_flops = self._pending
        self._pending = (prev_end, end, flops)
        clock.wait(prev_end)  # the unit before this one (or the step) has run; this one is queued
        if prev_flops:
            self._rate = prev_flops / max(clock.seconds(start, prev_end), 1e-9)
        elif self._rate is None:  # the first unit of all: wait for it too, and time it
            clock.wait(end)
            self._rate = flops / max(clock.seconds(prev_end, end), 1e-9)
        if self._step_seconds is None:
            self._step_seconds = clock.seconds(*self._step_marks)
        done = clock.seconds(self._step_marks[1], prev_end)  # the units before this one
        this = flops / self._rate  # this unit's time, at the last one's rate
        return done + 1.5 * this >= PREFILL_SHARE * self._step_seconds

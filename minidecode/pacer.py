"""How long a prompt's prefill runs between two decode steps of the running sequences.

While a prompt prefills beside running streams, its work comes in units (a chunk of one layer's
projections, an attention call; at most `Engine.prefill_unit_flops` each) and the streams step
between them. The pacer lets them step once the units since their last step have taken about
PREFILL_SHARE x that step's device time: a stream then waits about (1 + PREFILL_SHARE) steps
between tokens, whatever the GPU, the model, the prompt's length or the batch, where a fixed
count of FLOPs a gap gave 3.6 steps on an H200 (bench/NOTES-engine.md).

Times are the device's own: CUDA events on a GPU, the host clock on the CPU (where work runs as it
is called). One unit stays queued ahead of the host, which waits for the unit before it, so the
device never idles for the host's decision.
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


class Pacer:
    """Decides after each prefill unit whether the running sequences step now. The loop marks each
    decode step (`step_started`, `step_ended`) and calls `unit_done(flops)` after each unit."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(5)] if self.cuda else []
        self._units = 0  # units marked so far: the next one's slot
        self._step_marks = None  # (start, end) of the last step
        self._step_seconds: float | None = None  # its device time, once it has run
        self._pending = None  # (start, end, flops) of the last thing queued: a unit, or the step (0)
        self._rate: float | None = None  # FLOP/s of the last unit timed (kept across steps)

    def mark(self, slot: int):
        """A point in the device's queue: the event of `slot` recorded now, or the host clock on
        the CPU."""
        if not self.cuda:
            return time.perf_counter()
        event = self._events[slot]
        event.record()
        return event

    def wait(self, mark) -> None:
        """Until the device has reached `mark`."""
        if self.cuda:
            mark.synchronize()

    def seconds(self, a, b) -> float:
        """Device time from mark a to mark b (both reached)."""
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def step_started(self):
        """A decode step is about to be queued -> its start mark (the host may wait for it)."""
        self._step_marks = (self.mark(STEP_START), None)
        return self._step_marks[0]

    def step_ended(self) -> None:
        """The decode step was queued."""
        start = self._step_marks[0]
        self._step_marks, self._step_seconds = (start, self.mark(STEP_END)), None
        self._pending = (*self._step_marks, 0.0)

    def unit_done(self, flops: float) -> bool:
        """A prefill unit of `flops` was just queued -> whether the running sequences step after it:
        where the units since their last step, this one included, end closest to PREFILL_SHARE x
        the step (the next unit is taken to be as long as this one)."""
        if self._pending is None:  # no step yet
            return False
        end = self.mark(self._units % UNIT_SLOTS)  # (not a slot the two marks below still use)
        self._units += 1
        start, prev_end, prev_flops = self._pending
        self._pending = (prev_end, end, flops)
        self.wait(prev_end)  # the unit before this one (or the step) has run; this one is queued
        if prev_flops:
            self._rate = prev_flops / max(self.seconds(start, prev_end), 1e-9)
        elif self._rate is None:  # the first unit of all: wait for it too, and time it
            self.wait(end)
            self._rate = flops / max(self.seconds(prev_end, end), 1e-9)
        if self._step_seconds is None:
            self._step_seconds = self.seconds(*self._step_marks)
        done = self.seconds(self._step_marks[1], prev_end)  # the units before this one
        this = flops / self._rate  # this unit's time, at the last one's rate
        return done + 1.5 * this >= PREFILL_SHARE * self._step_seconds

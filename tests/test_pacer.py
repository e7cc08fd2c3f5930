"""The pacer, on a simulated device clock: the running sequences step once the prefill's units since
their last step have taken about PREFILL_SHARE x a step's time, whatever the step, the units' sizes
and their speed."""

import pytest
import torch

from minidecode.pacer import PREFILL_SHARE, STEP_END, STEP_START, DeviceClock, Pacer


def gaps(units: list[tuple[float, float]], step_seconds: float) -> list[float]:
    """Units of (flops, seconds) run one after another on a simulated device (an event is recorded
    once the work before it ran); the sequences step whenever the pacer says so.
    -> the prefill time between consecutive steps."""
    now = [0.0]

    class Event:  # a CUDA event of the simulated device (the pacer records each of its few again and again)
        def record(self) -> None:
            self.at = now[0]

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, later: "Event") -> float:  # ms
            return 1e3 * (later.at - self.at)

    clock = DeviceClock(torch.device("cpu"))
    clock.cuda, clock._events = True, [Event() for _ in range(5)]
    pacer = Pacer(clock)

    def step() -> None:  # marked as the engine marks a decode step of a plan
        start = clock.mark(STEP_START)
        now[0] += step_seconds
        pacer.stepped(start, clock.mark(STEP_END))

    step()
    found, since = [], now[0]
    for flops, seconds in units:
        now[0] += seconds
        if pacer.unit_done(flops, clock.unit()):
            found.append(now[0] - since)
            step()
            since = now[0]
    return found


@pytest.mark.parametrize("step_seconds", [0.002, 0.005, 0.008])
def test_units_between_steps_take_about_one_step(step_seconds):
    """Units of 1 ms: the prefill time between two steps is within half a unit of the step's, so
    a stream's gap follows its step (a count of FLOPs would give every step the same work)."""
    found = gaps([(1e12, 0.001)] * 200, step_seconds)
    assert len(found) >= 20
    for gap in found:
        assert abs(gap - PREFILL_SHARE * step_seconds) <= 0.0005 + 1e-12, found


def test_slower_units_of_another_kind_overshoot_by_at_most_one_unit():
    """Projections (1e12 FLOPs in 1 ms), then attention calls (1e12 in 3 ms), then projections: where
    the kind changes, the unit after the change is mispredicted by its rate; no gap exceeds the
    target by more than one unit, and gaps of one kind are within half a unit of it."""
    units = [(1e12, 0.001)] * 60 + [(1e12, 0.003)] * 30 + [(5e11, 0.0005)] * 60
    found = gaps(units, 0.006)
    assert max(found) <= 0.006 + 0.003 + 1e-12, found
    assert sum(abs(gap - 0.006) <= 0.0015 + 1e-12 for gap in found) >= len(found) - 2, found


def test_units_longer_than_a_step_step_after_each():
    found = gaps([(1e12, 0.01)] * 10, 0.005)
    assert found == pytest.approx([0.01] * 10, rel=1e-9)

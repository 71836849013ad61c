"""Test support: a simulated clock for time budgets. A budgeted run plans, re-plans, checkpoints and resumes as it
would on the wall clock, but its time moves only by the training steps it runs, each a set number of seconds.
The tests check the budget's logic with it in seconds instead of waiting for minutes; one real short budget stays
on the wall clock (tests/test_recipe.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from bertforge.pretrain import budget
from bertforge.train import loop


class SimulatedClock:
    """`now` in seconds; each training step moves it by `seconds_per_step`, and each step that `budget.time_steps`
    times by `timed_seconds_per_step` (a run slower than its timing, as on a loaded machine, makes the deadline
    re-plan)."""

    def __init__(self, seconds_per_step: float, timed_seconds_per_step: float | None = None):
        self.now = 1000.0
        self.seconds_per_step = seconds_per_step
        self.timed_seconds_per_step = timed_seconds_per_step or seconds_per_step
        self.timing = False
        self.steps = 0

    def __call__(self) -> float:
        return self.now


@contextlib.contextmanager
def simulated_clock(seconds_per_step: float, timed_seconds_per_step: float | None = None) -> Iterator[SimulatedClock]:
    """Within the block, budgets run on a `SimulatedClock` (the budget's clock and the training step replaced in
    this process; put back after)."""
    clock = SimulatedClock(seconds_per_step, timed_seconds_per_step)
    real_step, real_timing, real_clock = loop.train_step, budget.time_steps, budget.clock

    def step(*args, **kwargs):
        result = real_step(*args, **kwargs)
        clock.now += clock.timed_seconds_per_step if clock.timing else clock.seconds_per_step
        clock.steps += 1
        return result

    def time_steps(*args, **kwargs):
        clock.timing = True
        try:
            return real_timing(*args, **kwargs)
        finally:
            clock.timing = False

    loop.train_step, budget.time_steps, budget.clock = step, time_steps, clock
    try:
        yield clock
    finally:
        loop.train_step, budget.time_steps, budget.clock = real_step, real_timing, real_clock

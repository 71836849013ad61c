"""Items a second, as the demo, the baseline and the benches measure a model's speed: the median timed call after
an untimed warm-up."""

from bertforge import timing
from bertforge.timing import items_per_second


def _clock(monkeypatch, ticks):
    ticks = iter(ticks)
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks))


def test_a_speed_is_the_items_over_the_median_timed_call_after_one_warm_up(monkeypatch):
    # calls of 4, 1 and 2 seconds on a clock that moves only by them: the median call is 2 s, the warm-up not timed
    _clock(monkeypatch, [0.0, 4.0, 10.0, 11.0, 20.0, 22.0])
    calls = []
    rate = items_per_second(lambda: calls.append("run"), 500, warm_up=lambda: calls.append("warm"), repeats=3)
    assert calls == ["warm", "run", "run", "run"]
    assert rate == 250.0


def test_without_a_warm_up_the_call_itself_warms_up_untimed(monkeypatch):
    _clock(monkeypatch, [0.0, 1.0, 5.0, 6.0])
    calls = []
    assert items_per_second(lambda: calls.append("run"), 10, repeats=2) == 10.0
    assert calls == ["run", "run", "run"]


def test_a_call_quicker_than_the_clock_reads_as_fast_not_as_a_division_by_zero(monkeypatch):
    _clock(monkeypatch, [3.0] * 6)
    assert items_per_second(lambda: None, 7, repeats=3) == 7 / timing.MIN_SECONDS

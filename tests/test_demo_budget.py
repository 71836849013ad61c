"""The demo's budget against this CPU: the step forecast, and what the demo says and picks with it."""

from __future__ import annotations

import dataclasses
import math

import pytest
from simulated_clock import simulated_clock

from bertforge.config import BertConfig
from bertforge.demo.budget import MARGIN, PAYS_FROM_STEPS, parse_demo_minutes, plan_minutes
from bertforge.errors import BertforgeError
from bertforge.pretrain.budget import Forecast, forecast_steps
from bertforge.pretrain.objectives import CandidateSampler
from bertforge.pretrain.recipe import BERT, BUDGET

pytestmark = pytest.mark.usefixtures("one_thread")
CONFIG = BertConfig.from_preset("tiny", vocab_size=300)


@pytest.mark.slow  # seconds of training: make test runs it, make test-fast does not
def test_the_forecast_times_each_stage_of_a_stacked_recipe_and_counts_the_steps_its_minutes_buy():
    with simulated_clock(0.5) as clock:  # every timed step takes half a second
        stacked = forecast_steps(CONFIG, BUDGET, 2.0, seq_len=32, precision="fp32")
        assert clock.steps > 0
    assert stacked.seconds_per_step == pytest.approx((0.5, 0.5))
    # 60% of 120 s at half depth, 40% at full depth, half a second a step
    assert stacked.steps == int(0.6 * 120 / 0.5) + int(0.4 * 120 / 0.5) == 240
    with simulated_clock(0.25):
        single = forecast_steps(CONFIG, BERT, 1.0, seq_len=32, precision="fp32")
    assert single.seconds_per_step == pytest.approx((0.25,)) and single.steps == 240
    assert single.minutes_for(480) == pytest.approx(2.0)


def test_the_forecast_really_trains_the_recipes_model_on_the_wall_clock():
    probe = forecast_steps(CONFIG, BUDGET, 1.0, seq_len=16, precision="fp32")
    assert len(probe.seconds_per_step) == 2 and all(0 < s < 5 for s in probe.seconds_per_step)
    assert probe.steps == sum(int(share * 60 / s) for share, s in zip((0.6, 0.4), probe.seconds_per_step,
                                                                       strict=True))


def test_a_recipe_with_a_sampled_softmax_is_timed_with_it(monkeypatch):
    drawn = []
    real = CandidateSampler.sample
    monkeypatch.setattr(CandidateSampler, "sample", lambda self, *a: drawn.append(self.k) or real(self, *a))
    forecast_steps(CONFIG, dataclasses.replace(BUDGET, mlm_candidates=64), 1.0, seq_len=16, precision="fp32")
    assert drawn and set(drawn) == {64}
    drawn.clear()
    forecast_steps(CONFIG, dataclasses.replace(BUDGET, mlm_candidates=0), 1.0, seq_len=16, precision="fp32")
    assert not drawn


def fake_forecast(seconds_per_step: float):
    def forecast(config, recipe, minutes, *, seq_len, precision):
        steps = int(minutes * 60 / seconds_per_step)
        return Forecast(minutes=minutes, seconds_per_step=(seconds_per_step,), steps=steps)
    return forecast


def test_the_demo_says_when_its_budget_falls_short_of_the_steps_that_paid_and_auto_takes_the_budget_that_reaches():
    needed = PAYS_FROM_STEPS["tiny"]
    slow = fake_forecast(0.15)  # 4,000 steps in 10 minutes
    minutes, lines, record = plan_minutes(10.0, "tiny", CONFIG, BUDGET, seq_len=64, precision="fp32", forecast=slow)
    enough = math.ceil(MARGIN * (10.0 * needed / 4000))  # whole minutes at 4,000 steps per 10, with the margin
    assert minutes == 10.0 and record["forecast_steps"] == 4000 and record["minutes_that_reach_them"] == enough
    assert "10 minutes buy about 4,000 steps" in lines[0]
    assert f"at about {needed:,} steps" in lines[1] and f"--minutes {enough:g} (or --minutes auto)" in lines[1]
    minutes, lines, record = plan_minutes(None, "tiny", CONFIG, BUDGET, seq_len=64, precision="fp32", forecast=slow)
    assert minutes == enough and record["auto"] and record["forecast_steps"] >= needed
    assert lines[1].startswith(f"--minutes auto: {enough:g} minutes")
    fast = fake_forecast(0.03)  # 20,000 steps in 10 minutes: enough, and nothing to warn about
    minutes, lines, record = plan_minutes(10.0, "tiny", CONFIG, BUDGET, seq_len=64, precision="fp32", forecast=fast)
    assert minutes == 10.0 and len(lines) == 1 and record["forecast_steps"] == 20000
    # a budget that buys the recipe's larger batch says the steps it counted are of the smaller one
    minutes, lines, record = plan_minutes(30.0, "tiny", CONFIG, BUDGET, seq_len=64, precision="fp32", forecast=fast)
    assert record["forecast_steps"] == 60000 >= BUDGET.larger_batch.from_steps and len(lines) == 2
    assert lines[1].startswith(f"These are steps of batch 16; from {BUDGET.larger_batch.from_steps:,} of them "
                               f"pretraining takes batch 32")
    # a model without measured runs: no promise, and auto cannot choose
    assert plan_minutes(5.0, "mini", CONFIG, BUDGET, seq_len=64, precision="fp32", forecast=slow) == (5.0, [], {})
    with pytest.raises(BertforgeError, match="--minutes auto knows the steps that pay for tiny only"):
        plan_minutes(None, "mini", CONFIG, BUDGET, seq_len=64, precision="fp32", forecast=slow)


def test_the_demo_budget_is_minutes_or_auto():
    assert parse_demo_minutes("auto") is None and parse_demo_minutes("AUTO ") is None
    assert parse_demo_minutes("90s") == 1.5 and parse_demo_minutes(0.3) == 0.3
    with pytest.raises(BertforgeError, match="is not a duration"):
        parse_demo_minutes("soon")


def test_a_started_demo_pretraining_keeps_its_recorded_budget_under_auto(tmp_path, monkeypatch):
    from bertforge.demo import run as demo
    from bertforge.options import DemoOptions

    monkeypatch.setattr(demo, "plan_minutes", lambda *a, **k: pytest.fail("timed a run that had its budget"))
    pre_dir = tmp_path / "pretrain"
    (pre_dir / "half-depth").mkdir(parents=True)  # stopped in the first stage: only it has recorded the budget
    (pre_dir / "half-depth" / "run_config.json").write_text('{"stack": {"minutes": 7.5, "fraction": 0.6}}')
    assert demo._budget(DemoOptions(minutes="auto"), pre_dir, 300, 64) == (7.5, {})
    assert demo._budget(DemoOptions(minutes="12"), pre_dir, 300, 64) == (12.0, {})  # the resume names the change

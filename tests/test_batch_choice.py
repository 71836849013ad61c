"""The budget recipe's batch by the steps a time budget buys (bertforge.pretrain.budget), on a simulated clock:
each timed step takes 0.3 s, so 0.25 minutes buy 50 steps."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from simulated_clock import simulated_clock

from bertforge.cli import main
from bertforge.pretrain import budget as batch_choice
from bertforge.pretrain import recipe as recipe_module
from bertforge.pretrain.config import LargerBatch
from bertforge.pretrain.recipe import BUDGET
from bertforge.pretrain.run import pretrain
from bertforge.train.rundir import RUN_CONFIG

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models train faster on one thread (conftest)

LARGER = dict(batch_size=4, lr=5e-4)


def _recipe(from_steps: int):
    return dataclasses.replace(BUDGET, batch_size=2, stack_fraction=0.0,
                               larger_batch=LargerBatch(from_steps=from_steps, **LARGER))


def _run(prepared, out, recipe, **given):
    with simulated_clock(0.3):
        pretrain(recipe.config(str(prepared), str(out), {"model": "tiny", "minutes": 0.25, "max_seq_len": 16,
                                                         "progress": False, "eval_every": 0, **given}))
    return json.loads((out / RUN_CONFIG).read_text())["loop"]


@pytest.mark.slow  # seconds of training: make test runs it, make test-fast does not
@pytest.mark.parametrize("from_steps", [40, 60])
def test_a_budget_that_buys_the_steps_trains_at_the_larger_batch_and_one_that_does_not_at_the_recipes(
        prepared, tmp_path, capsys, from_steps):
    loop = _run(prepared, tmp_path / "run", _recipe(from_steps))
    said = capsys.readouterr().out
    bought = int(re.search(r"0.25 minutes buy about ([0-9,]+) steps of the budget recipe's batch", said)[1])
    assert bought == 50  # 15 s at the 0.3 s a timed step takes on the simulated clock
    if from_steps <= bought:
        assert (loop["batch_size"], loop["lr"]) == (LARGER["batch_size"], LARGER["lr"])
        assert f"at least {from_steps:,}: batch 4 at lr 0.0005" in said
    else:
        assert (loop["batch_size"], loop["lr"]) == (2, BUDGET.lr)
        assert f"under {from_steps:,}: batch 2 at lr {BUDGET.lr:g}" in said


@pytest.mark.slow  # a short pretraining each
@pytest.mark.parametrize("given", [{"batch_size": 3}, {"lr": 1e-3}])
def test_a_given_batch_size_or_lr_keeps_the_run_off_the_larger_batch_without_timing_anything(
        prepared, tmp_path, capsys, given):
    loop = _run(prepared, tmp_path / "run", _recipe(1), **given)
    assert "steps of the budget recipe's batch" not in capsys.readouterr().out
    assert loop["batch_size"] == given.get("batch_size", 2) and loop["lr"] == given.get("lr", BUDGET.lr)


def _config(prepared, out, recipe, **given):
    """The run's config as the recipe makes it with a budget of a minute (its larger batch not yet chosen)."""
    return recipe.config(str(prepared), str(out), {"model": "tiny", "minutes": 1.0, "max_seq_len": 16, **given})


def _never_forecast(*args, **kwargs):
    raise AssertionError("a resumed run timed steps to choose its batch again")


@pytest.mark.parametrize("recorded_lr, batch", [(LARGER["lr"], LARGER["batch_size"]), (BUDGET.lr, 2)])
def test_a_resumed_run_keeps_the_batch_it_started_with(prepared, tmp_path, monkeypatch, recorded_lr, batch):
    # the half-depth stage's record is the one a stacked run stopped in its first stage has
    (tmp_path / "half-depth").mkdir()
    (tmp_path / "half-depth" / RUN_CONFIG).write_text(json.dumps({"loop": {"lr": recorded_lr, "batch_size": 99}}))
    monkeypatch.setattr(batch_choice, "forecast_steps", _never_forecast)
    config = _config(prepared, tmp_path, _recipe(1), resume=True)
    chosen = batch_choice.choose_batch(config, model_config=None)
    assert chosen.loop.batch_size == batch and chosen.loop.steps == config.loop.steps
    assert chosen.budget.larger_batch is None  # chosen once


def test_the_forecast_times_the_run_as_asked_at_the_recipes_own_batch(prepared, tmp_path, monkeypatch):
    seen = {}

    def forecast(config, recipe, minutes, *, seq_len, precision, device):
        seen.update(batch=recipe.batch_size, stack=recipe.stack_fraction, seq_len=seq_len, vocab=config.vocab_size)
        return type("F", (), {"steps": 10})()

    monkeypatch.setattr(batch_choice, "forecast_steps", forecast)
    config = _config(prepared, tmp_path, _recipe(11), stack_fraction=0.5)  # given: wins over the recipe's
    config = config.replace(model=dataclasses.replace(config.model, max_seq_len=None))
    vocab = json.loads((prepared / "manifest.json").read_text())["vocab_size"]
    config = batch_choice.choose_batch(config, model_config=lambda name, v, n: type("C", (), {"vocab_size": v})())
    assert config.loop.batch_size == 2  # 10 steps, under 11
    assert seen == {"batch": 2, "stack": 0.5, "seq_len": 64, "vocab": vocab}


@pytest.mark.slow  # seconds of training: make test runs it, make test-fast does not
@pytest.mark.parametrize("flags, batch", [([], LARGER["batch_size"]), (["--batch-size", "3"], 3)])
def test_the_command_line_leaves_the_batch_to_the_budget_unless_it_is_given(prepared, tmp_path, monkeypatch, capsys,
                                                                            flags, batch):
    monkeypatch.setitem(recipe_module.RECIPES, "budget", _recipe(40))
    out = tmp_path / "run"
    with simulated_clock(0.3):
        assert main(["pretrain", "--data", str(prepared), "--out", str(out), "--model", "tiny", "--recipe", "budget",
                     "--minutes", "0.25", "--max-seq-len", "16", "--eval-every", "0", "--no-progress", *flags]) == 0
    assert json.loads((out / RUN_CONFIG).read_text())["loop"]["batch_size"] == batch
    assert ("steps of the budget recipe's batch here" in capsys.readouterr().out) == (not flags)

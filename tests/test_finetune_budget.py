"""Fine-tuning under a time budget (`--minutes`, bertforge.finetune.budget): the epochs cut to the steps the minutes
buy, the schedule fitted to them, never more than the epochs, and the command line's flag. On a simulated clock
(tests/simulated_clock.py): each training step costs a set number of seconds, so the tests check the plan's
arithmetic, not this machine's speed."""

from __future__ import annotations

import json

import pytest
from forked import Forked, kill_at
from simulated_clock import simulated_clock
from test_finetune import FAST, config, init_dir, one_thread, write_custom  # noqa: F401  (fixtures)

from bertforge.cli import main
from bertforge.files import read_jsonl
from bertforge.finetune.run import finetune
from bertforge.pretrain.budget import MIN_STEPS, TIMED_STEPS

EPOCH_STEPS = 6  # write_custom's 24 training examples at batch 4
SETUP = TIMED_STEPS + 2  # simulated seconds the planner's timing takes, at 1 s a step


def _train_records(out) -> list[dict]:
    return [r for r in read_jsonl(out / "metrics.jsonl") if r["split"] == "train"]


def _budgeted(tmp_path, init_dir, minutes: float, seconds_per_step: float):  # noqa: F811
    """A run through the library whose timed steps take 1 s each and whose training steps `seconds_per_step`."""
    out = tmp_path / "run"
    with simulated_clock(seconds_per_step, timed_seconds_per_step=1.0):
        result = finetune(config(write_custom("csv", tmp_path), init_dir, out, batch_size=4, epochs=4.0,
                                 minutes=minutes, warmup_ratio=0.1))
    return out, result


def _cli(tmp_path, init_dir, *extra) -> list[str]:  # noqa: F811
    """`bertforge finetune` on write_custom's data at batch 4 for 4 epochs, checkpoints every 3 steps; then `extra`."""
    return ["finetune", "--task", "csv", "--data", str(write_custom("csv", tmp_path)), "--init", str(init_dir),
            "--text-column", "review", "--label-column", "stars", "--batch-size", "4", "--epochs", "4", "--lr", "1e-3",
            "--max-length", "48", "--save-every", "3", *map(str, extra)]


def _killed_in_the_eighth_step(argv: list[str], log) -> int:
    """`bertforge ARGV` in a forked child SIGKILLed in its eighth training step (after the planner's timed calls of
    the step function); its exit code."""
    return Forked(argv, log, before=lambda: kill_at(f"bertforge.train.loop:train_step:{SETUP + 8}")).wait()


def test_a_budget_cuts_the_epochs_to_the_steps_it_buys_and_the_schedule_ends_with_them(tmp_path, init_dir):  # noqa: F811
    # 24 s: 10 timing the steps, then 14 steps of 1 s (fewer than the 4 epochs' 24)
    out, result = _budgeted(tmp_path, init_dir, minutes=24 / 60, seconds_per_step=1.0)
    train = _train_records(out)
    assert MIN_STEPS <= 24 - SETUP == len(train) < 4 * EPOCH_STEPS
    assert [r["step"] for r in train] == list(range(1, len(train) + 1))
    warmup = round(0.1 * len(train))
    assert train[-1]["lr"] == pytest.approx(1e-3 / (len(train) - warmup))  # decayed to its last step, not the epochs'
    assert json.loads((out / "budget_plan.json").read_text())["steps"] == len(train) == result["steps"]
    assert (out / "model.safetensors").is_file() and result["best_step"] is not None  # the best dev model, as ever


def test_a_budget_that_buys_more_than_the_epochs_trains_the_epochs(tmp_path, init_dir, capsys):  # noqa: F811
    # timed at 1 s a step but running at 0.25 s: the deadline would plan 50 steps; the epochs have 24
    out, result = _budgeted(tmp_path, init_dir, minutes=30 / 60, seconds_per_step=0.25)
    assert len(_train_records(out)) == 4 * EPOCH_STEPS == result["steps"]
    out, _ = _budgeted(tmp_path / "long", init_dir, minutes=10, seconds_per_step=1.0)
    assert len(_train_records(out)) == 4 * EPOCH_STEPS
    assert "the 24 steps of --epochs 4 fit in the budget" in capsys.readouterr().out


def test_the_command_line_takes_minutes_and_refuses_a_budget_too_short(tmp_path, init_dir, capsys):  # noqa: F811
    data = write_custom("csv", tmp_path)
    args = ["finetune", "--task", "csv", "--data", str(data), "--init", str(init_dir), "--text-column", "review",
            "--label-column", "stars", *FAST]
    with simulated_clock(1.0):
        assert main([*args, "--out", str(tmp_path / "short"), "--minutes", "0.1"]) == 2
    assert "error: a budget of 0.1 min leaves time for" in capsys.readouterr().err
    assert not (tmp_path / "short").exists()
    with simulated_clock(0.01):
        assert main([*args, "--out", str(tmp_path / "ok"), "--minutes", "5"]) == 0
    assert json.loads((tmp_path / "ok" / "run_config.json").read_text())["options"]["minutes"] == 5


def test_a_budgeted_run_killed_and_resumed_ends_as_the_uninterrupted_one(tmp_path, init_dir):  # noqa: F811
    """The plan is kept beside the checkpoints and the budget spent before the kill counts: SIGKILLed in its eighth
    step (after the planner's timed calls of the step), the run resumes to the uninterrupted run's steps and weights."""
    args = _cli(tmp_path, init_dir, "--minutes", 24 / 60)
    with simulated_clock(1.0):
        assert main([*args, "--out", str(tmp_path / "full")]) == 0
    with simulated_clock(1.0):
        killed = _killed_in_the_eighth_step([*args, "--out", str(tmp_path / "run")], tmp_path / "killed.log")
        assert killed == -9, (tmp_path / "killed.log").read_text()[-2000:]
    assert not (tmp_path / "run").exists()
    with simulated_clock(1.0):
        assert main([*args, "--out", str(tmp_path / "run"), "--resume"]) == 0
    steps = [[r["step"] for r in _train_records(tmp_path / name)] for name in ("full", "run")]
    assert steps[0] == steps[1] == list(range(1, 24 - SETUP + 1))
    weights = [(tmp_path / name / "model.safetensors").read_bytes() for name in ("full", "run")]
    assert weights[0] == weights[1]


def test_resume_refuses_another_budget_in_one_line(tmp_path, init_dir, capsys):  # noqa: F811
    """The plan kept beside the checkpoints is the budget's: a resumed run asking for other minutes is refused, as
    pretraining refuses it, and the interrupted run is left to continue."""
    args = _cli(tmp_path, init_dir, "--out", tmp_path / "run")
    with simulated_clock(1.0):
        assert _killed_in_the_eighth_step([*args, "--minutes", "0.4"], tmp_path / "killed.log") == -9
        assert main([*args, "--minutes", "0.5", "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "--minutes" in err and "0.4" in err, err
    assert (tmp_path / "run.partial" / "budget_plan.json").is_file()

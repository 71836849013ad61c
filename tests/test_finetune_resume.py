"""Fine-tuning survives interruption: a run SIGKILLed at any point (inside an epoch, at an epoch boundary, during
dev evaluation, while writing a checkpoint) and continued with `--resume` ends with the weights and metrics.json
of the uninterrupted run, bit for bit; `--resume` refuses what it cannot continue, in one `error:` line."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from forked import Forked, forked_ranks, kill_at

from bertforge.cli import main
from bertforge.errors import BertforgeError
from bertforge.finetune import run as ft
from bertforge.finetune.config import FinetuneConfig
from bertforge.finetune.sweep import finetune_many
from bertforge.options import FinetuneOptions
from bertforge.train import rows
from bertforge.train.loop import TrainingInterrupted
from bertforge.train.rundir import claim_run_dir

# 24 training examples in batches of 4: 6 steps an epoch, 18 in all; a checkpoint at each epoch's end (the default,
# every 10 minutes of training, would write none in these runs before the last step)
ARGS = ["--task", "csv", "--label-column", "label", "--batch-size", "4", "--epochs", "3", "--lr", "1e-3",
        "--max-length", "16", "--eval-batch-size", "4", "--save-every", "6"]
OPTIONS = FinetuneOptions(batch_size=4, epochs=3.0, lr=1e-3, max_length=16, eval_batch_size=4, save_every=6)  # ARGS'


@contextlib.contextmanager
def _one_thread():
    """Runs compare bitwise with each other and with two processes' ranks (one thread each): one thread here too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def as_the_ranks_run(monkeypatch):
    """One thread; the word embedding trained on its looked-up rows (bertforge.train.rows), as a real model's is
    (these tests' is under MIN_ELEMENTS): the forked runs inherit the setting."""
    monkeypatch.setattr(rows, "MIN_ELEMENTS", 0)
    with _one_thread():
        yield


def _write_data(root: Path) -> Path:
    """A keyword task (good/great -> pos, bad/awful -> neg) over the words of conftest's `mlm_dir`; the label
    twice, so that another --label-column reads the same data."""
    import random

    rng = random.Random(0)
    filler = ["the", "film", "movie", "plot", "acting", "story", "dog", "fox", "was", "it", "and", "of"]
    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 24), ("dev", 10)):
        rows = [["text", "label", "same_label"]]
        for i in range(n):
            words = [rng.choice(filler) for _ in range(5)] + [rng.choice(["good", "great"] if i % 2 else
                                                                         ["bad", "awful"])]
            rng.shuffle(words)
            rows.append([" ".join(words), *["pos" if i % 2 else "neg"] * 2])
        with open(root / f"{split}.csv", "w", newline="") as f:
            csv.writer(f).writerows(rows)
    return root


def _killed(args: list[str], kill: str, log: Path) -> int:
    """`bertforge finetune ARGS` in a forked child (tests/forked.py), which `kill_at` stops at `kill`; its exit
    code (-9: SIGKILLed), its output in `log`."""
    return Forked(["finetune", *args], log, before=lambda: kill_at(kill)).wait()


def _finetune(capsys, args: list, code: int = 0) -> tuple[str, str]:
    """`bertforge finetune ARGS` in this process, which must exit `code`; its stdout and stderr."""
    returned = main(["finetune", *[str(a) for a in args]])
    out, err = capsys.readouterr()
    assert returned == code, out + err
    return out, err


@pytest.fixture(scope="module")
def task(tmp_path_factory, mlm_dir) -> dict:
    """The data, the init model, and the uninterrupted run every resumed one must equal: made through the library,
    while the runs it is compared with go through the command line (ARGS and OPTIONS are one run)."""
    root = tmp_path_factory.mktemp("ft-resume")
    data = _write_data(root / "data")
    base = ["--data", data, "--init", mlm_dir, *ARGS]
    config = FinetuneConfig(task="csv", data_dir=data, init=mlm_dir, out_dir=root / "full",
                            task_options={"label_column": "label"}, options=OPTIONS)
    with _one_thread(), pytest.MonkeyPatch.context() as m:  # as the autouse fixture, which is per test, sets
        m.setattr(rows, "MIN_ELEMENTS", 0)
        ft.finetune(config)
    return {"base": base, "full": root / "full", "data": data, "init": mlm_dir, "config": config}


def _files(run: Path) -> dict[str, bytes]:
    return {name: (run / name).read_bytes()
            for name in ("model.safetensors", "metrics.json", "predictions_dev.json", "task.json")}


@pytest.mark.slow
@pytest.mark.parametrize("kill, options, resumed_from", [
    ("bertforge.train.loop:train_step:6", ["--save-every", "4"], "(step 4)"),  # inside the first epoch
    ("bertforge.train.loop:train_step:8", [], "(step 6)"),  # at an epoch boundary: after its evaluation and checkpoint
    ("bertforge.train.loop:Trainer._evaluate:2", [], "(step 6)"),  # during the second epoch's dev evaluation
    ("torch:save:2", [], "(step 6)"),  # while writing the second checkpoint
    ("bertforge.finetune.run:read_jsonl:1", [], ""),  # after the last checkpoint, before the run's end
    ("bertforge.finetune.run:plot_metrics:1", [], ""),  # while putting the finished run in place
], ids=["in-epoch", "epoch-boundary", "dev-evaluation", "writing-checkpoint", "after-training", "at-the-end"])
def test_a_killed_run_resumes_to_the_uninterrupted_result(task, tmp_path, capsys, kill, options, resumed_from):
    out = tmp_path / "run"
    log = tmp_path.parent / f"{tmp_path.name}.log"
    assert _killed([*task["base"], "--out", out, *options], kill, log) == -signal.SIGKILL, log.read_text()
    assert not out.exists() and (tmp_path / "run.partial").is_dir()
    printed, _ = _finetune(capsys, [*task["base"], "--out", out, *options, "--resume"])
    assert resumed_from in printed, printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert _files(out) == _files(task["full"])
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if r["split"] == "eval"] == [6, 12, 18]  # each once
    assert not (out / ".lock").exists()


@pytest.mark.slow  # the module's uninterrupted run (`task`)
def test_sigterm_saves_a_checkpoint_and_prints_the_command_that_resumes(task, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    kill_at("bertforge.train.loop:train_step:3:SIGTERM", monkeypatch.setattr)
    _, err = _finetune(capsys, [*task["base"], "--out", out], code=130)
    state = json.loads((tmp_path / "run.partial" / "checkpoints" / "step-3" / "state.json").read_text())
    assert state["data_position"] == {"epoch": 0, "batch": 3}
    command = err.splitlines()[-1]
    assert command.startswith("to resume: bertforge finetune ") and command.endswith(" --resume"), err
    printed, _ = _finetune(capsys, command.split()[4:])  # after "to resume: bertforge finetune"
    assert "(step 3)" in printed, printed
    assert _files(out) == _files(task["full"])


def _one_error(capsys, *args) -> str:
    code = main(["finetune", *[str(a) for a in args]])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


@pytest.fixture
def interrupted(task, tmp_path, capsys, monkeypatch) -> Path:
    """A run stopped by SIGINT after its first step: a checkpoint in run.partial/ to resume from."""
    real = ft.TaskObjective.losses

    def interrupting(self, model, batch):
        os.kill(os.getpid(), signal.SIGINT)
        return real(self, model, batch)

    monkeypatch.setattr(ft.TaskObjective, "losses", interrupting)
    assert main(["finetune", *[str(a) for a in task["base"]], "--out", str(tmp_path / "run")]) == 130
    monkeypatch.setattr(ft.TaskObjective, "losses", real)
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("to resume: bertforge finetune --task csv "), err
    return tmp_path / "run"


@pytest.mark.slow  # the module's uninterrupted run (`task`)
def test_resume_refuses_what_changed_in_one_line(task, interrupted, tmp_path):
    resumed = task["config"].replace(out_dir=interrupted, resume=True)

    def refusal(config: FinetuneConfig) -> str:
        with pytest.raises(BertforgeError) as refused:
            ft.finetune(config)
        assert len(str(refused.value).splitlines()) == 1
        return str(refused.value)

    for changed, expected in (({"lr": 2e-3}, "--lr 0.001 -> 0.002"), ({"seed": 1}, "--seed 42 -> 1"),
                              ({"batch_size": 8}, "--batch-size 4 -> 8")):
        err = refusal(resumed.with_options(**changed))
        assert expected in err and "--resume cannot change" in err, err
    err = refusal(resumed.replace(task_options={"label_column": "same_label"}))
    assert '--label-column "label" -> "same_label"' in err and "--resume cannot change" in err, err
    other_init = tmp_path / "init2"
    shutil.copytree(task["init"], other_init)
    assert "--init" in refusal(resumed.replace(init=other_init))
    data = tmp_path / "data2"
    shutil.copytree(task["data"], data)
    (data / "train.csv").write_text((data / "train.csv").read_text().replace("good", "bad", 1))
    err = refusal(resumed.replace(data_dir=data))
    assert f"the data: {data} is not the data the run was started on" in err, err


@pytest.mark.slow  # the module's uninterrupted run (`task`) is a process of its own
def test_an_interrupted_run_is_kept_and_its_directory_held_by_one_process(task, interrupted, capsys):
    out, base = interrupted, task["base"]
    err = _one_error(capsys, *base, "--out", out)  # without --resume its checkpoints are not thrown away
    assert f"{out}.partial holds an interrupted run into --out {out}: continue it with --resume" in err
    with claim_run_dir(Path(f"{out}.partial"), resume=True):
        err = _one_error(capsys, *base, "--out", out, "--resume")
    assert "is in use by another bertforge process" in err
    assert main(["finetune", *[str(a) for a in base], "--out", str(out), "--resume"]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert _files(out) == _files(task["full"])


@pytest.mark.slow  # the module's uninterrupted run (`task`)
def test_a_seed_sweep_interrupted_in_its_second_run_resumes_to_the_same_summary(task, tmp_path, capsys,
                                                                                 monkeypatch):
    finetune_many(task["config"].replace(out_dir=tmp_path / "full"), seeds=3)
    real, calls = ft.TaskObjective.losses, []

    def interrupting(self, model, batch):
        calls.append(1)
        if len(calls) == 18 + 3:  # the second run's third step
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, model, batch)

    monkeypatch.setattr(ft.TaskObjective, "losses", interrupting)
    out = tmp_path / "swept"
    swept = task["config"].replace(out_dir=out)
    with pytest.raises(TrainingInterrupted):
        finetune_many(swept, seeds=3)
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["run-seed42", "run-seed43.partial"]
    capsys.readouterr()
    finetune_many(swept.replace(resume=True), seeds=3)
    printed = capsys.readouterr().out
    assert f"{out / 'runs' / 'run-seed42'} is finished" in printed and "resumed from" in printed
    assert len(calls) == 18 * 3 + 3 - 3  # the first run was not trained again; the second went on from step 3
    assert (out / "metrics.json").read_text().replace(str(out), "OUT") == \
        (tmp_path / "full" / "metrics.json").read_text().replace(str(tmp_path / "full"), "OUT")
    assert {k: v for k, v in _files(out).items() if k != "metrics.json"} == \
        {k: v for k, v in _files(tmp_path / "full").items() if k != "metrics.json"}  # the best run's model


@pytest.mark.slow  # the module's uninterrupted run (`task`) is a process of its own
def test_a_sweep_resumes_only_as_it_was_started(task, tmp_path, capsys, monkeypatch):
    args = ["finetune", *[str(a) for a in task["base"]], "--out", str(tmp_path / "swept")]
    real = ft.TaskObjective.losses
    monkeypatch.setattr(ft.TaskObjective, "losses",
                        lambda *a: (os.kill(os.getpid(), signal.SIGINT), real(*a))[1])  # stops after step 1
    assert main([*args, "--seeds", "2"]) == 130
    capsys.readouterr()
    err = _one_error(capsys, *args[1:], "--seeds", "2")
    assert "run-seed42.partial holds an interrupted run of the sweep" in err and "--resume" in err, err
    for changed, expected in ((["--seeds", "3"], "--seeds 2 -> 3"), (["--seeds", "2", "--grid"], "--grid null ->"),
                              (["--seeds", "2", "--lr", "2e-3"], "--lr 0.001 -> 0.002")):
        err = _one_error(capsys, *args[1:], *changed, "--resume")
        assert expected in err and "--resume cannot change" in err, err


@pytest.mark.slow
def test_two_processes_killed_and_resumed_equal_an_uninterrupted_two_process_run(task, tmp_path):
    base = ["finetune", *task["base"], "--device", "cpu"]
    full = forked_ranks(base + ["--out", tmp_path / "full"], tmp_path / "logs-full")
    assert full.returncode == 0, full.stderr[-3000:]
    killed = forked_ranks(base + ["--out", tmp_path / "run"], tmp_path / "logs-killed",
                          before=lambda: kill_at("bertforge.train.loop:train_step:8"))
    assert killed.returncode != 0 and not (tmp_path / "run").exists(), killed.stderr[-3000:]
    resumed = forked_ranks(base + ["--out", tmp_path / "run", "--resume"], tmp_path / "logs-resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(step 6)" in resumed.stdout, resumed.stdout
    assert _files(tmp_path / "run") == _files(tmp_path / "full")

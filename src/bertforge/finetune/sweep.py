"""Sweeps of fine-tuning runs: the paper's grid (batch size x learning rate x epochs) and several seeds, and
one run scored on the test split. Each run is `bertforge.finetune.run.finetune`."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bertforge.errors import BertforgeError
from bertforge.files import atomic_path, write_json
from bertforge.finetune.config import FinetuneConfig
from bertforge.finetune.run import FinetuneOptions, check_out_dir, finetune, jsonable, partial_dir
from bertforge.finetune.workers import run_in_workers, run_log, say_jobs
from bertforge.tasks.runner import evaluate_examples, load_task_model
from bertforge.train.rundir import RUN_CONFIG, check_resume, write_run_config

TEST_PREDICTIONS = "predictions_test.json"  # a scored run's predictions on the test split, beside its scores.json
PAPER_GRID = {"batch_size": (16, 32), "lr": (5e-5, 3e-5, 2e-5), "epochs": (2, 3, 4)}


def finetune_many(config: FinetuneConfig, *, grid: bool = False, seeds: int = 1, jobs: int = 1) -> dict:
    """The paper's grid (batch x lr x epochs, best mean dev score) and/or several seeds (mean and sample
    standard deviation reported) of the run `config`: seed N is `config.options.seed + N`. Each run goes to
    `out_dir/runs/<settings>-seed<N>/`; the best run of the best settings is copied to `out_dir` with a
    `metrics.json` holding every run's scores. Only that run keeps its weights (the others keep their metrics and
    predictions), so a grid costs the disk of one model. `config.resume`: runs that finished are read back, not run
    again, and the interrupted one continues from its checkpoint. `jobs` > 1: that many runs at a time, each in a
    worker process on its share of the threads, its output in `<its directory>.log` (`finetune.workers`)."""
    if seeds < 1:
        raise BertforgeError(f"--seeds {seeds} must be at least 1")
    if jobs > 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise BertforgeError(f"--jobs {jobs} runs each run in a process of its own, and under torchrun every run "
                             "already spans its processes: leave out --jobs")
    base, out = config.options, Path(config.out_dir)
    check_out_dir(out)
    combos = [dict(batch_size=b, lr=lr, epochs=e) for b in PAPER_GRID["batch_size"] for lr in PAPER_GRID["lr"]
              for e in PAPER_GRID["epochs"]] if grid else [{}]
    record = dict(command="finetune", task=config.task, task_options=config.task_options, data=config.data_dir,
                  init=config.init, options=dataclasses.asdict(base), grid=combos if grid else None, seeds=seeds)
    _check_resume(out, record, config.resume)
    out.mkdir(parents=True, exist_ok=True)
    write_run_config(out, **record)
    planned = [config.replace(out_dir=str(out / "runs" / f"{_name(combo)}-seed{base.seed + s}"),
                              options=FinetuneOptions(**{**base.__dict__, **combo, "seed": base.seed + s}))
               for combo in combos for s in range(seeds)]
    say_jobs(len(planned), "fine-tunings", jobs, torch.get_num_threads())
    runs: list[dict] = []
    best: dict | None = None
    with contextlib.closing(run_in_workers(_run, planned, jobs=jobs, threads=torch.get_num_threads(),
                                           logs=[run_log(c.out_dir) for c in planned])) as done:
        for i, combo in enumerate(combos):
            runs.append(_summary(combo, [(run, next(done)) for run in planned[i * seeds:(i + 1) * seeds]]))
            if best is None or runs[-1]["mean"][runs[-1]["main_metric"]] > best["mean"][best["main_metric"]]:
                best = runs[-1]
            for r in (r for summary in runs for r in summary["runs"]):  # keep one model's weights on disk
                if r is not best["best_run"]:
                    Path(r["dir"], "model.safetensors").unlink(missing_ok=True)
    assert best is not None
    main = best["main_metric"]
    for f in Path(best["best_run"]["dir"]).iterdir():
        if f.is_file() and f.name not in ("metrics.json", RUN_CONFIG):  # ours describe the grid
            with atomic_path(out / f.name) as tmp:
                shutil.copyfile(f, tmp)
    report = {"task": config.task, "main_metric": main, "best_settings": best["settings"], "best": best,
              "all": runs, "metrics": best["best_run"]["metrics"]}
    write_json(out / "metrics.json", report)  # last: its presence marks a finished run
    return report


def _summary(combo: dict, results: list[tuple[FinetuneConfig, dict]]) -> dict:
    """One grid point's seeds: each run's directory, seed and metrics, their mean and sample std, the best run."""
    per_seed = [{"dir": str(run.out_dir), "seed": run.options.seed, **combo, "metrics": result["metrics"]}
                for run, result in results]
    main = results[-1][1]["main_metric"]
    keys = list(per_seed[0]["metrics"])
    return {"settings": combo, "runs": per_seed, "main_metric": main,
            "mean": {k: statistics.fmean(r["metrics"][k] for r in per_seed) for k in keys},
            "std": {k: statistics.stdev([r["metrics"][k] for r in per_seed]) if len(per_seed) > 1 else 0.0
                    for k in keys},
            "best_run": max(per_seed, key=lambda r: r["metrics"][main])}


def _name(combo: dict) -> str:
    """A grid point's part of its runs' directory names: `batch_size16-lr5e-05-epochs2`, or `run` without a grid."""
    return "-".join(f"{k}{v}" for k, v in combo.items()) or "run"


def _check_resume(out: Path, config: dict, resume: bool) -> None:
    """`--resume` continues the sweep it was started with (other data, task, options, grid or seeds are refused,
    each run checks its own data too); without it, a sweep with an interrupted run is refused before any work."""
    if resume:
        check_resume(out, json.loads(json.dumps(config)))
        return
    interrupted = sorted((out / "runs").glob("*.partial")) if (out / "runs").is_dir() else []
    if interrupted:
        raise BertforgeError(f"{interrupted[0]} holds an interrupted run of the sweep in --out {out}: continue it "
                             f"with --resume, or delete {out} to start again")


def _run(config: FinetuneConfig) -> dict:
    run_dir = Path(config.out_dir)
    done = run_dir / "metrics.json"
    if config.resume and done.is_file() and not partial_dir(run_dir).exists():
        print(f"--resume: {run_dir} is finished; reading its metrics", flush=True)
        return json.loads(done.read_text())
    return finetune(config)


def finetune_scored(config: FinetuneConfig) -> dict:
    """`finetune`, then the kept (best dev) model scored on the test split when it has labels. Returns
    {"dev": dev metrics, "test": test metrics or None, "seconds": wall time} and writes the test predictions to
    `TEST_PREDICTIONS`; a finished `out_dir` is read back, not trained again, and an interrupted one continues from
    its checkpoint (whatever `config.resume` says)."""
    return trained_and_scored(finetune, config)


def trained_and_scored(train: Callable[[Any], dict], config: Any) -> dict:
    """`finetune_scored` for any training path that writes a fine-tuned model directory: `train(config)` (`finetune`,
    `bertforge.distill.distill`) with a config that has `out_dir`, `data_dir`, `options` and `replace(resume=...)`."""
    out = Path(config.out_dir)
    record_file = out / "scores.json"
    if record_file.is_file():
        return json.loads(record_file.read_text())
    start = time.perf_counter()  # a resumed run's seconds are the resumed part's
    result = train(config.replace(resume=partial_dir(out).is_dir()))
    tm = load_task_model(out, device=config.options.device)
    try:
        test = tm.task.read(config.data_dir, "test")
    except BertforgeError:  # no test split
        test = []
    test_metrics, predictions = evaluate_examples(tm, test, windows=config.options.windows) if test else ({}, None)
    if predictions is not None:
        write_json(out / TEST_PREDICTIONS, jsonable(predictions))
    record = {"dev": result["metrics"], "test": test_metrics or None,
              "seconds": round(time.perf_counter() - start, 1)}
    write_json(record_file, record)  # last: its presence marks a scored run
    return record

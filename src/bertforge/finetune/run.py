"""Fine-tuning: any task of `bertforge.tasks` through the one training loop, one `FinetuneConfig` a run (config.py).
Loading and running the fine-tuned model is `bertforge.tasks.runner`; the sweeps are `bertforge.finetune.sweep`.

A fine-tuned model directory holds the model (config.json with the label map, model.safetensors), the
tokenizer, `task.json` (task name, options, labels, sequence length), `metrics.json` (best dev scores and
the history), `metrics.jsonl` (training progress), `run_config.json` and `predictions_dev.json`.

A run works in `<out>.partial/` beside `--out` (claimed by one process, see `bertforge.train.rundir`) and puts it
in place whole when it ends, so a failed or interrupted run leaves `--out` as it was: no half model, no mixed
logs. An existing `--out` must be empty or hold an earlier fine-tuning run (which is replaced); anything else is
refused rather than overwritten. The work directory holds checkpoints (`bertforge.train.checkpoints`, every
`--save-minutes` of training (10), every `--save-every` steps if given, and on SIGTERM/SIGINT; the last
`--keep-last` of them, 1 by default, beside the best model on dev): an interrupted or killed run continues with
`--resume` and ends with the weights and metrics.json an uninterrupted run would have. A run that fails
otherwise (a loss that is not finite, bad dev data) removes it: its settings need changing, which `--resume`
refuses.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from bertforge.config import BertConfig
from bertforge.errors import BertforgeError
from bertforge.files import read_jsonl, remove_stale_temporaries, replace_dir, write_json
from bertforge.finetune.batches import TARGETS, FeatureBatches, task_batch
from bertforge.finetune.budget import BudgetRun, budget_clock, plan_finetuning
from bertforge.finetune.config import FinetuneConfig
from bertforge.model_files import unwrap
from bertforge.options import FinetuneOptions
from bertforge.tasks import get_task
from bertforge.tasks.runner import MODEL_FOR_KIND, TASK_FILE, assemble_outputs, per_feature_outputs
from bertforge.tokenizer import Tokenizer
from bertforge.train import distributed
from bertforge.train.checkpoints import METRICS_FILE, checkpoints, recorded_total_steps
from bertforge.train.loop import Hooks, LoopOptions, Trainer, TrainingInterrupted, resolve_precision
from bertforge.train.report import plot_metrics
from bertforge.train.rundir import (
    LOCK_FILE,
    RUN_CONFIG,
    claim_run_dir,
    resume_history,
    used_dir_refusal,
    write_run_config,
)

__all__ = ["TARGETS", "FeatureBatches", "FinetuneOptions", "Prepared", "TaskObjective", "Training", "finetune",
           "prepare", "train_task"]


class TaskObjective:
    """The task head's own loss: mean over sequences, or over labelled tokens for tagging."""

    def __init__(self, kind: str):
        self.kind = kind

    def counts(self, batch: dict) -> dict[str, float]:
        if self.kind == "token_classification":
            return {"loss": int((batch["labels"] != -100).sum())}
        return {"loss": int(batch["input_ids"].shape[0])}

    def losses(self, model: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
        return {"loss": model(**batch).loss}


def jsonable(predictions: Any) -> Any:
    """A task's predictions as JSON takes them (a regression's array as a list)."""
    if isinstance(predictions, np.ndarray):
        return predictions.tolist()
    return predictions


def _is_run_dir(path: Path) -> bool:
    if (path / TASK_FILE).is_file():
        return True
    try:
        return json.loads((path / RUN_CONFIG).read_text()).get("command") == "finetune"
    except (OSError, ValueError, AttributeError):
        return False


def check_out_dir(out: Path) -> None:
    """Refuse an --out that a run would clobber: a file, or a non-empty directory that is not a fine-tuning
    run (a pretraining run, a data directory, `.`)."""
    if out.exists() and not out.is_dir():
        raise BertforgeError(f"--out {out} is a file: give a directory for the fine-tuned model")
    if out.is_dir() and any(out.iterdir()) and not _is_run_dir(out):
        raise BertforgeError(f"--out {out} is not empty and holds no fine-tuning run, so it will not be "
                             "replaced: choose a new directory")


@dataclass(frozen=True)
class Training:
    """How a run of the fine-tuning path learns, beside its FinetuneConfig and its `Prepared` inputs. `finetune`'s:
    the task's own loss (`TaskObjective`) on the task's features; distillation (`bertforge.distill`) gives its
    objective, a `collate` that adds the teacher's outputs to a batch, its student (`model`, when not a directory to
    load) and the run_config.json sections that record its settings."""

    objective: Any  # an `Objective` of `bertforge.train.loop`
    collate: Callable[[Sequence[dict], int], dict] = task_batch  # training features -> a batch
    model: Callable[[], nn.Module] | None = None  # the model to train (default: `config.init` with a fresh head)
    run_config: dict = field(default_factory=dict)  # sections of run_config.json added to (or replacing) its own
    command: str = "finetune"  # run_config.json's "command"
    started: float | None = None  # the `budget_clock()` a time budget counts from (None: when training is set up)


@dataclass(frozen=True)
class Prepared:
    """What a run reads before it trains: the task, its examples and features, the tokenizer."""

    task: Any
    tokenizer: Tokenizer
    train: list
    dev: list
    train_features: list
    dev_features: list
    max_length: int
    labels: list | None
    spec: dict  # what task.json records of the task


def prepare(config: FinetuneConfig) -> Prepared:
    """Every input of `config` read and checked (task, data, tokenizer, depth) before anything is written."""
    o = config.options
    task = get_task(config.task, **config.task_options)
    train = task.read_train(config.data_dir, o.max_train_examples)
    dev = task.read(config.data_dir, "dev")
    tokenizer = Tokenizer.from_pretrained(config.init)
    check_reinit(o, config.init)
    max_length = o.max_length or task.max_length
    labels = task.labels if task.kind in ("classification", "token_classification") else None
    label_map = task.label_map() if labels else None
    train_features = task.features(train, tokenizer, max_length, label_map)
    dev_features = task.features(dev, tokenizer, max_length, label_map, windows=o.windows)
    task.references(dev)  # a dev split without gold answers fails now, not after the first epoch
    return Prepared(task, tokenizer, train, dev, train_features, dev_features, max_length, labels,
                    task_spec(task, config.task_options, max_length))


def finetune(config: FinetuneConfig) -> dict:
    """Fine-tune `config.init` (a model directory with a tokenizer) on `config.task`; the best dev model ends in
    `config.out_dir`. Returns {"metrics": best dev metrics, "best_step", "history": per-evaluation metrics, ...}.
    Every input is checked before training starts; the output directory appears (or is replaced) only when the run
    has finished (module docstring). `config.resume`: go on from the newest checkpoint in `<out>.partial/`
    (`partial_dir`)."""
    started = budget_clock(config.options)
    check_out_dir(Path(config.out_dir))
    p = prepare(config)
    return train_task(config, p, Training(TaskObjective(p.task.kind), started=started))


def train_task(config: FinetuneConfig, p: Prepared, training: Training) -> dict:
    """The run of `finetune` on inputs `p` read and checked before (`prepare`, or distillation's), learning as
    `training` says; returns what `finetune` returns."""
    o, out = config.options, Path(config.out_dir)
    started = budget_clock(o) if training.started is None else training.started
    d = distributed.setup(o.device)
    run_dir = None
    try:
        resolve_precision(o.precision, d.device)  # a refused precision before anything is built or written
        loop = _loop_config(o, len(p.train_features), p.task.main_metric)
        loop.accumulation(d.world_size)  # a bad batch size fails before anything is written
        work = partial_dir(out)
        run_dir = _claim(work, out, config.resume, d)
        run_config = {**_run_config(config, p, loop), "command": training.command, **training.run_config}
        # what --resume may not change is refused before the model is loaded
        run_config["resumes"] = resume_history(work, run_config, None, verbose=d.is_main,
                                               complete_ok=True) if config.resume else []
        model = training.model() if training.model else _task_model(p.task, config.init, p.labels, o, d)
        _check_fits(model, p.tokenizer, p.max_length)
        try:
            result = _train(config, p, model, loop, BudgetRun(work, config.resume, started, d), run_config, training)
        except TrainingInterrupted:
            raise TrainingInterrupted(f"interrupted; {out} was left as it was and the run's checkpoint is in "
                                      f"{work}: continue it with the same command and --resume") from None
        except BaseException as e:
            if d.is_main:
                run_dir.release()
                run_dir = None
                shutil.rmtree(work, ignore_errors=True)  # see the module docstring: --resume could not help
            if not isinstance(e, BertforgeError) or "the loss became" not in str(e):
                raise
            # the loop's advice (--resume from a checkpoint) does not hold: the run needs other settings
            raise BertforgeError(f"{str(e).split(';')[0]}; {out} was left as it was: lower --lr or check the "
                                 "data") from None
        if d.is_main:
            run_dir = _put_in_place(work, out, run_dir)
        distributed.barrier(d)  # the other ranks wait for rank 0's writes: gloo aborts a peer that leaves early
        return result
    finally:
        if run_dir is not None:
            run_dir.release()
        distributed.teardown()


def _run_config(config: FinetuneConfig, p: Prepared, loop: LoopOptions) -> dict:
    """run_config.json: what `--resume` compares, with the keys of the runs before FinetuneConfig (they resume)."""
    return dict(command="finetune", task=p.spec, options=config.options, loop=loop, data=config.data_dir,
                init=config.init, train_examples=len(p.train), train_features=len(p.train_features),
                dev_examples=len(p.dev),
                manifest={"train": fingerprint(p.train_features), "dev": fingerprint(p.dev_features)})


def _check_fits(model: nn.Module, tokenizer: Tokenizer, max_length: int) -> None:
    tokenizer.check_compatible(model.config)
    if max_length > model.config.max_position_embeddings:
        raise BertforgeError(f"--max-length {max_length} exceeds the model's max_position_embeddings "
                             f"{model.config.max_position_embeddings}")


def task_spec(task: Any, task_options: dict | None, max_length: int) -> dict:
    """What task.json records of the task."""
    return {"task": task.name, "kind": task.kind,
            "options": {k: v for k, v in (task_options or {}).items() if v is not None},
            "labels": task.labels, "max_length": max_length}


def partial_dir(out: Path) -> Path:
    """Where a run into `out` works, checkpoints included, until it is put in place."""
    return out.parent / f"{out.resolve().name}.partial"


def fingerprint(features: Sequence[dict]) -> str:
    """A digest of the features a run trains or scores on: `--resume` refuses other data."""
    h = hashlib.sha256()
    for f in features:
        for k in sorted(f):
            v = f[k]
            h.update(f"{k}={v.tolist() if hasattr(v, 'tolist') else v!r};".encode())
    return h.hexdigest()[:16]


def _claim(work: Path, out: Path, resume: bool, d: distributed.Dist):
    """Lock the work directory (on the main process; every rank stops if it cannot). Without `resume`, the
    checkpoints of an interrupted run are refused rather than thrown away."""
    def claim():
        if not resume and used_dir_refusal(work) is not None:
            raise BertforgeError(f"{work} holds an interrupted run into --out {out}: continue it with "
                                 f"--resume, or delete {work} to start again")
        run_dir = claim_run_dir(work, resume=True)
        remove_stale_temporaries(out)  # what a run of an earlier version, killed, left beside --out
        return run_dir

    return distributed.main_decides(claim, d, f"{work} was refused (see the main process's error)")


def trained(work: Path, steps: int) -> bool:
    """Whether the run in `work` wrote its last checkpoint: at step `steps`, or at the total a time budget re-planned
    it to (its checkpoints record it)."""
    found = checkpoints(work)
    return bool(found) and found[-1][0] >= recorded_total_steps(work, steps)


def _put_in_place(work: Path, out: Path, run_dir: Any) -> None:
    """Replace `out` with the finished `work` directory, released; an earlier run is moved aside until then."""
    (work / LOCK_FILE).unlink()  # still locked through the open descriptor until released
    run_dir.release()
    replace_dir(work, out)


def _task_model(task: Any, init: str | Path, labels: list | None, o: FinetuneOptions, d: distributed.Dist) -> nn.Module:
    """The task's model: `init`'s encoder with a fresh head, or (`from_scratch`) random weights of its config."""
    model_cls = MODEL_FOR_KIND[task.kind]
    overrides = head_overrides(task, labels)
    torch.manual_seed(o.seed)  # the fresh head's initialisation, or the whole model's
    if o.from_scratch:
        return model_cls(BertConfig.from_json(init).replace(**overrides))
    model = model_cls.from_pretrained(init, verbose=d.is_main, **overrides)
    if o.reinit_layers:  # checked against the depth by `check_reinit`
        layers = model.bert.encoder.layer
        for module in (*layers[len(layers) - o.reinit_layers:], model.bert.pooler):
            if module is not None:
                module.apply(model._init_module)
    return model


def head_overrides(task: Any, labels: list | None) -> dict[str, Any]:
    """What a task model's config.json says of its head: the outputs' number, the task, the label map."""
    return {"num_labels": task.num_labels if task.kind != "multiple_choice" else 1, "task": task.name,
            "id2label": dict(enumerate(labels)) if labels else None}


def check_reinit(o: FinetuneOptions, init: str | Path) -> None:
    layers = BertConfig.from_json(init).num_hidden_layers
    if o.reinit_layers > layers:
        raise BertforgeError(f"--reinit-layers {o.reinit_layers} is more than the {layers} encoder layers of {init}: "
                             f"use at most {layers}")


def _loop_config(o: FinetuneOptions, n_features: int, main_metric: str) -> LoopOptions:
    """The loop of `o.epochs` over `n_features`: evaluated every epoch, the best by `main_metric` kept, a
    checkpoint every `o.save_minutes` of training and every `o.save_every` steps (if given)."""
    steps_per_epoch = math.ceil(n_features / o.batch_size)
    steps = max(1, round(o.epochs * steps_per_epoch))
    return LoopOptions(steps=steps, batch_size=o.batch_size, micro_batch_size=o.micro_batch_size, lr=o.lr,
                      warmup_steps=round(o.warmup_ratio * steps), weight_decay=o.weight_decay,
                      log_every=max(1, min(50, steps_per_epoch // 4)), eval_every=steps_per_epoch,
                      seed=o.seed, best_metric=main_metric, progress=o.progress,
                      device=o.device, compile=o.compile, precision=o.precision, keep_last=o.keep_last,
                      save_every=o.save_every or 0, save_minutes=o.save_minutes, layer_lr_decay=o.layer_lr_decay)


def _train(config: FinetuneConfig, p: Prepared, model: nn.Module, loop: LoopOptions, run: BudgetRun,
           run_config: dict, training: Training) -> dict:
    """The training run of `finetune`, writing into the work directory `run.work`."""
    o, resume, d, work = config.options, config.resume, run.dist, run.work
    task, tokenizer, dev, dev_features = p.task, p.tokenizer, p.dev, p.dev_features
    last_eval: dict[str, Any] = {}
    history: list[dict] = []

    def evaluate(m: nn.Module) -> dict[str, float]:
        # each rank runs its share of the features; every rank decodes and scores all of them (cheap next to
        # the forward passes), so all return the figures of one process
        mine = [dev_features[i] for i in distributed.shard(len(dev_features), d)]
        local = per_feature_outputs(m, mine, tokenizer.pad_id, batch_size=o.eval_batch_size, device=d.device)
        outputs = assemble_outputs(distributed.unshard(distributed.gather_objects(local, d), len(dev_features)))
        predictions = task.decode(dev, dev_features, outputs)
        scores = task.metric(predictions, task.references(dev))
        last_eval.update(predictions=predictions, scores=scores)
        history.append(dict(scores))
        return scores

    def save_model(m: nn.Module, path: Path) -> None:
        unwrap(m).save_pretrained(path)
        tokenizer.save_pretrained(path)
        write_json(path / TASK_FILE, p.spec)
        if last_eval:
            write_json(path / "predictions_dev.json", jsonable(last_eval["predictions"]))

    if resume and (work / "metrics.json").is_file():  # killed while putting the finished run in place
        return json.loads((work / "metrics.json").read_text())
    if d.is_main:
        write_run_config(work, **run_config)
    source = FeatureBatches(p.train_features, tokenizer.pad_id, seed=o.seed, rank=d.rank, world_size=d.world_size,
                            collate=training.collate)
    loop, deadline = plan_finetuning(o, loop, run, model=model, source=source, objective=training.objective,
                                     evaluate=evaluate)
    if not (resume and trained(work, loop.steps)):  # else killed after its last checkpoint: only the end is left
        Trainer(model, source, training.objective, loop, work, dist=d, resume=resume,
                hooks=Hooks(evaluate=evaluate, save_model=save_model, final_dir=work / "last",
                            deadline=deadline)).run()
    result = {"task": task.name, "metrics": {}, "best_step": None, "history": history,
              "main_metric": task.main_metric, "steps": recorded_total_steps(work, loop.steps), "epochs": o.epochs}
    if d.is_main:
        # every evaluation, those before a resumption too (the log keeps each step once, `checkpoints.truncate_metrics`)
        result["history"] = [{k: v for k, v in r.items() if k not in ("time", "step", "split")}
                             for r in read_jsonl(work / METRICS_FILE) if r.get("split") == "eval"]
        best_dir = work / "best"
        if not best_dir.is_dir():
            raise RuntimeError(f"no best model in {work}: the dev metric {task.main_metric} was never reported")
        best_metrics = json.loads((best_dir / "metrics.json").read_text())
        result["best_step"] = best_metrics["step"]
        result["metrics"] = {k: v for k, v in best_metrics.items() if k != "step"}
        for f in best_dir.iterdir():
            if f.name != "metrics.json":
                os.replace(f, work / f.name)
        for name in ("best", "checkpoints", "last"):
            shutil.rmtree(work / name, ignore_errors=True)
        write_json(work / "metrics.json", result)
        plot_metrics(work / "metrics.jsonl", work / "training_curves.svg")
    return result

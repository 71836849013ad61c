"""A fine-tuning run's time budget (`--minutes`): the steps its minutes buy, and never more than its epochs.

The budget counts from the command's start, as pretraining's does (`bertforge.pretrain.budget`, whose planner this
uses): a few steps are timed on a copy of the model and one dev evaluation with them, the steps that fit the minutes
(with an evaluation every epoch and one at the end) become the run's, at most `--epochs` worth, and the learning
rate's warmup (`--warmup-ratio` of them) and linear decay are fitted to that number. While the run trains its
deadline plans the rest again from the steps' real times, so a run slower than its timing still ends in time; it
never plans past the epochs' steps. The plan is written beside the checkpoints (`budget_plan.json`): `--resume`
keeps it, and the minutes spent before the interruption count against the budget.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from torch import nn

from bertforge.dropout import load_kernels
from bertforge.finetune.batches import FeatureBatches
from bertforge.options import FinetuneOptions
from bertforge.pretrain.budget import Deadline, Timing, deadline_for, now, plan_run, save_plan
from bertforge.pretrain.config import BudgetSpec
from bertforge.train import distributed
from bertforge.train.loop import LoopOptions


@dataclasses.dataclass(frozen=True)
class BudgetRun:
    """Where a budgeted fine-tuning run stands: its work directory, whether it resumes, the `now()` reading when the
    command started, and its processes."""

    work: Path
    resume: bool
    started: float
    dist: distributed.Dist


def budget_clock(o: FinetuneOptions) -> float:
    """The `now()` a run with options `o` counts its budget from; with a budget, dropout's kernels are loaded first,
    outside the clock, as pretraining does (`bertforge.dropout.load_kernels`)."""
    if o.minutes:
        load_kernels(o.device)
    return now()


def plan_finetuning(o: FinetuneOptions, loop: LoopOptions, run: BudgetRun, *, model: nn.Module,
                    source: FeatureBatches, objective, evaluate: Callable[[nn.Module], dict]
                    ) -> tuple[LoopOptions, Deadline | None]:
    """`loop` (the epochs' steps) and no deadline without `o.minutes`; with it, the loop of the steps the minutes buy
    (at most the epochs'), its warmup `o.warmup_ratio` of them, and the deadline that keeps the plan."""
    if not o.minutes:
        return loop, None
    micro, accum = loop.accumulation(run.dist.world_size)
    spec = BudgetSpec(minutes=o.minutes, warmup_fraction=o.warmup_ratio)
    plan, planned = plan_run(loop, spec, Timing(out_dir=run.work, resume=run.resume, started=run.started,
                                                dist=run.dist),
                             model=model, batches=source.batches(micro), objective=objective, accum=accum,
                             evaluate=evaluate)
    if plan.steps > loop.steps:  # the minutes buy more than the epochs: the epochs, as without a budget
        plan, planned = dataclasses.replace(plan, steps=loop.steps), loop
        if run.dist.is_main:
            print(f"the {loop.steps:,} steps of --epochs {o.epochs:g} fit in the budget: all of them run", flush=True)
    if run.dist.is_main:
        save_plan(run.work, plan)
    return planned, deadline_for(plan, run.started, most=loop.steps)

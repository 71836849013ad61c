"""A time budget for a training run: measure the step, then plan the steps so the schedule ends at the deadline.

The plan is made before the first real step, from a few timed steps of a copy of the model on batches of the
real data (the copy, its optimizer and the batches are thrown away; the random number generators are put back,
so the run's data, masks and initialisation are those of `--steps N`). Warmup and the decay to zero are laid
over the planned steps. Timed steps alone mispredict a run (its evaluations, checkpoints and the machine's other
load are not in them: a 10-minute BERT-mini run planned at 0.183 s/step ran at 0.21 and took 11.4 minutes), so
while the run goes, `Deadline` plans the rest again, every 2% of the plan, from the wall time the steps so far
have taken: the decay's end moves so that the learning rate reaches zero at the deadline. The first plan is
written to the run directory; checkpoints record the current one and the budget spent, and `--resume` goes on
from them.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from bertforge.errors import BertforgeError
from bertforge.files import write_json
from bertforge.options import LoopOptions
from bertforge.train import distributed, loop
from bertforge.train.loop import Objective, autocast, resolve_precision
from bertforge.train.optim import build_optimizer

PLAN_FILE = "budget_plan.json"
MIN_STEPS = 10  # the fewest steps a budget must leave (plan_steps)
TIMED_STEPS = 8  # after 2 untimed ones (first-call allocations and kernel selection)

# The clock a budget is planned and kept by, read through `now()`. Tests put a fake one here, which moves by the
# training steps they run, so that a budget's logic is checked without waiting for its minutes.
clock: Callable[[], float] = time.perf_counter


def now() -> float:
    return clock()


@dataclass
class BudgetPlan:
    minutes: float  # the budget: wall time from the start of `pretrain` to the final model
    seconds_per_step: float  # median of the timed steps
    eval_seconds: float  # one evaluation, timed on the copy
    steps: int  # optimizer steps that fit
    spent_before_training: float  # seconds of the budget gone before the first real step (setup, this timing)
    over_budget: bool = False  # fewer than MIN_STEPS fit, and the run continues one already paid for (plan_steps)

    def describe(self) -> str:
        over = ("; fewer fit: this stage continues a run, so it trains until the budget ends (at least one step) "
                "rather than refuse and lose the stage before it" if self.over_budget else "")
        return (f"budget {self.minutes:g} min: {self.steps:,} steps at {self.seconds_per_step:.3f} s/step "
                f"(one evaluation {self.eval_seconds:.1f} s; {self.spent_before_training:.0f} s spent on setup "
                f"and timing{over})")


def parse_minutes(text: str | float) -> float:
    """`30`, `30m`, `1.5h`, `90s` -> minutes; refuses anything else or a non-positive budget."""
    s = str(text).strip().lower()
    scale = {"s": 1 / 60, "m": 1.0, "h": 60.0}
    factor = scale.get(s[-1:])
    number = s[:-1] if factor is not None else s
    try:
        minutes = float(number) * (factor or 1.0)
    except ValueError:
        raise BertforgeError(f"--minutes {text!r} is not a duration: use minutes (30) or 90s, 30m, 1.5h") from None
    if not minutes > 0:
        raise BertforgeError(f"--minutes {text!r} must be a positive duration")
    return minutes


def time_steps(model: nn.Module, batches: Iterator[dict], objective: Objective, config: LoopOptions, *, accum: int,
               device: torch.device) -> float:
    """Median seconds of one optimizer step (`accum` micro-batches, the training's own step function
    `loop.train_step` with the run's optimizer, clipping and precision) of a copy of `model` in this process
    alone (no gradient all-reduce); loading the batches is not timed. Nothing of `model`, and no random number
    generator, is changed."""
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if device.type == "cuda" else None
    net = copy.deepcopy(model).to(device).train()
    opt = build_optimizer(net, name=config.optimizer, lr=config.lr, weight_decay=config.weight_decay,
                          betas=tuple(config.betas))
    precision = resolve_precision(config.precision, device)
    alone = distributed.Dist(device=device)
    times = []
    for i in range(TIMED_STEPS + 2):
        host = [next(batches) for _ in range(accum)]
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = now()
        # through the module: the step a test replaces is the one timed here and run by Trainer
        loop.train_step(net, host, objective=objective, optimizer=opt, dist=alone, precision=precision,
                        clip=config.clip_grad_norm)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(now() - start)
    torch.set_rng_state(rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)
    return statistics.median(times)


def time_call(fn: Callable[[], object]) -> float:
    start = now()
    fn()
    return now() - start


def steps_that_fit(minutes: float, seconds_per_step: float, eval_seconds: float, eval_every: int,
                   spent: float) -> int:
    """Steps that fit in what is left of the budget, with an evaluation every `eval_every` steps (0: only at the
    end) and one at the end."""
    left = minutes * 60 - spent - eval_seconds  # the final evaluation always runs
    return int(left / (seconds_per_step + (eval_seconds / eval_every if eval_every else 0.0)))


def plan_steps(minutes: float, seconds_per_step: float, eval_seconds: float, eval_every: int,
               spent: float, *, continuing: bool = False) -> int:
    """`steps_that_fit`; a budget too short for MIN_STEPS is refused, unless the run is `continuing` one already
    paid for (a stacked run's second stage: refusing there would throw away the first stage's work), which plans
    MIN_STEPS and ends when its deadline passes (`Deadline`: at least one step)."""
    steps = steps_that_fit(minutes, seconds_per_step, eval_seconds, eval_every, spent)
    if steps < MIN_STEPS:
        if continuing:
            return MIN_STEPS
        raise BertforgeError(f"a budget of {minutes:g} min leaves time for {max(steps, 0)} steps at "
                             f"{seconds_per_step:.2f} s/step: give more minutes or a smaller model")
    return steps


def agree(value: float, dist: distributed.Dist) -> float:
    """The mean of `value` over the processes, so every rank plans the same number of steps."""
    if not dist.enabled:
        return value
    return distributed.all_reduce_sum([value], dist)[0] / dist.world_size


def save_plan(out_dir: Path, plan: BudgetPlan) -> None:
    write_json(Path(out_dir) / PLAN_FILE, asdict(plan))


def load_plan(out_dir: Path) -> BudgetPlan | None:
    path = Path(out_dir) / PLAN_FILE
    if not path.is_file():
        return None
    try:
        return BudgetPlan(**json.loads(path.read_text()))
    except (ValueError, TypeError) as e:
        raise BertforgeError(f"{path} is not a budget plan ({e}): restore it, or start a new run") from None


REPLANS = 50  # times a run plans its remaining steps again, evenly spread over the first plan


class Deadline:
    """The end of a budgeted run, kept while it trains (the `deadline` of `Trainer`).

    The budget runs from `origin` (the `clock()` reading, by default `now()`, when the command started; a resumed
    run adds what the earlier processes used, as recorded in its checkpoint). `reserve` is kept free for the work
    after the last step (the final evaluation). Every `every` steps, `steps` gives the new total: the steps so far
    took their mean wall time each, evaluations and checkpoints included, and the rest will too."""

    def __init__(self, minutes: float, *, origin: float, reserve: float, every: int,
                 clock: Callable[[], float] | None = None):
        self.seconds, self.origin, self.reserve, self.every = minutes * 60, origin, reserve, max(1, every)
        self.clock = clock or now
        self.spent, self.started, self.first_step = 0.0, origin, 0

    def begin(self, step: int, spent_before: float | None = None) -> None:
        """The loop starts at `step`; `spent_before`: the budget a resumed run had used up to its checkpoint."""
        self.started, self.first_step = self.clock(), step
        self.spent = self.started - self.origin + (spent_before or 0.0)

    def spent_now(self) -> float:
        return self.spent + self.clock() - self.started

    def steps(self, step: int, dist: distributed.Dist) -> int:
        """The run's total steps planned again at `step` (at least one more); every process gets the same."""
        elapsed = self.clock() - self.started
        per_step = elapsed / max(1, step - self.first_step)
        left = agree((self.seconds - self.spent - elapsed - self.reserve) / per_step, dist)
        return step + max(1, int(left))


def deadline_for(plan: BudgetPlan, origin: float) -> Deadline:
    """The deadline that keeps `plan`, from `origin` (the `now()` reading when the command started)."""
    return Deadline(plan.minutes, origin=origin, reserve=plan.eval_seconds, every=max(1, plan.steps // REPLANS))


def plan_run(config: LoopOptions, *, minutes: float, warmup_fraction: float | None, out_dir: Path, resume: bool,
             started: float, dist: distributed.Dist, model: nn.Module, batches: Iterator[dict],
             objective: Objective, accum: int, evaluate: Callable[[nn.Module], dict] | None,
             continuing: bool = False) -> tuple[BudgetPlan, LoopOptions]:
    """The plan of a run with a budget of `minutes` (the one `out_dir` recorded when resumed, else timed now on
    copies of `model`), and the loop `config` with the planned steps and a warmup of `warmup_fraction` of them
    (None: `config.warmup_steps`). Every process gets the same. `continuing`: see `plan_steps`."""
    plan = load_plan(out_dir) if resume else None
    if plan is None:
        seconds = agree(time_steps(model, batches, objective, config, accum=accum, device=dist.device), dist)
        eval_seconds = agree(_time_evaluation(model, evaluate, config, dist.device), dist)
        spent = agree(now() - started, dist)
        steps = plan_steps(minutes, seconds, eval_seconds, config.eval_every, spent, continuing=continuing)
        over = steps_that_fit(minutes, seconds, eval_seconds, config.eval_every, spent) < MIN_STEPS
        plan = BudgetPlan(minutes=minutes, seconds_per_step=seconds, eval_seconds=eval_seconds, steps=steps,
                          spent_before_training=spent, over_budget=over)
    warmup = config.warmup_steps if warmup_fraction is None else round(warmup_fraction * plan.steps)
    config = dataclasses.replace(config, steps=plan.steps, warmup_steps=min(warmup, plan.steps - 1))
    if dist.is_main:
        print(plan.describe(), flush=True)
    return plan, config


def _time_evaluation(model: nn.Module, evaluate: Callable[[nn.Module], dict] | None, config: LoopOptions,
                     device: torch.device) -> float:
    """Seconds of one evaluation, run as the trainer runs it, on a copy of `model` (0 without evaluation)."""
    if evaluate is None:
        return 0.0
    probe = copy.deepcopy(model).to(device).eval()
    with torch.no_grad(), autocast(device, resolve_precision(config.precision, device)):
        return time_call(lambda: evaluate(probe))

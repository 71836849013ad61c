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

Before a run, `forecast_steps` says how many steps a budget buys on this machine: a few timed steps of the recipe's
model(s) on made-up batches of the run's shape (a step's time depends on the shape, not the words), each stacking
stage as it will run; the demo uses it to say whether its minutes reach the steps that paid in the measured runs.
`choose_batch` uses it for a recipe's larger batch (`LargerBatch`): a short run needs steps (at the AVX2 CPU's 10
minutes batch 16 fine-tuned better than 32), a long one gains from the larger batch's tokens (30 minutes in bf16:
+3.2 / +4.8 over random weights at batch 32 against +2.2 / +4.3 at 16, docs/experiments/untuned-task.md).
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
from typing import Any

import numpy as np
import torch
from torch import nn

from bertforge.config import BertConfig
from bertforge.data.shards import read_manifest
from bertforge.errors import BertforgeError
from bertforge.files import write_json
from bertforge.models import IGNORE_INDEX, BertForPreTraining
from bertforge.options import LoopOptions
from bertforge.pretrain.config import BudgetSpec, PretrainConfig
from bertforge.pretrain.objectives import CandidateSampler, PretrainingObjective
from bertforge.pretrain.recipe import Recipe, get_recipe
from bertforge.pretrain.stacking import HALF_DEPTH_DIR, half_depth, short_length, short_stage
from bertforge.train import distributed, loop
from bertforge.train.loop import Objective, autocast, resolve_precision
from bertforge.train.optim import build_optimizer
from bertforge.train.rundir import read_run_config

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
                 clock: Callable[[], float] | None = None, most: int | None = None):
        self.seconds, self.origin, self.reserve, self.every = minutes * 60, origin, reserve, max(1, every)
        self.most = most  # a total never planned past (fine-tuning's epochs), or None
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
        total = step + max(1, int(left))
        return total if self.most is None else max(step + 1, min(total, self.most))


def deadline_for(plan: BudgetPlan, origin: float, most: int | None = None) -> Deadline:
    """The deadline that keeps `plan`, from `origin` (the `now()` reading when the command started), never planning
    past `most` steps (None: no such limit)."""
    return Deadline(plan.minutes, origin=origin, reserve=plan.eval_seconds, every=max(1, plan.steps // REPLANS),
                    most=most)


@dataclass(frozen=True)
class Timing:
    """Where a budgeted run's clock stands: its directory (a resumed run's plan is read from it), the `now()`
    reading when the command started, its processes, and whether it continues a first stage (`plan_steps`)."""

    out_dir: Path
    resume: bool
    started: float
    dist: distributed.Dist
    continuing: bool = False


def plan_run(config: LoopOptions, spec: BudgetSpec, timing: Timing, *, model: nn.Module, batches: Iterator[dict],
             objective: Objective, accum: int,
             evaluate: Callable[[nn.Module], dict] | None) -> tuple[BudgetPlan, LoopOptions]:
    """The plan of a run with the budget `spec` (the one its directory recorded when resumed, else timed now on
    copies of `model`), and the loop `config` with the planned steps and a warmup of the budget's warmup fraction of
    them (None: `config.warmup_steps`). Every process gets the same."""
    dist, minutes = timing.dist, spec.minutes
    plan = load_plan(timing.out_dir) if timing.resume else None
    if plan is None:
        seconds = agree(time_steps(model, batches, objective, config, accum=accum, device=dist.device), dist)
        eval_seconds = agree(_time_evaluation(model, evaluate, config, dist.device), dist)
        spent = agree(now() - timing.started, dist)
        steps = plan_steps(minutes, seconds, eval_seconds, config.eval_every, spent, continuing=timing.continuing)
        over = steps_that_fit(minutes, seconds, eval_seconds, config.eval_every, spent) < MIN_STEPS
        plan = BudgetPlan(minutes=minutes, seconds_per_step=seconds, eval_seconds=eval_seconds, steps=steps,
                          spent_before_training=spent, over_budget=over)
    fraction = spec.warmup_fraction
    warmup = config.warmup_steps if fraction is None else round(fraction * plan.steps)
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


SPECIAL_IDS = 5  # [PAD] [UNK] [CLS] [SEP] [MASK]: not drawn as words


@dataclass(frozen=True)
class Forecast:
    minutes: float
    seconds_per_step: tuple[float, ...]  # each stage's (half depth then full depth, or the one stage)
    steps: int  # all stages together

    def minutes_for(self, steps: int) -> float:
        """The budget that would buy `steps`, at this forecast's mix of stages."""
        return self.minutes * steps / max(self.steps, 1)


def _batches(config: BertConfig, batch_size: int, seq_len: int, mask_prob: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    while True:
        ids = torch.randint(SPECIAL_IDS, config.vocab_size, (batch_size, seq_len), generator=g)
        masked = torch.rand(batch_size, seq_len, generator=g) < mask_prob
        masked[:, 0] = False  # [CLS]
        masked[0, 1] = True  # at least one prediction
        yield {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": torch.ones_like(ids),
               "mlm_labels": ids.masked_fill(~masked, IGNORE_INDEX), "nsp_labels": torch.zeros(batch_size).long()}


def _seconds_per_step(config: BertConfig, recipe: Recipe, loop: LoopOptions, seq_len: int, mask_prob: float,
                      device: torch.device) -> float:
    is_special = np.zeros(config.vocab_size, dtype=bool)
    is_special[:SPECIAL_IDS] = True
    # a sampled softmax draws from Zipf-like frequencies (exponent 1.1): 1,024 draws give about 550 different words
    # of 8,000, as the demo's corpus does (530)
    sampler = CandidateSampler(1e7 / np.arange(1, config.vocab_size + 1) ** 1.1, recipe.mlm_candidates, is_special,
                               seed=0) if recipe.mlm_candidates else None
    objective = PretrainingObjective(nsp=recipe.nsp, bow_weight=recipe.bow_weight, is_special=is_special,
                                     candidates=sampler)
    rng = torch.get_rng_state()
    model = BertForPreTraining(config)
    model.set_dropout(recipe.dropout if recipe.dropout is not None else config.hidden_dropout_prob)
    torch.set_rng_state(rng)
    batches = _batches(config, loop.batch_size, seq_len, mask_prob, 0)
    return time_steps(model, batches, objective, loop, accum=1, device=device)


def forecast_steps(config: BertConfig, recipe: Recipe, minutes: float, *, seq_len: int, precision: str,
                   device: torch.device | None = None) -> Forecast:
    """The optimizer steps a run of `recipe` for `minutes` reaches here on `device` (None: the CPU), stacked as the
    recipe stacks (the half-depth stage on shorter sequences, as many more of them a batch), from timed steps of each
    stage. Setup and evaluations are left out, so it is an upper bound by a few percent."""
    loop = LoopOptions(steps=1, batch_size=recipe.batch_size, lr=recipe.lr, betas=recipe.betas,
                       weight_decay=recipe.weight_decay, warmup_steps=0, precision=precision)
    stages = [(config, loop, seq_len, recipe.mask_prob, 1.0)]
    if recipe.stack_fraction:  # the stages as `stacking.stages` makes them
        short = short_length(seq_len, recipe.stack_length_fraction)
        first_mask = recipe.stack_mask_prob if recipe.stack_mask_prob is not None else recipe.mask_prob
        stages = [(half_depth(config), short_stage(loop, seq_len, short), short, first_mask, recipe.stack_fraction),
                  (config, loop, seq_len, recipe.mask_prob, 1.0 - recipe.stack_fraction)]
    device = device or torch.device("cpu")
    seconds = tuple(_seconds_per_step(c, recipe, stage_loop, length, mask, device)
                    for c, stage_loop, length, mask, _ in stages)
    steps = sum(int(share * minutes * 60 / s) for (*_, share), s in zip(stages, seconds, strict=True))
    return Forecast(minutes=minutes, seconds_per_step=seconds, steps=steps)


def forecast_recipe(c: PretrainConfig) -> Recipe:
    """The recipe a forecast times for the run `c`: its recipe with the run's batch, optimizer, masking, NSP,
    dropout, stacking, bag of words and sampled softmax."""
    return dataclasses.replace(
        get_recipe(c.recipe or "bert"), batch_size=c.loop.batch_size, lr=c.loop.lr, betas=c.loop.betas,
        weight_decay=c.loop.weight_decay, mask_prob=c.data.masked_lm_prob, nsp=c.data.nsp, dropout=c.model.dropout,
        stack_fraction=c.stacking.fraction, stack_length_fraction=c.stacking.length_fraction,
        stack_mask_prob=c.stacking.mask_prob, bow_weight=c.objective.bow_weight,
        mlm_candidates=c.objective.mlm_candidates)


def choose_batch(c: PretrainConfig, *, model_config: Callable[[str, int, int], Any]) -> PretrainConfig:
    """The run `c` at its budget's larger batch and lr when its minutes buy at least `larger_batch.from_steps` steps
    at its batch here, else at its own; either way with the choice made (`budget.larger_batch` None). A resumed run
    keeps the batch it was started with (its recorded lr tells which), and every process of a torchrun run takes the
    larger batch if any of them would. `model_config(name, vocab_size, seq_len)`: the model's config for the data."""
    larger, minutes = c.budget.larger_batch, c.budget.minutes
    decided = c.replace(budget=dataclasses.replace(c.budget, larger_batch=None))
    bigger = decided.replace(loop=dataclasses.replace(c.loop, batch_size=larger.batch_size, lr=larger.lr))
    out_dir = Path(c.out_dir)
    if c.resume:
        recorded = read_run_config(out_dir) or read_run_config(out_dir / HALF_DEPTH_DIR)
        if recorded is not None:
            return bigger if recorded["loop"]["lr"] == larger.lr else decided
    d = distributed.setup(c.loop.device)
    manifest = read_manifest(c.data_dir)
    seq_len = int(c.model.max_seq_len or manifest["max_seq_len"])
    probe = forecast_recipe(c)
    started = now()
    config = model_config(c.model.name, int(manifest["vocab_size"]), seq_len)
    steps = forecast_steps(config, probe, minutes, seq_len=seq_len, precision=c.loop.precision, device=d.device).steps
    take = distributed.any_rank(steps >= larger.from_steps, d)
    if d.is_main:
        verdict = (f"at least {larger.from_steps:,}: batch {larger.batch_size} at lr {larger.lr:g}" if take else
                   f"under {larger.from_steps:,}: batch {c.loop.batch_size} at lr {c.loop.lr:g}")
        print(f"{minutes:g} minutes buy about {steps:,} steps of the {probe.name} recipe's batch here (timed in "
              f"{now() - started:.1f} s), {verdict}", flush=True)
    return bigger if take else decided

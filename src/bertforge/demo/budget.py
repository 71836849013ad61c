"""The demo's budget against what this CPU can do: before pretraining, a few timed steps say how many steps the
minutes buy here (`bertforge.pretrain.budget`), and the demo says whether they reach the steps at which pretraining
paid in our runs, with the budget that would; `--minutes auto` takes that budget.

Why steps, not minutes: the budget recipe (batch 16, its sampled softmax, word embeddings from co-occurrences)
runs about 14,000 steps of BERT-tiny in the 10 minutes of a 2-core AVX2 EPYC in fp32; 13,600 of them scored above
random weights on both tasks in each pretraining measured (docs/experiments/untuned-task.md), fewer were not
measured. With the recipe before (batch 32, random embeddings) 8,000 steps scored at random weights' level and
12,000 above them.
"""

from __future__ import annotations

import math

from bertforge.config import BertConfig
from bertforge.errors import BertforgeError
from bertforge.pretrain.budget import Forecast, forecast_steps
from bertforge.pretrain.config import parse_minutes
from bertforge.pretrain.recipe import Recipe

DEFAULT_MINUTES = 10.0
# The fewest steps of the budget recipe at which the demo's pretrained model scored above random weights on both
# tasks in our runs, by model (docs/experiments/untuned-task.md: tiny, the AVX2 CPU's 10 minutes less the seconds
# of the co-occurrence embeddings); a model not listed gets no promise either way.
PAYS_FROM_STEPS = {"tiny": 13600}
MARGIN = 1.1  # the forecast leaves out setup and evaluations (a few percent): auto asks for a tenth more


def parse_demo_minutes(text: str | float) -> float | None:
    """The demo's `--minutes`: a duration (`10`, `90s`, `1.5h`) in minutes, or None for `auto`."""
    if isinstance(text, str) and text.strip().lower() == "auto":
        return None
    return parse_minutes(text)


def plan_minutes(asked: float | None, model: str, config: BertConfig, recipe: Recipe, *, seq_len: int,
                 precision: str, forecast=forecast_steps) -> tuple[float, list[str], dict]:
    """(the minutes to pretrain, the lines to print before pretraining, the record for the summary) for the demo's
    `--minutes` (`asked`, None: auto)."""
    needed = PAYS_FROM_STEPS.get(model)
    if needed is None:
        if asked is None:
            raise BertforgeError(f"--minutes auto knows the steps that pay for {', '.join(PAYS_FROM_STEPS)} only, not "
                                 f"--model {model}: give the minutes")
        return asked, [], {}
    probe = forecast(config, recipe, asked or DEFAULT_MINUTES, seq_len=seq_len, precision=precision)
    enough = math.ceil(MARGIN * probe.minutes_for(needed))
    minutes = asked if asked is not None else float(max(enough, 1))
    steps = probe.steps * minutes / probe.minutes
    lines = [_speed(probe, model, minutes, steps)]
    if steps < needed:
        lines.append(f"In our runs pretraining scored above random weights on both tasks at about {needed:,} steps "
                     f"(the 10 minutes of a 2-core CPU without bf16; fewer were not measured), so {minutes:g} minutes "
                     f"here may not: --minutes {enough} (or --minutes auto) reaches them on this CPU.")
    elif asked is None:
        lines.append(f"--minutes auto: {minutes:g} minutes, enough for the {needed:,} steps at which pretraining "
                     f"scored above random weights on both tasks in our runs.")
    larger = recipe.larger_batch
    if larger is not None and steps >= larger.from_steps:
        lines.append(f"These are steps of batch {recipe.batch_size}; from {larger.from_steps:,} of them pretraining "
                     f"takes batch {larger.batch_size}: fewer steps, of {larger.batch_size / recipe.batch_size:g}x the "
                     f"tokens each, which paid more at such budgets in our runs.")
    record = {"forecast_steps": round(steps), "seconds_per_step": list(probe.seconds_per_step),
              "pays_from_steps": needed, "minutes_that_reach_them": enough, "auto": asked is None}
    return minutes, lines, record


def _speed(probe: Forecast, model: str, minutes: float, steps: float) -> str:
    if len(probe.seconds_per_step) > 1:
        half, full = probe.seconds_per_step
        timed = f"{half:.3f} s a step at half depth, {full:.3f} at full depth"
    else:
        timed = f"{probe.seconds_per_step[0]:.3f} s a step"
    return f"On this CPU {minutes:g} minutes buy about {steps:,.0f} steps of BERT-{model} (timed: {timed})."

"""The budget recipe's batch, chosen by the steps a time budget buys on the machine at hand.

A small batch buys more steps in the same minutes, and a short run needs steps: at the 10 minutes of a 2-core AVX2
CPU (about 14,000 steps of BERT-tiny) batch 16 fine-tuned better than batch 32. A long run has the steps and gains
from the larger batch's tokens: 30 minutes in bf16 (about 56,000 steps at batch 16) scored +2.2 / +4.3 over random
weights at batch 16 and +3.2 / +4.8 at batch 32 (docs/experiments/untuned-task.md). So a recipe may name a larger
batch (`Recipe.larger_batch`) for the budgets that buy at least its `from_steps` steps at the recipe's own batch:
`forecast_steps` times a few steps of each stage before the run, a second or two outside the budget's clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from bertforge.data.shards import read_manifest
from bertforge.options import LoopOptions
from bertforge.train import budget, distributed
from bertforge.train.forecast import forecast_steps
from bertforge.train.recipe import Recipe
from bertforge.train.resume import read_run_config
from bertforge.train.stacking import HALF_DEPTH_DIR

# recipe options (`recipe.resolve`'s names, each its Recipe field's) a forecast needs as the run will have them
_FORECAST_OPTIONS = ("mask_prob", "nsp", "dropout", "stack_fraction", "stack_length_fraction", "bow_weight",
                     "mlm_candidates", "stack_mask_prob")


def budget_batch(recipe: Recipe, loop: LoopOptions, values: Mapping[str, Any], *, minutes: float,
                 model_config: Callable[[int, int], Any], data_dir: str | Path, max_seq_len: int | None,
                 out_dir: Path, resume: bool) -> LoopOptions:
    """`loop` at the recipe's larger batch and its lr when `minutes` buy at least `larger_batch.from_steps` steps at
    the recipe's batch here, else `loop` as it is. Only for a recipe with a larger batch and neither the batch size
    nor the lr given (`values["batch_given"]`, `pretrain.apply_recipe`); a resumed run keeps the batch it was
    started with (its recorded lr tells which), and every process of a torchrun run takes the larger batch if any
    of them would. `model_config(vocab_size, seq_len)`: the model's config for the data and the run's length."""
    larger = recipe.larger_batch
    if larger is None or values["batch_given"]:
        return loop
    bigger = dataclasses.replace(loop, batch_size=larger.batch_size, lr=larger.lr)
    if resume:
        recorded = read_run_config(out_dir) or read_run_config(out_dir / HALF_DEPTH_DIR)
        if recorded is not None:
            return bigger if recorded["loop"]["lr"] == larger.lr else loop
    d = distributed.setup(loop.device)
    manifest = read_manifest(data_dir)
    seq_len = int(max_seq_len or manifest["max_seq_len"])
    probe = dataclasses.replace(recipe, **{name: values[name] for name in _FORECAST_OPTIONS})
    started = budget.now()
    config = model_config(int(manifest["vocab_size"]), seq_len)
    steps = forecast_steps(config, probe, minutes, seq_len=seq_len, precision=loop.precision, device=d.device).steps
    take = distributed.any_rank(steps >= larger.from_steps, d)
    if d.is_main:
        verdict = (f"at least {larger.from_steps:,}: batch {larger.batch_size} at lr {larger.lr:g}" if take else
                   f"under {larger.from_steps:,}: batch {recipe.batch_size} at lr {recipe.lr:g}")
        print(f"{minutes:g} minutes buy about {steps:,} steps of the {recipe.name} recipe's batch here (timed in "
              f"{budget.now() - started:.1f} s), {verdict}", flush=True)
    return bigger if take else loop

"""How many steps a time budget buys on this machine, known before the run: a few timed steps of the recipe's
model(s) on batches of the run's shape, the way `budget.plan_run` times them once the run has started.

A demo that promises "pretraining pays" must know whether its minutes reach the steps at which it paid in the
measured runs; the CPU decides that (the same 10 minutes were 4,084 steps of the demo's BERT-tiny on a 2-core AVX2
EPYC in fp32 and about 15,000 on a 2-core EPYC with AVX512-BF16 under bf16). The batches are made up (random
tokens, the recipe's masking rate): a step's time depends on their shape, not their words.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from bertforge.config import BertConfig
from bertforge.models import IGNORE_INDEX, BertForPreTraining
from bertforge.options import LoopOptions
from bertforge.train import budget
from bertforge.train.candidates import CandidateSampler
from bertforge.train.objective import PretrainingObjective
from bertforge.train.recipe import Recipe
from bertforge.train.stacking import half_depth, short_length, short_stage

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
    return budget.time_steps(model, batches, objective, loop, accum=1, device=device)


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

"""Pretraining recipes: the paper's (`bert`, the default) and one for small compute (`budget`).

A recipe is a set of defaults, nothing more: every value is also an option of its own (`bertforge pretrain
--mask-prob 0.4 --no-nsp ...`), and an option given on the command line wins over the recipe's value. The
budget recipe gathers what the small-compute literature changes (Cramming, "How to Train BERT with an Academic
Budget", "Should You Mask 15%"); which of those changes earn their place on this project's CPU is measured by
`bench/pays.py` and recorded in docs/experiments/.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from bertforge.errors import BertforgeError
from bertforge.options import DataOptions, ElectraOptions, LoopOptions, cli_name
from bertforge.pretrain.config import (
    BudgetSpec,
    LargerBatch,
    ModelSpec,
    ObjectiveSpec,
    PretrainConfig,
    StackingSpec,
    parse_minutes,
)


@dataclass(frozen=True)
class Recipe:
    name: str
    lr: float  # peak learning rate
    warmup_fraction: float  # warmup steps as a share of all steps, then linear decay to zero at the last step
    betas: tuple[float, float]  # Adam's
    weight_decay: float
    batch_size: int  # global batch, sequences
    mask_prob: float  # share of positions masked (80% [MASK], 10% random, 10% unchanged)
    nsp: bool  # next-sentence prediction; without it each instance is one segment filling the sequence
    dropout: float | None  # dropout while pretraining; None: the model config's (0.1); the saved model keeps 0.1
    pre_layer_norm: bool  # pre-LN layers for a new model (see BertConfig.pre_layer_norm)
    tie_embeddings: bool  # the masked-LM decoder is the word embedding matrix (BertConfig.tie_word_embeddings)
    seq_len: int  # the length to prepare the data at (`bertforge prepare --max-seq-len`); the data decides
    stack_fraction: float  # share of the budget spent at half depth before stacking (stacking.py); 0: off
    stack_length_fraction: float  # the half-depth stage's sequence length, a share of the run's (same tokens a step)
    bow_weight: float  # weight of the bag-of-words loss on [CLS] (PretrainingObjective); 0: off
    mlm_candidates: int  # masked-LM scored against this many sampled words (objectives.py); 0: all of them
    stack_mask_prob: float | None = None  # the half-depth stage's masking rate; None: mask_prob, as the second's
    embedding_init: str = "random"  # a new model's word embeddings: random, or from co-occurrences (cooccurrence.py)
    larger_batch: LargerBatch | None = None  # the batch of long time budgets (budget.py); None: always batch_size

    def to_dict(self) -> dict:
        return asdict(self)

    def config(self, data: str, out: str, given: Mapping[str, Any]) -> PretrainConfig:
        """The run's whole configuration: the options `given` (by command-line name), this recipe's values for the
        rest (`recipe_config`)."""
        return _config(self, data, out, given)


BERT = Recipe(name="bert", lr=1e-4, warmup_fraction=0.01, betas=(0.9, 0.999), weight_decay=0.01, batch_size=256,
              mask_prob=0.15, nsp=True, dropout=None, pre_layer_norm=False, tie_embeddings=True, seq_len=128,
              stack_fraction=0.0, stack_length_fraction=1.0, bow_weight=0.0, mlm_candidates=0)

# Length 64: twice the steps of length 128 in the same minutes. Early on the masked-LM sits on a plateau for a
# number of tokens; stacking pays for them at half depth, half the price, and on sequences a quarter as long
# (16 tokens, 4x as many a step), which leave it after about a quarter of the tokens: on a 2-core AVX2 CPU ten
# minutes at length 64 ended on the plateau and fine-tuned 6.1 points below random weights with 1,000 labels,
# at 16 they left it and lost 2.4 (docs/experiments/stacking.md). A bag-of-words loss on [CLS] (0.1 of
# it): without NSP nothing else trains [CLS], and short runs fine-tuned below random weights through it (bow-loss.md).
# The masked-LM as a sampled softmax over 1,024 drawn words: the decoder over the vocabulary was most of a small
# model's step; at the same 10 minutes in bf16 it took BERT-tiny from +0.9 / +2.2 to +2.1 / +3.2 over random weights
# on Rotten Tomatoes / IMDB, and the AVX2 CPU's 10 minutes from -0.3 / -1.1 to +0.3 / -0.3 (untuned-task.md).
# Batch 16 at lr 1.4e-3 (2e-3 / sqrt 2): 1.8x the steps of batch 32 in the same time; at the AVX2 CPU's 10 minutes
# +0.8 / +0.6 over three pretrainings against batch 32's +0.0 / +0.3. Word embeddings from the corpus's
# co-occurrences (cooccurrence.py, seconds): there +1.4 / +2.5, +1.4 / +1.5, +1.2 / +1.6 in three runs; with both, 10
# minutes in bf16 +3.0 / +3.1 against batch 32's +2.1 / +3.2; those vectors at 3x the initializer's spread took the AVX2
# CPU's 10 minutes on IMDB from a mean +1.9 to +3.4 over three pretrainings, Rotten Tomatoes alike (untuned-task.md).
# Batch 32 at lr 2e-3 where the budget buys 50,000 steps of batch 16 (budget.py choose_batch): 30 minutes in
# bf16 scored +3.2 / +4.8 at batch 32 against +2.2 / +4.3 at 16; 10 minutes there, the same day, +1.7 / +4.0 at 32
# against +2.5 / +3.7 at 16 (untuned-task.md).
BUDGET = Recipe(name="budget", lr=1.4e-3, warmup_fraction=0.06, betas=(0.9, 0.98), weight_decay=0.01, batch_size=16,
                mask_prob=0.4, nsp=False, dropout=0.0, pre_layer_norm=True, tie_embeddings=True, seq_len=64,
                stack_fraction=0.6, stack_length_fraction=0.25, bow_weight=0.1, mlm_candidates=1024,
                embedding_init="cooccurrence", larger_batch=LargerBatch(from_steps=50_000, batch_size=32, lr=2e-3))

RECIPES = {r.name: r for r in (BERT, BUDGET)}


# The options a recipe supplies when none is given, by their command-line names: option -> Recipe field.
RECIPE_OPTIONS = {"batch_size": "batch_size", "lr": "lr", "warmup_steps": "warmup_fraction", "betas": "betas",
                  "weight_decay": "weight_decay", "mask_prob": "mask_prob", "nsp": "nsp", "dropout": "dropout",
                  "pre_ln": "pre_layer_norm", "tie_embeddings": "tie_embeddings", "stack_fraction": "stack_fraction",
                  "stack_length_fraction": "stack_length_fraction", "bow_weight": "bow_weight",
                  "mlm_candidates": "mlm_candidates", "stack_mask_prob": "stack_mask_prob",
                  "embedding_init": "embedding_init"}

# With a time budget the steps are planned when the run starts; this many stand in for them until then.
STEPS_UNTIL_PLANNED = 1000


def get_recipe(name: str | Recipe) -> Recipe:
    """The recipe of that name (a Recipe is returned as it is)."""
    if isinstance(name, Recipe):
        return name
    if name not in RECIPES:
        raise BertforgeError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)}")
    return RECIPES[name]


def default_warmup(recipe: Recipe, steps: int) -> int:
    """Warmup steps for a run of `steps`: the recipe's share of them, at least 1 (none for a 1-step run)."""
    return min(max(1, round(recipe.warmup_fraction * steps)), steps - 1)


def recipe_config(recipe: str | Recipe = "bert", /, *, data: str, out: str, **options: Any) -> PretrainConfig:
    """The whole configuration of a pretraining run of `recipe` on prepared `data` into `out`: the `options` given
    (by their command-line names: `minutes=30`, `batch_size=32`, `mask_prob=0.4`, `model="tiny"`; None: not given),
    the recipe's values for the rest. For example `pretrain(recipe_config("budget", data="data/", out="runs/tiny",
    model="tiny", minutes=30))`. Refuses an unknown option and what `PretrainConfig` refuses."""
    return get_recipe(recipe).config(data, out, {k: v for k, v in options.items() if v is not None})


def _config(recipe: Recipe, data: str, out: str, given: Mapping[str, Any]) -> PretrainConfig:
    _check_names(given)
    electra, init = given.get("objective") == "electra", given.get("init")
    minutes = parse_minutes(given["minutes"]) if "minutes" in given else None
    steps = STEPS_UNTIL_PLANNED if minutes is not None else given.get("steps")
    if steps is None:
        raise BertforgeError("pretrain needs the run's length: steps, or a time budget (minutes)")
    betas = tuple(given.get("betas", recipe.betas))
    if len(betas) != 2:
        raise BertforgeError(f"--betas {' '.join(map(str, betas))}: give 2 values, e.g. 0.9 0.999")
    fresh = init is None and not electra  # what only a new masked-LM model has
    # what a run of this kind cannot have, unless given (PretrainConfig refuses it given)
    instead = {"nsp": False, "bow_weight": 0.0, "mlm_candidates": 0, "tie_embeddings": True} if electra else {}
    if init is not None:
        instead["embedding_init"] = "random"
    if not fresh:
        instead["stack_fraction"] = 0.0

    def section(cls: type, **values: Any) -> Any:
        return _section(cls, recipe, given, {**instead, **values})

    loop = section(LoopOptions, steps=steps, betas=betas,
                   warmup_steps=given.get("warmup_steps", default_warmup(recipe, steps)))
    larger = recipe.larger_batch if minutes is not None and fresh and not {"batch_size", "lr"} & set(given) else None
    warmup_fraction = recipe.warmup_fraction if minutes is not None and "warmup_steps" not in given else None
    return PretrainConfig(data_dir=str(data), out_dir=str(out), loop=loop, data=section(DataOptions),
                          model=section(ModelSpec), objective=section(ObjectiveSpec, electra=section(ElectraOptions)),
                          stacking=section(StackingSpec), recipe=recipe.name, resume=bool(given.get("resume", False)),
                          budget=BudgetSpec(minutes=minutes, warmup_fraction=warmup_fraction, larger_batch=larger))


_COMPUTED = ("steps", "betas", "warmup_steps")  # the loop's, which `_config` works out from what was given


def _section(cls: type, recipe: Recipe, given: Mapping[str, Any], values: Mapping[str, Any]) -> Any:
    """One section of the config: each option as given (by its command-line name), else as `values` has it (by
    command-line or field name: the run's own rules), else the recipe's value (`RECIPE_OPTIONS`), else the class's
    default."""
    chosen = {}
    for f in dataclasses.fields(cls):
        name = cli_name(f)
        if name in given and name not in _COMPUTED:
            chosen[f.name] = given[name]
        elif name in values or f.name in values:
            chosen[f.name] = values[name] if name in values else values[f.name]
        elif name in RECIPE_OPTIONS:
            chosen[f.name] = getattr(recipe, RECIPE_OPTIONS[name])
    return cls(**chosen)


def option_names() -> tuple[str, ...]:
    """Every option `recipe_config` takes, by command-line name."""
    sections = (LoopOptions, DataOptions, ElectraOptions, ModelSpec, ObjectiveSpec, StackingSpec)
    names = [cli_name(f) for cls in sections for f in dataclasses.fields(cls) if "help" in f.metadata]
    return tuple(dict.fromkeys([*names, "steps", "minutes", "resume"]))


def _check_names(given: Mapping[str, Any]) -> None:
    known = option_names()
    for name in given:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; the options: {', '.join(sorted(known))}"
            raise BertforgeError(f"unknown pretraining option {name!r}{hint}")


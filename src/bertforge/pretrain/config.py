"""`PretrainConfig`: everything a pretraining run is, made once and passed whole.

A recipe makes it from what the user gave (`bertforge.pretrain.recipe.recipe_config`); `pretrain` takes it as its
only argument; stacking's two stages and the time budget's batch choice derive new ones from it with
`dataclasses.replace`. Nothing downstream asks whether a value was given: the config says what the run is. The
checks that span several options live in `PretrainConfig.__post_init__`, each a one-line error naming the fix.

Like `bertforge.options`, this module imports only the standard library and the option classes, so the command
line can build and check a config before torch is loaded.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from bertforge.errors import BertforgeError
from bertforge.options import EMBEDDING_INITS, DataOptions, ElectraOptions, LoopOptions

OBJECTIVES = ("mlm", "electra")
MAX_MINUTES = 366 * 24 * 60  # a year: a longer budget is a typo, not a plan


@dataclass(frozen=True)
class ModelSpec:
    """The model pretrained: a new one of `name`'s architecture, or `init`'s weights."""

    name: str = "mini"  # a preset (tiny ... large), a config.json, or a model directory: the architecture
    init: str | None = None  # start from this model directory's weights (the paper's second phase); None: new
    max_seq_len: int | None = None  # sequence length; None: the one the data was prepared for
    dropout: float | None = None  # dropout while pretraining; None: the model config's (the saved model keeps it)
    pre_layer_norm: bool = False  # pre-LN layers for a new model (transformers cannot load them)
    tie_embeddings: bool = True  # the masked-LM decoder is the word embedding matrix, as in BERT
    embedding_init: str = "random"  # a new model's word embeddings: random, or cooccurrence (cooccurrence.py)


@dataclass(frozen=True)
class ObjectiveSpec:
    """What the model learns: the masked-LM (+ NSP when `DataOptions.nsp`), or ELECTRA's replaced tokens."""

    kind: str = "mlm"  # mlm, or electra (Clark et al. 2020: a small generator trained beside the model)
    bow_weight: float = 0.0  # weight of a bag-of-words loss on [CLS] (objectives.py); 0: off
    mlm_candidates: int = 0  # the masked-LM as a sampled softmax over this many drawn words; 0: the whole vocabulary
    electra: ElectraOptions = field(default_factory=ElectraOptions)  # the generator and loss, for kind electra


@dataclass(frozen=True)
class StackingSpec:
    """Stacking (stacking.py): a model of half the depth first, then its layers copied on top of themselves."""

    fraction: float = 0.0  # share of the steps or minutes at half depth; 0: off
    length_fraction: float = 1.0  # the half-depth stage's sequence length as a share of the run's
    mask_prob: float | None = None  # the half-depth stage's masking rate; None: the run's


@dataclass(frozen=True)
class LargerBatch:
    """A time budget that buys at least `from_steps` steps at the run's batch here trains at `batch_size` and `lr`
    instead (`budget.choose_batch` times a few steps before the run to know)."""

    from_steps: int
    batch_size: int
    lr: float


@dataclass(frozen=True)
class BudgetSpec:
    """A time budget instead of a number of steps (budget.py plans the steps from timed ones)."""

    minutes: float | None = None  # None: the loop's steps
    warmup_fraction: float | None = None  # the warmup's share of the planned steps; None: the loop's warmup_steps
    larger_batch: LargerBatch | None = None  # None: the loop's batch whatever the budget buys


@dataclass(frozen=True)
class PretrainConfig:
    """One pretraining run (`bertforge.pretrain.pretrain`): the data, where it goes, and how it trains."""

    data_dir: str  # prepared data (`bertforge prepare`)
    out_dir: str  # the run directory: checkpoints, metrics.jsonl, curves, the model
    loop: LoopOptions  # the training loop: steps, batch, optimizer, checkpoints, device, precision
    data: DataOptions = field(default_factory=DataOptions)  # instances and masking
    model: ModelSpec = field(default_factory=ModelSpec)
    objective: ObjectiveSpec = field(default_factory=ObjectiveSpec)
    stacking: StackingSpec = field(default_factory=StackingSpec)
    budget: BudgetSpec = field(default_factory=BudgetSpec)
    recipe: str | None = None  # the recipe that made it, recorded in run_config.json (None: made by hand)
    resume: bool = False  # continue exactly from the last checkpoint in out_dir

    def __post_init__(self) -> None:
        _check_objective(self)
        m = self.model
        if m.embedding_init not in EMBEDDING_INITS:
            raise BertforgeError(f"unknown embedding_init {m.embedding_init!r}; choose {' or '.join(EMBEDDING_INITS)}")
        if m.init is not None and self.stacking.fraction:
            raise BertforgeError("--stack-fraction builds a new model in two stages; with --init there is none to "
                                 "build: drop one of them")
        if m.init is not None and m.embedding_init == "cooccurrence":
            raise BertforgeError("--embedding-init cooccurrence starts a new model's word embeddings; --init starts "
                                 "from a trained model's: drop one of them")
        if self.budget.minutes is not None:
            parse_minutes(self.budget.minutes)

    def replace(self, **sections) -> PretrainConfig:
        """A copy with some sections or fields replaced (`dataclasses.replace`)."""
        return dataclasses.replace(self, **sections)


def _check_objective(c: PretrainConfig) -> None:
    """ELECTRA fills each sequence with one segment and trains its own heads: no NSP, stacking, bag of words,
    sampled softmax, untied decoder or `init` (which would need a generator)."""
    o = c.objective
    if o.kind not in OBJECTIVES:
        raise BertforgeError(f"unknown objective {o.kind!r}; choose mlm or electra")
    if o.kind == "mlm":
        return
    for value, flag in ((c.stacking.fraction, "--stack-fraction"), (o.bow_weight, "--bow-weight"),
                        (o.mlm_candidates, "--mlm-candidates")):
        if value:
            raise BertforgeError(f"{flag} is not available with --objective electra: drop it or set it to 0")
    if not c.model.tie_embeddings:
        raise BertforgeError("--no-tie-embeddings is not available with --objective electra (the generator's decoder "
                             "is the shared embeddings): drop it")
    if c.model.init is not None:
        raise BertforgeError("--init is not available with --objective electra (it would need a generator): drop it")
    if c.data.nsp:
        raise BertforgeError("--nsp is not available with --objective electra (it fills each sequence): drop it")


def parse_minutes(text: str | float) -> float:
    """`30`, `30m`, `1.5h`, `90s` -> minutes; refuses anything else, and a budget that is not positive and finite
    or is over a year."""
    s = str(text).strip().lower()
    scale = {"s": 1 / 60, "m": 1.0, "h": 60.0}
    factor = scale.get(s[-1:])
    number = s[:-1] if factor is not None else s
    try:
        minutes = float(number) * (factor or 1.0)
    except ValueError:
        raise BertforgeError(f"--minutes {text!r} is not a duration: use minutes (30) or 90s, 30m, 1.5h") from None
    if not (math.isfinite(minutes) and 0 < minutes <= MAX_MINUTES):
        raise BertforgeError(f"--minutes {text!r}: give a positive duration of at most a year "
                             f"({MAX_MINUTES:,} minutes)")
    return minutes

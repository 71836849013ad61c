"""`bertforge pretrain`: MLM + NSP pretraining on prepared data.

    bertforge pretrain --data data/ --model mini --out runs/mini --steps 10000 --batch-size 256 \
        --micro-batch-size 32
    bertforge pretrain --data data/ --model mini --out runs/budget --recipe budget --minutes 30
    torchrun --nproc-per-node 2 -m bertforge pretrain --data data/ --model mini --out runs/mini ...

The paper's two phases: prepare the corpus twice (--max-seq-len 128 and 512), pretrain 90% of the steps on
the first, then start the second from the first's model with --init:

    bertforge pretrain --data data128/ --model base --out runs/p1 --steps 900000
    bertforge pretrain --data data512/ --init runs/p1 --out runs/p2 --steps 100000 --warmup-steps 0
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from bertforge.commands.base import (
    FRACTION,
    MIN_SEQ_LEN,
    POSITIVE,
    PROBABILITY,
    Bound,
    Command,
    arg,
    at_least,
    merge_config_file,
    precision_arg,
    seed_arg,
)
from bertforge.errors import BertforgeError
from bertforge.train.recipe import RECIPES


@dataclass
class PretrainArgs:
    data: str = arg(help="prepared data directory (from `bertforge prepare`)")
    out: str = arg(help="run directory: checkpoints, metrics.jsonl, curves and the final model")
    recipe: str = arg("bert", choices=list(RECIPES),
                      help="defaults for the options marked (recipe): bert, the paper's (lr 1e-4, 1%% warmup, "
                           "batch 256, 15%% masking, NSP, dropout 0.1, post-LN); budget, for small compute (lr 2e-3, "
                           "6%% warmup, betas 0.9/0.98, batch 32, 40%% masking, no NSP, no dropout while "
                           "pretraining, pre-LN); an option given here wins over its recipe")
    model: str = arg("mini", help="preset (tiny, mini, small, medium, base, large) or a config.json")
    init: str | None = arg(None, help="start from this model directory's weights (e.g. phase 1 of 2)")
    steps: int = arg(10000, help="optimizer steps (ignored with --minutes)", bound=at_least(1))
    minutes: str | None = arg(None, help="time budget instead of --steps: 30, 90s, 30m or 1.5h; the steps are "
                              "planned from timed steps so warmup and the decay to zero end at the deadline "
                              "(--resume keeps the plan)")
    batch_size: int | None = arg(None, help="global batch size in sequences (recipe: the paper's 256)",
                                 bound=at_least(1))
    micro_batch_size: int | None = arg(None, help="sequences per forward pass per process; gradients are "
                                       "accumulated up to --batch-size (default: batch size / processes)",
                                       bound=at_least(1))
    lr: float | None = arg(None, help="peak learning rate (recipe)", bound=POSITIVE)
    warmup_steps: int | None = arg(None, help="linear warmup steps, then linear decay to zero (recipe: 1%% of the "
                                   "steps, as the paper's 10,000 of 1M; budget 6%%)", bound=at_least(0))
    betas: list[float] | None = arg(None, metavar="B", help="Adam's beta1 beta2 (recipe: 0.9 0.999)",
                                    bound=FRACTION)
    weight_decay: float | None = arg(None, help="AdamW weight decay, not on biases and LayerNorm (recipe: 0.01)",
                                    bound=at_least(0))
    optimizer: str = arg("adamw", help="adamw, or lamb for large batches", choices=["adamw", "lamb"])
    mask_prob: float | None = arg(None, help="share of positions masked for MLM (recipe: 0.15)",
                                 bound=PROBABILITY.because("a masking rate that masks nothing or everything "
                                                           "teaches nothing"))
    nsp: bool | None = arg(None, help="next-sentence prediction; --no-nsp makes single-segment instances that fill "
                           "the sequence (recipe: on)")
    dropout: float | None = arg(None, help="dropout while pretraining; the saved model keeps its config's for "
                                "fine-tuning (recipe: the config's 0.1)", bound=FRACTION)
    pre_ln: bool | None = arg(None, help="pre-LayerNorm layers for a new model; transformers cannot load them "
                              "(recipe: off)")
    max_seq_len: int | None = arg(None, help="sequence length (default: the one the data was prepared for)",
                                  bound=MIN_SEQ_LEN)
    max_predictions_per_seq: int | None = arg(None, help="masked positions per sequence at most "
                                              "(default: the paper's 20 at length 128, 80 at 512)", bound=at_least(1))
    short_seq_prob: float = arg(0.1, help="share of instances with a random shorter target length",
                                 bound=Bound(lo=0, hi=1))
    whole_word_mask: bool = arg(False, help="mask all WordPieces of a word together")
    dupe_factor: int | None = arg(None, help="static masking with this many mask copies (default: dynamic)",
                                  bound=at_least(1))
    eval_every: int = arg(0, help="evaluate on the validation split every K steps (0: at the end only)",
                           bound=at_least(0))
    eval_batches: int = arg(20, help="validation batches per evaluation (0: no evaluation)", bound=at_least(0))
    save_every: int = arg(0, help="checkpoint every K steps (0: at the end only; also on Ctrl-C/SIGTERM)",
                           bound=at_least(0))
    keep_last: int = arg(3, help="checkpoints to keep", bound=at_least(1, "the last checkpoint is what --resume needs"))
    log_every: int = arg(10, help="write a metrics.jsonl line every K steps", bound=at_least(1))
    resume: bool = arg(False, help="continue exactly from the last checkpoint in --out")
    compile: bool = arg(False, help="torch.compile the encoder (dynamic shapes: one graph for every batch)")
    seed: int = seed_arg(12345, help="seed for initialisation, data order and masks")
    workers: int = arg(0, help="data loader worker processes (0: load in the training process)", bound=at_least(0))
    progress: bool = arg(True, help="show a progress bar (--no-progress: none; metrics.jsonl is written either way)")
    device: str | None = arg(None, help="cpu or cuda (default: cuda when available)")
    precision: str = precision_arg()
    config: str | None = arg(None, help="JSON file with any of these options (command-line values win)")


def pick(value, recipe_value):
    """An option's value: as given, or the recipe's when not given (None)."""
    return recipe_value if value is None else value


def pretrain_kwargs(args: PretrainArgs) -> dict:
    """The keyword arguments of `bertforge.train.pretrain.pretrain` for these options, the recipe's values
    filling what was not given; refuses impossible values."""
    from bertforge.train.budget import parse_minutes
    from bertforge.train.loop import LoopConfig
    from bertforge.train.pretrain import DataOptions
    from bertforge.train.recipe import default_warmup, get_recipe

    recipe = get_recipe(args.recipe)
    minutes = parse_minutes(args.minutes) if args.minutes is not None else None
    betas = tuple(pick(args.betas, recipe.betas))
    if len(betas) != 2:
        raise BertforgeError(f"--betas {' '.join(map(str, betas))}: give two numbers in [0, 1), e.g. 0.9 0.98")
    dropout = pick(args.dropout, recipe.dropout)
    if minutes is not None:  # the steps are planned later; 1000 only stands in for them until then
        steps, warmup_fraction = 1000, None if args.warmup_steps is not None else recipe.warmup_fraction
    else:
        steps, warmup_fraction = args.steps, None
    loop = LoopConfig(steps=steps, batch_size=pick(args.batch_size, recipe.batch_size),
                      micro_batch_size=args.micro_batch_size, lr=pick(args.lr, recipe.lr),
                      warmup_steps=pick(args.warmup_steps, default_warmup(recipe, steps)),
                      weight_decay=pick(args.weight_decay, recipe.weight_decay), betas=betas,
                      optimizer=args.optimizer, eval_every=args.eval_every, save_every=args.save_every,
                      keep_last=args.keep_last, log_every=args.log_every, seed=args.seed, compile=args.compile,
                      device=args.device, precision=args.precision, progress=args.progress)
    opts = DataOptions(short_seq_prob=args.short_seq_prob, masked_lm_prob=pick(args.mask_prob, recipe.mask_prob),
                       max_predictions_per_seq=args.max_predictions_per_seq, nsp=pick(args.nsp, recipe.nsp),
                       whole_word_mask=args.whole_word_mask, dupe_factor=args.dupe_factor, seed=args.seed,
                       eval_batches=args.eval_batches, num_workers=args.workers)
    return dict(data_dir=args.data, out_dir=args.out, model=args.model, loop=loop, data_options=opts,
                init=args.init, resume=args.resume, max_seq_len=args.max_seq_len, dropout=dropout,
                pre_layer_norm=pick(args.pre_ln, recipe.pre_layer_norm), minutes=minutes,
                warmup_fraction=warmup_fraction, recipe=recipe)


def run_pretrain(args: PretrainArgs) -> int:
    from bertforge.train.loop import TrainingInterrupted
    from bertforge.train.pretrain import pretrain

    args = merge_config_file(args, args.config)
    try:
        result = pretrain(**pretrain_kwargs(args))
    except TrainingInterrupted as e:
        print(str(e))
        return 130
    if os.environ.get("RANK", "0") != "0":  # under torchrun only rank 0 reports, as only it writes
        return 0
    if result.final_metrics:
        print("final: " + ", ".join(f"{k} {v:.4f}" for k, v in result.final_metrics.items()))
    print(f"model saved to {result.out_dir}")
    return 0


COMMANDS = [
    Command("pretrain", PretrainArgs, run_pretrain, help="pretrain BERT with masked-LM + next-sentence prediction",
            description=__doc__, trains=True),
]

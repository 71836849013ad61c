"""`bertforge pretrain`: MLM + NSP pretraining on prepared data.

    bertforge pretrain --data data/ --model mini --out runs/mini --steps 10000 --batch-size 256 \
        --micro-batch-size 32
    torchrun --nproc-per-node 2 -m bertforge pretrain --data data/ --model mini --out runs/mini ...

The paper's two phases: prepare the corpus twice (--max-seq-len 128 and 512), pretrain 90% of the steps on
the first, then start the second from the first's model with --init:

    bertforge pretrain --data data128/ --model base --out runs/p1 --steps 900000
    bertforge pretrain --data data512/ --init runs/p1 --out runs/p2 --steps 100000 --warmup-steps 0
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from bertforge.commands.base import Command, arg, precision_arg
from bertforge.errors import BertforgeError


@dataclass
class PretrainArgs:
    data: str = arg(help="prepared data directory (from `bertforge prepare`)")
    out: str = arg(help="run directory: checkpoints, metrics.jsonl, curves and the final model")
    model: str = arg("mini", help="preset (tiny, mini, small, medium, base, large) or a config.json")
    init: str | None = arg(None, help="start from this model directory's weights (e.g. phase 1 of 2)")
    steps: int = arg(10000, help="optimizer steps")
    batch_size: int = arg(256, help="global batch size in sequences (the paper: 256)")
    micro_batch_size: int | None = arg(None, help="sequences per forward pass per process; gradients are "
                                       "accumulated up to --batch-size (default: batch size / processes)")
    lr: float = arg(1e-4, help="peak learning rate")
    warmup_steps: int = arg(10000, help="linear warmup steps, then linear decay to zero")
    weight_decay: float = arg(0.01, help="AdamW weight decay (not on biases and LayerNorm)")
    optimizer: str = arg("adamw", help="adamw, or lamb for large batches", choices=["adamw", "lamb"])
    max_seq_len: int | None = arg(None, help="sequence length (default: the one the data was prepared for)")
    max_predictions_per_seq: int | None = arg(None, help="masked positions per sequence at most "
                                              "(default: 15%% of --max-seq-len)")
    whole_word_mask: bool = arg(False, help="mask all WordPieces of a word together")
    dupe_factor: int | None = arg(None, help="static masking with this many mask copies (default: dynamic)")
    eval_every: int = arg(0, help="evaluate on the validation split every K steps (0: at the end only)")
    eval_batches: int = arg(20, help="validation batches per evaluation")
    save_every: int = arg(0, help="checkpoint every K steps (0: at the end only; also on Ctrl-C/SIGTERM)")
    keep_last: int = arg(3, help="checkpoints to keep")
    log_every: int = arg(10, help="write a metrics.jsonl line every K steps")
    resume: bool = arg(False, help="continue exactly from the last checkpoint in --out")
    compile: bool = arg(False, help="use torch.compile")
    seed: int = arg(12345, help="seed for initialisation, data order and masks")
    workers: int = arg(0, help="data loader worker processes")
    device: str | None = arg(None, help="cpu or cuda (default: cuda when available)")
    precision: str = precision_arg()
    config: str | None = arg(None, help="JSON file with any of these options (command-line values win)")


def _merge_config_file(args: PretrainArgs) -> PretrainArgs:
    if args.config is None:
        return args
    try:
        values = json.loads(Path(args.config).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BertforgeError(f"cannot read --config {args.config}: {e}") from None
    defaults = PretrainArgs(data=args.data, out=args.out)
    known = {f.name for f in fields(PretrainArgs)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise BertforgeError(f"--config {args.config} has unknown options {unknown}; see bertforge pretrain --help")
    for key, value in values.items():
        if getattr(args, key) == getattr(defaults, key):  # not given on the command line
            setattr(args, key, value)
    return args


def run_pretrain(args: PretrainArgs) -> int:
    from bertforge.train.loop import LoopConfig, TrainingInterrupted
    from bertforge.train.pretrain import DataOptions, pretrain

    args = _merge_config_file(args)
    loop = LoopConfig(steps=args.steps, batch_size=args.batch_size, micro_batch_size=args.micro_batch_size,
                      lr=args.lr, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
                      optimizer=args.optimizer, eval_every=args.eval_every, save_every=args.save_every,
                      keep_last=args.keep_last, log_every=args.log_every, seed=args.seed, compile=args.compile,
                      device=args.device, precision=args.precision)
    opts = DataOptions(max_predictions_per_seq=args.max_predictions_per_seq, whole_word_mask=args.whole_word_mask,
                       dupe_factor=args.dupe_factor, seed=args.seed, eval_batches=args.eval_batches,
                       num_workers=args.workers)
    try:
        result = pretrain(args.data, args.out, model=args.model, loop=loop, data_options=opts, init=args.init,
                          resume=args.resume, max_seq_len=args.max_seq_len)
    except TrainingInterrupted as e:
        print(str(e))
        return 130
    if result.final_metrics:
        print("final: " + ", ".join(f"{k} {v:.4f}" for k, v in result.final_metrics.items()))
    print(f"model saved to {result.out_dir}")
    return 0


COMMANDS = [
    Command("pretrain", PretrainArgs, run_pretrain, help="pretrain BERT with masked-LM + next-sentence prediction",
            description=__doc__),
]

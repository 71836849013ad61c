"""`bertforge pretrain`: MLM + NSP pretraining on prepared data (or ELECTRA's, `--objective electra`).

    bertforge pretrain --data data/ --model mini --out runs/mini --steps 10000 --batch-size 256 \\
        --micro-batch-size 32
    bertforge pretrain --data data/ --model mini --out runs/budget --recipe budget --minutes 30
    torchrun --nproc-per-node 2 -m bertforge pretrain --data data/ --model mini --out runs/mini ...
    bertforge pretrain --data data/ --model mini --out runs/electra --objective electra --steps 10000

The paper's two phases: prepare the corpus twice (--max-seq-len 128 and 512), pretrain 90% of the steps on
the first, then start the second from the first's model with --init:

    bertforge pretrain --data data128/ --model base --out runs/p1 --steps 900000
    bertforge pretrain --data data512/ --init runs/p1 --out runs/p2 --steps 100000 --warmup-steps 0
"""

from __future__ import annotations

import dataclasses
import os

from bertforge.commands.arguments import Command, command_args
from bertforge.options import DataOptions, ElectraOptions, LoopOptions, option, seed_option
from bertforge.pretrain.config import ModelSpec, ObjectiveSpec, StackingSpec
from bertforge.pretrain.recipe import RECIPE_OPTIONS, RECIPES


def recipe_note(field: str) -> str:
    """What each recipe gives an option, for its --help: "recipe: bert 0.0001, budget 0.002"."""
    def shown(value) -> str:
        if field == "warmup_fraction":
            return f"{value:.0%} of the steps"
        if isinstance(value, bool):
            return "on" if value else "off"
        if value is None:
            return "the model config's"
        if isinstance(value, str):
            return value
        return " ".join(map(str, value)) if isinstance(value, tuple) else f"{value:g}"

    return "recipe: " + ", ".join(f"{r.name} {shown(getattr(r, field))}" for r in RECIPES.values())


@command_args(ModelSpec, ObjectiveSpec, StackingSpec, LoopOptions, DataOptions, ElectraOptions,
              defaults={"steps": 10000}, optional={name: recipe_note(field) for name, field in RECIPE_OPTIONS.items()})
class PretrainArgs:
    """`bertforge pretrain`'s arguments: these, then the options of a `PretrainConfig`'s sections (the model, the
    objective, stacking, the loop, the data, ELECTRA's)."""

    data: str = option(help="prepared data directory (from `bertforge prepare`)")
    out: str = option(help="run directory: checkpoints, metrics.jsonl, curves and the final model")
    recipe: str = option("bert", choices=list(RECIPES),
                         help="defaults for the options marked (recipe: ...): bert, the paper's; budget, for small "
                              "compute (higher lr and masking rate, no NSP but a bag-of-words loss on [CLS], no "
                              "dropout while pretraining, pre-LN, stacking); an option given on the command line or "
                              "in --config wins over its recipe")
    minutes: str | None = option(None, help="time budget instead of --steps: 30, 90s, 30m or 1.5h; the steps are "
                                 "planned from timed steps so warmup and the decay to zero end at the deadline "
                                 "(--resume keeps the plan)")
    seed: int = seed_option(12345, help="seed for initialisation, data order and masks")
    resume: bool = option(False, help="continue exactly from the last checkpoint in --out")
    config: str | None = option(None, help="JSON file with any of these options, keyed by name (\"batch_size\": 32); "
                                "the command line wins over it")


def pretrain_config(args: PretrainArgs):
    """The `PretrainConfig` these arguments ask for: the options given (not None) over `--recipe`'s values
    (`bertforge.pretrain.recipe_config`), which refuses impossible combinations."""
    from bertforge.pretrain.recipe import recipe_config

    given = {name: value for name, value in dataclasses.asdict(args).items() if name not in ("recipe", "data", "out",
                                                                                          "config")}
    return recipe_config(args.recipe, data=args.data, out=args.out, **given)


def run_pretrain(args: PretrainArgs) -> int:
    from bertforge.pretrain.run import pretrain
    from bertforge.train.loop import TrainingInterrupted

    try:
        result = pretrain(pretrain_config(args))
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
    Command("pretrain", PretrainArgs, run_pretrain,
            help="pretrain BERT with masked-LM + next-sentence prediction, or as ELECTRA's discriminator",
            description=__doc__, keeps_freed_memory=True),
]

"""`bertforge demo`: the whole journey on public-domain demo data (see `bertforge.demo`)."""

from __future__ import annotations

from dataclasses import dataclass

from bertforge.commands.base import POSITIVE, Command, arg, at_least, seed_arg


@dataclass
class DemoArgs:
    out: str = arg("runs/demo", help="output directory (a re-run reuses finished stages)")
    minutes: float = arg(10.0, help="pretraining budget in minutes", bound=POSITIVE)
    corpus: list[str] = arg([], help="pretrain on your own text (files, directories, globs) instead")
    cache: str | None = arg(None, help="where fetched demo data is cached (default: ~/.cache/bertforge)")
    model: str = arg("mini", help="model preset to pretrain")
    recipe: str = arg("budget", choices=["budget", "bert"], help="pretraining recipe (see bertforge pretrain --help)")
    finetune_epochs: float = arg(2.0, help="fine-tuning epochs on Rotten Tomatoes", bound=POSITIVE)
    finetune_seeds: int = arg(3, help="fine-tuning runs per side (pretrained, random weights), one seed each",
                              bound=at_least(1))
    finetune_lr_pretrained: float = arg(1e-3, help="fine-tuning learning rate from the pretrained model",
                                        bound=POSITIVE)
    finetune_lr_scratch: float = arg(3e-4, help="fine-tuning learning rate from random weights", bound=POSITIVE)
    finetune_examples: int | None = arg(None, help="fine-tune on only the first N training reviews",
                                        bound=at_least(1))
    seed: int = seed_arg(12345)


def run(args: DemoArgs) -> int:
    from pathlib import Path

    from bertforge.demo import DemoOptions, run_demo

    run_demo(DemoOptions(out=Path(args.out), minutes=args.minutes, corpus=args.corpus or None,
                         cache=Path(args.cache) if args.cache else None, model=args.model, recipe=args.recipe,
                         finetune_epochs=args.finetune_epochs, finetune_seeds=args.finetune_seeds,
                         finetune_lr_pretrained=args.finetune_lr_pretrained,
                         finetune_lr_scratch=args.finetune_lr_scratch, finetune_examples=args.finetune_examples,
                         seed=args.seed))
    return 0


COMMANDS = [Command("demo", DemoArgs, run, help="the whole journey end to end on public-domain demo data",
                    description=__doc__, trains=True)]

"""`bertforge distill`: a small student trained on a fine-tuned teacher's outputs.

    bertforge distill --teacher runs/minilm-rt --student runs/tiny --task csv --data rt/ --out runs/tiny-rt
    bertforge distill --teacher runs/minilm-rt --student runs/tiny --task csv --data rt/ --out runs/tiny-rt \\
        --transfer-corpus reviews/ --max-transfer-texts 40000 --temperature 2 --epochs 3
    bertforge distill --teacher runs/sst2 --student mini --task sst2 --data glue/SST-2 --out runs/mini-sst2
    bertforge distill --teacher my-roberta-sst2/ --student runs/tiny --task sst2 --data glue/SST-2 --out runs/tiny-sst2
    bertforge distill --teacher runs/rt-seed0 runs/rt-seed1 runs/rt-seed2 --student runs/tiny ...   # their mean

The teacher is a fine-tuned model directory of the task (`bertforge finetune`'s --out), or a transformers sequence
classifier of any architecture (RoBERTa, MPNet, DeBERTa, ...; save_pretrained's directory, safetensors weights,
config.json's id2label naming the task's labels), which runs through transformers (`pip install
'bertforge[teachers]'`). The student is a pretrained model directory with its own tokenizer (it may differ from the
teacher's), or, for a bertforge teacher, a preset (tiny, mini, small, medium, base, large): random weights of that
size over the teacher's tokenizer. The teacher labels the task's training
examples, and the snippets of --transfer-corpus (unlabelled text in any form `prepare` reads; single-text tasks
only), once, on its fastest engine; its outputs are cached (--cache-dir), so a repeated or resumed run does not run
it again. The student learns T^2 KL at --temperature plus --alpha times the task's loss where an example has a
label. With several teachers of the same labels it learns the mean of their outputs, each teacher's cached on its
own. Its learning rate defaults to 5e-4, for small students (tiny, mini); give a larger one a lower --lr (1e-4).

The output is an ordinary fine-tuned model directory: `bertforge predict`, `evaluate`, `serve` and `export` take
it. An interrupted run continues from its last checkpoint with the same command and --resume, and under torchrun:

    torchrun --nproc-per-node 2 -m bertforge distill --teacher ... --student ... --task ... --data ... --out ...
"""

from __future__ import annotations

import os
import sys

from bertforge.commands.arguments import Command, command_args, options_from
from bertforge.commands.finetune import FinetuneArgs, resume_command, task_options
from bertforge.distill.config import DISTILL_LR, DistillConfig
from bertforge.options import DistillOptions, FinetuneOptions, option, same_as


@command_args(FinetuneOptions, DistillOptions, defaults={"lr": DISTILL_LR})
class DistillArgs:
    """`bertforge distill`'s arguments: these, then the options of FinetuneOptions and DistillOptions."""

    teacher: list[str] = option(help="the teacher: a fine-tuned model directory of the task (from `bertforge "
                                     "finetune`), or a transformers sequence classifier of any architecture whose "
                                     "id2label names the task's labels; several (of the same labels): the student "
                                     "learns the mean of their outputs")
    student: str = option(help="the student: a pretrained model directory with its tokenizer, or a preset (tiny, "
                               "mini, ...): random weights of that size over the teacher's tokenizer")
    task: str = same_as(FinetuneArgs, "task")
    data: str = option(help="the task's data directory (or file): its train split is distilled on, its dev split "
                            "picks the best student")
    out: str = option(help="output directory: the best student on dev, an ordinary fine-tuned model directory")
    transfer_corpus: list[str] = option([], help="unlabelled text for the teacher to label (files, directories, "
                                        "globs; .txt, .jsonl, .parquet, .arrow, compressed or not), cut into snippets "
                                        "the task's length; single-text classification and regression tasks")
    cache_dir: str | None = option(None, help="where the teacher's outputs and the chosen transfer sets are "
                                              "cached (default: ~/.cache/bertforge/teacher-outputs)")
    resume: bool = same_as(FinetuneArgs, "resume")
    text_column: str | None = same_as(FinetuneArgs, "text_column")
    text_pair_column: str | None = same_as(FinetuneArgs, "text_pair_column")
    label_column: str | None = same_as(FinetuneArgs, "label_column")
    regression: bool = same_as(FinetuneArgs, "regression")


def distill_config(args: DistillArgs) -> DistillConfig:
    """The run the command line asks for: its flags mapped to a DistillConfig, nothing more."""
    return DistillConfig(teacher=args.teacher[0], more_teachers=tuple(args.teacher[1:]), student=args.student,
                         task=args.task, data_dir=args.data, out_dir=args.out, task_options=task_options(args),
                         transfer=tuple(args.transfer_corpus), options=options_from(FinetuneOptions, args),
                         distill=options_from(DistillOptions, args), cache_dir=args.cache_dir, resume=args.resume)


def run_distill(args: DistillArgs) -> int:
    from bertforge.distill.run import distill
    from bertforge.train.loop import TrainingInterrupted

    config = distill_config(args)
    try:
        result = distill(config)
    except TrainingInterrupted as e:
        print(str(e), file=sys.stderr)
        print(f"to resume: {resume_command(args, 'distill')}", file=sys.stderr)
        return 130
    if os.environ.get("RANK", "0") != "0":  # under torchrun only rank 0 reports, as only it writes
        return 0
    teacher = result["teacher"]
    mean = f"the mean of {len(args.teacher)} teachers', " if len(args.teacher) > 1 else ""
    print(f"teacher outputs {teacher['outputs']} ({mean}{'from the cache' if teacher['cached'] else 'computed'}; "
          f"{teacher['transfer_texts']} transfer texts)")
    print(f"best dev (step {result['best_step']}): " + ", ".join(
        f"{k} {v:.2f}" for k, v in result["metrics"].items() if isinstance(v, (int, float))))
    print(f"model saved to {args.out}")
    return 0


COMMANDS = [
    Command("distill", DistillArgs, run_distill, help="train a small student on a fine-tuned teacher's outputs",
            description=__doc__, keeps_freed_memory=True),
]

"""`bertforge finetune` and `bertforge evaluate` (`bertforge predict` is in commands/infer.py).

    bertforge finetune --task sst2 --data glue/SST-2 --init runs/mini --out runs/sst2
    bertforge finetune --task csv --data reviews/ --text-column text --label-column label --init runs/mini \\
        --out runs/reviews --seeds 3
    bertforge evaluate --model runs/sst2 --data glue/SST-2 --split dev

An interrupted run (SIGTERM, SIGINT, a kill) continues from its last checkpoint with the same command and
--resume, and ends as the uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from dataclasses import dataclass
from typing import Any

from bertforge.bounds import at_least
from bertforge.commands.arguments import Command, check_output_file, command_args, options_from
from bertforge.finetune.config import FinetuneConfig
from bertforge.options import FinetuneOptions, option, windows_option


@command_args(FinetuneOptions)
class FinetuneArgs:
    """`bertforge finetune`'s arguments: these, then the options of FinetuneOptions."""

    task: str = option(help="cola sst2 mrpc qqp stsb mnli qnli rte wnli swag squad conll2003, or csv / jsonl for "
                            "your own data")
    data: str = option(help="the task's data directory in its official layout (or a file)")
    init: str = option(help="model directory to start from (pretrained BERT with its tokenizer)")
    out: str = option(help="output directory: the best model on dev, metrics.json, predictions")
    grid: bool = option(False, help="run the paper's grid (batch 16/32 x lr 5e-5/3e-5/2e-5 x epochs 2/3/4), keep "
                                    "the best on dev")
    resume: bool = option(False, help="continue an interrupted run from its last checkpoint (in <out>.partial/)")
    seeds: int = option(1, help="repeat with this many seeds and report mean and standard deviation",
                        bound=at_least(1, "each a fine-tuning run", at_most=1000))
    jobs: int = option(1, help="with --seeds or --grid: runs at a time, each in a process of its own on its share of "
                               "the CPU threads, its output in <its directory>.log (BERT-tiny's runs, 2 at a "
                               "time on 2 cores, ended 1.1-1.8x sooner; a larger model may gain nothing)",
                       bound=at_least(1, "runs at a time", at_most=64))
    text_column: str | None = option(None, help="csv/jsonl: column with the text (default: text)")
    text_pair_column: str | None = option(None, help="csv/jsonl: column with the second text of a pair")
    label_column: str | None = option(None, help="csv/jsonl: column with the label (default: label)")
    regression: bool = option(False, help="csv/jsonl: labels are numbers to predict (regression)")


def task_options(args) -> dict:
    options = {"text_column": args.text_column, "text_pair_column": args.text_pair_column,
               "label_column": args.label_column, "regression": args.regression or None}
    return {k: v for k, v in options.items() if v is not None}


def _print_metrics(title: str, metrics: dict) -> None:
    print(title + ": " + ", ".join(f"{k} {v:.2f}" for k, v in metrics.items() if isinstance(v, (int, float))))


def run_finetune(args: FinetuneArgs) -> int:
    from bertforge.train.loop import TrainingInterrupted

    try:
        return _finetune(args)
    except TrainingInterrupted as e:
        print(str(e), file=sys.stderr)
        print(f"to resume: {resume_command(args)}", file=sys.stderr)
        return 130


def resume_command(args: Any, command: str = "finetune") -> str:
    """The command line that continues this run of `command`: its arguments that are not the defaults, and
    --resume."""
    words = ["bertforge", command]
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if f.name == "resume" or (default is not dataclasses.MISSING and value == default):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            words.append(flag if value else "--no-" + flag[2:])
        else:
            words += [flag, *map(str, value)] if isinstance(value, list) else [flag, str(value)]
    return shlex.join([*words, "--resume"])


def finetune_config(args: FinetuneArgs) -> FinetuneConfig:
    """The run the command line asks for: its flags mapped to a FinetuneConfig, nothing more."""
    return FinetuneConfig(task=args.task, data_dir=args.data, init=args.init, out_dir=args.out,
                          task_options=task_options(args), options=options_from(FinetuneOptions, args),
                          resume=args.resume)


def _finetune(args: FinetuneArgs) -> int:
    from bertforge.finetune.run import finetune
    from bertforge.finetune.sweep import finetune_many
    from bertforge.progress import counted

    config = finetune_config(args)
    if args.grid or args.seeds > 1:
        report = finetune_many(config, grid=args.grid, seeds=args.seeds, jobs=args.jobs)
        for run in report["all"]:
            mean = ", ".join(f"{k} {v:.2f} ± {run['std'][k]:.2f}" for k, v in run["mean"].items())
            print(f"{run['settings'] or 'runs'}: {mean} (over {counted(len(run['runs']), 'seed')})")
        print(f"best settings: {report['best_settings'] or 'default'}")
        _print_metrics("best dev", report["metrics"])
    else:
        result = finetune(config)
        _print_metrics(f"best dev (step {result['best_step']})", result["metrics"])
    print(f"model saved to {args.out}")
    return 0


@dataclass
class EvaluateArgs:
    model: str = option(help="fine-tuned model directory (from `bertforge finetune`)")
    data: str = option(help="the task's data directory or file")
    split: str = option("dev", help="split to evaluate: dev, test (MNLI also dev_mismatched); a split without "
                                    "labels (GLUE's test files) gets predictions only")
    out: str | None = option(None, help="write metrics, example ids and predictions to this JSON file")
    batch_size: int = option(64, help="sequences per forward pass",
                             bound=at_least(1, "more than 2**20 sequences at once fit no device", at_most=2**20))
    device: str | None = option(None, help="cpu, cuda or cuda:N (default: cuda when available)")
    windows: int = windows_option()


def run_evaluate(args: EvaluateArgs) -> int:
    from bertforge.files import write_json
    from bertforge.tasks.runner import evaluate_examples, load_task_model

    check_output_file(args.out)
    tm = load_task_model(args.model, device=args.device)
    examples = tm.task.read(args.data, args.split)
    metrics, predictions = evaluate_examples(tm, examples, batch_size=args.batch_size, windows=args.windows)
    if metrics:
        _print_metrics(f"{tm.task.name} {args.split} ({len(examples)} examples)", metrics)
    else:
        print(f"{tm.task.name} {args.split} ({len(examples)} examples): no gold labels, predictions only"
              + ("" if args.out else "; pass --out FILE to save them"))
    if args.out:
        if hasattr(predictions, "tolist"):
            predictions = predictions.tolist()
        report = {"task": tm.task.name, "split": args.split, "data": args.data, "metrics": metrics,
                  "predictions": predictions}
        if isinstance(predictions, list):  # SQuAD's are already {question id: answer}
            report["ids"] = [ex.id for ex in examples]
        write_json(args.out, report)
        print(f"metrics and predictions written to {args.out}")
    return 0


COMMANDS = [
    Command("finetune", FinetuneArgs, run_finetune, help="fine-tune a pretrained model on a task",
            description=__doc__, keeps_freed_memory=True),
    Command("evaluate", EvaluateArgs, run_evaluate, help="score a fine-tuned model on a split",
            description=__doc__, keeps_freed_memory=True),
]

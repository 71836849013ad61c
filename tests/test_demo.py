"""`bertforge demo` end to end on a small slice of the demo data, and its reuse of finished stages."""

from __future__ import annotations

import csv
import dataclasses
import json
import re
import statistics
from pathlib import Path

import pytest
from simulated_clock import simulated_clock

from bertforge import cpu
from bertforge.demo import distill as demo_distill
from bertforge.demo import imdb as demo_imdb
from bertforge.demo import run as demo_module
from bertforge.demo.data import DemoData
from bertforge.demo.report import deploy_verdict, verdict
from bertforge.errors import BertforgeError
from bertforge.train.memory import keep_freed_memory


@pytest.fixture
def small_demo_data(tmp_path, shared_data, monkeypatch):
    # stands in for the IMDB reviews: the paragraphs of ten State of the Union addresses of the development data,
    # one record each (hundreds of documents, as the demo's 3% validation share needs)
    reviews = tmp_path / "reviews.jsonl"
    addresses = sorted((shared_data / "corpus" / "sotu").glob("19*.txt"))[:10]
    paragraphs = [p for f in addresses for p in f.read_text().split("\n\n") if p.strip()]
    reviews.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    task = tmp_path / "rt"
    task.mkdir()
    for split, rows in (("train", 200), ("dev", 60), ("test", 60)):
        lines = (shared_data / "tasks" / "rotten-tomatoes" / f"{split}.csv").read_text().splitlines(True)
        (task / f"{split}.csv").write_text("".join(lines[:rows + 1]))
    # stands in for the IMDB task: Rotten Tomatoes training snippets the task above does not use, as the wheel's rows
    # (label 0/1, source imdb), built into splits by the demo data's own code
    with open(shared_data / "tasks" / "rotten-tomatoes" / "train.csv", newline="") as f:
        rows = [{"text": r["text"], "label": "1" if r["label"] == "positive" else "0", "source": "imdb"}
                for r in list(csv.DictReader(f))[1000:1150]]
    labels = demo_imdb.read_reviews(rows, "fixture")
    demo_imdb.write_task(labels, demo_imdb.split_reviews(labels), tmp_path / "imdb")
    data = DemoData(reviews_file=reviews, sentiment_dir=task, imdb_dir=tmp_path / "imdb")
    monkeypatch.setattr("bertforge.demo.data.fetch_demo_data", lambda cache, progress=True: data)
    return data


@pytest.mark.slow
def test_demo_runs_end_to_end_and_reuses_finished_stages(small_demo_data, tmp_path, capsys, monkeypatch):
    out = tmp_path / "demo"
    monkeypatch.setattr(demo_module, "UNTUNED_SELECT_SEEDS", 1)  # the grid on one seed, then one more at its choice
    # the distillation stage's teacher starts from the demo's own pretrained tiny (MiniLM is 83 MB and slow to tune),
    # for one epoch, and labels a few hundred snippets of the corpus
    monkeypatch.setattr("bertforge.demo.data.fetch_teacher_model", lambda cache, progress=True: out / "pretrain")
    monkeypatch.setattr(demo_distill, "TEACHER_EPOCHS", 1.0)
    keep_freed_memory()  # as `bertforge demo` does before it runs: the budget's step timing assumes it
    # the pretrained side at the model's measured learning rate, random weights at one given on the command line
    options = demo_module.DemoOptions(out=out, minutes=0.3, model="tiny", vocab_size=2000, batch_size=4,
                                      finetune_examples=200, finetune_epochs=1, finetune_seeds=2,
                                      finetune_lr_scratch=3e-4, distill_seeds=2, transfer_texts=300,
                                      jobs=2, progress=False)
    with simulated_clock(0.3):  # the budget's logic runs on its own in tests/test_recipe.py, on the wall clock
        summary = demo_module.run_demo(options)
    text = capsys.readouterr().out
    for stage in ("1/7", "2/7", "3/7", "4/7", "5/7", "6/7", "7/7"):
        assert f"== {stage}" in text
    assert "pretraining MLM accuracy (val)" in text and "from random weights" in text and "helped by" in text
    # before pretraining, the steps the budget buys here (timed) against the steps that paid in our runs
    assert text.index("On this CPU 0.3 minutes buy about") < text.index("== 4/7")
    assert "(or --minutes auto) reaches them on this CPU" in text
    assert 0 < summary["budget"]["forecast_steps"] < summary["budget"]["pays_from_steps"]
    assert "from pretrained (lr 0.001, 1 epoch)" in text and "(lr 0.001, 1 epoch, 2 seeds)" in text
    assert "== 7/7 a bag-of-words baseline" in text
    # the baseline trains on the labelled snippets the fine-tunings saw (the first 200 rows of the file cut at
    # 200 lines, some rows spanning two) and is scored on the same test set
    with open(small_demo_data.sentiment_dir / "train.csv", newline="") as f:
        train_rows = sum(1 for _ in csv.DictReader(f))
    baseline = summary["bag_of_words"]
    assert 190 < train_rows <= 200 and baseline["train_examples"] == train_rows and 0 <= baseline["test"] <= 100
    assert re.search(rf"bag of words \(no language model\) +{baseline['test']:.1f}\n", text)
    assert set(summary["finetune"]) == {"pretrained", "scratch"}
    # the runs of a round went two at a time in worker processes, each one's output in a log beside its directory
    assert "4 fine-tunings, 2 at a time on " in text and "2 students, 2 at a time on " in text
    for run in ("finetune-pretrained/seed0", "finetune-scratch/seed1", "distill/seed1"):
        assert (out / run / "model.safetensors").is_file() and "accuracy" in (out / f"{run}.log").read_text()
    _check_untuned(summary, text, out, small_demo_data)
    _check_distilled(summary, text, out)
    assert options.model == demo_module.DemoOptions().model == "tiny"
    for name, lr in (("pretrained", demo_module.finetune_plan("tiny", 0.3)[1]), ("scratch", 3e-4)):
        side = summary["finetune"][name]
        assert side["lr"] == lr and side["epochs"] == 1
        assert [r["seed"] for r in side["runs"]] == [options.seed, options.seed + 1]
        assert all(0 <= r["test"] <= 100 for r in side["runs"])
        assert side["test_mean"] == pytest.approx(sum(r["test"] for r in side["runs"]) / 2)
    # the budget recipe stacks: 60% of the budget at half depth, then the full model
    plans = [json.loads((d / "budget_plan.json").read_text()) for d in (out / "pretrain" / "half-depth",
                                                                          out / "pretrain")]
    assert [p["minutes"] for p in plans] == pytest.approx([0.18, 0.12]) and min(p["steps"] for p in plans) >= 10
    # The corpus is the reviews file and the unlabelled snippets of the training movies, nothing of dev or test.
    manifest = json.loads((out / "data" / "manifest.json").read_text())
    assert manifest["inputs"]["files"] == 2 and manifest["settings"]["val_fraction"] == 0.03
    assert f"corpus: {small_demo_data.reviews_file}, {out / 'corpus' / 'movies.txt'}" in text
    movies = (out / "corpus" / "movies.txt").read_text()
    with open(small_demo_data.sentiment_dir / "dev.csv", newline="") as f:
        dev_texts = [row["text"] for row in csv.DictReader(f)]
    assert "A three-hour cinema master class." in movies and not any(t in movies for t in dev_texts)
    assert 0 <= summary["pretraining"]["mlm_accuracy"] <= 1
    assert len(summary["fill_mask"]) == len(demo_module.FILL_MASK_EXAMPLES)
    assert all(len(item["top"]) == 3 for item in summary["fill_mask"])
    report = (out / "report.md").read_text()
    assert "![pretraining](pretrain/training_curves.svg)" in report
    assert (out / "pretrain" / "training_curves.svg").is_file()
    assert json.loads((out / "summary.json").read_text())["finetune"] == summary["finetune"]
    # it ends with the command that serves the model its summary says to deploy (test_the_last_line_serves_the_
    # model_the_summary_says_to_deploy says which), a model directory that command can load, or says there is none
    last = text.rstrip().splitlines()[-1]
    assert last == demo_module.serve_command(out, summary)
    if "serve --model DIR" in last:  # no BERT above bag of words on this tiny run's figures
        assert "bag of words is above every one" in last
    else:
        assert (Path(last.rsplit("bertforge serve --model ", 1)[1]) / "task.json").is_file()

    before = {p: p.stat().st_mtime_ns for p in (out / "pretrain" / "model.safetensors",
                                                 out / "finetune-scratch" / "seed1" / "model.safetensors")}
    assert demo_module.run_demo(options)["finetune"] == summary["finetune"]
    again = capsys.readouterr().out
    assert again.count("reusing") == 3  # tokenizer, data, pretraining; fine-tunings read their scores back
    assert "at a time" not in again  # finished runs are read back in this process
    assert all(p.stat().st_mtime_ns == t for p, t in before.items())

    # a finished pretraining of another model or budget is refused, not reported as this run's; so is a finished
    # fine-tuning of other settings
    for change, named in (({"model": "mini"}, "not --model mini (L4/H256/A4/I1024)"),
                          ({"minutes": 30.0}, "a budget of 0.3 minutes, not --minutes 30"),
                          ({"finetune_epochs": 2.0}, f"{out / 'finetune-pretrained' / 'seed0'} holds another "
                                                     "fine-tuning (epochs 1, not 2): pass another --out, or remove "
                                                     f"{out / 'finetune-*'} to run it again"),
                          ({"finetune_examples": 100}, "seed0 holds another fine-tuning (training examples 200, "
                                                       "not 100)"),
                          ({"finetune_lr_scratch": 1e-3}, f"{out / 'finetune-scratch' / 'seed0'} holds another "
                                                          "fine-tuning (lr 0.0003, not 0.001)")):
        with pytest.raises(BertforgeError, match=re.escape(named)) as refused:
            demo_module.run_demo(dataclasses.replace(options, **change))
        assert "pass another --out, or remove" in str(refused.value)
    assert all(p.stat().st_mtime_ns == t for p, t in before.items())
    # nor a finished distillation of other settings (an earlier demo's, of other epochs)
    epochs = demo_distill.STUDENT_EPOCHS
    monkeypatch.setattr(demo_distill, "STUDENT_EPOCHS", epochs + 1)
    with pytest.raises(BertforgeError, match=re.escape(f"{out / 'distill' / 'seed0'} holds another distillation "
                                                       f"(epochs {epochs:g}, not {epochs + 1:g}): pass another --out")):
        demo_module.run_demo(options)
    monkeypatch.setattr(demo_distill, "STUDENT_EPOCHS", epochs)
    # nor are stages built from another corpus (an earlier demo's, whose corpus held the IMDB task's dev and test
    # reviews): its model would be scored on text it was pretrained on
    with open(small_demo_data.reviews_file, "a") as f:
        f.write(json.dumps({"text": "One more review."}) + "\n")
    with pytest.raises(BertforgeError, match=re.escape(f"{out} holds stages built from another corpus (2 files, ")):
        demo_module.run_demo(options)
    assert all(p.stat().st_mtime_ns == t for p, t in before.items())


def _check_distilled(summary: dict, text: str, out) -> None:
    """The distillation stage: the teacher fine-tuned and scored, a student distilled from it over the task and the
    corpus's snippets (the teacher's outputs cached), both models' speed, the rows and the verdict on what to deploy."""
    d = summary["distill"]
    assert d["student"]["transfer_texts"] == 300 and "learned from up to 300 snippets of the corpus" in text
    teacher = json.loads((out / "teacher" / "scores.json").read_text())
    assert d["teacher"]["test"] == teacher["test"]["accuracy"] and d["teacher"]["epochs"] == 1.0
    runs = d["student"]["runs"]
    scores = [json.loads((out / "distill" / f"seed{k}" / "scores.json").read_text()) for k in (0, 1)]
    assert [r["test"] for r in runs] == [s["test"]["accuracy"] for s in scores]
    assert d["student"]["test_mean"] == pytest.approx(statistics.mean(r["test"] for r in runs))
    assert [r["seed"] for r in runs] == [12345, 12346]
    record = json.loads((out / "distill" / "seed0" / "run_config.json").read_text())
    assert record["command"] == "distill" and (out / "distill" / "seed0" / "task.json").is_file()
    # the student trains as the demo pretrains: bf16 where the CPU has bf16 instructions, else training's default
    student_precision = "bf16" if cpu.has_native_bf16() else "auto"
    assert record["options"]["precision"] == d["student"]["precision"] == student_precision
    assert json.loads((out / "teacher" / "run_config.json").read_text())["options"]["precision"] == "auto"
    # labelled once (here, before the two students ran side by side), the task's and the corpus's texts
    assert sorted(p.name for p in (out / "teacher-outputs").iterdir()) == sorted([record["teacher"]["outputs"],
                                                                                 "transfer-sets"])
    assert len(list((out / "teacher-outputs" / "transfer-sets").iterdir())) == 1  # chosen once, read back by each
    assert all(json.loads((out / "distill" / f"seed{k}" / "run_config.json").read_text())["teacher"]["outputs"]
               == record["teacher"]["outputs"] for k in (0, 1))
    assert all(0 < d["texts_per_s"][k] < float("inf") for k in ("teacher", "student")) and d["speed_texts"] > 50
    assert "== 6/7 distil MiniLM-L6, fine-tuned on Rotten Tomatoes, into the pretrained BERT-tiny (2 seeds;" in text
    assert re.search(r"BERT-tiny distilled from it \(2 seeds\) +\d+\.\d ± \d+\.\d\n", text)
    # how the teacher's transfer set was chosen, as the README's tour says
    assert "transfer set: up to 300 snippets of the demo's corpus (--transfer-texts), those most like the task's " \
           "training snippets (--transfer-select task-like)" in text
    assert re.search(r"texts/s on this CPU, bag of words +[\d,]+\n", text)
    assert "Deploy " in text


def _check_untuned(summary: dict, text: str, out, data: DemoData) -> None:
    """The untuned task's part of the demo: each side tried both learning rates on its first seed, kept the one of
    the better dev accuracy (read here from the runs' own scores), ran its second seed at it; both reported."""
    untuned = summary["untuned"]
    assert untuned["title"] == "IMDB" and untuned["task_dir"] == str(data.imdb_dir)
    for name in ("pretrained", "scratch"):
        dev = {lr: json.loads((out / f"finetune-imdb-{name}-lr{lr:g}" / "seed0" / "scores.json").read_text())
               ["dev"]["accuracy"] for lr in demo_module.UNTUNED_LRS}
        best = max(demo_module.UNTUNED_LRS, key=dev.__getitem__)
        side = untuned["finetune"][name]
        assert side["lr"] == best and side["epochs"] == 1
        assert side["grid_dev"] == {f"{lr:g}": d for lr, d in dev.items()}
        assert [r["seed"] for r in side["runs"]] == [12345, 12346] and side["runs"][0]["dev"] == dev[best]
        assert (out / f"finetune-imdb-{name}-lr{best:g}" / "seed1" / "scores.json").is_file()
        others = [lr for lr in demo_module.UNTUNED_LRS if lr != best]
        assert not any((out / f"finetune-imdb-{name}-lr{lr:g}" / "seed1").exists() for lr in others)
        assert side["test_mean"] == pytest.approx(sum(r["test"] for r in side["runs"]) / 2)
    with open(data.imdb_dir / "train.csv", newline="") as f:
        assert untuned["bag_of_words"]["train_examples"] == sum(1 for _ in csv.DictReader(f)) > 50
    assert "IMDB (untuned) test accuracy, from pretrained" in text
    assert "IMDB (untuned) test accuracy, bag of words" in text
    assert "On IMDB, where no setting of ours was chosen, " in text
    # the pretrained embeddings' isotropy: the saved model's, equal to the last evaluation's in metrics.jsonl
    iso = summary["isotropy"]
    assert iso["pretrained"] == pytest.approx({k: summary["pretraining"][k] for k in iso["pretrained"]}, rel=1e-6)
    assert set(iso["pretrained"]) == set(iso["initial"]) == {"emb_cos_1000_2000", "emb_mean_unit_norm",
                                                              "emb_norm_mean"}
    assert re.search(r"word vectors' mean pair cosine, ids 1000-2000 \(at init\) +-?\d\.\d\d \(-?\d\.\d\d\)", text)


def _summary(pre: list[float], scratch: list[float], mlm: float, examples: int | None = None,
             minutes: float = 10.0, cpu_bf16: bool = False) -> dict:
    def side(runs):
        return {"runs": [{"test": t} for t in runs], "test_mean": statistics.mean(runs),
                "test_std": statistics.stdev(runs) if len(runs) > 1 else 0.0}
    return {"pretraining": {"mlm_accuracy": mlm}, "finetune": {"pretrained": side(pre), "scratch": side(scratch)},
            "finetune_examples": examples, "pretrain_minutes": minutes, "cpu_bf16": cpu_bf16}


def test_the_fine_tuning_plan_follows_the_measured_one_for_the_model_and_budget():
    # docs/experiments/finetuning-settings.md: tiny chose 1e-3 at two epochs on both sides; from 30 minutes of
    # pretraining on, four epochs at 3e-4 (dev's choice on both sides) paid more; mini chose 3e-4 at two epochs
    assert demo_module.finetune_plan("tiny", 10.0) == (2.0, 1e-3, 1e-3)
    assert demo_module.finetune_plan("tiny", 29.9) == (2.0, 1e-3, 1e-3)
    assert demo_module.finetune_plan("tiny", 30.0) == demo_module.finetune_plan("tiny", 60.0) == (4.0, 3e-4, 3e-4)
    assert demo_module.finetune_plan("mini", 30.0) == demo_module.finetune_plan("small", 10.0) == (2.0, 3e-4, 3e-4)


def test_the_verdict_weighs_the_difference_against_the_seeds_spread():
    # means 77 and 75, stds 1 and 1 over 3 seeds: 2 standard errors = 2 sqrt(2/3) = 1.63 < 2
    helped = verdict(_summary([76, 77, 78], [74, 75, 76], mlm=0.30))
    assert helped == ["Pretraining helped: +2.0 points, more than two standard errors of the difference (1.6)."]
    # the same means with stds 2 and 2: 2 standard errors = 3.27 > 2
    unclear = verdict(_summary([75, 77, 79], [73, 75, 77], mlm=0.30))
    assert unclear[0].startswith("The difference (+2.0 points) is within two standard errors (3.3)")
    assert "--model tiny" in unclear[1] and "--minutes 60" in unclear[1]
    worse = verdict(_summary([74, 74.5, 75], [76, 76.5, 77], mlm=0.30, examples=1000))
    assert worse[0] == "Random weights did better, by 2.0 points (two standard errors: 0.8)."
    assert "--model tiny" in worse[1]
    # a run of 60 minutes or more gets no advice to run for 60 minutes
    long = verdict(_summary([74, 74.5, 75], [76, 76.5, 77], mlm=0.30, minutes=60))
    assert long == ["Random weights did better, by 2.0 points (two standard errors: 0.8)."]
    # the advice quotes the figures of the CPU kind the demo ran on: twice the steps a minute with bf16
    assert "without bf16" in worse[1] and "--minutes 60" in worse[1]
    bf16 = verdict(_summary([74, 74.5, 75], [76, 76.5, 77], mlm=0.30, cpu_bf16=True))
    assert "with bf16" in bf16[1] and "--minutes 30" in bf16[1] and "--minutes 60" not in bf16[1]
    assert len(verdict(_summary([74, 74.5, 75], [76, 76.5, 77], mlm=0.30, minutes=30,
                                            cpu_bf16=True))) == 1
    plateau = verdict(_summary([75, 75.5, 76], [75, 76, 77], mlm=0.131))
    assert plateau[0].startswith("Pretraining ended on the masked-LM's early plateau (val MLM accuracy 13.1%")
    assert "--minutes 30" in plateau[0]
    # fewer labels are no help to a model still on the plateau: only the advice to pretrain longer
    assert plateau[1].startswith("The difference (-0.5 points) is within two standard errors") and len(plateau) == 2
    assert verdict(_summary([75], [74], mlm=0.3)) == [
        "Difference +1.0 points from one seed a side: no spread to judge it by (--finetune-seeds 3 or more)."]


def test_the_verdict_on_the_untuned_task_follows_the_first_tasks():
    s = _summary([76, 77, 78], [74, 75, 76], mlm=0.30)
    untuned = _summary([74, 74.5, 75], [76, 76.5, 77], mlm=0.30)["finetune"]
    lines = verdict({**s, "untuned": {"title": "IMDB", "finetune": untuned}})
    assert lines == verdict(s) + ["On IMDB, where no setting of ours was chosen, random weights did better, by 2.0 "
                                  "points (two standard errors: 0.8)."]
    # 2 sqrt(2/3) = 1.63: +2.0 stands out, +1.0 does not
    for pre, said in (([76, 77, 78], "pretraining helped: +2.0 points (two standard errors: 1.6)."),
                      ([75, 76, 77], "the difference (+1.0 points) is within two standard errors (1.6).")):
        u = _summary(pre, [74, 75, 76], mlm=0.30)["finetune"]
        assert verdict({**s, "untuned": {"title": "IMDB", "finetune": u}})[-1].endswith(said)


def test_the_untuned_task_says_where_bag_of_words_is_above_a_bert():
    s = _summary([76, 77, 78], [74, 75, 76], mlm=0.30)
    u = _summary([84, 85, 86], [80, 81, 82], mlm=0.30)["finetune"]
    imdb = {"title": "IMDB", "finetune": u, "bag_of_words": {"test": 87.25}}
    assert verdict({**s, "model": "tiny", "untuned": imdb})[-1] == (
        "On IMDB bag of words (87.2) is above BERT-tiny fine-tuned from the pretrained model (85.0) and from random "
        "weights (81.0): fine-tuned on the labels alone, BERT-tiny is not worth deploying there (distilled from a "
        "MiniLM-L6 fine-tuned on IMDB, BERT-tiny reached bag of words' level there in our runs: "
        "docs/distillation.md).")
    # only the rows below it are named, and the figure from our runs only for the model they measured
    between = {**imdb, "bag_of_words": {"test": 83.0}}
    assert verdict({**s, "model": "mini", "untuned": between})[-1] == (
        "On IMDB bag of words (83.0) is above BERT-mini fine-tuned from random weights (81.0): fine-tuned on the "
        "labels alone, BERT-mini is not worth deploying there.")
    # bag of words below both: nothing said of it
    lines = verdict({**s, "untuned": {**imdb, "bag_of_words": {"test": 80.0}}})
    assert lines[-1].startswith("On IMDB, where no setting of ours was chosen, pretraining helped")


def _deployable(teacher: float, student: list[float], direct: float, scratch: float, bow: float) -> dict:
    s = _summary([direct, direct], [scratch, scratch], mlm=0.30)
    return {**s, "model": "tiny", "bag_of_words": {"test": bow, "texts_per_s": 20000.0},
            "distill": {"teacher": {"test": teacher, "lr": 5e-5}, "texts_per_s": {"teacher": 300.0, "student": 6000.0},
                        "student": {"runs": [{"test": t} for t in student], "test_mean": statistics.mean(student),
                                    "test_std": statistics.stdev(student)}}}


def test_the_summary_says_which_model_to_deploy_and_where_bag_of_words_is_above_a_bert():
    # the first try: the distilled tiny above every other small model and bag of words, 97% of the teacher
    lines = deploy_verdict(_deployable(84.9, [82.1, 82.9], direct=78.2, scratch=75.4, bow=78.5))
    assert lines[0] == ("Bag of words (78.5) is above BERT-tiny fine-tuned on the labels alone (78.2), BERT-tiny from "
                        "random weights (75.4): those models are not worth deploying for this task.")
    assert lines[1] == ("Deploy the distilled BERT-tiny: 82.5 test accuracy, 97% of the teacher's 84.9 at 20x its "
                        "speed, +4.3 points over BERT-tiny fine-tuned on the labels alone and +4.0 over bag of words.")
    assert lines[2] == "Where 2.4 more points matter more than speed, serve the teacher (300 texts/s)."
    # a student no better than bag of words: the teacher, named with its speed, and the bag of words row said plainly
    lines = deploy_verdict(_deployable(84.9, [78.0, 78.4], direct=79.0, scratch=75.4, bow=78.5))
    assert lines[0].startswith("Bag of words (78.5) is above BERT-tiny distilled (78.2), BERT-tiny from random")
    assert lines[1] == ("Deploy the teacher MiniLM-L6 (84.9, 300 texts/s on this CPU): the distilled BERT-tiny did not "
                        "beat bag of words here.")
    # nothing above bag of words: bag of words
    assert deploy_verdict(_deployable(70.0, [69.0, 69.5], direct=68.0, scratch=66.0, bow=71.0))[-1] == \
        "Deploy bag of words (71.0): no BERT here beats it on this task."
    # the verdict follows the tasks' in the summary's sentences
    s = _deployable(84.9, [82.1, 82.9], direct=78.2, scratch=75.4, bow=78.5)
    assert verdict(s)[-3:] == deploy_verdict(s)
    assert verdict({**s, "untuned": {"title": "IMDB", "finetune": s["finetune"]}})[-4:-1] == deploy_verdict(s)
    # the transfer set's size with its flag, where the summary records it (one written before the flag does not)
    assert not any("--transfer-texts" in line for line in deploy_verdict(s))
    s["distill"]["student"]["transfer_texts"] = 40000
    assert deploy_verdict(s)[-1].startswith("The distilled BERT-tiny learned from up to 40,000 snippets of the corpus "
                                            "(--transfer-texts): where the corpus holds more, more kept paying")
    s["distill"]["student"]["blend_bag_of_words"] = True
    assert deploy_verdict(s)[-1].startswith("The distilled BERT-tiny learned from up to 40,000 snippets of the corpus "
                                            "(--transfer-texts) and a bag of words in its teacher "
                                            "(--blend-bag-of-words): where")


def test_the_last_line_serves_the_model_the_summary_says_to_deploy(tmp_path):
    def with_dev(side: dict, *dev: float) -> None:
        side["runs"] = [{**run, "dev": d} for run, d in zip(side["runs"], dev, strict=True)]

    serve = "(pip install 'bertforge[serve]'): bertforge serve --model "
    s = _deployable(84.9, [82.1, 82.9, 82.5], direct=78.2, scratch=75.4, bow=78.5)
    with_dev(s["distill"]["student"], 80.1, 80.7, 80.8)
    with_dev(s["finetune"]["pretrained"], 77.0, 78.5)
    # the distilled student, its seed best on dev (not on test)
    got = demo_module.serve_command(tmp_path, s)
    assert got == f"serve the distilled BERT-tiny {serve}{tmp_path / 'distill' / 'seed2'}"
    # the teacher, where the student is no better than bag of words
    s["distill"]["student"]["test_mean"] = 78.3
    assert demo_module.serve_command(tmp_path, s) == f"serve the teacher MiniLM-L6 {serve}{tmp_path / 'teacher'}"
    # no BERT above bag of words: no command, and why
    s["distill"]["teacher"]["test"] = 78.0
    assert demo_module.serve_command(tmp_path, s).startswith(
        "no BERT of this run to serve: bag of words is above every one on Rotten Tomatoes")
    # without the distillation stage: the pretrained side's fine-tuning where it is above bag of words
    del s["distill"]
    s["bag_of_words"]["test"] = 78.0
    assert demo_module.serve_command(tmp_path, s) == (
        f"serve BERT-tiny fine-tuned from the pretrained model {serve}{tmp_path / 'finetune-pretrained' / 'seed1'}")
    s["bag_of_words"]["test"] = 79.0
    assert demo_module.serve_command(tmp_path, s).startswith("no BERT of this run to serve")


def test_a_finished_distillation_is_read_back_only_under_the_settings_it_ran_with(tmp_path):
    """`check_reused_run` over a finished run's record: the same settings pass, another transfer selection or
    temperature or precision is refused in one line naming both values, and a run recorded before --transfer-select
    existed counts as the uniform sample it drew."""
    from bertforge.distill.config import DistillConfig
    from bertforge.options import DistillOptions, FinetuneOptions

    def want(precision="auto", **distill):
        return demo_distill.RunSettings(DistillConfig(
            teacher="t", student="s", task="csv", data_dir="d", out_dir=str(tmp_path),
            options=FinetuneOptions(lr=5e-4, epochs=3.0, seed=7, precision=precision),
            distill=DistillOptions(**distill)))

    recorded = dataclasses.asdict(FinetuneOptions(lr=5e-4, epochs=3.0, seed=7)) | dataclasses.asdict(DistillOptions())
    del recorded["transfer_select"]  # an older bertforge's record
    (tmp_path / "run_config.json").write_text(json.dumps({"command": "distill", "options": recorded}))
    (tmp_path / "scores.json").write_text(json.dumps({"dev": {}, "test": None, "seconds": 1.0}))
    demo_distill.check_reused_run(tmp_path, want(transfer_select="random"), "distillation", tmp_path)
    for change, named in (({"transfer_select": "task-like"}, "transfer selection random, not task-like"),
                          ({"transfer_select": "random", "temperature": 4.0}, "temperature 2, not 4"),
                          ({"transfer_select": "random", "precision": "bf16"}, "precision auto, not bf16")):
        with pytest.raises(BertforgeError, match=re.escape(f"{tmp_path} holds another distillation ({named}): pass "
                                                           f"another --out, or remove {tmp_path} to run it again")):
            demo_distill.check_reused_run(tmp_path, want(**change), "distillation", tmp_path)
    (tmp_path / "scores.json").unlink()  # an unfinished run is not read back, so not checked
    demo_distill.check_reused_run(tmp_path, want(transfer_select="task-like"), "distillation", tmp_path)


def test_an_interrupted_demo_says_how_to_go_on_in_one_line_not_a_traceback(monkeypatch, capsys):
    from bertforge.cli import main
    from bertforge.train.loop import TrainingInterrupted

    def interrupted(options):  # what a fine-tuning run raises on SIGINT, here or in a worker process (--jobs)
        raise TrainingInterrupted("interrupted; runs/demo/finetune-pretrained/seed0 was left as it was")

    monkeypatch.setattr(demo_module, "run_demo", interrupted)
    assert main(["demo", "--out", "runs/demo"]) == 130
    err = capsys.readouterr().err
    assert err.splitlines() == ["interrupted: the demo keeps what it finished and each interrupted run's checkpoint; "
                                "run the same command again to continue"]


def test_the_demo_blends_a_bag_of_words_into_its_teacher_when_asked(tmp_path, monkeypatch):
    """`bertforge demo --blend-bag-of-words` reaches every student's DistillOptions (off by default), and a finished
    student distilled without the blend is not read back as one distilled with it."""
    from bertforge.cli import main

    asked = []
    monkeypatch.setattr(demo_module, "run_demo", asked.append)
    assert main(["demo", "--transfer-texts", "400000", "--blend-bag-of-words", "--distill-seeds", "2"]) == 0
    assert main(["demo"]) == 0
    blended, plain = (demo_distill.student_configs(o, tmp_path, tmp_path / "teacher", tmp_path / "task",
                                                   ["corpus.txt"], tmp_path / "pretrain", "auto") for o in asked)
    assert [(c.distill.blend_bag_of_words, c.distill.max_transfer_texts) for c in blended] == [(True, 400_000)] * 2
    assert [c.options.seed for c in blended] == [12345, 12346] and blended[1].out_dir.endswith("seed1")
    assert not any(c.distill.blend_bag_of_words for c in plain) and len(plain) == 3
    seed0 = tmp_path / "distill" / "seed0"
    seed0.mkdir(parents=True)
    recorded = demo_distill.RunSettings(plain[0]).__dict__
    (seed0 / "run_config.json").write_text(json.dumps({"command": "distill", "options": recorded}))
    (seed0 / "scores.json").write_text(json.dumps({"dev": {}, "test": None, "seconds": 1.0}))
    demo_distill.check_reused_run(seed0, demo_distill.RunSettings(plain[0]), "distillation", tmp_path)
    named = "transfer texts 40000, not 400000; bag of words in the teacher False, not True)"
    with pytest.raises(BertforgeError, match=re.escape(named)):
        demo_distill.check_reused_run(seed0, demo_distill.RunSettings(blended[0]), "distillation", tmp_path)

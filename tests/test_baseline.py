"""The bag-of-words baseline: it learns what words tell, no more, on the labels it is given, and refuses what it
cannot classify with one clear error."""

from __future__ import annotations

import csv
import random

import pytest

from bertforge import baseline
from bertforge.baseline import bag_of_words
from bertforge.errors import BertforgeError

POSITIVE = ["wonderful", "moving", "brilliant", "charming", "superb"]
NEGATIVE = ["dull", "tedious", "clumsy", "bland", "dreadful"]
FILLER = ["the", "film", "plot", "actors", "story", "scene", "director", "cast", "script", "ending"]


def _write(path, rows, columns=("text", "label")):
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        writer.writerows(rows)


def _task(tmp_path, n_train=400, *, informative=True, pair=False, seed=0):
    """Snippets of filler words plus one sentiment word that gives the label away (or, with informative=False,
    labels drawn at random). With pair=True the telling word is in the second text only."""
    rng = random.Random(seed)
    task = tmp_path / "task"
    task.mkdir()
    for split, n in (("train", n_train), ("dev", 200), ("test", 200)):
        rows = []
        for _ in range(n):
            label = rng.choice(["positive", "negative"])
            word = rng.choice(POSITIVE if label == "positive" else NEGATIVE)
            if not informative:
                label = rng.choice(["positive", "negative"])
            filler = " ".join(rng.choices(FILLER, k=6))
            rows.append((filler, f"{filler} {word}", label) if pair else (f"{filler} {word} {filler}", label))
        _write(task / f"{split}.csv", rows, ("text", "second", "label") if pair else ("text", "label"))
    return task


def test_words_that_give_the_label_away_are_learnt(tmp_path):
    result = bag_of_words(_task(tmp_path))
    assert result["dev"] == 100.0 and result["test"] == 100.0
    assert result["train_examples"] == 400
    assert 0 < result["texts_per_s"] < float("inf")  # from text to label, the test split's 200 texts


def test_labels_that_no_word_tells_stay_near_chance(tmp_path):
    result = bag_of_words(_task(tmp_path, informative=False))
    assert 30 <= result["test"] <= 70  # 200 coin flips: chance within about four standard deviations


def test_only_the_first_training_examples_are_used(tmp_path):
    task = _task(tmp_path)
    # the first 4 training rows cannot name all ten sentiment words, so unseen ones are guessed from filler
    few = bag_of_words(task, max_train_examples=4)
    assert few["train_examples"] == 4 and few["test"] < 100.0
    assert bag_of_words(task, max_train_examples=400)["test"] == 100.0


def test_both_texts_of_a_pair_are_read(tmp_path):
    task = _task(tmp_path, pair=True)
    result = bag_of_words(task, task_options={"text_column": "text", "text_pair_column": "second"})
    assert result["test"] == 100.0


def test_without_test_only_dev_is_scored(tmp_path):
    task = _task(tmp_path)
    (task / "test.csv").unlink()
    assert set(bag_of_words(task, test=False)) == {"c", "train_examples", "dev", "texts_per_s"}


def test_what_it_cannot_classify_is_refused_in_one_line(tmp_path):
    task = _task(tmp_path)
    with pytest.raises(BertforgeError, match="classifies texts; task 'csv' is regression"):
        bag_of_words(task, task_options={"regression": True})
    with pytest.raises(BertforgeError, match="must be at least 1"):
        bag_of_words(task, max_train_examples=0)
    one_label = tmp_path / "one"
    one_label.mkdir()
    for split in ("train", "dev", "test"):
        _write(one_label / f"{split}.csv", [("a fine film", "positive"), ("a good film", "positive")])
    with pytest.raises(BertforgeError, match="every training example has the label 'positive'"):
        bag_of_words(one_label)
    unseen = tmp_path / "unseen"
    unseen.mkdir()
    _write(unseen / "train.csv", [("a fine film", "positive"), ("a dull film", "negative")])
    _write(unseen / "dev.csv", [("a fine film", "positive"), ("an odd film", "neutral")])
    _write(unseen / "test.csv", [("a fine film", "positive")])
    with pytest.raises(BertforgeError, match=r"dev\.csv:3: unknown label 'neutral' \(the task's labels: negative, "
                                             r"positive\); fix the label, or train with data that has it"):
        bag_of_words(unseen)


def test_its_speed_is_the_test_splits_texts_timed_as_every_models_speed_is(tmp_path, monkeypatch):
    timed = []

    def fake(run, items, warm_up=None):
        warm_up()
        timed.append((run(), items))
        return 123.0

    monkeypatch.setattr(baseline, "items_per_second", fake)
    assert bag_of_words(_task(tmp_path))["texts_per_s"] == 123.0
    (labels, items), = timed
    assert items == len(labels) == 200  # the run predicts every test text

"""SWAG multiple choice: official CSV columns, (C, T) features, decoding, accuracy, collate."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from bertforge import Tokenizer
from bertforge.errors import BertforgeError
from bertforge.tasks import collate, get_task

HEADER = ["", "video-id", "fold-ind", "startphrase", "sent1", "sent2", "gold-source",
          "ending0", "ending1", "ending2", "ending3", "label"]
ROWS = [
    ["0", "anetv_jkn6uvmqwh4", "3416", "Members of the procession walk down the street holding small horn brass "
     "instruments. A drum line", "Members of the procession walk down the street holding small horn brass "
     "instruments.", "A drum line", "gold", "passes by walking down the street playing their instruments.",
     "has heard approaching them.", "arrives and they're outside dancing and asleep.", "turns the lead singer "
     "watches the performance.", "0"],
    ["1", "lsmdc3001_21_JUMP_STREET-422", "16430", "Someone walks over to the radio. Someone", "Someone walks "
     "over to the radio.", "Someone", "gen", "hands her another phone.", "looks off, his face a mask of "
     "contempt.", "turns on the radio.", "is ringing the bell.", "2"],
]


@pytest.fixture(scope="module")
def tok(minilm_dir):
    return Tokenizer.from_pretrained(minilm_dir)


def _write(path: Path, header: list[str], rows: list[list[str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


@pytest.fixture
def swag_dir(tmp_path):
    _write(tmp_path / "train.csv", HEADER, ROWS)
    _write(tmp_path / "val.csv", HEADER, ROWS[::-1])
    _write(tmp_path / "test.csv", HEADER[:-1], [r[:-1] for r in ROWS])
    return tmp_path


def test_swag_reads_and_builds_choice_features(swag_dir, tok):
    task = get_task("swag")
    assert task.kind == "multiple_choice" and task.main_metric == "accuracy"
    train = task.read(swag_dir, "train")
    assert train[1].context == "Someone walks over to the radio."
    assert train[1].choices[2] == "Someone turns on the radio." and train[1].label == 2
    assert [ex.label for ex in task.read(swag_dir, "dev")] == [2, 0]
    assert all(ex.label is None for ex in task.read(swag_dir, "test"))
    features = task.features(train, tok, max_length=24)
    f = features[0]
    assert len(f["input_ids"]) == len(f["token_type_ids"]) == 4 and f["labels"] == 0
    for ids, types in zip(f["input_ids"], f["token_type_ids"], strict=True):
        assert ids[0] == tok.cls_id and ids[-1] == tok.sep_id and len(ids) <= 24
        assert types[-1] == 1 and len(types) == len(ids)
    batch = collate(features, tok.pad_id)
    B, C, T = batch["input_ids"].shape
    assert (B, C) == (2, 4) and batch["attention_mask"].shape == (B, C, T)
    assert batch["labels"].tolist() == [0, 2]
    assert batch["attention_mask"][0, 0].sum() == len(f["input_ids"][0])
    predictions = task.decode(train, features, [[0.0, 1.0, 0.5, 0.2], [0.1, 0.0, 3.0, 0.0]])
    assert predictions == [1, 2]
    assert task.metric(predictions, task.references(train)) == {"accuracy": 50.0}


def test_swag_errors(tmp_path):
    task = get_task("swag")
    with pytest.raises(BertforgeError, match=r"expected val\.csv or dev\.csv"):
        task.read(tmp_path, "dev")
    _write(tmp_path / "train.csv", HEADER[:-2] + ["label"], [r[:-2] + ["0"] for r in ROWS])
    with pytest.raises(BertforgeError, match=r"train\.csv:1: no column 'ending3'"):
        task.read(tmp_path, "train")
    bad = [list(ROWS[0])]
    bad[0][-1] = "7"
    _write(tmp_path / "train.csv", HEADER, bad)
    with pytest.raises(BertforgeError, match=r"train\.csv:2: label '7' is not a choice number 0-3"):
        task.read(tmp_path, "train")

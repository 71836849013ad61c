"""Your own CSV/JSONL data: columns by option, labels from the training file, regression, pairs, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bertforge import Tokenizer
from bertforge.errors import BertforgeError
from bertforge.tasks import get_task


@pytest.fixture(scope="module")
def tok(minilm_dir):
    return Tokenizer.from_pretrained(minilm_dir)


def _csv(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


REVIEWS = (
    "text,label,movie\n"
    "A three-hour cinema master class.,positive,a_grin_without_a_cat\n"
    '"Long, slow and, in the end, pointless.",negative,a_grin_without_a_cat\n'
    '"The actors don\'t inhabit their roles -- they\'re ""trapped"" by them.",negative,a_rumor_of_angels\n'
)


def test_csv_classification_like_rotten_tomatoes(tmp_path, tok):
    data = tmp_path / "rt"
    _csv(data / "train.csv", REVIEWS)
    _csv(data / "dev.csv", "text,label,movie\nA gorgeous, witty film.,positive,x\n".replace(
        "A gorgeous, witty film.", '"A gorgeous, witty film."'))
    _csv(data / "test.csv", "text,movie\nDull.,y\n")
    task = get_task("csv", text_column="text", label_column="label")
    train = task.read(data, "train")
    assert [ex.label for ex in train] == ["positive", "negative", "negative"]
    assert train[2].text == "The actors don't inhabit their roles -- they're \"trapped\" by them."
    assert train[1].source.endswith("train.csv:3")
    assert task.label_list(train) == ["negative", "positive"] and task.num_labels == 2
    dev = task.read(data, "dev")
    features = task.features(dev, tok, max_length=16)
    assert features[0]["labels"] == 1 and features[0]["input_ids"][0] == tok.cls_id
    test = task.read(data, "test")  # no label column: fine for prediction
    assert test[0].label is None and "labels" not in task.features(test, tok, 16)[0]
    predictions = task.decode(dev, features, [[-1.0, 1.0]])
    assert task.metric(predictions, task.references(dev)) == {"accuracy": 100.0, "macro_f1": 100.0}
    assert task.main_metric == "accuracy"


def test_rotten_tomatoes_development_data(shared_data, tok):
    task = get_task("csv")
    data = shared_data / "tasks" / "rotten-tomatoes"
    train = task.read(data, "train")
    assert len(train) == 10504 and task.label_list(train) == ["negative", "positive"]
    dev = task.read(data, "dev")
    assert len(dev) == 981
    features = task.features(dev[:50], tok, max_length=64)
    assert all(f["labels"] in (0, 1) and len(f["input_ids"]) <= 64 for f in features)


def test_jsonl_pairs_and_regression(tmp_path, tok):
    rows = [{"premise": "A man sleeps.", "hypothesis": "Someone rests.", "score": 4.5},
            {"premise": "A cat sits.", "hypothesis": "A dog runs.", "score": 0}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    task = get_task("jsonl", text_column="premise", text_pair_column="hypothesis", label_column="score",
                    regression=True)
    assert task.kind == "regression" and task.num_labels == 1 and task.main_metric == "pearson"
    examples = task.read(path, "dev")  # a file serves any split
    assert [ex.label for ex in examples] == [4.5, 0.0] and examples[0].text_pair == "Someone rests."
    features = task.features(examples, tok, max_length=32)
    assert features[1]["labels"] == 0.0 and 1 in features[0]["token_type_ids"]
    assert task.label_list(examples) is None


def test_jsonl_labels_given_and_numbers_sorted(tmp_path, tok):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"t{i}", "label": lab}) for i, lab in enumerate([10, 2, 1])))
    assert get_task("jsonl").label_list(get_task("jsonl").read(tmp_path, "train")) == ["1", "2", "10"]
    task = get_task("jsonl", labels=["10", "2", "1"])
    examples = task.read(tmp_path, "train")
    assert task.label_list(examples) == ["10", "2", "1"]
    assert [f["labels"] for f in task.features(examples, tok, 8)] == [0, 1, 2]


def test_custom_errors_name_file_line_and_fix(tmp_path, tok):
    task = get_task("csv", text_column="review")
    _csv(tmp_path / "train.csv", REVIEWS)
    with pytest.raises(BertforgeError, match=r"train\.csv:1: no column 'review' \(columns: text, label, movie\); "
                                             r"name the right one with text_column"):
        task.read(tmp_path, "train")
    with pytest.raises(BertforgeError, match="no column 'stars'"):
        get_task("csv", label_column="stars").read(tmp_path, "train")
    _csv(tmp_path / "dev.csv", "")
    with pytest.raises(BertforgeError, match=r"dev\.csv is empty"):
        get_task("csv").read(tmp_path, "dev")
    _csv(tmp_path / "dev.csv", "text,label\n")
    with pytest.raises(BertforgeError, match="has no examples"):
        get_task("csv").read(tmp_path, "dev")
    _csv(tmp_path / "dev.csv", "text,label\ngood,positive\nnew,neutral\n")
    trained = get_task("csv", labels=["negative", "positive"])
    dev = trained.read(tmp_path, "dev")
    with pytest.raises(BertforgeError, match=r"dev\.csv:3: unknown label 'neutral'"):
        trained.features(dev, tok, 16)
    _csv(tmp_path / "test.csv", "text,label\ngood,positive,extra\n")
    with pytest.raises(BertforgeError, match=r"test\.csv:2: 3 columns where the header has 2"):
        get_task("csv").read(tmp_path, "test")
    _csv(tmp_path / "train.csv", "text,label\ngood,\n")
    with pytest.raises(BertforgeError, match=r"train\.csv:2: empty label"):
        get_task("csv").read(tmp_path, "train")
    (tmp_path / "x.jsonl").write_text('{"text": "a", "label": "b"}\n{"text": "c", label}\n')
    with pytest.raises(BertforgeError, match=r"x\.jsonl:2: not valid JSON"):
        get_task("jsonl").read(tmp_path / "x.jsonl", "train")
    (tmp_path / "x.jsonl").write_text('{"text": "a", "label": "b"}\n{"sentence": "c", "label": "d"}\n')
    with pytest.raises(BertforgeError, match=r"x\.jsonl:2: no field 'text'"):
        get_task("jsonl").read(tmp_path / "x.jsonl", "train")
    _csv(tmp_path / "r.csv", "text,score\nfine,high\n")
    with pytest.raises(BertforgeError, match=r"r\.csv:2: 'score' is 'high', not a number"):
        get_task("csv", label_column="score", regression=True).read(tmp_path / "r.csv", "train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BertforgeError, match=r"no test file for task csv in .*: expected test\.csv or test\.tsv"):
        get_task("csv").read(tmp_path / "empty", "test")


def test_get_task_options():
    with pytest.raises(BertforgeError, match="unknown task 'glue'"):
        get_task("glue")
    with pytest.raises(BertforgeError, match="does not take text_column"):
        get_task("sst2", text_column="x")
    assert get_task("SST-2").name == "sst2"
    assert get_task("mnli", labels=["contradiction", "entailment", "neutral"]).num_labels == 3
    with pytest.raises(BertforgeError, match="differ from sst2's"):
        get_task("sst2", labels=["negative", "positive"])
    assert get_task("stsb", labels=None).num_labels == 1
    assert get_task("conll2003", labels=["O", "B-X"]).num_labels == 2
    assert get_task("squad").max_length == 384 and get_task("sst2").max_length == 128
    assert get_task("csv", text_pair_column=None).text_pair_column is None

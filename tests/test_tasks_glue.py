"""GLUE readers on fixture files in the official layout, features with a real tokenizer, errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from bertforge import Tokenizer
from bertforge.errors import BertforgeError
from bertforge.tasks import TASKS, collate, get_task


@pytest.fixture(scope="module")
def tok(minilm_dir):
    return Tokenizer.from_pretrained(minilm_dir)


def _write(path: Path, rows: list[list[str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")


MNLI_HEAD = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
             "sentence1_parse", "sentence2_parse", "sentence1", "sentence2"]
STSB_HEAD = ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2"]

# task -> {file: rows}; each labelled split has 2 examples; test files have the official test headers
FIXTURES: dict[str, dict[str, list[list[str]]]] = {
    "cola": {
        "train.tsv": [["gj04", "1", "", "Our friends won't buy this analysis, let alone the next one."],
                      ["gj04", "0", "*", "They drank the pub."]],
        "dev.tsv": [["clc95", "1", "", 'The sailors rode the breeze clear of the "rocks.'],
                    ["clc95", "0", "*", "The more does Bill smoke, the more Susan hates him."]],
        "test.tsv": [["index", "sentence"], ["0", "Bill whistled past the house."], ["1", "The car honked."]],
    },
    "sst2": {
        "train.tsv": [["sentence", "label"], ["hide new secretions from the parental units ", "0"],
                      ["that loves its characters ", "1"]],
        "dev.tsv": [["sentence", "label"], ["it 's a charming and often affecting journey . ", "1"],
                    ["unflinchingly bleak and desperate ", "0"]],
        "test.tsv": [["index", "sentence"], ["0", "uneasy mishmash of styles and genres ."],
                     ["1", "this film 's relationship to actual tension is the same as what christmas-tree "
                           "flocking in a spray can is to actual snow : a poor -- if durable -- imitation ."]],
    },
    "mrpc": {
        "train.tsv": [["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"],
                      ["1", "702876", "702977", "Amrozi accused his brother , whom he called \" the witness \" .",
                       "Referring to him as only \" the witness \" , Amrozi accused his brother ."],
                      ["0", "2108705", "2108831", "Yucaipa owned Dominick 's before selling the chain .",
                       "Yucaipa bought Dominick 's in 1995 for $ 693 million ."]],
        "dev.tsv": [["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"],
                    ["1", "1355540", "1355592", "He said the foodservice pie business doesn 't fit .",
                     "The foodservice pie business does not fit our long-term growth strategy ."],
                    ["0", "2029631", "2029565", "Magnarelli said Racicot hated the Iraqi regime .",
                     "His wife said he was \" 100 percent behind George Bush \" ."]],
        "test.tsv": [["index", "#1 ID", "#2 ID", "#1 String", "#2 String"],
                     ["0", "1089874", "1089925", "PCCW 's chief operating officer will be the chief .",
                      "Current Chief Operating Officer Mike Butcher will be the chief ."]],
    },
    "qqp": {
        "train.tsv": [["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
                      ["133273", "213221", "213222", "How is the life of a math student?",
                       "Which level of prepration is enough for the exam jlpt5?", "0"],
                      ["402555", "536040", "536041", "How do I control my horny emotions?",
                       "How do you control your horniness?", "1"]],
        "dev.tsv": [["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
                    ["201359", "303345", "303346", "Why are African-Americans so beautiful?",
                     "Why are hispanics so beautiful?", "0"],
                    ["263843", "69383", "380476", "I want to pursue PhD in Computer Science?",
                     "I handle social media for a non-profit. Should I try to get a PhD?", "1"]],
        "test.tsv": [["id", "question1", "question2"],
                     ["0", "Would the idea of Trump and Putin be good?", "What do you think of Trump and Putin?"]],
    },
    "stsb": {
        "train.tsv": [STSB_HEAD + ["score"],
                      ["0", "main-captions", "MSRvid", "2012test", "0001", "none", "none", "A plane is taking off.",
                       "An air plane is taking off.", "5.000"],
                      ["1", "main-captions", "MSRvid", "2012test", "0004", "none", "none",
                       "A man is playing a large flute.", "A man is playing a flute.", "3.800"]],
        "dev.tsv": [STSB_HEAD + ["score"],
                    ["0", "main-captions", "MSRvid", "2012test", "0000", "none", "none",
                     "A man with a hard hat is dancing.", "A man wearing a hard hat is dancing.", "5.000"],
                    ["1", "main-captions", "MSRvid", "2012test", "0002", "none", "none",
                     "A young child is riding a horse.", "A child is riding a horse.", "4.750"]],
        "test.tsv": [STSB_HEAD, ["0", "main-captions", "MSRvid", "2012test", "0024", "none", "none",
                                 "A girl is styling her hair.", "A girl is brushing her hair."]],
    },
    "qnli": {
        "train.tsv": [["index", "question", "sentence", "label"],
                      ["0", "When did the third Digimon series begin?",
                       "Unlike the two seasons before it, Digimon Tamers takes a darker approach.", "not_entailment"],
                      ["1", "Which missile batteries often have individual launchers?",
                       "When MANPADS is operated by specialists, batteries may have several launchers.",
                       "entailment"]],
        "dev.tsv": [["index", "question", "sentence", "label"],
                    ["0", "What came into force after the new constitution was herald?",
                     "As of that day, the new constitution heralding the Second Republic came into force.",
                     "entailment"],
                    ["1", "What is the first major city in the stream of the Rhine?",
                     "The most important tributaries in this area are the Ill below of Strasbourg.",
                     "not_entailment"]],
        "test.tsv": [["index", "question", "sentence"],
                     ["0", "What organization is devoted to Jihad against Israel?",
                      "For some decades prior to the First Palestine Intifada in 1987, the Muslim Brotherhood..."]],
    },
    "rte": {
        "train.tsv": [["index", "sentence1", "sentence2", "label"],
                      ["0", "No Weapons of Mass Destruction Found in Iraq Yet.",
                       "Weapons of Mass Destruction Found in Iraq.", "not_entailment"],
                      ["1", "A place of sorrow, after Pope John Paul II died, became a place of celebration.",
                       "Pope Benedict XVI is the new leader of the Roman Catholic Church.", "entailment"]],
        "dev.tsv": [["index", "sentence1", "sentence2", "label"],
                    ["0", "Dana Reeve, the widow of the actor Christopher Reeve, has died of lung cancer at age 44.",
                     "Christopher Reeve had an accident.", "not_entailment"],
                    ["1", "Yet, we now are discovering that antibiotics are losing their effectiveness.",
                     "Bacteria is winning the war against antibiotics.", "entailment"]],
        "test.tsv": [["index", "sentence1", "sentence2"],
                     ["0", "Mangla was summoned after Madhumita's sister Nidhi Shukla filed a complaint.",
                      "Shukla is related to Mangla."]],
    },
    "wnli": {
        "train.tsv": [["index", "sentence1", "sentence2", "label"],
                      ["0", "I stuck a pin through a carrot. When I pulled the pin out, it had a hole.",
                       "The carrot had a hole.", "1"],
                      ["1", "John couldn't see the stage with Billy in front of him because he is so short.",
                       "John is so short.", "0"]],
        "dev.tsv": [["index", "sentence1", "sentence2", "label"],
                    ["0", "The drain is clogged with hair. It has to be cleaned.", "The hair has to be cleaned.",
                     "0"],
                    ["1", "Jane knocked on Susan's door but she did not answer.", "Susan did not answer.", "1"]],
        "test.tsv": [["index", "sentence1", "sentence2"],
                     ["0", "Maude and Dora had seen the trains rushing across the prairie.", "Horses ran away."]],
    },
}

_MNLI_ROW = ["0", "31193", "31193n", "government", "( ( Conceptually ...", "( ( ( Product ...", "(ROOT ...",
             "(ROOT ...", "Conceptually cream skimming has two basic dimensions - product and geography.",
             "Product and geography are what make cream skimming work. "]
FIXTURES["mnli"] = {
    "train.tsv": [MNLI_HEAD + ["label1", "gold_label"], _MNLI_ROW + ["neutral", "neutral"],
                  _MNLI_ROW[:8] + ["you know during the season and i guess at at your level uh you lose them",
                                   "You lose the things to the following level if the people recall.",
                                   "entailment", "entailment"]],
    "dev_matched.tsv": [MNLI_HEAD + [f"label{i}" for i in range(1, 6)] + ["gold_label"],
                        _MNLI_ROW + ["neutral"] * 5 + ["neutral"],
                        _MNLI_ROW[:8] + ['The new "rights are nice enough', "Everyone really likes the newest benefits",
                                         "neutral", "entailment", "neutral", "neutral", "neutral", "neutral"]],
    "dev_mismatched.tsv": [MNLI_HEAD + [f"label{i}" for i in range(1, 6)] + ["gold_label"],
                           _MNLI_ROW + ["contradiction"] * 6,
                           _MNLI_ROW + ["entailment"] * 6],
    "test_matched.tsv": [MNLI_HEAD, _MNLI_ROW],
    "test_mismatched.tsv": [MNLI_HEAD, _MNLI_ROW],
}


def _glue_dir(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    for file, rows in FIXTURES[name].items():
        _write(d / file, rows)
    return d


def test_every_glue_task_is_registered():
    assert set(FIXTURES) <= set(TASKS)
    assert {"swag", "squad", "conll2003", "csv", "jsonl"} <= set(TASKS)


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_glue_reads_official_layout_and_builds_features(tmp_path, tok, name):
    task = get_task(name)
    data = _glue_dir(tmp_path, name)
    train = task.read(data, "train")
    assert len(train) == 2 and all(ex.label is not None for ex in train)
    dev_splits = ["dev", "dev_mismatched"] if name == "mnli" else ["dev"]
    test_splits = ["test", "test_mismatched"] if name == "mnli" else ["test"]
    for split in dev_splits:
        assert len(task.read(data, split)) == 2
    for split in test_splits:
        test = task.read(data, split)
        assert test and all(ex.label is None for ex in test)

    labels = task.label_list(train)
    if name == "stsb":
        assert task.kind == "regression" and labels is None and task.num_labels == 1
    else:
        assert task.kind == "classification" and task.num_labels == len(labels)
    features = task.features(train, tok, max_length=24)
    for ex, f in zip(train, features, strict=True):
        assert f["input_ids"][0] == tok.cls_id and f["input_ids"][-1] == tok.sep_id
        assert len(f["input_ids"]) == len(f["token_type_ids"]) <= 24
        if ex.text_pair is not None:
            assert f["token_type_ids"][-1] == 1
        if name == "stsb":
            assert isinstance(f["labels"], float) and f["labels"] == ex.label
        else:
            assert labels[f["labels"]] == ex.label
    test_features = task.features(test, tok, max_length=24)
    assert all("labels" not in f for f in test_features)


def test_glue_columns_and_labels(tmp_path):
    cola = get_task("cola").read(_glue_dir(tmp_path, "cola"), "dev")
    assert cola[0].text == 'The sailors rode the breeze clear of the "rocks.'  # stray quote kept as is
    assert [ex.label for ex in cola] == ["1", "0"]
    mrpc = get_task("mrpc").read(_glue_dir(tmp_path, "mrpc"), "train")
    assert mrpc[0].text.startswith("Amrozi") and mrpc[0].text_pair.startswith("Referring")
    assert mrpc[0].label == "1"
    stsb = get_task("stsb").read(_glue_dir(tmp_path, "stsb"), "train")
    assert [ex.label for ex in stsb] == [5.0, 3.8] and stsb[0].text_pair == "An air plane is taking off."
    mnli = get_task("mnli")
    dev = mnli.read(_glue_dir(tmp_path, "mnli"), "dev")
    assert dev[1].text == 'The new "rights are nice enough' and dev[1].label == "neutral"
    assert [ex.label for ex in mnli.read(tmp_path / "mnli", "dev_mismatched")] == ["contradiction", "entailment"]
    assert mnli.labels == ["contradiction", "entailment", "neutral"]
    qnli = get_task("qnli").read(_glue_dir(tmp_path, "qnli"), "test")
    assert qnli[0].id == "0" and qnli[0].text.startswith("What organization")
    qqp = get_task("qqp").read(_glue_dir(tmp_path, "qqp"), "train")
    assert qqp[1].id == "402555" and qqp[1].label == "1"


def test_glue_errors_name_file_and_fix(tmp_path, tok):
    sst2 = get_task("sst2")
    with pytest.raises(BertforgeError, match=r"no dev file .* expected dev\.tsv"):
        sst2.read(tmp_path, "dev")
    with pytest.raises(BertforgeError, match="has no split 'validation'"):
        sst2.read(tmp_path, "validation")
    with pytest.raises(BertforgeError, match="does not exist"):
        sst2.read(tmp_path / "nope", "train")
    _write(tmp_path / "train.tsv", [["text", "label"], ["good", "1"]])
    with pytest.raises(BertforgeError, match=r"train\.tsv:1: no column 'sentence'"):
        sst2.read(tmp_path, "train")
    (tmp_path / "dev.tsv").write_text("")
    with pytest.raises(BertforgeError, match="is empty"):
        sst2.read(tmp_path, "dev")
    _write(tmp_path / "test.tsv", [["sentence", "label"], ["good", "1"], ["bad"]])
    with pytest.raises(BertforgeError, match=r"test\.tsv:3: expected at least 2 tab-separated columns"):
        sst2.read(tmp_path, "test")
    _write(tmp_path / "test.tsv", [["sentence", "label"], ["fine", "1"], ["meh", "2"]])
    examples = sst2.read(tmp_path, "test")
    with pytest.raises(BertforgeError, match=r"test\.tsv:3: unknown label '2'"):
        sst2.features(examples, tok, max_length=16)
    stsb_dir = tmp_path / "stsb"
    _write(stsb_dir / "train.tsv", [STSB_HEAD + ["score"], ["0", "g", "f", "y", "o", "s", "s", "a", "b", "high"]])
    with pytest.raises(BertforgeError, match=r"train\.tsv:2: score 'high' is not a number"):
        get_task("stsb").read(stsb_dir, "train")


def test_glue_decode_and_metric_round_trip(tmp_path, tok):
    task = get_task("mrpc")
    dev = task.read(_glue_dir(tmp_path, "mrpc"), "dev")
    features = task.features(dev, tok, max_length=32)
    predictions = task.decode(dev, features, [[0.1, 2.0], [3.0, -1.0]])
    assert predictions == ["1", "0"]
    assert task.metric(predictions, task.references(dev)) == {"f1": 100.0, "accuracy": 100.0}
    stsb = get_task("stsb")
    rows = stsb.read(_glue_dir(tmp_path, "stsb"), "dev")
    assert stsb.decode(rows, stsb.features(rows, tok, 32), [[4.0], [1.0]]) == [4.0, 1.0]


def test_collate_pads_on_the_right(tmp_path, tok):
    task = get_task("rte")
    train = task.read(_glue_dir(tmp_path, "rte"), "train")
    features = task.features(train, tok, max_length=64)
    batch = collate(features, tok.pad_id)
    lengths = [len(f["input_ids"]) for f in features]
    assert batch["input_ids"].shape == (2, max(lengths))
    assert batch["attention_mask"].sum(dim=1).tolist() == lengths
    short = lengths.index(min(lengths))
    assert (batch["input_ids"][short, min(lengths):] == tok.pad_id).all()
    assert batch["labels"].tolist() == [f["labels"] for f in features]
    stsb = get_task("stsb")
    rows = stsb.read(_glue_dir(tmp_path, "stsb"), "train")
    labels = collate(stsb.features(rows, tok, 32), tok.pad_id)["labels"]
    assert labels.dtype.is_floating_point and labels.tolist() == pytest.approx([5.0, 3.8])


def test_sentence_features_are_the_full_encodings_ids_for_every_kind_of_text(tok):
    """Features take ids from the tokenizer's id path (a per-word cache); they must be exactly the full encodings'
    (offsets and all), truncation included, for plain ASCII, accented and bracketed text, singles and pairs."""
    from bertforge.tasks.base import ChoiceExample, TextExample
    from bertforge.tasks.features import choice_features, sequence_features

    texts = ["A gorgeous, witty film.", "Naïve and café-bound [but] fun", "tab\tand\nnewline", "x " * 40, ""]
    pairs = ["Is it good?", "non-ascii: éè", "[MASK] here", "y " * 40, "short"]
    for max_length in (8, 64):
        for with_pairs in (False, True):
            examples = [TextExample(id=str(i), text=t, text_pair=p if with_pairs else None, label="pos")
                        for i, (t, p) in enumerate(zip(texts, pairs, strict=True))]
            features = sequence_features(examples, tok, max_length, {"pos": 0})
            full = tok.encode_many(texts, pairs if with_pairs else None, max_length=max_length)
            assert [f["input_ids"] for f in features] == [e.ids for e in full]
            assert [f["token_type_ids"] for f in features] == [e.type_ids for e in full]
    choices = [ChoiceExample(id="0", context=texts[1], choices=pairs[:2], label=1)]
    full = tok.encode_many([texts[1]] * 2, pairs[:2], max_length=16)
    assert choice_features(choices, tok, 16)[0]["input_ids"] == [e.ids for e in full]

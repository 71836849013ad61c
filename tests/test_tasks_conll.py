"""CoNLL-2003: column files, first-sub-token labels, long sentences, decoding to words and entity spans."""

from __future__ import annotations

import pytest

from bertforge import Tokenizer
from bertforge.errors import BertforgeError
from bertforge.tasks import IGNORE_INDEX, collate, get_task
from bertforge.tokenizer import VocabOptions

# the original IOB1 files (eng.train) start like this
IOB1 = """-DOCSTART- -X- O O

EU NNP I-NP I-ORG
rejects VBZ I-VP O
German JJ I-NP I-MISC
call NN I-NP O
to TO I-VP O
boycott VB I-VP O
British JJ I-NP I-MISC
lamb NN I-NP O
. . O O

Peter NNP I-NP I-PER
Blackburn NNP I-NP I-PER

BRUSSELS NNP I-NP I-LOC
1996-08-22 CD I-NP O
"""

IOB2 = """-DOCSTART- -X- -X- O

SOCCER NN B-NP O
- : O O
JAPAN NNP B-NP B-LOC
GET VB B-VP O
LUCKY NNP B-NP O
WIN NNP I-NP O
, , O O
CHINA NNP B-NP B-PER
IN IN B-PP O
SURPRISE DT B-NP O
DEFEAT NN I-NP O
. . O O

Nadim NNP B-NP B-PER
Ladki NNP I-NP I-PER
"""


@pytest.fixture(scope="module")
def tok(minilm_dir):
    return Tokenizer.from_pretrained(minilm_dir)


@pytest.fixture
def conll_dir(tmp_path):
    (tmp_path / "train.txt").write_text(IOB2)
    (tmp_path / "valid.txt").write_text(IOB2)
    (tmp_path / "test.txt").write_text(IOB2)
    return tmp_path


def test_conll_reads_both_layouts(tmp_path, conll_dir):
    task = get_task("conll2003")
    assert task.kind == "token_classification" and task.main_metric == "f1"
    train = task.read(conll_dir, "train")
    assert len(train) == 2 and train[0].words[:3] == ["SOCCER", "-", "JAPAN"]
    assert train[0].tags[2] == "B-LOC" and train[1].tags == ["B-PER", "I-PER"]
    assert train[1].source.endswith("train.txt:16")
    assert len(task.read(conll_dir, "dev")) == len(task.read(conll_dir, "test")) == 2
    orig = tmp_path / "orig"
    orig.mkdir()
    for name in ("eng.train", "eng.testa", "eng.testb"):
        (orig / name).write_text(IOB1)
    for split in ("train", "dev", "test"):
        examples = task.read(orig, split)
        assert [len(ex.words) for ex in examples] == [9, 2, 2]
    assert task.label_list(task.read(orig, "train")) == ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC",
                                                          "B-MISC", "I-MISC"]
    assert task.num_labels == 9


def test_conll_other_tags_and_errors(tmp_path):
    (tmp_path / "train.txt").write_text("Paris NNP B-GPE\nis VBZ O\n\nBob NNP S-PER\n")
    task = get_task("conll2003")
    assert task.label_list(task.read(tmp_path, "train")) == ["O", "B-GPE", "S-PER"]
    (tmp_path / "valid.txt").write_text("Paris B-LOC\nbad\n")
    with pytest.raises(BertforgeError, match=r"valid\.txt:2: expected 'word \.\.\. tag' columns"):
        task.read(tmp_path, "dev")
    (tmp_path / "test.txt").write_text("-DOCSTART- -X- O O\n\n")
    with pytest.raises(BertforgeError, match=r"test\.txt has no sentences"):
        task.read(tmp_path, "test")
    (tmp_path / "valid.txt").unlink()
    with pytest.raises(BertforgeError, match=r"no dev file .*: expected valid\.txt or dev\.txt or eng\.testa"):
        task.read(tmp_path, "dev")


def test_first_sub_token_labels_and_decoding(conll_dir, tok):
    task = get_task("conll2003")
    train = task.read(conll_dir, "train")
    labels = task.label_list(train)
    features = task.features(train, tok, max_length=64)
    assert len(features) == 2
    for ex, f in zip(train, features, strict=True):
        ids, wids, labs = f["input_ids"], f["word_ids"], f["labels"]
        assert ids[0] == tok.cls_id and ids[-1] == tok.sep_id
        assert labs[0] == labs[-1] == IGNORE_INDEX and wids[0] is wids[-1] is None
        firsts = [p for p in range(len(ids)) if wids[p] is not None and wids[p] != wids[p - 1]]
        assert [wids[p] for p in firsts] == list(range(len(ex.words)))  # every word has a first sub-token
        assert [labels[labs[p]] for p in firsts] == ex.tags
        others = set(range(len(ids))) - set(firsts)
        assert all(labs[p] == IGNORE_INDEX for p in others)
    assert any(len(set(f["word_ids"][1:-1])) < len(f["word_ids"]) - 2 for f in features)  # some words split

    # decoding: logits that put the gold tag on every position give back the gold tags
    logits = []
    for f in features:
        rows = []
        for p, w in enumerate(f["word_ids"]):
            row = [0.0] * len(labels)
            tag = train[f["example_index"]].tags[w] if w is not None else "O"
            row[labels.index(tag) if p == 0 or w != f["word_ids"][p - 1] else 0] = 1.0
            rows.append(row)
        logits.append(rows)
    predicted = task.decode(train, features, logits)
    assert predicted == task.references(train)
    assert task.metric(predicted, task.references(train))["f1"] == 100.0
    batch = collate(features, tok.pad_id)
    assert batch["labels"].shape == batch["input_ids"].shape
    assert (batch["labels"][1, len(features[1]["input_ids"]):] == IGNORE_INDEX).all()
    import numpy as np  # padded (N, T, L) logits decode the same

    padded = np.zeros((2, batch["input_ids"].shape[1], len(labels)))
    for i, rows in enumerate(logits):
        padded[i, : len(rows)] = rows
    assert task.decode(train, features, padded) == predicted


def test_long_sentences_split_at_word_boundaries(conll_dir, tok):
    task = get_task("conll2003")
    train = task.read(conll_dir, "train")
    task.label_list(train)
    features = task.features(train, tok, max_length=8)  # 6 tokens per piece
    assert len(features) > 2
    seen: dict[int, list[int]] = {0: [], 1: []}
    for f in features:
        assert len(f["input_ids"]) <= 8 and f["input_ids"][0] == tok.cls_id and f["input_ids"][-1] == tok.sep_id
        words = [w for w in f["word_ids"] if w is not None]
        seen[f["example_index"]].extend(dict.fromkeys(words))
    for i, ex in enumerate(train):
        assert seen[i] == list(range(len(ex.words)))  # every word once, in order, none cut across pieces
    # a word longer than a piece is cut inside; its label stays on its first sub-token only
    long_word = task.example("Supercalifragilisticexpialidocious")
    long_word.tags = ["O"]
    pieces = task.features([long_word], tok, max_length=4)
    assert len(pieces) > 1
    assert sum(lab != IGNORE_INDEX for f in pieces for lab in f["labels"]) == 1


def test_entities_from_raw_text(tok):
    task = get_task("conll2003")
    task.label_list([])
    text = "Angela Merkel visited  Paris, France."
    example = task.example(text)
    assert example.words == ["Angela", "Merkel", "visited", "Paris", ",", "France", "."]
    tags = ["B-PER", "I-PER", "O", "B-LOC", "O", "I-LOC", "O"]
    assert task.entities(example, tags) == [
        {"type": "PER", "start": 0, "end": 13, "text": "Angela Merkel"},
        {"type": "LOC", "start": 23, "end": 28, "text": "Paris"},
        {"type": "LOC", "start": 30, "end": 36, "text": "France"},
    ]
    features = task.features([example], tok, max_length=32)
    assert "labels" not in features[0] and task.decode([example], features, [[[0.0] * 9] * 32]) == [["O"] * 7]


def test_first_sub_token_labels_with_a_tiny_cased_vocab(tmp_path):
    (tmp_path / "corpus.txt").write_text(IOB2 + IOB1)
    tiny = Tokenizer.train(tmp_path / "corpus.txt", VocabOptions(vocab_size=80, lowercase=False), show_progress=False)
    (tmp_path / "train.txt").write_text(IOB1)
    task = get_task("conll2003")
    train = task.read(tmp_path, "train")
    labels = task.label_list(train)
    features = task.features(train, tiny, max_length=10)
    tags: dict[int, list[str]] = {i: [] for i in range(len(train))}
    for f in features:
        tags[f["example_index"]] += [labels[lab] for lab in f["labels"] if lab != IGNORE_INDEX]
    assert [tags[i] for i in range(len(train))] == [ex.tags for ex in train]

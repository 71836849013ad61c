"""The bag of words blended into the teacher (`bertforge.distill.bag_of_words`): its weight chosen on dev, the
teacher's outputs kept where the teacher is best, the bag of words' where the teacher knows nothing, and its
outputs on the training examples out of fold."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression

from bertforge.baseline import vectorizer
from bertforge.distill import bag_of_words
from bertforge.errors import BertforgeError
from bertforge.tasks import TextExample

LABELS = {"neg": 0, "pos": 1}
WORDS = [f"w{k}" for k in range(300)]


def _examples(n: int, seed: int, *, keyword: bool = True) -> list[TextExample]:
    """Texts of filler words, labelled by a keyword (good/bad) in each, or at random (keyword=False)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        positive = rng.random() < 0.5
        words = rng.sample(WORDS, 8) + ([("good" if positive else "bad")] if keyword else [])
        out.append(TextExample(id=str(i), text=" ".join(words), label="pos" if positive else "neg", source=f"row {i}"))
    return out


def _logits(examples: list[TextExample], right: bool) -> np.ndarray:
    """A teacher's logits: sure of the gold label (right), or the same for every label (knows nothing)."""
    if not right:
        return np.zeros((len(examples), 2), dtype=np.float32)
    return np.array([[0.0, 4.0] if e.label == "pos" else [4.0, 0.0] for e in examples], dtype=np.float32)


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64) - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def test_a_teacher_right_on_dev_is_kept_whole():
    train, transfer, dev = _examples(60, 0), _examples(40, 1), _examples(30, 2)
    logits, record = bag_of_words.blended(_logits(train + transfer, True), _logits(dev, True), LABELS,
                                          (train, transfer, dev))
    assert record["weight"] == 1.0 and record["dev"]["teacher"] == record["dev"]["blend"] == 100.0
    np.testing.assert_allclose(logits, _log_softmax(_logits(train + transfer, True)), rtol=1e-6, atol=1e-6)


def test_a_teacher_that_knows_nothing_gives_way_to_the_bag_of_words():
    train, transfer, dev = _examples(80, 3), _examples(40, 4), _examples(30, 5)
    logits, record = bag_of_words.blended(_logits(train + transfer, False), _logits(dev, False), LABELS,
                                          (train, transfer, dev))
    # every weight under 1 ranks the labels as the bag of words does; of equals the most teacher is kept
    assert record["weight"] == 0.95 and record["dev"]["blend"] == record["dev"]["bag_of_words"] > 90.0
    assert record["dev"]["teacher"] == pytest.approx(100.0 * np.mean([e.label == "neg" for e in dev]))  # all "neg"
    gold = np.array([LABELS[e.label] for e in train + transfer])
    assert (logits.argmax(axis=1) == gold).mean() > 0.9  # the keyword, learnt from the labels


def test_the_training_examples_are_scored_out_of_fold():
    """With labels at random, a classifier fitted on all the training texts gives most of them back; scored out of
    fold it is at chance on them."""
    train = _examples(200, 6, keyword=False)
    y = np.array([LABELS[e.label] for e in train])
    texts = [e.text for e in train]
    words = vectorizer()
    recalled = (LogisticRegression(C=100.0, max_iter=5000).fit(words.fit_transform(texts), y)
                .predict(words.transform(texts)) == y).mean()
    out_of_fold = (bag_of_words._out_of_fold(texts, y, 100.0, 2).argmax(axis=1) == y).mean()
    assert recalled > 0.95 and out_of_fold < 0.7


def test_a_task_the_bag_of_words_cannot_classify_is_refused_in_one_line():
    with pytest.raises(BertforgeError, match="--blend-bag-of-words: stsb is a regression task"):
        bag_of_words.check_task(SimpleNamespace(kind="regression", name="stsb"))
    one = _examples(1, 7)
    with pytest.raises(BertforgeError, match="two examples or more of each of two labels"):
        bag_of_words.blended(_logits(one, True), _logits(one, True), LABELS, (one, [], one))

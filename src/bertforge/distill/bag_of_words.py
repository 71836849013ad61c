"""A bag of words blended into the teacher (`--blend-bag-of-words`).

A fine-tuned transformer and a bag of words err differently: one reads phrasing and context, the other counts the
task's telling words. Their blend, w x log p(teacher) + (1 - w) x log p(bag of words), is a better teacher than
either on a sentiment task (on Rotten Tomatoes 84.3 on test against the MiniLM teacher's 82.5 and the bag of words'
77.6), and a student that learns it over a large transfer set gains from it (docs/experiments/distillation.md).
The student is still only a BERT: the bag of words is part of the teacher, not of the model deployed.

The bag of words is `bertforge.baseline`'s classifier (TF-IDF words and word pairs, logistic regression with its C
chosen on dev), fitted on the task's training examples. On those examples its outputs are out of fold, each fifth
scored by a classifier fitted on the other four: the blend there is what the classifier makes of text it has not
seen, as on the transfer set, not the labels it was fitted on read back. The weight w is chosen on dev in steps of
0.05 (of equals, the most teacher). Classification only: a regression or a tagging has no bag-of-words classifier.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from bertforge.baseline import chosen_on_dev, classifier, texts_of, vectorizer
from bertforge.errors import BertforgeError
from bertforge.tasks.features import label_id

FOLDS = 5
WEIGHTS = tuple(round(0.05 * k, 2) for k in range(21))


def check_task(task: Any) -> None:
    """Refuse, in one line, a task the bag of words cannot classify."""
    if task.kind != "classification":
        raise BertforgeError(f"--blend-bag-of-words: {task.name} is a {task.kind.replace('_', ' ')} task and the bag "
                             "of words a classifier of texts: leave it out")


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def _log_probs(model: Any, x: Any, n_labels: int) -> np.ndarray:
    """The fitted classifier's log-probabilities of the features `x` over all `n_labels` (a label its training data
    lacked: about log 1e-6)."""
    out = np.full((x.shape[0], n_labels), np.log(1e-6))
    out[:, model.classes_] = model.predict_log_proba(x)
    return out


def _accuracy(log_probs: np.ndarray, labels: np.ndarray) -> float:
    return 100.0 * float((log_probs.argmax(axis=1) == labels).mean())


def _out_of_fold(texts: list[str], labels: np.ndarray, c: float, n_labels: int) -> np.ndarray:
    """Each training text's log-probabilities from a classifier fitted on the folds without it."""
    from sklearn.model_selection import StratifiedKFold

    counts = np.bincount(labels)
    folds = min(FOLDS, int(counts[counts > 0].min()))
    out = np.empty((len(texts), n_labels))
    for fit_on, scored in StratifiedKFold(folds, shuffle=True, random_state=0).split(np.zeros(len(labels)), labels):
        words = vectorizer()
        model = classifier(c).fit(words.fit_transform([texts[i] for i in fit_on]), labels[fit_on])
        out[scored] = _log_probs(model, words.transform([texts[i] for i in scored]), n_labels)
    return out


def blended(teacher: np.ndarray, teacher_dev: np.ndarray, label_map: dict,
            examples: tuple[Sequence, Sequence, Sequence]) -> tuple[np.ndarray, dict]:
    """The teacher's logits on the (training, transfer) examples blended with the bag of words', both as
    log-probabilities, w chosen on the dev examples (`teacher_dev`: the teacher's logits there), and what was chosen:
    {"weight", "c", "dev": {"teacher", "bag_of_words", "blend"} accuracies}."""
    train, transfer, dev = examples
    y, y_dev = (np.array([label_id(str(e.label), label_map, e.source) for e in split]) for split in (train, dev))
    counts = np.bincount(y)
    if (counts > 0).sum() < 2 or counts[counts > 0].min() < 2:
        raise BertforgeError("--blend-bag-of-words: the bag of words needs two examples or more of each of two labels "
                             "or more in the training data: leave it out")
    train_texts, dev_texts, n = texts_of(train), texts_of(dev), len(label_map)
    words = vectorizer()
    x_train, x_dev = words.fit_transform(train_texts), words.transform(dev_texts)
    c, model = chosen_on_dev(x_train, y.tolist(), x_dev, y_dev.tolist())
    bow_dev = _log_probs(model, x_dev, n)
    t_dev = _log_softmax(teacher_dev.astype(np.float64))
    accuracy, weight = max((_accuracy(w * t_dev + (1 - w) * bow_dev, y_dev), w) for w in WEIGHTS)
    bow_transfer = _log_probs(model, words.transform(texts_of(transfer)), n)
    bow = np.concatenate([_out_of_fold(train_texts, y, c, n), bow_transfer])
    logits = weight * _log_softmax(teacher.astype(np.float64)) + (1 - weight) * bow
    record = {"weight": weight, "c": c, "dev": {"teacher": _accuracy(t_dev, y_dev),
                                                "bag_of_words": _accuracy(bow_dev, y_dev), "blend": accuracy}}
    return logits.astype(np.float32), record


def described(record: dict) -> str:
    """What `blended` chose, in a line for the run's output."""
    dev = record["dev"]
    return (f"bag of words in the teacher: weight {record['weight']:.2f} on the teacher (C {record['c']:g}); dev "
            f"accuracy teacher {dev['teacher']:.2f}, bag of words {dev['bag_of_words']:.2f}, blend {dev['blend']:.2f}")

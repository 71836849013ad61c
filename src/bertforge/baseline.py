"""A bag-of-words baseline for text classification: what a pretrained model has to beat to be worth its minutes.

TF-IDF weights of the words and word pairs of each text (a sentence pair's two texts together), a logistic
regression on them, its regularisation strength chosen on dev. On short sentiment snippets such a classifier
scores about what a small BERT fine-tuned from random weights does (docs/experiments/baselines.md), so
it tells a user how much of a fine-tuned model's accuracy needs no language model at all.

    from bertforge.baseline import bag_of_words
    bag_of_words("rotten-tomatoes/")  # the demo's task: {"c": 30.0, "train_examples": 10504, "dev": 78.4, "test": 77.6,
                                      #                   "texts_per_s": ...}
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bertforge.errors import BertforgeError
from bertforge.tasks import get_task, metrics
from bertforge.tasks.features import label_id
from bertforge.timing import items_per_second

if TYPE_CHECKING:
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

# Inverse regularisation strengths tried on dev; the larger ones suit more training examples.
C_GRID = (0.3, 1.0, 3.0, 10.0, 30.0, 100.0)


def texts_of(examples: Sequence) -> list[str]:
    """What the bag of words reads of each example: its text, a pair's two texts joined."""
    return [e.text if e.text_pair is None else f"{e.text} {e.text_pair}" for e in examples]


def vectorizer() -> TfidfVectorizer:
    """The bag of words' features: TF-IDF of words and word pairs, lower-cased, sublinear counts."""
    from sklearn.feature_extraction.text import TfidfVectorizer  # here: 1.7 s to import, for this baseline alone

    return TfidfVectorizer(ngram_range=(1, 2), lowercase=True, sublinear_tf=True)


def classifier(c: float) -> LogisticRegression:
    """The bag of words' classifier at regularisation C (unfitted)."""
    from sklearn.linear_model import LogisticRegression

    return LogisticRegression(C=c, max_iter=5000)


def chosen_on_dev(x_train: Any, y_train: Sequence[int], x_dev: Any, y_dev: Sequence[int]
                  ) -> tuple[float, LogisticRegression]:
    """A logistic regression of the features `x_train` fitted at each C of C_GRID, and the one most accurate on dev
    with its C (of equals the first: the stronger regularisation)."""
    fitted = [(c, classifier(c).fit(x_train, y_train)) for c in C_GRID]
    return max(fitted, key=lambda cm: metrics.accuracy(cm[1].predict(x_dev).tolist(), list(y_dev)))


def bag_of_words(data: str | Path, *, task_name: str = "csv", task_options: dict | None = None,
                 max_train_examples: int | None = None, test: bool = True) -> dict:
    """Train on the task's train split (its first `max_train_examples` when given, as fine-tuning takes them),
    choose C on dev, and score accuracy (percent) on dev and, with `test`, on test."""
    task = get_task(task_name, **(task_options or {}))
    if task.kind != "classification":
        raise BertforgeError(f"the bag-of-words baseline classifies texts; task {task_name!r} is {task.kind}")
    train = task.read_train(data, max_train_examples)
    splits = {"dev": task.read(data, "dev"), **({"test": task.read(data, "test")} if test else {})}
    label_map = task.label_map()

    def gold(examples: Sequence) -> list[int]:  # an unknown label fails as in fine-tuning, naming its line
        return [label_id(str(e.label), label_map, e.source) for e in examples]

    words = vectorizer()
    x_train = words.fit_transform(texts_of(train))
    x = {name: words.transform(texts_of(examples)) for name, examples in splits.items()}
    y_train, y = gold(train), {name: gold(examples) for name, examples in splits.items()}

    c, model = chosen_on_dev(x_train, y_train, x["dev"], y["dev"])
    scores = {name: metrics.accuracy(model.predict(x[name]).tolist(), y[name]) for name in splits}
    last = splits.get("test") or splits["dev"]
    return {"c": c, "train_examples": len(train), **scores, "texts_per_s": _speed(words, model, texts_of(last))}


def _speed(vectorizer: TfidfVectorizer, model: LogisticRegression, texts: list[str]) -> float:
    """Texts a second from raw text to a label (the TF-IDF weights and the regression), measured as every model's
    speed is (`timing.items_per_second`)."""
    return items_per_second(lambda: model.predict(vectorizer.transform(texts)), len(texts),
                            warm_up=lambda: model.predict(vectorizer.transform(texts[:256])))

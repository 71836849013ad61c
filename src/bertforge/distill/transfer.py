"""The transfer set: unlabelled text cut into inputs the size of a task's, for the teacher to label.

A student learns most of what a teacher knows from the teacher's outputs on many inputs like the task's, far more
than the task's labelled examples (DistilBERT, "Well-Read Students Learn Better"). The corpus is read as `bertforge
prepare` reads it (`bertforge.corpus`: text files and directories, JSONL, Parquet and Arrow, compressed or
not), each document's sentences joined into snippets of up to `words` words (a longer sentence is cut into pieces
of that size), so a snippet reads like a single-text example of the task. Snippets are deduplicated (whitespace
aside) and the task's own texts left out; when there are more than `limit`, a uniform sample of them is kept
(reservoir sampling, seeded), in corpus order, so the same corpus and seed always give the same set.

A corpus is seldom all like the task: speeches beside reviews, or a review site's users retelling plots between
their verdicts where a critics' snippet task is all verdict. `most_like` keeps the snippets most like the task's own
texts (`--transfer-select task-like`; Moore and Lewis's selection of in-domain text, with a classifier in place of
their two language models): a logistic regression over TF-IDF words and word pairs learns to tell the task's
training texts from a sample of the snippets, and the snippets it scores highest are kept, so the teacher's labels go
to text of the task's kind (what it measured: docs/experiments/distillation.md).

Choosing the set reads the whole corpus and, task-like, scores ten times as many snippets (15-20 s for the demo's
40,000 of its reviews on a 2-core CPU): the set is stored once under the teacher outputs' cache (`cached_texts`),
named by what decides it (each corpus file's bytes, the task's texts, the settings), so the demo's seeds, a
`--resume` and a repeated run read it back; a changed file or setting is another entry.

Only single-text classification and regression tasks take a transfer set: a pair, choice or tagging task's inputs
have a structure that plain text does not (they distil on the task's own examples).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from bertforge.corpus import END, ReadStats, expand_inputs, plan_units, read_unit
from bertforge.errors import BertforgeError
from bertforge.files import file_sha256, write_text


def median_words(texts: Sequence[str]) -> int:
    """The median word count of `texts` (the task's training texts): the transfer snippets' default length."""
    counts = sorted(len(t.split()) for t in texts)
    return max(1, counts[len(counts) // 2]) if counts else 1


def documents(paths: Sequence[str], stats: ReadStats) -> Iterator[list[str]]:
    """Each document of the corpus `paths` as its sentences, in corpus order."""
    sentences: list[str] = []
    for unit in plan_units(expand_inputs(list(paths), stats), "auto", stats=stats):
        for sentence in read_unit(unit, stats):
            if sentence is END:
                if sentences:
                    yield sentences
                sentences = []
            else:
                sentences.append(sentence)
    if sentences:
        yield sentences


def snippets(sentences: Iterable[str], words: int) -> Iterator[str]:
    """One document's sentences joined, in order, into snippets of at most `words` words; a sentence longer than
    that is cut into pieces of `words` words."""
    held: list[str] = []
    for sentence in sentences:
        w = sentence.split()
        if held and len(held) + len(w) > words:
            yield " ".join(held)
            held = []
        while len(w) > words:
            yield " ".join(w[:words])
            w = w[words:]
        held += w
    if held:
        yield " ".join(held)


def _digest(text: str) -> bytes:
    return hashlib.blake2b(" ".join(text.split()).encode(), digest_size=12).digest()


def transfer_texts(paths: Sequence[str], *, words: int, limit: int, seed: int,
                   exclude: Iterable[str] = ()) -> list[str]:
    """The transfer set of the corpus `paths` (module docstring): at most `limit` distinct snippets of up to `words`
    words, none of them one of `exclude` (the task's texts), sampled by `seed` when there are more, in corpus
    order. A corpus with no text is refused in one line."""
    stats = ReadStats()
    seen = {_digest(t) for t in exclude}
    rng = random.Random(seed)
    kept: list[tuple[int, str]] = []
    n = 0
    for doc in documents(paths, stats):
        for text in snippets(doc, words):
            key = _digest(text)
            if key in seen:
                continue
            seen.add(key)
            if n < limit:
                kept.append((n, text))
            else:
                j = rng.randrange(n + 1)
                if j < limit:
                    kept[j] = (n, text)
            n += 1
    if not kept:
        raise BertforgeError(f"--transfer-corpus {' '.join(paths)} holds no text (besides the task's own): give "
                             "files of unlabelled text, or leave it out to distil on the task's examples alone")
    return [text for _, text in sorted(kept)]


# most_like: how many snippets (a sample of the candidates) the classifier learns to tell the task's texts from, and
# its regularization (sklearn's C): the one pair of values measured (30,000 against Rotten Tomatoes' 10,504 texts).
COMPARED_SNIPPETS = 30_000
SELECTION_C = 4.0


def most_like(task_texts: Sequence[str], candidates: Sequence[str], keep: int, *, seed: int) -> list[str]:
    """The `keep` snippets of `candidates` most like `task_texts` (module docstring), in their order; all of them
    when there are no more than `keep`. Deterministic for the same inputs and seed."""
    if len(candidates) <= keep:
        return list(candidates)
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    others = random.Random(seed).sample(list(candidates), min(len(candidates), COMPARED_SNIPPETS))
    docs = [*task_texts, *others]
    vectorizer = TfidfVectorizer(ngram_range=(1, 2), min_df=2 if len(docs) >= 1000 else 1, sublinear_tf=True)
    try:
        x = vectorizer.fit_transform(docs)
    except ValueError:  # no word in any text (numbers and punctuation alone): nothing to tell them apart by
        return [candidates[i] for i in sorted(random.Random(seed).sample(range(len(candidates)), keep))]
    y = np.r_[np.ones(len(task_texts)), np.zeros(len(others))]
    classifier = LogisticRegression(C=SELECTION_C, max_iter=2000).fit(x, y)
    score = classifier.decision_function(vectorizer.transform(candidates))
    best = np.sort(np.argsort(-score, kind="stable")[:keep])
    return [candidates[i] for i in best]


# The stored sets' format: one snippet a line (a snippet is whitespace-joined words, so it holds no newline). Raise
# it when the way a set is read or chosen changes, so that sets chosen the old way are not read back.
SELECTION_FORMAT = 1


def selection_key(paths: Sequence[str], task_texts: Sequence[str], settings: dict) -> str:
    """The name of a transfer set's cache entry: a hash of what decides it, each corpus file's name and bytes (read
    at disk speed, far faster than the corpus is parsed), the task's texts and `settings` (a JSON-able dict)."""
    files = [[f.name, file_sha256(f)] for f in expand_inputs(list(paths), ReadStats())]
    task = hashlib.sha256("\n".join(task_texts).encode()).hexdigest()
    decided = {"format": SELECTION_FORMAT, "files": files, "task_texts": task, "settings": settings}
    return hashlib.sha256(json.dumps(decided, sort_keys=True).encode()).hexdigest()[:32]


def cached_texts(entry: Path, make: Callable[[], list[str]]) -> list[str]:
    """The snippets stored at `entry`, else `make()`'s, stored there first (written whole or not at all)."""
    if entry.is_file():
        return entry.read_text(encoding="utf-8").split("\n")
    texts = make()
    write_text(entry, "\n".join(texts))
    return texts

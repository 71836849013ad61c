"""What every task shares: the example types, the `Task` interface, and the file helpers readers use.

A task turns files in their official layout into examples, examples into model features, model outputs back
into predictions, and predictions into scores:

    examples = task.read(data_dir, "train")
    labels = task.label_list(examples)                      # None for regression, QA, multiple choice
    features = task.features(examples, tokenizer, max_length=128)
    predictions = task.decode(examples, features, outputs)  # outputs: what the model's head returns
    scores = task.metric(predictions, task.references(examples))

Every example remembers where it came from (`source`, "file:line") so a bad label or a bad answer is
reported with its place in the file.
"""

from __future__ import annotations

import csv
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bertforge.errors import BertforgeError
from bertforge.files import open_text

KINDS = ("classification", "regression", "multiple_choice", "token_classification", "question_answering")
SPLITS = ("train", "dev", "test")
IGNORE_INDEX = -100  # the label of positions the loss skips (specials, non-first sub-tokens, padding)

csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # some task files have fields over the 128 KB default


@dataclass
class TextExample:
    """One sentence or sentence pair: classification (label is a label name) or regression (a float)."""

    id: str
    text: str
    text_pair: str | None = None
    label: str | float | None = None
    source: str = ""


@dataclass
class ChoiceExample:
    """A context and its candidate continuations; `label` is the index of the right one."""

    id: str
    context: str
    choices: list[str]
    label: int | None = None
    source: str = ""


@dataclass
class TaggedExample:
    """A sentence as words with one tag each. `text` holds the words and `spans` each word's (start, end)
    characters in it, so predicted entities come back as character offsets into `text`."""

    id: str
    words: list[str]
    tags: list[str] | None = None
    source: str = ""
    text: str = ""
    spans: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.text and self.words:
            spans, pos = [], 0
            for word in self.words:
                spans.append((pos, pos + len(word)))
                pos += len(word) + 1
            self.text, self.spans = " ".join(self.words), spans


@dataclass
class QAExample:
    """A SQuAD question. `answers` are all the ground-truth texts; `answer_start`/`answer_text` locate the
    first one in `context` (None when it is not known, e.g. a question asked at prediction time)."""

    id: str
    question: str
    context: str
    answers: list[str] = field(default_factory=list)
    answer_start: int | None = None
    answer_text: str | None = None
    title: str = ""
    source: str = ""


Example = TextExample | ChoiceExample | TaggedExample | QAExample
Feature = dict[str, Any]


class Task:
    """The interface the training loop and the commands use; see the module docstring for the flow.

    name         registry name (`sst2`, `squad`, `csv`, ...)
    kind         one of KINDS; decides the model head
    main_metric  the key of `metric()` that picks the best checkpoint (always higher-is-better)
    labels       label names, in id order, once known: fixed by the task (GLUE), given with
                 `get_task(..., labels=[...])`, or taken from the training data by `label_list(examples)`
    splits       the split names `read` accepts
    max_length   the usual sequence length for the task

    Each kind also has `example(...)`, which builds an unlabelled example for `predict`:
    classification/regression `example(text, text_pair=None)`, multiple choice `example(context, choices)`,
    token classification `example(text)`, question answering `example(question, context)`.
    """

    name: str = ""
    kind: str = ""
    main_metric: str = ""
    splits: tuple[str, ...] = SPLITS
    max_length: int = 128  # the usual sequence length for the task (SQuAD: 384)

    def __init__(self, labels: Sequence[str] | None = None):
        self.labels: list[str] | None = list(labels) if labels is not None else None

    # --- reading ---
    def read(self, data_path: str | Path, split: str) -> list[Example]:
        raise NotImplementedError

    def read_train(self, data_path: str | Path, max_examples: int | None = None) -> list[Example]:
        """The train split to learn from: its first `max_examples` when given (--max-train-examples), checked for
        what any training needs (at least one example; for classification at least two labels, which are then
        known, as after `label_list`)."""
        train = self.read(data_path, "train")
        if max_examples is not None:
            if max_examples < 1:
                raise BertforgeError(f"--max-train-examples {max_examples} must be at least 1")
            train = train[:max_examples]
        if not train:
            raise BertforgeError(f"no training examples in {data_path}: check the file and its columns")
        self.label_list(train)
        if self.kind == "classification" and len(self.labels) < 2:
            raise BertforgeError(f"{train[0].source.rsplit(':', 1)[0]}: every training example has the label "
                                 f"{self.labels[0]!r}; classification needs at least two labels")
        return train

    # --- labels ---
    def label_list(self, examples: Sequence[Example]) -> list[str] | None:
        """The label names in id order. Fixed or configured labels win; otherwise they come from `examples`
        (pass the training examples) and are remembered, so `num_labels` and `features` use them."""
        return self.labels

    @property
    def num_labels(self) -> int:
        """The size of the head's output: 1 for regression, 2 for QA (start, end), 1 per choice for
        multiple choice, else the number of labels."""
        if self.labels is None:
            raise BertforgeError(f"task {self.name}: labels are not known yet; call task.label_list(train_examples)"
                                 " or pass labels=[...] to get_task")
        return len(self.labels)

    def label_map(self) -> dict[str, int]:
        return {label: i for i, label in enumerate(self.labels or [])}

    # --- features, decoding, scoring ---
    def features(self, examples: Sequence[Example], tokenizer: Any, max_length: int,
                 label_map: dict[str, int] | None = None, windows: int = 1) -> list[Feature]:
        """Model features of examples. `windows`: the most windows a long single text is read in where the task
        averages them (`SequenceTask`); the other tasks have their own way with long inputs and ignore it."""
        raise NotImplementedError

    def decode(self, examples: Sequence[Example], features: Sequence[Feature], outputs: Any) -> Any:
        raise NotImplementedError

    def references(self, examples: Sequence[Example]) -> Any:
        raise NotImplementedError

    def metric(self, predictions: Any, references: Any) -> dict[str, float]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<task {self.name} ({self.kind})>"


# --- file helpers ----------------------------------------------------------------------------------------


def split_file(data_path: str | Path, split: str, names: dict[str, Sequence[str]], task: str) -> Path:
    """The file holding `split`: `data_path` itself when it is a file, else the first of `names[split]`
    present in the directory. Errors name the expected files."""
    path = Path(data_path)
    if split not in names:
        raise BertforgeError(f"task {task} has no split {split!r}: use one of {', '.join(names)}")
    if path.is_file():
        return path
    if not path.is_dir():
        raise BertforgeError(f"data path {path} does not exist: pass the {task} data directory or file")
    for name in names[split]:
        if (path / name).is_file():
            return path / name
    expected = " or ".join(names[split])
    raise BertforgeError(f"no {split} file for task {task} in {path}: expected {expected}")


def where(path: Path, line: int) -> str:
    return f"{path}:{line}"


def read_tsv(path: Path) -> Iterator[tuple[int, list[str]]]:
    """(line number, fields) of a tab-separated file, quotes taken literally (GLUE files have stray ones);
    blank lines skipped. An empty file is an error."""
    with open_text(path, newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        seen = False
        for row in reader:
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            seen = True
            yield reader.line_num, row
    if not seen:
        raise BertforgeError(f"{path} is empty: expected rows of tab-separated columns")


def column_index(header: Sequence[str], name: str, path: Path, hint: str = "") -> int:
    try:
        return list(header).index(name)
    except ValueError:
        columns = ", ".join(repr(c) for c in header)
        raise BertforgeError(f"{where(path, 1)}: no column {name!r} in the header ({columns}){hint}") from None


def field_at(row: Sequence[str], index: int, path: Path, line: int) -> str:
    if index >= len(row):
        raise BertforgeError(f"{where(path, line)}: expected at least {index + 1} tab-separated columns, found "
                             f"{len(row)}; fix or delete the line")
    return row[index]

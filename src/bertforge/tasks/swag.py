"""SWAG: pick the most plausible of four continuations (multiple choice).

The official files are train.csv, val.csv and test.csv with a header row
`[unnamed index,] video-id, fold-ind, startphrase, sent1, sent2, gold-source, ending0..ending3, label`
(test.csv has no label). As in the BERT paper, the context is `sent1` and each choice is `sent2 + " " +
ending<i>`. The model scores every (context, choice) pair: its logits are (N, 4); accuracy is the metric.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bertforge.errors import BertforgeError
from bertforge.files import open_text
from bertforge.tasks.base import ChoiceExample, Feature, Task, split_file, where
from bertforge.tasks.classification import as_array
from bertforge.tasks.features import choice_features
from bertforge.tasks.metrics import accuracy

NUM_CHOICES = 4
_FILES = {"train": ["train.csv"], "dev": ["val.csv", "dev.csv"], "test": ["test.csv"]}


class SwagTask(Task):
    name = "swag"
    kind = "multiple_choice"
    main_metric = "accuracy"

    @property
    def num_labels(self) -> int:
        return 1  # one score per choice; BertForMultipleChoice compares the choices' scores

    def read(self, data_path: str | Path, split: str) -> list[ChoiceExample]:
        path = split_file(data_path, split, _FILES, self.name)
        endings = [f"ending{i}" for i in range(NUM_CHOICES)]
        examples = []
        with open_text(path, newline="") as f:
            reader = csv.DictReader(f)
            header = reader.fieldnames or []
            if not header:
                raise BertforgeError(f"{path} is empty: expected the SWAG header and rows")
            for column in ["sent1", "sent2", *endings, *(["label"] if split == "train" else [])]:
                if column not in header:
                    raise BertforgeError(f"{where(path, 1)}: no column {column!r} (columns: {', '.join(header)}); "
                                         "use the official SWAG csv files")
            for row in reader:
                line = reader.line_num
                if None in row.values():
                    raise BertforgeError(f"{where(path, line)}: fewer columns than the header; fix the line")
                label = None
                if row.get("label") not in (None, ""):
                    label = _label(row["label"], path, line)
                start = row["sent2"].strip()
                examples.append(ChoiceExample(
                    id=row.get("") or row.get("fold-ind") or str(line), context=row["sent1"],
                    choices=[f"{start} {row[e].strip()}".strip() for e in endings], label=label,
                    source=where(path, line)))
        if not examples:
            raise BertforgeError(f"{path} has no examples; use the complete SWAG file")
        return examples

    def example(self, context: str, choices: Sequence[str]) -> ChoiceExample:
        """An unlabelled example for prediction."""
        return ChoiceExample(id="0", context=context, choices=list(choices), source="<input>")

    def features(self, examples: Sequence[ChoiceExample], tokenizer: Any, max_length: int,
                 label_map: dict[str, int] | None = None, windows: int = 1) -> list[Feature]:
        return choice_features(examples, tokenizer, max_length)

    def decode(self, examples: Sequence[ChoiceExample], features: Sequence[Feature], outputs: Any) -> list[int]:
        """The chosen index per example, from logits (N, num_choices)."""
        return [int(i) for i in as_array(outputs).argmax(axis=1)]

    def references(self, examples: Sequence[ChoiceExample]) -> list[int]:
        missing = next((ex for ex in examples if ex.label is None), None)
        if missing is not None:
            raise BertforgeError(f"{missing.source}: no gold label to score against; evaluate on a labelled split")
        return [int(ex.label) for ex in examples]

    def metric(self, predictions: Sequence[int], references: Sequence[int]) -> dict[str, float]:
        return {"accuracy": accuracy([int(p) for p in predictions], [int(r) for r in references])}


def _label(value: str, path: Path, line: int) -> int:
    try:
        label = int(value)
    except ValueError:
        label = -1
    if not 0 <= label < NUM_CHOICES:
        raise BertforgeError(f"{where(path, line)}: label {value!r} is not a choice number 0-{NUM_CHOICES - 1}; "
                             "fix the line")
    return label

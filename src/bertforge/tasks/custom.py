"""Your own data: classification, regression or sentence pairs from CSV or JSONL files.

`data_path` is a file (read for any split) or a directory with train/dev/test files (`dev` may also be named
`validation` or `val`). CSV files have a header row (`.tsv`: tab-separated); JSONL files hold one JSON object
per line. Columns are chosen by name:

    get_task("csv", text_column="text", label_column="label")                  # the defaults
    get_task("jsonl", text_column="premise", text_pair_column="hypothesis", label_column="label")
    get_task("csv", text_column="sentence", label_column="score", regression=True)

Labels are taken from the training file (sorted; numerically when they are numbers) unless given with
`labels=[...]`. Metrics: accuracy and macro F1 for classification, Pearson and Spearman for regression.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from bertforge.errors import BertforgeError
from bertforge.files import open_text
from bertforge.tasks.base import TextExample, split_file, where
from bertforge.tasks.classification import SequenceTask

_DEV = ("dev", "validation", "valid", "val")


def _names(exts: Sequence[str]) -> dict[str, list[str]]:
    return {"train": [f"train{e}" for e in exts], "dev": [f"{d}{e}" for d in _DEV for e in exts],
            "test": [f"test{e}" for e in exts]}


def _records_csv(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    with open_text(path, newline="") as f:
        reader = csv.reader(f, delimiter=delimiter)
        header = next(reader, None)
        if header is None:
            raise BertforgeError(f"{path} is empty: expected a header line naming the columns, then rows")
        header = [h.strip() for h in header]
        yield 1, {"__header__": header}
        for row in reader:
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if len(row) != len(header):
                raise BertforgeError(f"{where(path, reader.line_num)}: {len(row)} columns where the header has "
                                     f"{len(header)}; quote fields that contain '{delimiter}'")
            yield reader.line_num, dict(zip(header, row, strict=True))


def _records_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with open_text(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise BertforgeError(f"{where(path, line_no)}: not valid JSON ({e.msg}); each line must be one "
                                     "JSON object") from None
            if not isinstance(record, dict):
                raise BertforgeError(f"{where(path, line_no)}: expected a JSON object like "
                                     '{"text": ..., "label": ...}')
            yield line_no, record


class CustomTask(SequenceTask):
    """Classification or regression over one text column (and optionally a second, for pairs)."""

    def __init__(self, name: str, *, text_column: str = "text", text_pair_column: str | None = None,
                 label_column: str = "label", regression: bool = False, labels: Sequence[str] | None = None):
        metrics = ("pearson", "spearman") if regression else ("accuracy", "macro_f1")
        super().__init__(name, regression=regression, labels=labels, metrics=metrics)
        self.text_column = text_column
        self.text_pair_column = text_pair_column
        self.label_column = label_column
        self.files = _names([".jsonl", ".json"] if name == "jsonl" else [".csv", ".tsv"])

    def read(self, data_path: str | Path, split: str) -> list[TextExample]:
        path = split_file(data_path, split, self.files, self.name)
        jsonl = self.name == "jsonl" or path.suffix.lower() in (".jsonl", ".json")
        records = _records_jsonl(path) if jsonl else _records_csv(path)
        wanted = {"text_column": self.text_column, "text_pair_column": self.text_pair_column,
                  "label_column": self.label_column}
        examples = []
        for line, record in records:
            if "__header__" in record:  # CSV: check the columns once, on the header line
                header = record["__header__"]
                for option, column in wanted.items():
                    if column is None or column in header:
                        continue
                    if option == "label_column" and split != "train":
                        continue
                    raise BertforgeError(f"{where(path, 1)}: no column {column!r} (columns: {', '.join(header)}); "
                                         f"name the right one with {option}")
                continue
            examples.append(self._example(record, path, line, split))
        if not examples:
            raise BertforgeError(f"{path} has no examples; expected one per line after the header"
                                 if not jsonl else f"{path} has no examples; expected one JSON object per line")
        return examples

    def _example(self, record: dict[str, Any], path: Path, line: int, split: str) -> TextExample:
        def get(column: str, option: str) -> Any:
            if column not in record:
                raise BertforgeError(f"{where(path, line)}: no field {column!r} (fields: {', '.join(record)}); "
                                     f"name the right one with {option}")
            return record[column]

        text = get(self.text_column, "text_column")
        if not isinstance(text, str) or not text.strip():
            raise BertforgeError(f"{where(path, line)}: empty or non-text {self.text_column!r}; fix or delete the "
                                 "line")
        pair = get(self.text_pair_column, "text_pair_column") if self.text_pair_column else None
        if pair is not None and not isinstance(pair, str):
            pair = str(pair)
        label: Any = None
        if self.label_column in record or split == "train":
            label = get(self.label_column, "label_column")
            if label is None or (isinstance(label, str) and not label.strip()):
                raise BertforgeError(f"{where(path, line)}: empty label in {self.label_column!r}; fix or delete "
                                     "the line")
            if self.regression:
                try:
                    label = float(label)
                except (TypeError, ValueError):
                    raise BertforgeError(f"{where(path, line)}: {self.label_column!r} is {label!r}, not a number; "
                                         "a regression task needs numeric labels") from None
            else:
                label = str(label).strip()
        return TextExample(id=str(record.get("id", line)), text=text, text_pair=pair, label=label,
                           source=where(path, line))

"""The GLUE tasks, read from the official directory layout (the one `download_glue_data.py` writes).

Each task directory holds train.tsv, dev.tsv and test.tsv (MNLI: dev_matched.tsv, dev_mismatched.tsv,
test_matched.tsv, test_mismatched.tsv). Files are tab-separated and read with quoting off, since several
contain unbalanced quotes. Columns, as the official files have them:

    CoLA   train/dev: no header; source, label, original label, sentence.    test: index, sentence
    SST-2  sentence, label                                                    test: index, sentence
    MRPC   Quality, #1 ID, #2 ID, #1 String, #2 String                        test: index, #1 ID, ...
    QQP    id, qid1, qid2, question1, question2, is_duplicate                 test: id, question1, question2
    STS-B  index, genre, filename, year, old_index, source1, source2, sentence1, sentence2, score
    MNLI   index, promptID, pairID, genre, ..., sentence1, sentence2, label1, [label2-5,] gold_label
    QNLI   index, question, sentence, label
    RTE    index, sentence1, sentence2, label
    WNLI   index, sentence1, sentence2, label

Test files have the same columns minus the label. Columns are found by header name, so extra columns do no
harm. Metrics follow the BERT paper: Matthews correlation for CoLA, F1 (and accuracy) for MRPC and QQP,
Spearman (and Pearson) for STS-B, accuracy for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bertforge.errors import BertforgeError
from bertforge.tasks.base import TextExample, column_index, field_at, read_tsv, split_file, where
from bertforge.tasks.classification import SequenceTask


@dataclass(frozen=True)
class GlueSpec:
    text: str                       # header name of the first sentence
    pair: str | None                # header name of the second sentence, if any
    label: str                      # header name of the label (absent in test files)
    labels: tuple[str, ...] | None  # label names in id order; None for regression
    metrics: tuple[str, ...]        # the first is the main metric
    id: str | None = "index"        # header name of the example id, if any
    headerless: tuple[int, int] | None = None  # (text, label) column numbers of header-less train/dev files
    label_last: bool = False        # take the label from the last column (STS-B: some rows have extra tabs)


GLUE: dict[str, GlueSpec] = {
    "cola": GlueSpec("sentence", None, "label", ("0", "1"), ("mcc", "accuracy"), headerless=(3, 1)),
    "sst2": GlueSpec("sentence", None, "label", ("0", "1"), ("accuracy",)),
    "mrpc": GlueSpec("#1 String", "#2 String", "Quality", ("0", "1"), ("f1", "accuracy")),
    "qqp": GlueSpec("question1", "question2", "is_duplicate", ("0", "1"), ("f1", "accuracy"), id="id"),
    "stsb": GlueSpec("sentence1", "sentence2", "score", None, ("spearman", "pearson"), label_last=True),
    "mnli": GlueSpec("sentence1", "sentence2", "gold_label", ("contradiction", "entailment", "neutral"),
                     ("accuracy",)),
    "qnli": GlueSpec("question", "sentence", "label", ("entailment", "not_entailment"), ("accuracy",)),
    "rte": GlueSpec("sentence1", "sentence2", "label", ("entailment", "not_entailment"), ("accuracy",)),
    "wnli": GlueSpec("sentence1", "sentence2", "label", ("0", "1"), ("accuracy",)),
}

_FILES = {"train": ["train.tsv"], "dev": ["dev.tsv"], "test": ["test.tsv"]}
_MNLI_FILES = {"train": ["train.tsv"], "dev": ["dev_matched.tsv"], "dev_mismatched": ["dev_mismatched.tsv"],
               "test": ["test_matched.tsv"], "test_mismatched": ["test_mismatched.tsv"]}


class GlueTask(SequenceTask):
    def __init__(self, name: str, labels: list[str] | None = None):
        spec = GLUE[name]
        if labels is not None and list(labels) != list(spec.labels or []):
            raise BertforgeError(f"labels {list(labels)} differ from {name}'s ({', '.join(spec.labels or [])}); "
                                 f"use a model fine-tuned on {name}")
        super().__init__(name, regression=spec.labels is None, labels=spec.labels, metrics=spec.metrics,
                         positive_label="1" if "f1" in spec.metrics else None)
        self.spec = spec
        self.files = _MNLI_FILES if name == "mnli" else _FILES
        self.splits = tuple(self.files)

    def read(self, data_path: str | Path, split: str) -> list[TextExample]:
        path = split_file(data_path, split, self.files, self.name)
        rows = read_tsv(path)
        spec = self.spec
        if spec.headerless and not split.startswith("test"):
            text_i, label_i = spec.headerless
            pair_i = id_i = None
        else:
            _, header = next(rows)
            hint = f"; is {path} the {self.name} file?"
            text_i = column_index(header, spec.text, path, hint)
            pair_i = column_index(header, spec.pair, path, hint) if spec.pair else None
            id_i = header.index(spec.id) if spec.id in header else None
            if spec.label in header:
                label_i = header.index(spec.label)
            elif split.startswith("test"):
                label_i = None
            else:
                column_index(header, spec.label, path, hint)  # raises: a labelled split needs the label
        examples = []
        for line, row in rows:
            label: str | float | None = None
            if label_i is not None:
                label = (row[-1] if spec.label_last else field_at(row, label_i, path, line)).strip()
                if self.regression:
                    try:
                        label = float(label)
                    except ValueError:
                        raise BertforgeError(f"{where(path, line)}: score {label!r} is not a number; fix the "
                                             "line") from None
            examples.append(TextExample(
                id=field_at(row, id_i, path, line) if id_i is not None else str(line),
                text=field_at(row, text_i, path, line),
                text_pair=field_at(row, pair_i, path, line) if pair_i is not None else None,
                label=label, source=where(path, line)))
        if not examples:
            raise BertforgeError(f"{path} has a header but no examples; use the complete {self.name} file")
        return examples

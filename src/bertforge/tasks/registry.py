"""Task names -> task objects.

    get_task("sst2")                                         # GLUE: cola sst2 mrpc qqp stsb mnli qnli rte wnli
    get_task("swag"), get_task("squad"), get_task("conll2003")
    get_task("csv", text_column="text", label_column="label")  # or "jsonl"; see bertforge.tasks.custom
"""

from __future__ import annotations

from typing import Any

from bertforge.errors import BertforgeError
from bertforge.tasks.base import Task
from bertforge.tasks.conll import ConllTask
from bertforge.tasks.custom import CustomTask
from bertforge.tasks.glue import GLUE, GlueTask
from bertforge.tasks.squad import SquadTask
from bertforge.tasks.swag import SwagTask

TASKS: dict[str, str] = {
    "cola": "GLUE CoLA: grammatical acceptability (Matthews correlation)",
    "sst2": "GLUE SST-2: sentence sentiment (accuracy)",
    "mrpc": "GLUE MRPC: paraphrase pairs (F1, accuracy)",
    "qqp": "GLUE QQP: duplicate question pairs (F1, accuracy)",
    "stsb": "GLUE STS-B: sentence similarity, regression (Spearman, Pearson)",
    "mnli": "GLUE MNLI: entailment, 3 classes; dev = matched, dev_mismatched (accuracy)",
    "qnli": "GLUE QNLI: does the sentence answer the question (accuracy)",
    "rte": "GLUE RTE: entailment (accuracy)",
    "wnli": "GLUE WNLI: pronoun resolution as entailment (accuracy)",
    "swag": "SWAG: choose the continuation, multiple choice (accuracy)",
    "squad": "SQuAD v1.1: extractive question answering (exact match, F1)",
    "conll2003": "CoNLL-2003: named entities, token classification (entity F1 as conlleval)",
    "csv": "your own CSV classification/regression (options: text_column, text_pair_column, label_column, "
           "regression, labels)",
    "jsonl": "your own JSONL classification/regression (same options as csv)",
}

_OPTIONS = {
    **{name: {"labels"} for name, spec in GLUE.items() if spec.labels is not None},
    "csv": {"text_column", "text_pair_column", "label_column", "regression", "labels"},
    "jsonl": {"text_column", "text_pair_column", "label_column", "regression", "labels"},
    "conll2003": {"labels"},
    "squad": {"doc_stride", "max_query_length", "n_best", "max_answer_length"},
}


def get_task(name: str, **options: Any) -> Task:
    """A fresh task object. Options set to None are ignored, so CLI defaults can be passed through.

    `labels` (classification and tagging tasks) fixes the label names in id order, e.g. the label map a
    fine-tuned model was saved with; for GLUE tasks they must be the task's own labels.
    """
    key = name.lower().replace("-", "")
    if key not in TASKS:
        raise BertforgeError(f"unknown task {name!r}: choose one of {', '.join(TASKS)}")
    options = {k: v for k, v in options.items() if v is not None}
    unknown = set(options) - _OPTIONS.get(key, set())
    if unknown:
        allowed = ", ".join(sorted(_OPTIONS.get(key, ()))) or "none"
        raise BertforgeError(f"task {key} does not take {', '.join(sorted(unknown))} (its options: {allowed})")
    if key in GLUE:
        return GlueTask(key, **options)
    if key in ("csv", "jsonl"):
        return CustomTask(key, **options)
    if key == "conll2003":
        return ConllTask(options.get("labels"))
    if key == "squad":
        return SquadTask(**options)
    return SwagTask()

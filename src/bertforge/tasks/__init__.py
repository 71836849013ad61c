"""Fine-tuning tasks: readers for GLUE, SWAG, SQuAD v1.1, CoNLL-2003 and your own CSV/JSONL files,
feature building, decoding of model outputs, and metrics. See `bertforge.tasks.base` for the flow."""

from bertforge.tasks.base import (
    IGNORE_INDEX,
    KINDS,
    ChoiceExample,
    Example,
    Feature,
    QAExample,
    TaggedExample,
    Task,
    TextExample,
)
from bertforge.tasks.features import collate
from bertforge.tasks.registry import TASKS, get_task

__all__ = ["IGNORE_INDEX", "KINDS", "TASKS", "ChoiceExample", "Example", "Feature", "QAExample", "TaggedExample",
           "Task", "TextExample", "collate", "get_task"]

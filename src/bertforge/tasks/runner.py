"""A fine-tuned task model, loaded from its directory and run in batches: what `evaluate`, `predict`,
`export` and the fine-tuning loop's dev evaluation share; and any model directory's encoder, loaded for
`embed` and `export`.

A fine-tuned model directory holds the model (config.json with the label map, model.safetensors), the
tokenizer and `task.json` (task name, options, labels, sequence length); `bertforge.finetune.run` writes it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from bertforge.batching import length_batches, run_batches
from bertforge.device import pick_device, to_device
from bertforge.encoder import BertModel
from bertforge.errors import BertforgeError
from bertforge.files import read_json_object
from bertforge.model_files import load_model
from bertforge.models import (
    BertForMultipleChoice,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
)
from bertforge.options import DEFAULT_WINDOWS
from bertforge.tasks.base import QAExample, TaggedExample, Task
from bertforge.tasks.features import collate
from bertforge.tasks.registry import get_task
from bertforge.tokenizer import Tokenizer

MODEL_FOR_KIND = {
    "classification": BertForSequenceClassification,
    "regression": BertForSequenceClassification,
    "token_classification": BertForTokenClassification,
    "question_answering": BertForQuestionAnswering,
    "multiple_choice": BertForMultipleChoice,
}
# The inputs of every model, in their forward's order: what a batch feeds it and what an exported graph takes.
MODEL_INPUTS = ("input_ids", "token_type_ids", "attention_mask")
TASK_FILE = "task.json"


def feature_length(feature: dict) -> int:
    """Tokens of a feature; of its longest choice for multiple choice."""
    ids = feature["input_ids"]
    return max(len(s) for s in ids) if ids and isinstance(ids[0], list) else len(ids)


def run_model(model: nn.Module, features: Sequence[dict], pad_id: int, *, batch_size: int = 64,
              device: torch.device | None = None, streams: int = 1) -> Any:
    """The head's outputs for every feature, in feature order, with no work on padding beyond each
    length-sorted batch's longest: (N, L) logits, (N, C) for multiple choice, a list of (T_i, L) arrays for
    tagging, and (start list, end list) of (T_i,) arrays for QA. `streams`: batches run at once
    (`bertforge.batching`)."""
    return assemble_outputs(per_feature_outputs(model, features, pad_id, batch_size=batch_size, device=device,
                                                streams=streams))


@torch.no_grad()
def per_feature_outputs(model: nn.Module, features: Sequence[dict], pad_id: int, *, batch_size: int,
                        device: torch.device | None, streams: int = 1) -> list[Any]:
    """`run_model`'s outputs as one item per feature: a logits array, or a (start, end) pair for QA."""
    if any(m.training for m in model_modules(model)):  # eval() sets an attribute on every module: 0.4 ms on MiniLM
        model.eval()
    device = device or model_device(model)
    lengths = np.array([feature_length(f) for f in features])
    results: list[Any] = [None] * len(features)

    def run(idx: np.ndarray) -> None:
        batch = collate([features[j] for j in idx], pad_id)
        # pinned, non-blocking copies on CUDA; a mask without padding stays on the host and is dropped
        inputs = to_device({k: batch[k] for k in MODEL_INPUTS}, device)
        out = model(**inputs)
        if isinstance(out, tuple) or hasattr(out, "start_logits"):
            start, end = out.start_logits.float().cpu().numpy(), out.end_logits.float().cpu().numpy()
            for row, j in enumerate(idx):
                results[j] = (start[row, :lengths[j]], end[row, :lengths[j]])
        elif out.logits.ndim == 3:
            logits = out.logits.float().cpu().numpy()
            for row, j in enumerate(idx):
                results[j] = logits[row, :lengths[j]]
        else:
            logits = out.logits.float().cpu().numpy()
            for row, j in enumerate(idx):
                results[j] = logits[row]

    run_batches(run, list(length_batches(lengths, max_tokens=None, max_batch=batch_size)), streams)
    return results


_MODULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_modules(model: nn.Module) -> tuple[nn.Module, ...]:
    """`model.modules()`, listed once a model (walking MiniLM-L6's 76 took 50-56 us, a thirtieth of one int8 text's
    answer): a model's modules are not replaced once it runs."""
    listed = _MODULES.get(model)
    if listed is None:
        listed = _MODULES[model] = tuple(model.modules())
    return listed


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter, over `model_modules` (`model.parameters()` walks the modules anew:
    11 us of a BERT-tiny's 0.4 ms answer to one text); the CPU for a model with none (a fully quantized one keeps its
    weights outside nn.Parameters)."""
    for module in model_modules(model):
        for p in module._parameters.values():
            if p is not None:
                return p.device
    return torch.device("cpu")


def assemble_outputs(results: list[Any]) -> Any:
    """`per_feature_outputs`' items in `run_model`'s shape."""
    if results and isinstance(results[0], tuple):
        return [r[0] for r in results], [r[1] for r in results]
    if results and results[0].ndim == 1:
        return np.stack(results)
    return results


@dataclass
class TaskModel:
    """A fine-tuned model with everything needed to use it."""

    task: Task
    model: nn.Module
    tokenizer: Tokenizer
    max_length: int
    spec: dict = field(default_factory=dict)


def load_task_model(path: str | Path, *, device: str | None = None) -> TaskModel:
    """Load a fine-tuned model directory (written by `finetune`)."""
    path = Path(path)
    task, spec = load_task(path)
    model_cls = MODEL_FOR_KIND[task.kind]
    model = model_cls.from_pretrained(path, verbose=False).to(pick_device(device)).eval()
    tokenizer = Tokenizer.from_pretrained(path)
    tokenizer.check_compatible(model.config)
    return TaskModel(task, model, tokenizer, int(spec.get("max_length", task.max_length)), spec)


def load_encoder(path: str | Path) -> BertModel:
    """The encoder of any model directory (pretrained or fine-tuned; heads ignored), in eval mode, without a
    pooler where the directory has no pooler weights: a randomly initialised one is never used or exported."""
    model, fresh = load_model(BertModel, path, verbose=False)
    if any(k.startswith("pooler.") for k in fresh):
        model.pooler = None
    return model.eval()


def load_task(path: Path) -> tuple[Task, dict]:
    """(task, task.json's contents) of a fine-tuned model directory, or of its ONNX export."""
    spec_path = path / TASK_FILE
    if not spec_path.is_file():
        raise BertforgeError(f"{path} has no {TASK_FILE}: it is not a fine-tuned model; pass the --out "
                             f"directory of `bertforge finetune`")
    spec = _read_spec(spec_path)
    task = get_task(spec["task"], **spec.get("options", {}))
    if spec.get("labels") is not None:
        task.labels = list(spec["labels"])
    return task, spec


def _read_spec(path: Path) -> dict:
    """task.json as `finetune` writes it: an object with the task's name, and its options, labels and sequence
    length if any. A file cut short, not UTF-8 or of another shape is a BertforgeError naming it."""
    fix = "copy it again from the fine-tuning run's --out, or fine-tune again"
    spec = read_json_object(path, what="the task's name, options and labels", fix=fix)
    if not (isinstance(spec.get("task"), str) and isinstance(spec.get("options", {}), dict)
            and isinstance(spec.get("labels"), list | None) and type(spec.get("max_length", 1)) is int
            and spec.get("max_length", 1) > 0):
        raise BertforgeError(f"{path} is not a task description (a JSON object: \"task\" name, \"options\" object, "
                             f"\"labels\" list, \"max_length\" above 0): {fix}")
    return spec


def is_labelled(example: Any) -> bool:
    """Does the example carry a gold answer to score against?"""
    if isinstance(example, QAExample):
        return bool(example.answers)
    if isinstance(example, TaggedExample):
        return example.tags is not None
    return example.label is not None


def evaluate_examples(tm: TaskModel, examples: Sequence, *, batch_size: int = 64,
                      windows: int = DEFAULT_WINDOWS) -> tuple[dict[str, float], Any]:
    """(metrics, predictions) of a task model on examples. Metrics are {} when no example has a gold answer
    (a test split): then only the predictions are made. `windows`: the most windows a long single text is read in
    (`bertforge.tasks.features.window_starts`; 1: its first tokens)."""
    labelled = any(is_labelled(ex) for ex in examples)
    label_map = tm.task.label_map() if tm.task.labels else None
    features = tm.task.features(examples, tm.tokenizer, tm.max_length, label_map, windows=windows)
    outputs = run_model(tm.model, features, tm.tokenizer.pad_id, batch_size=batch_size)
    predictions = tm.task.decode(examples, features, outputs)
    if not labelled:
        return {}, predictions
    return tm.task.metric(predictions, tm.task.references(examples)), predictions

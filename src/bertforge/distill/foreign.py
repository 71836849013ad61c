"""Teachers of another architecture: a Hugging Face sequence classifier bertforge does not run itself (RoBERTa, MPNet,
DeBERTa, DistilBERT, ... whatever `transformers` loads with `AutoModelForSequenceClassification`), run through
`transformers` to label the examples once.

Such a teacher is a model directory with no task.json and a config.json whose `architectures` name a
`...ForSequenceClassification`; its labels are config.json's `id2label` in id order, which must be the task's label
names (a generic LABEL_0, LABEL_1 is refused: it says nothing about which label is which). It teaches the tasks a
sequence classifier can: classification (one text or a pair) and regression (one output). It reads each example with
its own tokenizer (`AutoTokenizer`) up to the task's sequence length, so the student's tokenizer is free.

Loading executes no code: weights from safetensors only, `trust_remote_code` off, local files only. The engine is
the one `teacher.teacher_engine` names, prepared as bertforge's own models are (`infer.transforms.prepare`): int8 (a
CPU's auto) swaps every Linear layer for bertforge's dynamically quantized one (its kernels where they load), bf16
runs the model in bfloat16, fp32 on the CPU packs the Linear layers for oneDNN; the rest of the model (attention,
its position biases) runs as transformers wrote it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bertforge.errors import BertforgeError
from bertforge.infer import EngineOptions
from bertforge.infer.checks import engine_device
from bertforge.infer.transforms import prepare
from bertforge.progress import progress_reporter
from bertforge.tasks.runner import TASK_FILE

INSTALL = "pip install 'bertforge[teachers]' (transformers)"
_GENERIC_LABEL = re.compile(r"LABEL_\d+")


def is_foreign(teacher: Path) -> bool:
    """Whether `teacher` is a transformers sequence classifier rather than a bertforge fine-tuned directory."""
    if (teacher / TASK_FILE).is_file() or not (teacher / "config.json").is_file():
        return False
    try:
        architectures = json.loads((teacher / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    return any(str(a).endswith("ForSequenceClassification") for a in architectures)


def foreign_task(teacher: Path, task: Any) -> Any:
    """The teacher's task: `task` with the teacher's labels (config.json's id2label, in id order), refused in one line
    where the teacher cannot teach it."""
    config = json.loads((teacher / "config.json").read_text())
    model_type = config.get("model_type", "?")
    if task.kind not in ("classification", "regression"):
        raise BertforgeError(f"--teacher {teacher} is a transformers sequence classifier ({model_type}): it teaches "
                             f"classification and regression, not {task.name} ({task.kind.replace('_', ' ')}); give "
                             "a teacher fine-tuned with `bertforge finetune`")
    id2label = config.get("id2label") or {}
    labels = [str(id2label.get(str(i), "")) for i in range(len(id2label))]
    regression = config.get("problem_type") == "regression" or len(labels) == 1
    if regression != (task.kind == "regression"):
        raise BertforgeError(f"--teacher {teacher} is a {'regression' if regression else 'classification'} model "
                             f"({len(labels)} outputs) and {task.name} a {task.kind} task: give a teacher of this "
                             "task")
    theirs = copy.copy(task)
    if regression:
        theirs.labels = None
        return theirs
    if not labels or all(_GENERIC_LABEL.fullmatch(label) for label in labels):
        named = f"its labels {', '.join(labels)}" if labels else "no labels"
        raise BertforgeError(f"--teacher {teacher}: its config.json names {named}, not the task's: write the label "
                             "names into id2label in id order (e.g. {\"0\": \"negative\", \"1\": \"positive\"}) "
                             "and label2id")
    theirs.labels = labels
    return theirs


def _transformers(teacher: Path) -> Any:
    try:
        import transformers
    except ImportError:
        raise BertforgeError(f"--teacher {teacher} is a transformers model, which bertforge runs through "
                             f"transformers: {INSTALL}") from None
    return transformers


@contextlib.contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    """transformers' loading reports and progress bars off while it loads the teacher, as they were after."""
    logging = transformers.utils.logging
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def load_foreign(teacher: Path, engine: EngineOptions) -> tuple[Any, Any, torch.device]:
    """(model, tokenizer, device) of the teacher on `engine`, loaded without executing code."""
    if not any(teacher.glob("*.safetensors")):
        raise BertforgeError(f"--teacher {teacher} has no .safetensors weights: bertforge never unpickles a "
                             "checkpoint; save the model again with save_pretrained (safetensors is its default)")
    transformers = _transformers(teacher)
    where = engine_device(engine)
    try:
        with _quiet(transformers):
            model, info = transformers.AutoModelForSequenceClassification.from_pretrained(
                teacher, use_safetensors=True, local_files_only=True, trust_remote_code=False,
                output_loading_info=True)
            tokenizer = transformers.AutoTokenizer.from_pretrained(teacher, local_files_only=True,
                                                                   trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BertforgeError(f"--teacher {teacher}: transformers cannot load it ({first}): give the directory "
                             "save_pretrained wrote (config.json, weights, tokenizer files)") from None
    if info.get("missing_keys"):
        missing = sorted(info["missing_keys"])
        raise BertforgeError(f"--teacher {teacher} lacks weights ({', '.join(missing[:3])}"
                             f"{', ...' if len(missing) > 3 else ''}): it is not a fine-tuned classifier; fine-tune "
                             "it on the task first")
    return prepare(model.eval(), engine, where), tokenizer, where


def run_foreign(teacher: Path, examples: Sequence[Any], engine: EngineOptions, batch_size: int, max_length: int,
                progress: bool) -> list[np.ndarray]:
    """The teacher's logits (or value) per example, as float32 arrays (`foreign_outputs`)."""
    model, tokenizer, where = load_foreign(teacher, engine)
    return foreign_outputs(model, tokenizer, where, examples, batch_size, max_length, progress)


def foreign_outputs(model: Any, tokenizer: Any, where: torch.device, examples: Sequence[Any], batch_size: int,
                    max_length: int, progress: bool) -> list[np.ndarray]:
    """A loaded teacher's (`load_foreign`) logits per example, in length-sorted batches with a progress bar."""
    pairs = [ex.text_pair for ex in examples]
    limit = min(max_length, int(getattr(tokenizer, "model_max_length", max_length) or max_length))
    encoded = tokenizer([ex.text for ex in examples], pairs if any(p is not None for p in pairs) else None,
                        truncation=True, max_length=limit)
    ids = encoded["input_ids"]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    outputs: list[np.ndarray] = [np.zeros(0, np.float32)] * len(ids)
    bar = progress_reporter(len(ids), desc="teacher", unit="input", enabled=progress)
    try:
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                rows = order[start:start + batch_size]
                batch = tokenizer.pad([{k: encoded[k][i] for k in encoded} for i in rows], return_tensors="pt")
                logits = model(**{k: v.to(where) for k, v in batch.items()}).logits
                for r, i in enumerate(rows):
                    outputs[i] = logits[r].float().cpu().numpy().reshape(-1)
                bar.update(len(rows))
    finally:
        bar.close()
    return outputs


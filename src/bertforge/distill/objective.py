"""The distillation loss, and the training batches that carry the teacher's outputs.

Per example (per word for tagging), with z the student's logits and t the teacher's:

    T^2 KL(softmax(t / T) || softmax(z / T))  +  alpha CE(z, label)      classification, multiple choice, tagging
    (z - t)^2                                  +  alpha (z - label)^2     regression

The first term is the mean over the examples with a teacher output (every example; for tagging every word the
teacher saw, on each word's first sub-token, so the two tokenizers may cut words differently); the second the mean
over the examples with a label (the task's own; the transfer set's have none). T^2 keeps the soft targets'
gradients the size of the hard ones' as T changes (Hinton et al. 2015). At T = 1 with a one-hot teacher the first
term is the cross-entropy itself.

A training feature is a task feature (`bertforge.tasks.features`) plus `teacher`, a float32 array: (L,) logits,
(1,) for regression, (C,) for multiple choice, (T_i, L) for tagging with NaN rows where no word starts; and its
`labels` is always there: IGNORE_INDEX (-100) or NaN (regression) where the example has none.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bertforge.tasks import IGNORE_INDEX, collate
from bertforge.tasks.runner import MODEL_INPUTS


def soft_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 KL(softmax(teacher / T) || softmax(student / T)) per row of (..., L) logits. A teacher logit of -inf (a
    one-hot teacher) adds nothing: 0 log 0 is 0."""
    t = temperature
    p_log = F.log_softmax(teacher.float() / t, dim=-1)
    p = p_log.exp()
    q_log = F.log_softmax(student.float() / t, dim=-1)
    return t * t * (torch.special.xlogy(p, p) - p * q_log).sum(-1)


def distill_losses(logits: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, *, kind: str,
                   temperature: float, alpha: float) -> dict[str, torch.Tensor]:
    """{"distill": mean soft loss over the outputs with a teacher target, "task": alpha x mean task loss over those
    with a label} for a batch of the student's `logits` (B, L), (B, 1), (B, C) or (B, T, L); each is 0 (not NaN)
    when the batch has none, so a micro-batch of transfer texts alone weighs nothing in the step's mean."""
    logits = logits.float()
    if kind == "regression":
        z, t = logits.reshape(-1), teacher.reshape(-1).float()
        has = ~labels.isnan()
        task = ((z - labels.nan_to_num()) ** 2 * has).sum() / has.sum().clamp_min(1)
        return {"distill": ((z - t) ** 2).mean(), "task": alpha * task}
    if kind == "token_classification":
        has_t = ~teacher[..., 0].isnan()  # (B, T): the words' first sub-tokens
        soft = soft_kl(logits[has_t], teacher[has_t], temperature).sum() / has_t.sum().clamp_min(1)
        flat = logits.flatten(0, 1)  # (B * T, L)
    else:
        soft = soft_kl(logits, teacher, temperature).mean()
        flat = logits
    labelled = (labels != IGNORE_INDEX).sum().clamp_min(1)
    hard = F.cross_entropy(flat, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum") / labelled
    return {"distill": soft, "task": alpha * hard}


class DistillObjective:
    """The loop's objective (`bertforge.train.loop.Objective`) for distillation: two terms, `distill` (counted in
    examples, or words for tagging) and `task` (in labelled examples or words), each the mean of `distill_losses`."""

    def __init__(self, kind: str, temperature: float, alpha: float):
        self.kind, self.temperature, self.alpha = kind, temperature, alpha

    def counts(self, batch: dict) -> dict[str, float]:
        labels, teacher = batch["labels"], batch["teacher"]
        if self.kind == "regression":
            return {"distill": int(teacher.shape[0]), "task": int((~labels.isnan()).sum())}
        distilled = int((~teacher[..., 0].isnan()).sum()) if self.kind == "token_classification" \
            else int(teacher.shape[0])
        return {"distill": distilled, "task": int((labels != IGNORE_INDEX).sum())}

    def losses(self, model: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
        logits = model(**{k: batch[k] for k in MODEL_INPUTS}).logits
        return distill_losses(logits, batch["teacher"], batch["labels"], kind=self.kind,
                              temperature=self.temperature, alpha=self.alpha)


def distill_batch(features: Sequence[dict], pad_id: int) -> dict:
    """A training batch of distillation features: the model's inputs, `labels` and `teacher` ((B, L), (B, 1),
    (B, C), or (B, T, L) padded with NaN for tagging)."""
    batch = collate(features, pad_id)
    teacher = [f["teacher"] for f in features]
    if teacher[0].ndim == 2:  # tagging: each feature's (T_i, L), padded to the batch's width
        width = batch["input_ids"].shape[-1]
        stacked = np.full((len(teacher), width, teacher[0].shape[1]), np.nan, dtype=np.float32)
        for i, rows in enumerate(teacher):
            stacked[i, :len(rows)] = rows
    else:
        stacked = np.stack(teacher).astype(np.float32, copy=False)
    return {**{k: batch[k] for k in MODEL_INPUTS}, "labels": batch["labels"], "teacher": torch.from_numpy(stacked)}


def with_targets(features: list[dict], teacher: Sequence[np.ndarray], kind: str) -> list[dict]:
    """The student's task features with the teacher's outputs for their examples (`teacher[i]`: example i's, per
    word (W_i, L) for tagging) and a label on every one (IGNORE_INDEX, or NaN for regression, where none)."""
    missing = float("nan") if kind == "regression" else IGNORE_INDEX
    out = []
    for f in features:
        target = teacher[f["example_index"]]
        if kind == "token_classification":
            target = _word_rows(f["word_ids"], target)
        out.append({**f, "labels": f.get("labels", missing), "teacher": np.asarray(target, dtype=np.float32)})
    return out


def _word_rows(word_ids: Sequence[int | None], words: np.ndarray) -> np.ndarray:
    """A tagging feature's teacher rows: each word's logits on its first sub-token, NaN elsewhere."""
    rows = np.full((len(word_ids), words.shape[1]), np.nan, dtype=np.float32)
    for p, w in enumerate(word_ids):
        if w is not None and (p == 0 or word_ids[p - 1] != w):
            rows[p] = words[w]
    return rows

"""What pretraining optimises and how it is scored: the masked-LM (+ NSP, + a bag-of-words loss on [CLS]) loss of
`PretrainingObjective`, and `evaluate_pretraining` on the validation split."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from bertforge.device import to_device
from bertforge.models import IGNORE_INDEX, BertForPreTraining
from bertforge.train import distributed
from bertforge.train.candidates import CandidateSampler


class PretrainingObjective:
    """loss = mean MLM cross-entropy over masked positions + mean NSP cross-entropy over sequences (MLM alone
    with `nsp=False`) + `bow_weight` x the bag-of-words loss on [CLS] (`heads.bag_of_words`), which needs
    `is_special`, the vocabulary-sized mask of tokens to leave out of the bag (`PretrainingData.is_special`).
    With `candidates` the masked-LM term is a sampled softmax over the words it draws (train/candidates.py)."""

    def __init__(self, nsp: bool = True, bow_weight: float = 0.0, is_special: np.ndarray | None = None,
                 candidates: CandidateSampler | None = None):
        self.nsp, self.bow_weight, self.candidates = nsp, bow_weight, candidates
        if bow_weight and is_special is None:
            raise ValueError("the bag-of-words loss needs is_special, the mask of the tokenizer's special tokens")
        self.is_special = None if is_special is None else torch.as_tensor(is_special, dtype=torch.bool)

    def counts(self, batch: dict) -> dict[str, float]:
        counts = {"mlm": int((batch["mlm_labels"] != IGNORE_INDEX).sum())}
        if self.nsp:
            counts["nsp"] = int(batch["nsp_labels"].numel())
        if self.bow_weight:
            counts["bow"] = int(batch["input_ids"].shape[0])
        return counts

    def bow_labels(self, batch: dict) -> torch.Tensor:
        """The sequence's original tokens (the masked positions' labels put back), -100 at special tokens and
        padding."""
        labels = batch["mlm_labels"]
        original = torch.where(labels != IGNORE_INDEX, labels, batch["input_ids"])
        if self.is_special.device != original.device:  # moved once, not on every step
            self.is_special = self.is_special.to(original.device)
        special = self.is_special[original]
        return original.masked_fill(special | (batch["attention_mask"] == 0), IGNORE_INDEX)

    def losses(self, model: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
        drawn = self.candidates.sample(batch, batch["input_ids"].device) if self.candidates else None
        out = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
                    mlm_labels=batch["mlm_labels"], nsp_labels=batch["nsp_labels"] if self.nsp else None,
                    bow_labels=self.bow_labels(batch) if self.bow_weight else None, mlm_candidates=drawn)
        losses = {"mlm": out.mlm_loss}
        if self.nsp:
            losses["nsp"] = out.nsp_loss
        if self.bow_weight:
            losses["bow"] = self.bow_weight * out.bow_loss  # logged weighted: the terms add up to the loss
        return losses


def evaluate_pretraining(model: BertForPreTraining, batches: list[dict], device: torch.device, *,
                         nsp: bool = True, dist: distributed.Dist | None = None) -> dict[str, float]:
    """MLM accuracy and perplexity over masked positions, NSP accuracy (unless `nsp` is False: a split of one
    document has IsNext pairs only), on fixed validation batches. Under several processes (`dist`) each rank
    passes its share of the batches and gets the figures of all of them."""
    mlm_loss_sum = mlm_correct = mlm_n = nsp_correct = nsp_n = 0.0
    for batch in batches:
        b = to_device(batch, device)  # as the training step moves its batches
        out = model(b["input_ids"], b["token_type_ids"], b["attention_mask"], mlm_labels=b["mlm_labels"],
                    nsp_labels=b["nsp_labels"])
        targets = b["mlm_labels"][b["mlm_labels"] != IGNORE_INDEX]
        mlm_loss_sum += float(torch.nn.functional.cross_entropy(out.mlm_logits.float(), targets, reduction="sum"))
        mlm_correct += float((out.mlm_logits.argmax(-1) == targets).sum())
        mlm_n += targets.numel()
        nsp_correct += float((out.nsp_logits.argmax(-1) == b["nsp_labels"]).sum())
        nsp_n += b["nsp_labels"].numel()
    if dist is not None:
        mlm_loss_sum, mlm_correct, mlm_n, nsp_correct, nsp_n = distributed.all_reduce_sum(
            [mlm_loss_sum, mlm_correct, mlm_n, nsp_correct, nsp_n], dist)
    mean = mlm_loss_sum / max(mlm_n, 1)
    results = {"mlm_accuracy": mlm_correct / max(mlm_n, 1), "mlm_loss": mean,
               "mlm_perplexity": math.exp(min(mean, 50.0))}
    if nsp:
        results["nsp_accuracy"] = nsp_correct / max(nsp_n, 1)
    return results

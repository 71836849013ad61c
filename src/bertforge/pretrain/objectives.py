"""The words a sampled-softmax masked-LM step scores (`pretrain --mlm-candidates K`; `models.sampled_masked_lm`).

Where the model is small, the vocabulary projection is most of a pretraining step: BERT-tiny's decoder over 8,000
words at 40% masking is about two thirds of a step's time on a CPU without bf16 (docs/experiments/). A sampled
softmax scores each masked position against its own word and K words drawn for the whole micro-batch instead:
drawn K times, with replacement, from the corpus's word frequencies (counted in the training split), duplicates
dropped, and each logit corrected by the log of its word's chance to be drawn at least once, 1 - (1 - q)^K, so the
expected gradient approaches the full softmax's. The special tokens are always in the set (never drawn, chance 1):
masking never makes them targets, and without it nothing would hold their logits down for fill-mask.

One draw serves a whole optimizer step: it is seeded by the step's place in the data (the epoch, and the index of
the micro-batch's first instance over the global batch size), not by a process's generator, so every micro-batch
and every process of a step draw the same words, and a resumed run or one under several processes draws what the
uninterrupted single-process run drew.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from bertforge.data.loader import PretrainingData
from bertforge.device import to_device
from bertforge.models import IGNORE_INDEX, BertForPreTraining
from bertforge.train import distributed


class CandidateSampler:
    def __init__(self, counts: np.ndarray, k: int, is_special: np.ndarray, seed: int, batch_size: int = 1):
        if k < 1:
            raise ValueError(f"k {k} must be at least 1")
        freq = (counts.astype(np.float64) + 1.0) * ~is_special  # +1: every ordinary word can be drawn
        q = freq / freq.sum()
        self.k, self.seed, self.batch_size = k, seed, batch_size
        self.probs = torch.as_tensor(q)
        # log P(word among the K draws) = log(1 - (1 - q)^K), exactly 0 for the specials (always in the set)
        log_inclusion = np.log(-np.expm1(k * np.log1p(-q)), where=q > 0, out=np.zeros_like(q))
        self.log_inclusion = torch.as_tensor(log_inclusion, dtype=torch.float32)
        self.special = torch.as_tensor(np.flatnonzero(is_special), dtype=torch.long)

    def sample(self, batch: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(candidates (K',), log_inclusion (V,)) on `device` for one micro-batch."""
        g = torch.Generator().manual_seed(_draw_seed(self.seed, batch.get("instance"), self.batch_size))
        drawn = torch.multinomial(self.probs, self.k, replacement=True, generator=g)
        candidates = torch.cat([self.special, torch.unique(drawn)])
        if self.log_inclusion.device != device:  # moved once, not on every step
            self.log_inclusion = self.log_inclusion.to(device)
        return candidates.to(device), self.log_inclusion


def candidate_sampler(data: PretrainingData, k: int, seed: int, batch_size: int) -> CandidateSampler | None:
    """The sampler for `k` words a step of `batch_size` sequences (all processes together) from `data`'s word
    frequencies; None for k = 0 (the whole vocabulary)."""
    if not k:
        return None
    counts = data.documents.word_counts(data.tokenizer.vocab_size)
    return CandidateSampler(counts, k, data.is_special, seed, batch_size)


def _draw_seed(seed: int, instance: torch.Tensor | None, batch_size: int) -> int:
    """A seed from `seed`, the epoch and the step of the micro-batch's first instance (`instance` (B, 2): epoch,
    index); batches made elsewhere than PretrainingData (a timing's) carry none and take one from the process's
    generator."""
    if instance is None:
        return int(torch.randint(0, 2**62, ()))
    epoch, index = (int(x) for x in instance[0])
    return int(np.random.SeedSequence([seed, epoch, index // batch_size]).generate_state(2, np.uint64)[0] >> 2)


class PretrainingObjective:
    """loss = mean MLM cross-entropy over masked positions + mean NSP cross-entropy over sequences (MLM alone
    with `nsp=False`) + `bow_weight` x the bag-of-words loss on [CLS] (`heads.bag_of_words`), which needs
    `is_special`, the vocabulary-sized mask of tokens to leave out of the bag (`PretrainingData.is_special`).
    With `candidates` the masked-LM term is a sampled softmax over the words it draws (train/py)."""

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

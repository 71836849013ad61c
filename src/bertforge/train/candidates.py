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

import numpy as np
import torch

from bertforge.data.loader import PretrainingData


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

"""ELECTRA's pretraining objective (`pretrain --objective electra`): the generator's masked-LM loss plus lambda x the
discriminator's replaced-token loss (`ElectraObjective`), and their evaluation (`evaluate_electra`).

The generator's samples are drawn from uniforms that are a function of the run's seed and each instance's place in
the data stream (epoch, index: the batch's `instance` column) and position, not of a process's random number
generator: one process and two draw the same samples for the same instances, and a resumed run draws what the
uninterrupted one did.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from bertforge.config import BertConfig
from bertforge.device import to_device
from bertforge.electra import ElectraForPreTraining, generator_config
from bertforge.models import IGNORE_INDEX
from bertforge.options import ElectraOptions
from bertforge.train import distributed

_M32 = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors holding values below 2**32 (products stay below 2**63: exact)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def position_uniforms(seed: int, instance: torch.Tensor, length: int) -> torch.Tensor:
    """(B, T) uniforms in (0, 1), float32, for the instances `instance` (B, 2) (epoch, index) at positions 0..T-1:
    a hash of (seed, epoch, index, position), the same on every device and process."""
    key = _mix(torch.full_like(instance[:, :1], seed & _M32))
    key = _mix(key ^ (instance[:, :1] & _M32))
    key = _mix(key ^ (instance[:, 1:] & _M32))  # (B, 1)
    positions = torch.arange(length, device=instance.device)[None, :]
    h = _mix(_mix(key ^ positions))  # (B, T)
    return ((h >> 8).float() + 0.5) / float(1 << 24)


def build_electra(config: BertConfig, options: ElectraOptions) -> ElectraForPreTraining:
    return ElectraForPreTraining(config, generator_config(config, options.generator_width, options.generator_layers))


class ElectraObjective:
    """loss = the generator's mean MLM cross-entropy over masked positions + `discriminator_weight` x the
    discriminator's mean replaced-token cross-entropy over non-padding positions. The second term is logged
    weighted (`rtd_loss`), so the terms add up to the loss; the evaluation reports it unweighted (`disc_loss`)."""

    def __init__(self, discriminator_weight: float, seed: int):
        self.weight, self.seed = discriminator_weight, seed

    def counts(self, batch: dict) -> dict[str, float]:
        return {"mlm": int((batch["mlm_labels"] != IGNORE_INDEX).sum()), "rtd": int(batch["attention_mask"].sum())}

    def uniforms(self, batch: dict) -> torch.Tensor:
        ids = batch["input_ids"]
        if "instance" not in batch:  # batches made elsewhere than PretrainingData: the process's generator
            return torch.rand(ids.shape, device=ids.device)
        return position_uniforms(self.seed, batch["instance"], ids.shape[1])

    def forward(self, model: nn.Module, batch: dict):
        return model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
                     mlm_labels=batch["mlm_labels"], uniforms=self.uniforms(batch))

    def losses(self, model: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
        out = self.forward(model, batch)
        return {"mlm": out.mlm_loss, "rtd": self.weight * out.rtd_loss}


def evaluate_electra(model: ElectraForPreTraining, batches: list[dict], device: torch.device, *,
                     objective: ElectraObjective, dist: distributed.Dist | None = None) -> dict[str, float]:
    """The generator's MLM accuracy, loss and perplexity over masked positions; the discriminator's accuracy and
    mean loss over non-padding positions, and its precision and recall on the replaced tokens (`replaced_share`: the
    share of them, so 1 - it is the accuracy of always answering "original"). Sharded as `evaluate_pretraining`."""
    sums = dict.fromkeys(("mlm_loss", "mlm_correct", "mlm_n", "disc_loss", "disc_correct", "disc_n", "tp", "fp",
                          "replaced"), 0.0)
    for batch in batches:
        b = to_device(batch, device)
        out = objective.forward(model, b)
        targets = b["mlm_labels"][b["mlm_labels"] != IGNORE_INDEX]
        sums["mlm_loss"] += float(torch.nn.functional.cross_entropy(out.mlm_logits.float(), targets,
                                                                    reduction="sum"))
        sums["mlm_correct"] += float((out.mlm_logits.argmax(-1) == targets).sum())
        sums["mlm_n"] += targets.numel()
        real = b["attention_mask"].to(out.rtd_logits.device).bool()
        n = float(real.sum())
        said, truth = (out.rtd_logits > 0)[real], out.replaced[real]
        sums["disc_loss"] += float(out.rtd_loss) * n
        sums["disc_correct"] += float((said == truth).sum())
        sums["disc_n"] += n
        sums["tp"] += float((said & truth).sum())
        sums["fp"] += float((said & ~truth).sum())
        sums["replaced"] += float(truth.sum())
    if dist is not None:
        sums = dict(zip(sums, distributed.all_reduce_sum(list(sums.values()), dist), strict=True))
    mean = sums["mlm_loss"] / max(sums["mlm_n"], 1)
    return {"mlm_accuracy": sums["mlm_correct"] / max(sums["mlm_n"], 1), "mlm_loss": mean,
            "mlm_perplexity": math.exp(min(mean, 50.0)),
            "disc_accuracy": sums["disc_correct"] / max(sums["disc_n"], 1),
            "disc_loss": sums["disc_loss"] / max(sums["disc_n"], 1),
            "replaced_precision": sums["tp"] / max(sums["tp"] + sums["fp"], 1),
            "replaced_recall": sums["tp"] / max(sums["replaced"], 1),
            "replaced_share": sums["replaced"] / max(sums["disc_n"], 1)}

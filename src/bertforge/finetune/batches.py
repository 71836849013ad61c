"""The training batches of the fine-tuning path: a task's features shuffled, grouped by length and padded per batch
(`FeatureBatches`), resumable from a position. Fine-tuning feeds the model's inputs and the task's targets;
distillation (`bertforge.distill`) passes its own `collate`, which adds the teacher's outputs."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from bertforge.tasks import collate
from bertforge.tasks.runner import MODEL_INPUTS, feature_length

TARGETS = ("labels", "start_positions", "end_positions")


def task_batch(features: Sequence[dict], pad_id: int) -> dict:
    """A training batch of task features: the model's inputs and the task's targets, padded."""
    return {k: v for k, v in collate(features, pad_id).items() if k in MODEL_INPUTS or k in TARGETS}


class FeatureBatches:
    """Shuffled batches of task features, padded per batch, grouped by length so little work is padding.

    Epoch e shuffles with (seed, e); consecutive runs of 50 batches' worth of features are sorted by length
    and cut into batches, whose order is shuffled again. `position` = {"epoch", "batch"}. With several
    processes, rank r takes batches r, r + W, ... of each global step's W x accumulation batches. `collate` makes
    a batch of features (default: `task_batch`).
    """

    def __init__(self, features: Sequence[dict], pad_id: int, *, seed: int = 0, rank: int = 0, world_size: int = 1,
                 group_by_length: bool = True, collate: Callable[[Sequence[dict], int], dict] = task_batch):
        self.features, self.pad_id, self.seed, self.collate = list(features), pad_id, seed, collate
        self.rank, self.world_size, self.group = rank, world_size, group_by_length
        self.lengths = np.array([feature_length(f) for f in self.features])

    def epoch_batches(self, epoch: int, size: int) -> list[np.ndarray]:
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self.features))
        if self.group:
            chunk = size * 50
            order = np.concatenate([c[np.argsort(self.lengths[c], kind="stable")]
                                    for c in np.split(order, range(chunk, len(order), chunk))])
        batches = [order[i:i + size] for i in range(0, len(order), size)]
        if self.group:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches

    def batches(self, micro_batch_size: int, position: dict | None = None):
        return _FeatureIterator(self, micro_batch_size, position or {"epoch": 0, "batch": 0})


class _FeatureIterator:
    def __init__(self, source: FeatureBatches, size: int, position: dict):
        self.source, self.size = source, size
        self.position = {"epoch": int(position["epoch"]), "batch": int(position["batch"])}
        self._cache: tuple[int, list] | None = None

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        s = self.source
        while True:
            epoch, k = self.position["epoch"], self.position["batch"]
            if self._cache is None or self._cache[0] != epoch:
                self._cache = (epoch, s.epoch_batches(epoch, self.size))
            batches = self._cache[1]
            usable = len(batches) - len(batches) % s.world_size  # every rank gets the same number
            if k * s.world_size >= usable:
                self.position = {"epoch": epoch + 1, "batch": 0}
                continue
            self.position = {"epoch": epoch, "batch": k + 1}
            idx = batches[k * s.world_size + s.rank]
            return s.collate([s.features[i] for i in idx], s.pad_id)

"""Masked-LM masking by the original rules (google-research/bert `create_masked_lm_predictions`).

Pure functions of their inputs and an explicit `np.random.Generator`, so they replay exactly and can be
tested statistically. Conventions: `ids` (T,) is one whole instance, `[CLS] A [SEP] B [SEP]`; labels are
-100 (IGNORE_INDEX) where nothing is predicted and the original token id where something is.

Rules: of the non-special positions, `min(max_predictions, max(1, round(T * masked_lm_prob)))` are chosen
(T counts the special tokens too, as in the original); each chosen one becomes `[MASK]` with probability 0.8,
stays itself with 0.1, and becomes a random token with 0.1. With `whole_word_mask`, a word (a token and the
`##` pieces after it) is chosen or left whole, and words that would overshoot the count are skipped.

One deliberate difference: the random replacement is drawn from the non-special tokens (the original draws
from the whole vocabulary, so could put `[CLS]` or `[PAD]` mid-sentence).
"""

from __future__ import annotations

import numpy as np

IGNORE_INDEX = -100


def num_predictions(length: int, masked_lm_prob: float, max_predictions: int) -> int:
    """How many positions the original predicts in an instance of `length` tokens (Python's `round`)."""
    return min(max_predictions, max(1, int(round(length * masked_lm_prob))))


def word_starts(ids: np.ndarray, candidates: np.ndarray, is_subword: np.ndarray) -> np.ndarray:
    """(W,) indices into `candidates` where a new word starts: a candidate is a continuation when its token
    is a `##` piece and the previous candidate is the position just before it."""
    if len(candidates) == 0:
        return np.zeros(0, np.int64)
    cont = np.zeros(len(candidates), bool)
    cont[1:] = is_subword[ids[candidates[1:]]] & (np.diff(candidates) == 1)
    return np.flatnonzero(~cont)


def mask_tokens(ids: np.ndarray, rng: np.random.Generator, *, is_special: np.ndarray, mask_id: int,
                replacement_ids: np.ndarray, masked_lm_prob: float = 0.15, max_predictions: int = 20,
                is_subword: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Mask one instance. Returns (input_ids (T,) int64, labels (T,) int64, -100 where not predicted).

    `is_special` (V,) bool marks tokens never chosen ([CLS], [SEP], [PAD], ...); `replacement_ids` are the
    ids a random replacement is drawn from; `is_subword` (V,) bool, given, turns on whole-word masking.
    """
    ids = np.asarray(ids, dtype=np.int64)
    out = ids.copy()
    labels = np.full(len(ids), IGNORE_INDEX, np.int64)
    candidates = np.flatnonzero(~is_special[ids])
    if len(candidates) == 0:
        return out, labels
    n = num_predictions(len(ids), masked_lm_prob, max_predictions)
    if is_subword is None:
        chosen = rng.permutation(candidates)[:n]
    else:
        starts = word_starts(ids, candidates, is_subword)
        ends = np.append(starts[1:], len(candidates))
        chosen_list: list[np.ndarray] = []
        total = 0
        for w in rng.permutation(len(starts)):
            if total >= n:
                break
            size = int(ends[w] - starts[w])
            if total + size > n:
                continue
            chosen_list.append(candidates[starts[w]:ends[w]])
            total += size
        chosen = np.concatenate(chosen_list) if chosen_list else np.zeros(0, np.int64)
    labels[chosen] = ids[chosen]
    u = rng.random(len(chosen))
    to_mask = chosen[u < 0.8]
    to_random = chosen[u >= 0.9]
    out[to_mask] = mask_id
    out[to_random] = replacement_ids[rng.integers(0, len(replacement_ids), len(to_random))]
    return out, labels


# -- a whole batch at once ---------------------------------------------------------------------------------
# Per-instance generators cost more than the masking itself (about 17 us to key one, 64 a step at half depth), so
# batches are masked in a few array operations instead, each instance from its own counter-based random numbers:
# splitmix64's finalizer over (instance key, position, stream), the same whatever else is in the batch.

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_U64 = (1 << 64) - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise over uint64 (wrapping): neighbouring inputs give unrelated outputs."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def instance_keys(seed: int, epochs: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """(B,) uint64: the masking key of each (epoch, index) instance under `seed`."""
    epochs = np.asarray(epochs).astype(np.uint64)
    key = _mix(np.full(len(epochs), seed & _U64, np.uint64) + _GOLDEN)
    key = _mix(key + epochs * _GOLDEN)
    return _mix(key + np.asarray(indices).astype(np.uint64) * _GOLDEN)


def _stream(keys: np.ndarray, width: int, stream: int) -> np.ndarray:
    """(B, width) uint64 random numbers of `stream` (0-2) for each instance key and position."""
    positions = np.arange(width, dtype=np.uint64) * np.uint64(3) + np.uint64(stream + 1)
    return _mix(keys[:, None] + positions[None, :] * _GOLDEN)


def mask_batch(ids: np.ndarray, lengths: np.ndarray, keys: np.ndarray, *, is_special: np.ndarray, mask_id: int,
               replacement_ids: np.ndarray, masked_lm_prob: float = 0.15,
               max_predictions: int = 20) -> tuple[np.ndarray, np.ndarray]:
    """`mask_tokens`'s rules for B instances at once: `ids` (B, T) int64, row i's instance in its first
    `lengths[i]` positions (the rest padding, never chosen), `keys` (B,) from `instance_keys`. Each row chooses
    `num_predictions(lengths[i])` of its non-special positions uniformly (the smallest of their random numbers),
    then 80% `[MASK]`, 10% unchanged, 10% a random token. Returns (input_ids, labels), both (B, T) int64."""
    ids = np.asarray(ids, dtype=np.int64)
    b, width = ids.shape
    lengths = np.asarray(lengths, dtype=np.int64)
    candidate = ~is_special[ids] & (np.arange(width) < lengths[:, None])
    # Python's round, as num_predictions: numpy's rounds halves to even too
    wanted = np.minimum(max_predictions, np.maximum(1, np.round(lengths * masked_lm_prob).astype(np.int64)))
    draw = np.where(candidate, _stream(keys, width, 0), np.uint64(_U64))
    rank = np.empty((b, width), np.int64)
    np.put_along_axis(rank, np.argsort(draw, axis=1, kind="stable"), np.arange(width)[None, :], 1)
    chosen = candidate & (rank < wanted[:, None])
    u = (_stream(keys, width, 1) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
    replacement = replacement_ids[(_stream(keys, width, 2) % np.uint64(len(replacement_ids))).astype(np.int64)]
    labels = np.where(chosen, ids, IGNORE_INDEX)
    out = np.where(chosen & (u < 0.8), mask_id, ids)
    out = np.where(chosen & (u >= 0.9), replacement, out)
    return out, labels

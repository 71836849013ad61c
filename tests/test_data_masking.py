"""MLM masking: counts by the original rule, uniform choice of positions, 80/10/10, specials never chosen,
whole words whole; the same rules for a batch masked at once (`mask_batch`, run here one row at a time and in
mixed batches). Statistical bounds are 5 sigma of a binomial proportion for the sample size used."""

from __future__ import annotations

import numpy as np
import pytest
from support import binomial_bound

from bertforge.data.masking import IGNORE_INDEX, instance_keys, mask_batch, mask_tokens

V = 1000
PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
IS_SPECIAL = np.zeros(V, bool)
IS_SPECIAL[[PAD, UNK, CLS, SEP, MASK]] = True
REPLACEMENTS = np.flatnonzero(~IS_SPECIAL)


def instance(len_a: int, len_b: int, rng: np.random.Generator) -> np.ndarray:
    a = rng.integers(5, V, len_a)
    b = rng.integers(5, V, len_b)
    return np.concatenate([[CLS], a, [SEP], b, [SEP]])


def mask(ids, rng, **kw):
    kw.setdefault("max_predictions", 20)
    return mask_tokens(ids, rng, is_special=IS_SPECIAL, mask_id=MASK, replacement_ids=REPLACEMENTS, **kw)


def mask_one_row(ids, rng, **kw):
    """`mask_batch` on a batch of one, its key drawn from `rng`, padded to a wider row that must stay as it was."""
    kw.setdefault("max_predictions", 20)
    key = instance_keys(int(rng.integers(2**62)), np.zeros(1, int), np.zeros(1, int))
    padded = np.concatenate([ids, [PAD] * 5])[None, :]
    out, labels = mask_batch(padded, np.array([len(ids)]), key, is_special=IS_SPECIAL, mask_id=MASK,
                             replacement_ids=REPLACEMENTS, **kw)
    assert (out[0, len(ids):] == PAD).all() and (labels[0, len(ids):] == IGNORE_INDEX).all()
    return out[0, :len(ids)], labels[0, :len(ids)]


both = pytest.mark.parametrize("mask", [mask, mask_one_row], ids=["per-instance", "batch"])


@both
def test_number_of_predictions_follows_the_original_rule(mask):
    rng = np.random.default_rng(0)
    for total in range(5, 300, 7):
        ids = instance(total - 3 - total // 3, total // 3, rng)
        _, labels = mask(ids, rng, max_predictions=20)
        expected = min(20, max(1, int(round(total * 0.15))))  # the rule, written out here
        assert (labels != IGNORE_INDEX).sum() == expected, total


@both
def test_about_15_percent_of_tokens_are_predicted_when_the_cap_does_not_bind(mask):
    rng = np.random.default_rng(1)
    chosen = total = 0
    for _ in range(500):
        ids = instance(int(rng.integers(10, 60)), int(rng.integers(10, 60)), rng)
        _, labels = mask(ids, rng, max_predictions=10_000)
        chosen += int((labels != IGNORE_INDEX).sum())
        total += len(ids)
    assert abs(chosen / total - 0.15) < 0.5 / 40  # rounding per instance moves it by at most half a token


@both
def test_special_tokens_are_never_chosen_and_labels_are_the_originals(mask):
    rng = np.random.default_rng(2)
    for _ in range(300):
        ids = instance(int(rng.integers(1, 80)), int(rng.integers(1, 80)), rng)
        ids[rng.integers(1, len(ids) - 1, 3)] = UNK  # [UNK] in the text is special too
        out, labels = mask(ids, rng)
        picked = labels != IGNORE_INDEX
        assert not IS_SPECIAL[ids[picked]].any()
        np.testing.assert_array_equal(labels[picked], ids[picked])
        np.testing.assert_array_equal(out[~picked], ids[~picked])  # nothing else changes
        assert not IS_SPECIAL[out[picked & (out != MASK)]].any()  # random replacements are never special


@both
def test_positions_are_chosen_uniformly(mask):
    rng = np.random.default_rng(3)
    n, len_a, len_b = 4000, 50, 47  # total 100: round(15.0) = 15 of 97 candidates
    counts = np.zeros(100)
    for _ in range(n):
        _, labels = mask(instance(len_a, len_b, rng), rng)
        counts += labels != IGNORE_INDEX
    p = 15 / 97
    candidates = np.ones(100, bool)
    candidates[[0, 51, 99]] = False
    assert (counts[~candidates] == 0).all()
    assert np.abs(counts[candidates] / n - p).max() < binomial_bound(n, p)


@both
def test_80_10_10(mask):
    rng = np.random.default_rng(4)
    masked = kept = replaced = 0
    for _ in range(3000):
        ids = instance(60, 60, rng)
        out, labels = mask(ids, rng)
        picked = labels != IGNORE_INDEX
        masked += int((out[picked] == MASK).sum())
        kept += int((out[picked] == ids[picked]).sum())
        replaced += int(((out[picked] != MASK) & (out[picked] != ids[picked])).sum())
    n = masked + kept + replaced
    same = 1 / len(REPLACEMENTS)  # a random replacement can draw the original token
    for got, p in ((masked, 0.8), (kept, 0.1 + 0.1 * same), (replaced, 0.1 * (1 - same))):
        assert abs(got / n - p) < binomial_bound(n, p), (got / n, p)


def test_whole_word_masking_keeps_words_whole():
    rng = np.random.default_rng(5)
    is_subword = np.zeros(V, bool)
    is_subword[500:] = True  # ids >= 500 are '##' pieces
    words_seen = set()
    for _ in range(500):
        ids = instance(40, 40, rng)
        out, labels = mask(ids, rng, is_subword=is_subword)
        picked = labels != IGNORE_INDEX
        n = min(20, max(1, int(round(len(ids) * 0.15))))
        assert picked.sum() <= n
        # Walk the words as the original defines them and check each is all-or-nothing.
        start = None
        for i in range(len(ids) + 1):
            new_word = i == len(ids) or IS_SPECIAL[ids[i]] or not is_subword[ids[i]] or start is None
            if new_word and start is not None:
                state = picked[start:i]
                assert state.all() or not state.any(), (ids[start:i], state)
                if state.all():
                    words_seen.add(i - start)
                start = None
            if i < len(ids) and not IS_SPECIAL[ids[i]] and start is None:
                start = i
    assert max(words_seen) >= 3  # multi-piece words were actually masked whole


def test_same_rng_same_result():
    ids = instance(30, 30, np.random.default_rng(6))
    a = mask(ids, np.random.default_rng(7))
    b = mask(ids, np.random.default_rng(7))
    c = mask(ids, np.random.default_rng(8))
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[1], c[1])


def batch_of(rows, keys, **kw):
    lengths = np.array([len(r) for r in rows])
    ids = np.full((len(rows), lengths.max()), PAD)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    kw.setdefault("max_predictions", 20)
    return mask_batch(ids, lengths, keys, is_special=IS_SPECIAL, mask_id=MASK, replacement_ids=REPLACEMENTS, **kw)


def test_a_batch_row_depends_on_its_instance_and_key_only():
    rng = np.random.default_rng(9)
    rows = [instance(int(rng.integers(1, 70)), int(rng.integers(0, 70)), rng) for _ in range(40)]
    keys = instance_keys(12345, np.full(40, 3), np.arange(100, 140))
    out, labels = batch_of(rows, keys)
    for i in rng.permutation(40)[:10]:
        others = [rows[j] for j in (i, (i + 7) % 40)]  # another batch, another width, this row first
        alone_out, alone_labels = batch_of(others, keys[[i, (i + 7) % 40]])
        n = len(rows[i])
        np.testing.assert_array_equal(alone_out[0, :n], out[i, :n])
        np.testing.assert_array_equal(alone_labels[0, :n], labels[i, :n])


def test_batch_keys_differ_by_seed_epoch_and_index():
    keys = [instance_keys(s, np.array([e]), np.array([i]))[0] for s in (1, 2) for e in (0, 1) for i in (0, 1)]
    assert len(set(keys)) == 8
    ids = instance(60, 60, np.random.default_rng(10))
    masks = {batch_of([ids], np.array([k]))[1].tobytes() for k in keys}
    assert len(masks) == 8  # 18 of 123 positions: eight keys drawing one choice twice is not a chance to fear

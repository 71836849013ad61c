"""PretrainingData and its batches: conventions, determinism in (seed, epoch), exact resume, DDP rank and
DataLoader worker sharding, dynamic and static masking, tokenizer checks; the one padding helper that pretraining
and task batches share."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from support import prepared_dir, tokenizer

from bertforge.data.loader import PretrainingData, collate
from bertforge.data.padding import pad_ids, pad_rows
from bertforge.errors import BertforgeError
from bertforge.options import DataOptions
from bertforge.tasks import collate as collate_features


@pytest.fixture(scope="module")
def data_dir():
    return prepared_dir()


def take(it, n):
    return list(itertools.islice(it, n))


def assert_batches_equal(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            torch.testing.assert_close(x[k], y[k], rtol=0, atol=0)


def test_batch_conventions(data_dir):
    tok = tokenizer()
    data = PretrainingData(data_dir, "train")
    assert data.max_seq_len == 64 and data.manifest["max_seq_len"] == 64
    assert data.tokenizer_fingerprint == tok.fingerprint
    widths = set()
    for batch in take(data.batches(2), 60):
        ids, types, att, labels, nsp = (batch[k] for k in
                                        ("input_ids", "token_type_ids", "attention_mask", "mlm_labels", "nsp_labels"))
        b, t = ids.shape
        assert b == 2 and t <= 64 and nsp.shape == (2,)
        assert all(x.dtype == torch.long and x.shape == (b, t) for x in (ids, types, att, labels))
        lengths = att.sum(1)
        assert lengths.max() == t  # padded only to the longest in the batch
        widths.add(t)
        assert set(nsp.tolist()) <= {0, 1}
        for row in range(b):
            n = int(lengths[row])
            assert (att[row, :n] == 1).all() and (att[row, n:] == 0).all()
            assert (ids[row, n:] == tok.pad_id).all() and (labels[row, n:] == -100).all()
            assert ids[row, 0] == tok.cls_id and ids[row, n - 1] == tok.sep_id
            seps = (ids[row, :n] == tok.sep_id).nonzero().flatten().tolist()
            assert len(seps) == 2
            assert (types[row, : seps[0] + 1] == 0).all() and (types[row, seps[0] + 1 : n] == 1).all()
            picked = labels[row] != -100
            assert 1 <= picked.sum() <= round(n * 0.15) + 1
            assert not picked[[0, seps[0], seps[1]]].any()
    assert len(widths) > 1


def test_deterministic_in_seed_and_epoch(data_dir):
    a = take(PretrainingData(data_dir, options=DataOptions(seed=3)).batches(4), 5)
    b = take(PretrainingData(data_dir, options=DataOptions(seed=3)).batches(4), 5)
    c = take(PretrainingData(data_dir, options=DataOptions(seed=4)).batches(4), 5)
    assert_batches_equal(a, b)
    assert not torch.equal(a[0]["input_ids"], c[0]["input_ids"])


def test_resume_exactly_including_across_an_epoch_boundary(data_dir):
    data = PretrainingData(data_dir, "val")
    n_epoch = sum(1 for _ in data.epoch_instances(0))
    assert n_epoch > 8
    it = data.batches(5)
    positions = []
    batches = []
    for _ in range(n_epoch // 5 + 4):  # runs past the end of epoch 0
        batches.append(next(it))
        positions.append(dict(it.position))
    assert positions[0] == {"epoch": 0, "position": 5}
    assert positions[-1]["epoch"] == 1
    for k in (0, len(batches) // 2, n_epoch // 5 - 1, n_epoch // 5):
        resumed = take(PretrainingData(data_dir, "val").batches(5, position=positions[k]), len(batches) - k - 1)
        assert_batches_equal(resumed, batches[k + 1:])


def test_epochs_use_fresh_pairs_and_masks_and_static_masking_repeats(data_dir):
    dyn = PretrainingData(data_dir)
    e0 = take(dyn.batches(4, epoch_start=0), 2)
    e1 = take(dyn.batches(4, epoch_start=1), 2)
    assert not torch.equal(e0[0]["input_ids"], e1[0]["input_ids"])
    static = PretrainingData(data_dir, options=DataOptions(dupe_factor=2))
    s0, s2 = take(static.batches(4, epoch_start=0), 2), take(static.batches(4, epoch_start=2), 2)
    s1 = take(static.batches(4, epoch_start=1), 2)
    assert_batches_equal(s0, s2)
    assert not torch.equal(s0[0]["input_ids"], s1[0]["input_ids"])


def test_ranks_take_disjoint_interleaved_shares_of_the_same_stream(data_dir):
    whole = PretrainingData(data_dir, "val")
    r0 = PretrainingData(data_dir, "val", rank=0, world_size=2)
    r1 = PretrainingData(data_dir, "val", rank=1, world_size=2)
    n = sum(1 for _ in whole.epoch_instances(0))
    reference = [whole.mask(inst, 0, i) for i, inst in enumerate(whole.epoch_instances(0))]
    got = {}
    for r, data in ((0, r0), (1, r1)):
        stream = data._rank_stream(0, 0)
        for e, i, inst in itertools.islice(stream, n // 2):
            assert e == 0 and i % 2 == r
            got[i] = data.mask(inst, e, i)
    assert sorted(got) == list(range(2 * (n // 2)))  # disjoint, and together the whole epoch (less an odd one)
    for i, (ids, labels, types, nsp) in got.items():
        for mine, ref in zip((ids, labels, types, nsp), reference[i], strict=True):
            np.testing.assert_array_equal(mine, ref)
    b0, b1 = next(r0.batches(3)), next(r1.batches(3))
    it0 = r0.batches(3)
    next(it0)
    it1 = r1.batches(3)
    next(it1)
    assert it0.position == it1.position == {"epoch": 0, "position": 6}  # the same on every rank
    assert not torch.equal(b0["input_ids"][0, :5], b1["input_ids"][0, :5])


def test_dataloader_workers_give_the_same_batches(data_dir):
    data = PretrainingData(data_dir, "val")
    plain = data.batches(4)
    expected = take(plain, 6)
    it = data.batches(4, num_workers=2)
    got = take(it, 6)
    assert_batches_equal(got, expected)
    assert it.position == plain.position


def test_whole_word_masking_option(data_dir):
    tok = tokenizer()
    data = PretrainingData(data_dir, options=DataOptions(whole_word_mask=True))
    for batch in take(data.batches(16), 5):
        for ids, labels in zip(batch["input_ids"], batch["mlm_labels"], strict=True):
            picked = (labels != -100).numpy()
            sub = tok.is_subword[np.where(picked, labels.numpy(), ids.numpy())]
            # a '##' piece is predicted exactly when the token before it is (they are one word)
            follow = sub[1:] & (ids[1:] != tok.pad_id).numpy()
            assert (picked[1:][follow] == picked[:-1][follow]).all()


def test_tokenizer_mismatch_and_bad_arguments_are_refused(data_dir, tmp_path):
    from bertforge.tokenizer import Tokenizer

    data = PretrainingData(data_dir)
    other = Tokenizer(tokenizer().vocab[:-1], lowercase=True)
    with pytest.raises(BertforgeError, match="prepared with tokenizer"):
        data.check_tokenizer(other.fingerprint)
    with pytest.raises(BertforgeError, match="prepared with tokenizer"):
        PretrainingData(data_dir, tokenizer=other)
    with pytest.raises(BertforgeError, match="rank"):
        PretrainingData(data_dir, rank=2, world_size=2)
    with pytest.raises(BertforgeError, match="no prepared data"):
        PretrainingData(tmp_path)
    with pytest.raises(BertforgeError, match="multiple of world_size"):
        PretrainingData(data_dir, world_size=2).batches(2, position={"epoch": 0, "position": 3})


def test_pretraining_and_task_batches_are_padded_by_one_helper():
    rows = [[5, 6, 7], [8], [9, 10]]
    ids, mask = pad_ids(rows, 0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0], [9, 10, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert ids.dtype == mask.dtype == torch.long
    assert pad_rows([np.array([1]), [2, 3]], -100, width=4).tolist() == [[1, -100, -100, -100], [2, 3, -100, -100]]
    pretraining = collate([(np.array(r), np.full(len(r), -100), np.zeros(len(r), np.int64), False) for r in rows], 0)
    task = collate_features([{"input_ids": r, "token_type_ids": [0] * len(r)} for r in rows], 0)
    for batch in (pretraining, task):
        assert torch.equal(batch["input_ids"], ids) and torch.equal(batch["attention_mask"], mask)
    choices = collate_features([{"input_ids": [r, r[:1]], "token_type_ids": [[0] * len(r), [0]]} for r in rows], 0)
    assert choices["input_ids"].shape == (3, 2, 3) and choices["attention_mask"][:, 1].sum() == 3  # (B, C, T)
    with pytest.raises(BertforgeError, match="same number of choices"):  # padded as rows, not silently reshaped
        collate_features([{"input_ids": [[1, 2]] * n, "token_type_ids": [[0, 0]] * n} for n in (2, 1, 3)], 0)


@pytest.mark.parametrize("whole_word_mask", [False, True])
def test_a_batch_is_its_instances_masked_one_by_one(data_dir, whole_word_mask):
    data = PretrainingData(data_dir, "train", DataOptions(whole_word_mask=whole_word_mask, masked_lm_prob=0.4))
    batch = next(data.batches(16))
    rows = [data.mask(inst, 0, i) for i, inst in enumerate(itertools.islice(data.epoch_instances(0), 16))]
    assert_batches_equal([batch], [{**collate(rows, data.pad_id), "instance": batch["instance"]}])
    assert (batch["mlm_labels"] != -100).sum() > 16  # something was masked

"""NSP instance creation: properties, rates with binomial bounds, and statistics matched against a
straightforward re-implementation of the original create_pretraining_data.py logic kept here."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import binomial_bound

from bertforge.data.instances import create_instances, truncate_pair
from bertforge.data.masking import mask_tokens
from bertforge.tokenizer import longest_first

MAX_SEQ_LEN = 64


def synthetic_documents(n_docs: int, seed: int) -> list[list[np.ndarray]]:
    """Documents of 1-60 sentences of 1-40 tokens; every token of document d is 1000 + d (so a token tells
    which document it came from)."""
    rng = np.random.default_rng(seed)
    return [[np.full(int(rng.integers(1, 41)), 1000 + d) for _ in range(int(rng.integers(1, 61)))]
            for d in range(n_docs)]


def ours(docs, seed, short_seq_prob=0.1, max_seq_len=MAX_SEQ_LEN):
    out = []
    for d, doc in enumerate(docs):
        rng = np.random.default_rng([seed, d])
        out.extend(create_instances(doc, d, len(docs), docs.__getitem__, rng, max_seq_len=max_seq_len,
                                    short_seq_prob=short_seq_prob))
    return out


# -- the reference: the original algorithm, written out plainly with lists and random.Random -------------

def ref_truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng):
    while True:
        total_length = len(tokens_a) + len(tokens_b)
        if total_length <= max_num_tokens:
            break
        trunc_tokens = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        if rng.random() < 0.5:
            del trunc_tokens[0]
        else:
            trunc_tokens.pop()


def ref_create_instances_from_document(all_documents, document_index, max_seq_length, short_seq_prob, rng):
    document = all_documents[document_index]
    max_num_tokens = max_seq_length - 3
    target_seq_length = max_num_tokens
    if rng.random() < short_seq_prob:
        target_seq_length = rng.randint(2, max_num_tokens)
    instances = []
    current_chunk = []
    current_length = 0
    i = 0
    while i < len(document):
        segment = document[i]
        current_chunk.append(segment)
        current_length += len(segment)
        if i == len(document) - 1 or current_length >= target_seq_length:
            if current_chunk:
                a_end = 1
                if len(current_chunk) >= 2:
                    a_end = rng.randint(1, len(current_chunk) - 1)
                tokens_a = []
                for j in range(a_end):
                    tokens_a.extend(current_chunk[j])
                tokens_b = []
                is_random_next = False
                if len(current_chunk) == 1 or rng.random() < 0.5:
                    is_random_next = True
                    target_b_length = target_seq_length - len(tokens_a)
                    for _ in range(10):
                        random_document_index = rng.randint(0, len(all_documents) - 1)
                        if random_document_index != document_index:
                            break
                    random_document = all_documents[random_document_index]
                    random_start = rng.randint(0, len(random_document) - 1)
                    for j in range(random_start, len(random_document)):
                        tokens_b.extend(random_document[j])
                        if len(tokens_b) >= target_b_length:
                            break
                    num_unused_segments = len(current_chunk) - a_end
                    i -= num_unused_segments
                else:
                    is_random_next = False
                    for j in range(a_end, len(current_chunk)):
                        tokens_b.extend(current_chunk[j])
                ref_truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng)
                instances.append((tokens_a, tokens_b, is_random_next))
            current_chunk = []
            current_length = 0
        i += 1
    return instances


def ref_num_masked(tokens, masked_lm_prob, max_predictions_per_seq, rng):
    """The original create_masked_lm_predictions' count of predictions (its candidate walk, shuffled)."""
    cand_indexes = [i for i, t in enumerate(tokens) if t not in ("[CLS]", "[SEP]")]
    rng.shuffle(cand_indexes)
    num_to_predict = min(max_predictions_per_seq, max(1, int(round(len(tokens) * masked_lm_prob))))
    masked = []
    for index in cand_indexes:
        if len(masked) >= num_to_predict:
            break
        masked.append(index)
    return len(masked)


def reference(docs, seed, short_seq_prob=0.1):
    lists = [[list(map(int, s)) for s in doc] for doc in docs]
    rng = random.Random(seed)
    out = []
    for d in range(len(lists)):
        out.extend(ref_create_instances_from_document(lists, d, MAX_SEQ_LEN, short_seq_prob, rng))
    return out


# -- statistics compared ------------------------------------------------------------------------------------

def _stats(pairs):
    """Per-instance arrays: total length, A share, NotNext, predictions."""
    total = np.array([len(a) + len(b) for a, b, _ in pairs], float)
    share = np.array([len(a) / (len(a) + len(b)) for a, b, _ in pairs])
    nsp = np.array([float(r) for _, _, r in pairs])
    return total, share, nsp


def _assert_same_mean(x, y, what):
    se = np.sqrt(x.var() / len(x) + y.var() / len(y))
    assert abs(x.mean() - y.mean()) < 5 * se, (what, x.mean(), y.mean(), se)


@pytest.mark.slow
def test_statistics_match_the_reference_implementation():
    docs = synthetic_documents(400, seed=10)
    mine = [(i.tokens_a, i.tokens_b, i.is_random_next) for seed in range(3) for i in ours(docs, seed)]
    ref = [p for seed in range(3) for p in reference(docs, seed)]
    # Instances per document depend on segments being returned after a random B: same count, within noise.
    assert abs(len(mine) - len(ref)) < 5 * np.sqrt(len(ref)), (len(mine), len(ref))
    (t1, s1, n1), (t2, s2, n2) = _stats(mine), _stats(ref)
    _assert_same_mean(t1, t2, "total length")
    _assert_same_mean(s1, s2, "A share of the pair")
    _assert_same_mean(n1, n2, "NotNext rate")
    # Length histogram: each bin's share within 5 sigma of the difference of two proportions.
    bins = [0, 8, 16, 24, 32, 40, 48, 56, 60, 61]
    h1 = np.histogram(t1, bins)[0] / len(t1)
    h2 = np.histogram(t2, bins)[0] / len(t2)
    for k in range(len(h1)):
        p = (h1[k] * len(t1) + h2[k] * len(t2)) / (len(t1) + len(t2))
        se = np.sqrt(p * (1 - p) * (1 / len(t1) + 1 / len(t2)))
        assert abs(h1[k] - h2[k]) < 5 * se + 1e-12, (bins[k], h1[k], h2[k])
    # Predictions per instance: our masking against the original's rule on the reference instances.
    is_special = np.zeros(2000, bool)
    is_special[[0, 1, 2, 3, 4]] = True
    rng, prng = np.random.default_rng(0), random.Random(0)
    p1 = np.array([(mask_tokens(np.concatenate([[2], a, [3], b, [3]]), rng, is_special=is_special, mask_id=4,
                                replacement_ids=np.arange(5, 2000), max_predictions=20)[1] >= 0).sum()
                   for a, b, _ in mine], float)
    p2 = np.array([ref_num_masked(["[CLS]", *a, "[SEP]", *b, "[SEP]"], 0.15, 20, prng) for a, b, _ in ref],
                  float)
    _assert_same_mean(p1, p2, "predictions per instance")
    assert set(np.unique(p1)) == set(np.unique(p2))


def test_lengths_never_exceed_the_maximum_and_segments_are_never_empty():
    docs = synthetic_documents(100, seed=11)
    for inst in ours(docs, 0):
        assert len(inst.tokens_a) >= 1 and len(inst.tokens_b) >= 1
        assert len(inst.tokens_a) + len(inst.tokens_b) <= MAX_SEQ_LEN - 3


def test_notnext_b_never_comes_from_the_same_document_and_isnext_always_does():
    docs = synthetic_documents(50, seed=12)
    for d, doc in enumerate(docs):
        for inst in create_instances(doc, d, len(docs), docs.__getitem__, np.random.default_rng(d),
                                     max_seq_len=MAX_SEQ_LEN):
            assert (inst.tokens_a == 1000 + d).all()
            if inst.is_random_next:
                assert len(np.unique(inst.tokens_b)) == 1 and inst.tokens_b[0] != 1000 + d
            else:
                assert (inst.tokens_b == 1000 + d).all()


def test_nsp_coin_is_fair():
    """Where the chunk has two or more segments a fair coin decides; single-segment chunks are always
    NotNext (as in the original), and are flagged, so the coin is measured without them."""
    docs = synthetic_documents(600, seed=13)
    insts = ours(docs, 0)
    coin = [i.is_random_next for i in insts if not i.forced_random]
    forced = [i.is_random_next for i in insts if i.forced_random]
    assert all(forced)
    n = len(coin)
    assert n > 3000
    assert abs(np.mean(coin) - 0.5) < binomial_bound(n, 0.5)


@pytest.mark.slow
def test_short_sequence_rate():
    """Documents of 200 one-token sentences: a first instance that is IsNext fills its target exactly, so it is
    shorter than max_seq_len - 3 only when a short target was drawn: p = 0.1 * (59 / 60) at max_seq_len 64
    (the short target is uniform on [2, 61], and 61 is not short). (A random B may run out of document.)"""
    docs = [[np.array([1000 + d])] * 200 for d in range(6000)]
    short = n = 0
    for d, doc in enumerate(docs):
        first = create_instances(doc, d, len(docs), docs.__getitem__, np.random.default_rng([5, d]),
                                 max_seq_len=MAX_SEQ_LEN)[0]
        if not first.is_random_next:
            n += 1
            short += len(first.tokens_a) + len(first.tokens_b) < MAX_SEQ_LEN - 3
    p = 0.1 * 59 / 60
    assert n > 2500
    assert abs(short / n - p) < binomial_bound(n, p)


def test_single_document_split_makes_only_isnext_pairs():
    docs = synthetic_documents(1, seed=14)
    insts = create_instances(docs[0], 0, 1, docs.__getitem__, np.random.default_rng(0), max_seq_len=MAX_SEQ_LEN)
    assert insts and not any(i.is_random_next for i in insts)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 200), st.integers(0, 200), st.integers(2, 150))
def test_closed_form_truncation_matches_the_token_by_token_loop(la, lb, max_tokens):
    a, b = list(range(la)), list(range(1000, 1000 + lb))
    ref_truncate_seq_pair(a, b, max_tokens, random.Random(0))
    assert longest_first(la, lb, la + lb - max_tokens) == (len(a), len(b))


def test_truncation_cuts_both_ends_evenly():
    rng = np.random.default_rng(0)
    a = np.arange(100)
    fronts = [int(truncate_pair(a, np.arange(10), 60, rng)[0][0]) for _ in range(2000)]
    # 50 tokens removed from A; the number from the front is Binomial(50, 1/2): mean 25, sd 3.54
    assert abs(np.mean(fronts) - 25) < 5 * 3.54 / np.sqrt(2000)

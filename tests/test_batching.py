"""Inference batches (`bertforge.batching`): grouped by length within their budgets, and run two at a time on a
CPU, every batch once, the caller's settings kept."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from bertforge.batching import cpu_streams, length_batches, run_batches
from bertforge.errors import BertforgeError


def test_length_batches_cover_every_index_once_within_the_token_budget():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 100, size=500)
    batches = list(length_batches(lengths, max_tokens=400, max_batch=16))
    assert sorted(np.concatenate(batches).tolist()) == list(range(500))
    for b in batches:
        assert len(b) <= 16 and (len(b) == 1 or len(b) * lengths[b].max() <= 400)
    widths = [lengths[b].max() for b in batches]
    assert widths == sorted(widths, reverse=True)  # longest first: padding only within a batch's own range
    assert [len(b) for b in length_batches([500, 3], max_tokens=100)] == [1, 1]  # too long for the budget: alone


def test_length_batches_without_a_token_budget_are_fixed_size_in_length_order():
    """What predict and evaluate run (`run_model`'s batch size): stable length order, longest first, cut every
    max_batch indices whatever the lengths."""
    lengths = [3, 9, 3, 500, 9, 1, 3]
    batches = [b.tolist() for b in length_batches(lengths, max_tokens=None, max_batch=3)]
    assert batches == [[3, 1, 4], [0, 2, 6], [5]]
    assert list(length_batches([], max_tokens=None, max_batch=3)) == []
    for bad in ({"max_tokens": 0}, {"max_batch": 0}, {"max_tokens": None, "max_batch": 0}):
        with pytest.raises(BertforgeError, match="must be at least 1"):
            list(length_batches(lengths, **bad))


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_every_batch_runs_once_on_two_threads_of_one_torch_thread_each(two_threads):
    seen, lock = [], threading.Lock()

    def fn(batch):
        with lock:
            seen.append((batch, threading.get_ident(), torch.get_num_threads(), torch.is_grad_enabled()))
        threading.Event().wait(0.005)  # long enough that neither stream takes every batch

    with torch.no_grad():
        run_batches(fn, range(10), streams=2)
    assert sorted(b for b, *_ in seen) == list(range(10))
    assert {threads for _, _, threads, _ in seen} == {1}  # the caller's 2 threads shared out
    assert {grad for *_, grad in seen} == {False}  # the caller's no_grad, though grad mode is per thread
    assert threading.get_ident() in {ident for _, ident, _, _ in seen}  # the caller is one of the streams
    assert torch.get_num_threads() == 2  # restored
    seen.clear()
    run_batches(fn, range(3), streams=1)  # one stream: in the caller's thread, in order, with its threads
    assert seen == [(b, threading.get_ident(), 2, True) for b in range(3)]


def _threads_of_this_process() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)")
def test_the_streams_teams_add_no_threads_to_the_callers():
    """Each thread that runs a parallel region keeps an OpenMP team; a caller that only waited would keep its full
    team idle beside the streams' (more threads than cores, which makes libgomp wake sleeping threads on every
    region). The caller runs a stream with its share instead, so its team shrinks: the process has no more threads
    during the streams than after the caller's own work at four threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        a = torch.randn(256, 256)

        def work(_=None):
            a @ a
            torch.nn.functional.gelu(torch.randn(2_000_000))

        work()
        alone = _threads_of_this_process()
        counts = []
        run_batches(lambda b: (work(), counts.append(_threads_of_this_process())), range(8), streams=2)
        assert len(counts) == 8 and max(counts) <= alone
    finally:
        torch.set_num_threads(before)


def test_the_first_error_stops_every_stream_and_is_raised(two_threads):
    started = []

    def fn(batch):
        started.append(batch)
        if batch == 2:
            raise ValueError("batch 2 is bad")
        threading.Event().wait(0.01)

    with pytest.raises(ValueError, match="batch 2 is bad"):
        run_batches(fn, range(100), streams=2)
    assert len(started) < 10 and torch.get_num_threads() == 2


def test_two_streams_only_on_a_cpu_with_threads_to_share_and_batches_to_spare(two_threads):
    cpu = torch.device("cpu")
    assert cpu_streams(cpu, 4) == 2
    assert cpu_streams(cpu, 3) == 1
    assert cpu_streams(torch.device("cuda"), 100) == 1
    torch.set_num_threads(1)
    assert cpu_streams(cpu, 100) == 1


def test_run_model_runs_the_model_in_eval_mode_whatever_mode_its_parts_were_left_in(tiny_config):
    """`run_model` (predict's, evaluate's and the fine-tuning loop's dev evaluation's) switches a model in training
    to eval, dropout off; a part of it put back in training after a run (the model's modules are listed once) is
    found again."""
    from bertforge.models import BertForSequenceClassification
    from bertforge.tasks.runner import run_model

    tiny_config.hidden_dropout_prob = tiny_config.attention_probs_dropout_prob = 0.5
    torch.manual_seed(0)
    model = BertForSequenceClassification(tiny_config)
    features = [{"input_ids": [2, 7, 9, 11, 3], "token_type_ids": [0] * 5}, {"input_ids": [2, 8, 3],
                                                                              "token_type_ids": [0] * 3}]
    with torch.no_grad():
        expected = model.eval()(torch.tensor([features[0]["input_ids"]])).logits[0].numpy()
    for part in (model, model.bert.encoder.layer[1], model.classifier):
        part.train()
        logits = run_model(model, features, pad_id=0)
        assert not any(m.training for m in model.modules())
        np.testing.assert_allclose(logits[0], expected, rtol=1e-5, atol=1e-6)

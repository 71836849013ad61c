"""bertforge.train.prefetch: batches made ahead in a thread (the training loop's on a GPU) are the source's, in its
order, each with the position the source had after it; errors and the end arrive where the batch was asked for."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from bertforge.errors import BertforgeError
from bertforge.train.prefetch import Prefetched


class Counting:
    """Batches {"x": [k]} for k = 0, 1, ...; `.position` is the next k; fails with `error` at `fail_at`, ends at
    `end`."""

    def __init__(self, end: int | None = None, fail_at: int | None = None, delay: float = 0.0):
        self.position = {"next": 0}
        self.end, self.fail_at, self.delay = end, fail_at, delay
        self.made = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        k = self.position["next"]
        if k == self.fail_at:
            raise BertforgeError(f"batch {k} is malformed")
        if k == self.end:
            raise StopIteration
        time.sleep(self.delay)
        self.position = {"next": k + 1}
        self.made += 1
        return {"x": torch.tensor([k]), "note": f"batch {k}"}


def test_the_batches_and_positions_are_the_sources_in_order():
    ahead = Prefetched(Counting(), depth=3, pin=False)
    assert ahead.position == {"next": 0}
    for k in range(20):
        batch = ahead.__next__()
        assert int(batch["x"]) == k and batch["note"] == f"batch {k}"
        assert ahead.position == {"next": k + 1}  # where a checkpoint taken now resumes
    ahead.close()


def test_it_runs_ahead_only_as_deep_as_asked():
    source = Counting()
    ahead = Prefetched(source, depth=2, pin=False)
    next(ahead)
    deadline = time.time() + 5
    while source.made < 4 and time.time() < deadline:  # one handed out, two queued, one waiting to be queued
        time.sleep(0.01)
    time.sleep(0.1)
    assert source.made == 4
    ahead.close()


def test_a_source_error_is_raised_where_the_batch_is_asked_for_after_the_good_ones():
    ahead = Prefetched(Counting(fail_at=3), depth=4, pin=False)
    assert [int(next(ahead)["x"]) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(BertforgeError, match="batch 3 is malformed"):
        next(ahead)
    with pytest.raises(BertforgeError):  # and again, not a hang
        next(ahead)
    ahead.close()


def test_the_end_of_the_source_ends_the_iteration():
    assert [int(b["x"]) for b in Prefetched(Counting(end=5), depth=2, pin=False)] == [0, 1, 2, 3, 4]


def test_close_stops_the_thread_while_it_waits_on_a_full_queue():
    ahead = Prefetched(Counting(delay=0.001), depth=1, pin=False)
    next(ahead)
    time.sleep(0.05)
    before = threading.active_count()
    ahead.close()
    assert not ahead._thread.is_alive()
    assert threading.active_count() == before - 1


def test_a_training_step_sees_the_same_batches_through_it():
    """The pretraining loader's batches through the thread equal its own, positions included."""
    from support import prepared_dir

    from bertforge.data.loader import PretrainingData

    data = prepared_dir()
    plain = PretrainingData(data).batches(4)
    ahead = Prefetched(PretrainingData(data).batches(4), depth=3, pin=False)
    for _ in range(12):
        a, b = next(plain), next(ahead)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert ahead.position == plain.position
    ahead.close()

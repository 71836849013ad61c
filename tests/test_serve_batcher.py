"""The server's batcher on its own (no web stack): what runs together, what each request gets back, the bound."""

import threading
import time

import pytest

from bertforge.serve.batcher import Batcher, Closed, QueueFull


class Engine:
    """A runner that records each call's (key, items) and can be held until released."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.hold = threading.Event()
        self.hold.set()
        self.running = threading.Event()

    def __call__(self, key, items):
        self.running.set()
        assert self.hold.wait(10)
        self.calls.append((key, list(items)))
        if any(item == "bad" for item in items):
            raise ValueError("bad input")
        return [f"{key}:{item}" for item in items]


def busy(engine: Engine, batcher: Batcher):
    """Hold the worker on a first request, so that what is submitted next waits in the queue."""
    engine.hold.clear()
    first = batcher.submit("k", ["first"], 1)
    assert engine.running.wait(10)
    return first


@pytest.fixture
def engine_and_batcher():
    engine = Engine()
    batcher = Batcher(engine, max_tokens=10, max_wait=0.0, max_queue=6)
    batcher.start()
    yield engine, batcher
    engine.hold.set()
    batcher.close(10)


def test_queued_requests_of_a_kind_run_together_within_the_budget_and_each_gets_its_own(engine_and_batcher):
    engine, batcher = engine_and_batcher
    first = busy(engine, batcher)
    a = batcher.submit("k", ["a1", "a2"], 4)
    other = batcher.submit("j", ["o"], 1)  # another endpoint or options: never in the same call
    b = batcher.submit("k", ["b"], 4)
    c = batcher.submit("k", ["c"], 4)  # 4 + 4 + 4 > 10: the next call
    assert batcher.queued == 5
    engine.hold.set()
    assert first.result(10) == ["k:first"]
    assert a.result(10) == ["k:a1", "k:a2"] and b.result(10) == ["k:b"] and c.result(10) == ["k:c"]
    assert other.result(10) == ["j:o"]
    assert [items for _, items in engine.calls] == [["first"], ["a1", "a2", "b"], ["o"], ["c"]]
    assert batcher.queued == 0


def test_a_bad_input_fails_only_its_own_request(engine_and_batcher):
    engine, batcher = engine_and_batcher
    busy(engine, batcher)
    good, bad, also_good = (batcher.submit("k", [x], 1) for x in ("x", "bad", "y"))
    engine.hold.set()
    assert good.result(10) == ["k:x"] and also_good.result(10) == ["k:y"]
    with pytest.raises(ValueError, match="bad input"):
        bad.result(10)
    assert batcher.accepting  # the worker lives on


def test_the_queue_is_bounded_in_inputs_and_a_cancelled_request_never_runs(engine_and_batcher):
    engine, batcher = engine_and_batcher
    busy(engine, batcher)
    kept = batcher.submit("k", ["a", "b", "c", "d"], 4)
    gone = batcher.submit("k", ["e", "f"], 2)
    start = time.monotonic()
    with pytest.raises(QueueFull):
        batcher.submit("k", ["g"], 1)
    assert time.monotonic() - start < 0.05  # refused at once, not after a wait
    assert gone.cancel()
    engine.hold.set()
    assert kept.result(10) == ["k:a", "k:b", "k:c", "k:d"]
    assert all("e" not in items for _, items in engine.calls)


def test_close_runs_what_was_queued_then_refuses(engine_and_batcher):
    engine, batcher = engine_and_batcher
    busy(engine, batcher)
    queued = [batcher.submit("k", [str(n)], 1) for n in range(3)]
    closer = threading.Thread(target=batcher.close, args=(10,))
    closer.start()
    time.sleep(0.05)
    with pytest.raises(Closed):
        batcher.submit("k", ["late"], 1)
    engine.hold.set()
    closer.join(10)
    assert [f.result(0) for f in queued] == [["k:0"], ["k:1"], ["k:2"]]
    assert not batcher.accepting


def test_a_lone_request_runs_at_once_and_overlapping_ones_wait_to_share_a_call():
    engine = Engine()
    batcher = Batcher(engine, max_tokens=100, max_wait=0.5, max_queue=10)
    batcher.start()
    try:
        start = time.monotonic()
        assert batcher.submit("k", ["alone"], 1).result(10) == ["k:alone"]
        assert time.monotonic() - start < 0.25  # no 0.5 s wait: nothing overlapped yet
        engine.running.clear()
        first = busy(engine, batcher)
        during = batcher.submit("k", ["during"], 1)  # arrives while a call runs: requests overlap
        engine.hold.set()
        assert first.result(10) == ["k:first"]
        joined = batcher.submit("k", ["joined"], 1)  # within the wait the worker now keeps for more
        assert during.result(10) == ["k:during"] and joined.result(10) == ["k:joined"]
        assert engine.calls[-1] == ("k", ["during", "joined"])
        late = batcher.submit("k", ["late"], 1)  # the last call ran two: this one still waits, alone
        assert late.result(10) == ["k:late"]
        start = time.monotonic()
        assert batcher.submit("k", ["again"], 1).result(10) == ["k:again"]  # a call of one, nothing overlapped
        assert time.monotonic() - start < 0.25
        assert [items for _, items in engine.calls] == [["alone"], ["first"], ["during", "joined"], ["late"],
                                                         ["again"]]
    finally:
        batcher.close(10)

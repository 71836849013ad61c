"""Dynamic batching: request handlers queue their inputs, one worker thread owns the engines and runs what is
queued together.

The worker takes the oldest request, then every queued request of the same kind (same endpoint and options) that
fits the token budget, waiting up to `max_wait` for more to arrive while requests overlap (one arrived while the
last engine call ran, or that call ran several). A lone client's request so runs at once: waiting always cost it 2-4
ms of 9-14 (one snippet to MiniLM-L6 over loopback, fp32 and int8, a 2-core Zen 4 EPYC), while never waiting cost
4-8 concurrent clients up to 1.6x in requests/s, which the wait gathers into shared engine calls (bench/serve.py
--clients, --max-wait-ms 0 against 2). The engine call over all their inputs sorts them by length and batches them
itself (`bertforge.batching`), and each request gets its own slice of the results. One request's bad input must not
fail the others that ran with it, so a failed call over several requests is run again one request at a time. The
queue is bounded in inputs: past it `submit` refuses at once (the server answers 503), rather than let latency grow
without bound. A request whose client went away is cancelled and skipped if it has not started.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


class QueueFull(Exception):
    """The queue holds `max_queue` inputs already."""


class Closed(Exception):
    """The batcher is draining (the server is shutting down) and takes no more requests."""


@dataclass
class Job:
    key: Hashable  # requests run together only with the same key: the endpoint and its options
    items: Sequence[Any]
    cost: int  # estimated tokens of all items
    future: Future = field(default_factory=Future)


# The callable that runs one engine call: (key, items of every request in the group) -> one result per item.
Runner = Callable[[Hashable, list], list]


class Batcher:
    """Queue requests with `submit`, get each one's results from its Future; `close` drains and stops."""

    def __init__(self, run: Runner, *, max_tokens: int, max_wait: float, max_queue: int,
                 on_batch: Callable[[int, int], None] | None = None):
        self._run = run
        self.max_tokens, self.max_wait, self.max_queue = max_tokens, max_wait, max_queue
        self._on_batch = on_batch  # (requests, inputs) of every engine call, for the metrics
        self._jobs: collections.deque[Job] = collections.deque()
        self._queued = 0  # inputs in self._jobs
        self._running = False  # an engine call is under way
        self._overlapping = False  # the last group held several requests, or one arrived while its call ran
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="bertforge-serve-engine", daemon=True)

    @property
    def queued(self) -> int:
        """Inputs waiting (not the ones running)."""
        return self._queued

    @property
    def full(self) -> bool:
        """No room for another input: any request `submit`ted now would be refused."""
        return self._queued >= self.max_queue

    @property
    def accepting(self) -> bool:
        return not self._closed and self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def submit(self, key: Hashable, items: Sequence[Any], cost: int) -> Future:
        job = Job(key, items, cost)
        with self._cond:
            if self._closed:
                raise Closed
            if self._queued + len(items) > self.max_queue:
                raise QueueFull
            self._jobs.append(job)
            self._queued += len(items)
            self._overlapping = self._overlapping or self._running
            self._cond.notify()
        return job.future

    def close(self, timeout: float | None = None) -> None:
        """Take no more requests, run those queued, and stop the worker."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            group = self._take()
            if group is None:
                return
            self._run_group(group)

    def _pop(self, job: Job) -> bool:
        """Remove `job` from the queue (lock held); False where its request was cancelled meanwhile."""
        self._jobs.remove(job)
        self._queued -= len(job.items)
        return job.future.set_running_or_notify_cancel()

    def _take(self) -> list[Job] | None:
        """The next group to run: the oldest live request and those that join it; None once closed and empty."""
        with self._cond:
            first = None
            while first is None:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return None
                job = self._jobs[0]
                first = job if self._pop(job) else None
            group, cost = [first], first.cost
            deadline = time.monotonic() + (self.max_wait if self._overlapping else 0.0)
            while True:
                for job in [j for j in self._jobs if j.key == first.key]:
                    if cost + job.cost <= self.max_tokens and self._pop(job):
                        group.append(job)
                        cost += job.cost
                left = deadline - time.monotonic()
                if cost >= self.max_tokens or left <= 0 or self._closed:
                    self._overlapping = len(group) > 1
                    return group
                self._cond.wait(left)

    def _engine(self, key: Hashable, items: list) -> list:
        """The engine call, marked as under way while it runs (`submit` notes a request that arrives meanwhile)."""
        with self._cond:
            self._running = True
        try:
            return self._run(key, items)
        finally:
            with self._cond:
                self._running = False

    def _run_group(self, group: list[Job]) -> None:
        items = [item for job in group for item in job.items]
        if self._on_batch is not None:
            self._on_batch(len(group), len(items))
        try:
            results = self._engine(group[0].key, items)
        except BaseException as e:  # noqa: BLE001 -- every failure goes back to its requests, none kills the worker
            if len(group) == 1:
                group[0].future.set_exception(e)
                return
            for job in group:  # find whose input it was: each request alone
                self._run_group([job])
            return
        start = 0
        for job in group:
            job.future.set_result(results[start:start + len(job.items)])
            start += len(job.items)

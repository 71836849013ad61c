"""Batches made ahead, in a thread, while the device trains on the last ones.

On a GPU the training step ends by reading its losses (a sync: a loss that is not finite must stop the run before
the update). Without this, the next batch is only then masked and collated on the host, and the GPU idles through
it: the first GPU check measured 22 ms of a 94 ms BERT-base step so (23%), and 10 ms with two loader workers.
`Prefetched` keeps `depth` batches ready, in pinned memory, so the step after the sync starts at once.

The batches and their order are the source's (its random numbers are its own generators, not torch's global
one); `.position` is the source's position after the last batch handed out, so checkpoints resume exactly."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from typing import Any

import torch

_END = object()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetched:
    """Iterates `source` (an iterator of dict batches with a `.position`) `depth` batches ahead in a thread, each
    tensor pinned when `pin`. `close()` stops the thread; it is a daemon, so an unclosed one never holds the
    process open."""

    def __init__(self, source: Iterator[dict], depth: int, pin: bool):
        self._source, self._pin = source, pin
        self.position = _position(source)
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="bertforge-prefetch", daemon=True)
        self._thread.start()

    def __iter__(self) -> Prefetched:
        return self

    def __next__(self) -> dict:
        item = self._queue.get()
        if item is _END:
            self._queue.put(_END)  # a later call ends the same way
            raise StopIteration
        if isinstance(item, _Failed):
            self._queue.put(item)
            raise item.error
        batch, self.position = item
        return batch

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self._queue.get_nowait()
            self._thread.join(timeout=0.05)

    def _fill(self) -> None:
        try:
            for batch in self._source:
                if self._pin:
                    batch = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                if not self._put((batch, _position(self._source))):
                    return
            self._put(_END)
        except BaseException as e:  # handed to the training thread, which raises it where it asked for a batch
            self._put(_Failed(e))

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False


def _position(source: Any) -> Any:
    position = getattr(source, "position", None)
    return dict(position) if isinstance(position, dict) else position


"""Inference batches run two at a time on a CPU, each on its share of the threads.

On the small matrices of inference a CPU's threads split one product less well than they run separate ones. On
bench/inference.py's MiniLM classifier over Rotten Tomatoes test (a 2-core AVX512 EPYC, 1,323 texts of 26 tokens
on average, batches of 64), two batches at a time on one thread each made `Predictor.predict` 1.07x faster in fp32,
1.08x in bf16 and 1.17x in int8 than one batch at a time on both threads (`bench/inference.py --one-stream`).
ONNX Runtime's int8 gains the same way (1.08x there, 1.25x on 16-128 tokens; its fp32 does not), so
bench/inference.py runs it both ways.
The batches are the same either way, and so are the results up to rounding; each stream takes the next batch
when it is done with its last.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


def cpu_streams(device: torch.device, batches: int) -> int:
    """How many batches to run at once: 2 on a CPU with 2 or more threads and at least 4 batches, else 1 (the
    other streams would only wait; on CUDA one stream already keeps the GPU busy)."""
    return 2 if device.type == "cpu" and torch.get_num_threads() >= 2 and batches >= 4 else 1


def run_batches(fn: Callable[[T], None], batches: Iterable[T], streams: int) -> None:
    """fn(batch) for every batch, on `streams` threads that share the caller's torch threads out evenly (the
    caller's thread count is restored after). Gradient mode is per thread in torch, so each stream takes the
    caller's. The first error stops every stream from taking another batch and is raised here."""
    if streams <= 1:
        for batch in batches:
            fn(batch)
        return
    threads = torch.get_num_threads()
    grad = torch.is_grad_enabled()
    pending = iter(batches)
    lock = threading.Lock()
    failed = threading.Event()

    def stream() -> None:
        torch.set_num_threads(max(1, threads // streams))
        with torch.set_grad_enabled(grad):
            while not failed.is_set():
                with lock:
                    batch = next(pending, None)
                if batch is None:
                    return
                try:
                    fn(batch)
                except BaseException:
                    failed.set()
                    raise

    try:
        with ThreadPoolExecutor(streams, thread_name_prefix="bertforge-batch") as pool:
            for future in [pool.submit(stream) for _ in range(streams)]:
                future.result()
    finally:
        torch.set_num_threads(threads)

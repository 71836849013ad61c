"""Inference batches: texts grouped by length, and the groups run side by side on a CPU's threads.

Grouping (`length_batches`): indices sorted by length, longest first, and cut into batches within a size and a
padded-token budget, so each batch is padded only to its own longest sequence; callers put the results back in
input order. Every batched path takes its batches from here: the engines of `bertforge.infer`, `run_model` of
`bertforge.tasks.runner` (predict, evaluate, the fine-tuning loop's dev evaluation) and bench/inference.py.

Running (`run_batches`): on the small matrices of inference a CPU's threads split one product less well than they
run separate ones. On bench/inference.py's MiniLM classifier over Rotten Tomatoes test (a 2-core AVX512 EPYC,
1,323 texts of 26 tokens on average, batches of 64), two batches at a time on one thread each made
`Predictor.predict` 1.07x faster in fp32, 1.08x in bf16 and 1.17x in int8 than one batch at a time on both threads
(`bench/inference.py --one-stream`). ONNX Runtime's int8 gains the same way (1.08x there, 1.25x on 16-128 tokens;
its fp32 does not), so bench/inference.py runs it both ways. A "stream" here is one such CPU thread taking batches
(not a CUDA stream). The batches are the same either way, and so are the results up to rounding; each stream takes
the next batch when it is done with its last.

The calling thread runs one of the streams itself. Under torch's OpenMP (GNU libgomp in its Linux wheels) every
thread that has run a parallel region keeps a team of worker threads, idle or not, and once the teams' threads
outnumber the cores libgomp barely spins before sleeping, so each parallel region then wakes sleeping threads: on
`serve`'s engine thread, beside a main thread that had loaded the model, one MiniLM text took 8.0 ms against 5.8
and a 64 x 64 product 80 us against 7 (docs/benchmarks.md, "serve's batching wait"). A caller that only waited
for new stream threads would keep its full team beside theirs; running a stream with its share of the threads
shrinks that team (libgomp lets a team's surplus threads exit when the thread next runs a smaller one), so the
streams' teams add up to the caller's thread count. On 2 cores each stream runs on one thread and opens no team,
so this matters from 4 cores up (not yet measured on such a CPU; tests/test_batching.py counts the threads).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import torch

from bertforge.errors import BertforgeError

T = TypeVar("T")

# Length-grouped batching's defaults: a batch holds at most MAX_TOKENS padded tokens and MAX_BATCH sequences.
MAX_TOKENS = 8192
MAX_BATCH = 256


def length_batches(lengths: Sequence[int], *, max_tokens: int | None = MAX_TOKENS,
                   max_batch: int = MAX_BATCH) -> Iterator[np.ndarray]:
    """Indices grouped into batches of similar length, longest first (ties in input order), each of at most
    max_batch sequences and within a padded-token budget: batch size x its longest sequence <= max_tokens (a
    sequence longer than the budget goes alone; None: no budget, every batch max_batch but the last)."""
    if (max_tokens is not None and max_tokens < 1) or max_batch < 1:
        raise BertforgeError(f"max_tokens ({max_tokens}) and max_batch ({max_batch}) must be at least 1")
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    i = 0
    while i < len(order):
        size = max_batch
        if max_tokens is not None:
            size = max(1, min(max_batch, max_tokens // max(int(lengths[order[i]]), 1)))
        yield order[i:i + size]
        i += size


def cpu_streams(device: torch.device, batches: int) -> int:
    """How many batches to run at once: 2 on a CPU with 2 or more threads and at least 4 batches, else 1 (the
    other streams would only wait; on CUDA one stream already keeps the GPU busy)."""
    return 2 if device.type == "cpu" and torch.get_num_threads() >= 2 and batches >= 4 else 1


def run_batches(fn: Callable[[T], None], batches: Iterable[T], streams: int) -> None:
    """fn(batch) for every batch, on `streams` threads that share the caller's torch threads out evenly (the
    caller's thread count is restored after). The caller is one of the streams: its OpenMP team shrinks to its
    share rather than idling beside the others' (module docstring). Gradient mode is per thread in torch, so each
    stream takes the caller's. The first error stops every stream from taking another batch and is raised here."""
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
        with ThreadPoolExecutor(streams - 1, thread_name_prefix="bertforge-batch") as pool:
            others = [pool.submit(stream) for _ in range(streams - 1)]
            stream()
            for future in others:
                future.result()
    finally:
        torch.set_num_threads(threads)

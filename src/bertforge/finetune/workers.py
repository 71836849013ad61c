"""Several training runs at a time, each in a worker process of its own on its share of the CPU's threads.

A small model's step uses a second thread poorly: its products are too small to split well and much of the step is
per-operator work on one thread. On a 2-core Zen 4 EPYC (the sixty-fifth session, bf16), two of the demo's
distillation students (BERT-tiny, 4,737 steps each) took 264 s one after another on two threads and 147 s side by
side on one thread each (1.8x); ten-second fine-tunings of the tiny in bf16 1.5x, process start included; the demo's
fine-tunings in fp32 1.1-1.2x (that VM's two vCPUs multiply at little more than one core's rate). The whole demo
there: 30.4 minutes one run at a time, 28.1 two at a time (docs/experiments/demo-runs.md). So the demo and
bench/pays.py run their seeds `jobs` at a time. A run's result depends on its config and on its thread count (a sum
split over two threads adds in another order), so a given `jobs` on a given machine repeats its runs to the bit.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from bertforge.errors import BertforgeError
from bertforge.progress import counted

MAX_JOBS = 4  # beyond a few runs at a time, each run's memory (its model, optimizer and features) outweighs the gain


def default_jobs(threads: int, *, on_gpu: bool) -> int:
    """Runs at a time on `threads` CPU threads: one a thread up to MAX_JOBS; one on a GPU, which one run fills."""
    return 1 if on_gpu else max(1, min(threads, MAX_JOBS))


def say_jobs(count: int, what: str, jobs: int, threads: int) -> None:
    """The line before `count` runs (`what`) that go `jobs` at a time on `threads` threads; none when they go one
    after another in this process."""
    if jobs > 1 and count > 1:
        print(f"{count} {what}, {min(jobs, count)} at a time on {counted(_share(threads, jobs), 'thread')} each "
              "(--jobs; each run's output in <its directory>.log)", flush=True)


def _share(threads: int, jobs: int) -> int:
    """The threads each of `jobs` runs at a time gets of `threads`: at least one."""
    return max(1, threads // jobs)


def run_log(run_dir: str | Path) -> Path:
    """Where a run's output goes when it runs in a worker process: beside its directory, `<run_dir>.log`."""
    return Path(f"{run_dir}.log")


def run_in_workers(fn: Callable[[Any], Any], items: Sequence[Any], *, jobs: int, threads: int,
                   logs: Sequence[Path] | None = None) -> Iterator[Any]:
    """`fn(item)` for each of `items`, yielded in their order as each is ready. With `jobs` > 1, `jobs` at a time in
    worker processes (spawned: `fn` and the items must pickle), each on `threads` // `jobs` threads, with everything
    an item's run prints (Python's and the libraries' own output) going to its file of `logs`; with `jobs` 1, in this
    process, printing as it goes. A run's exception is raised here, after the runs already started have ended."""
    if jobs <= 1 or len(items) <= 1:
        yield from (fn(item) for item in items)
        return
    paths = list(logs) if logs is not None else [None] * len(items)
    waiting = enumerate(zip(items, paths, strict=True))
    spawn = multiprocessing.get_context("spawn")
    pool = concurrent.futures.ProcessPoolExecutor(min(jobs, len(items)), mp_context=spawn, initializer=_start_worker,
                                                  initargs=(_share(threads, jobs),))
    running: dict[concurrent.futures.Future, int] = {}
    ended: dict[int, concurrent.futures.Future] = {}
    try:
        for index in range(len(items)):
            while index not in ended:
                # no more runs handed to the pool than it has workers: a run it holds starts whatever happens here
                while len(running) < jobs and (job := next(waiting, None)) is not None:
                    k, (item, path) = job
                    running[pool.submit(_run_logged, (fn, item, path))] = k
                done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
                ended.update((running.pop(f), f) for f in done)
            yield _result(ended.pop(index), paths[index])
    finally:  # a run failed, or the caller stopped (Ctrl-C, which the runs' own processes get too): no run starts
        pool.shutdown(wait=True, cancel_futures=True)


def _result(future: concurrent.futures.Future, log: Path | None) -> Any:
    """A run's result, or its exception; a worker process that ended without one (killed by the system, say for
    memory) as one line that names its log."""
    try:
        return future.result()
    except BrokenProcessPool as e:
        where = f" (its output: {log})" if log else ""
        raise BertforgeError(f"a worker process ended before its run did, killed by the system or out of memory"
                             f"{where}: run again with fewer runs at a time (--jobs 1: one after another); finished "
                             "runs are kept") from e


def _start_worker(threads: int) -> None:
    """A worker's setup, before torch is imported in it: its share of the threads (OpenMP's too, which bertforge's
    kernels read), and freed memory kept for reuse as the `bertforge` commands that train do."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    from bertforge.train.memory import keep_freed_memory

    torch.set_num_threads(threads)
    keep_freed_memory()


def _run_logged(job: tuple[Callable[[Any], Any], Any, Path | None]) -> Any:
    """One item's run in a worker, its output (file descriptors 1 and 2) in its log file while it runs."""
    fn, item, log = job
    if log is None:
        return fn(item)
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "a", encoding="utf-8") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            return fn(item)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])

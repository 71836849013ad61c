"""Runs side by side in worker processes (`bertforge.finetune.workers`): in order, each on its share of the threads,
its output in its log, a failure raised where it happened and no run started after it."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from bertforge.errors import BertforgeError
from bertforge.finetune.workers import default_jobs, run_in_workers, run_log, say_jobs


def _report(item: tuple[str, float]) -> dict:
    """A worker's job: says where it ran and on how many threads, in print and through the file descriptor."""
    import torch

    name, seconds = item
    time.sleep(seconds)  # the first item ends last: results still come in the items' order
    print(f"python says {name}")
    sys.stdout.flush()
    os.write(2, f"fd 2 says {name}\n".encode())
    return {"name": name, "pid": os.getpid(), "threads": torch.get_num_threads(),
            "omp": os.environ.get("OMP_NUM_THREADS")}


def _fail_on_first(item: tuple[Path, int]) -> int:
    """Marks that it started; the first item fails at once, the second takes a moment."""
    where, k = item
    (where / f"started-{k}").touch()
    if k == 0:
        raise ValueError("run 0 failed")
    time.sleep(0.5)
    return k


def test_runs_two_at_a_time_in_order_each_on_its_share_of_the_threads_its_output_in_its_log(tmp_path, capfd):
    items = [("a", 1.0), ("b", 0.0), ("c", 0.0)]
    logs = [run_log(tmp_path / "runs" / name) for name, _ in items]
    results = list(run_in_workers(_report, items, jobs=2, threads=4, logs=logs))
    assert [r["name"] for r in results] == ["a", "b", "c"]
    assert all(r["pid"] != os.getpid() for r in results) and len({r["pid"] for r in results}) == 2
    assert all(r["threads"] == 2 and r["omp"] == "2" for r in results)  # 4 threads shared by 2 jobs
    for (name, _), log in zip(items, logs, strict=True):
        assert log == tmp_path / "runs" / f"{name}.log"
        assert log.read_text().splitlines() == [f"python says {name}", f"fd 2 says {name}"]
    printed = capfd.readouterr()
    assert "says" not in printed.out + printed.err  # the runs' output is in their logs, not on this terminal


def test_one_job_runs_here_and_prints_as_it_goes(tmp_path, capfd):
    results = list(run_in_workers(_report, [("x", 0.0), ("y", 0.0)], jobs=1, threads=4,
                                  logs=[tmp_path / "x.log", tmp_path / "y.log"]))
    assert [r["pid"] for r in results] == [os.getpid()] * 2
    printed = capfd.readouterr()
    assert "python says x" in printed.out and "fd 2 says y" in printed.err
    assert not list(tmp_path.iterdir())


def test_a_failed_run_is_raised_in_its_place_and_no_later_run_starts(tmp_path):
    done = run_in_workers(_fail_on_first, [(tmp_path, k) for k in range(5)], jobs=2, threads=2)
    with pytest.raises(ValueError, match="run 0 failed"):
        next(done)
    # the pool held no more runs than its two workers: the second had started, no other ever does
    assert sorted(p.name for p in tmp_path.iterdir()) == ["started-0", "started-1"]


def test_default_jobs_is_one_a_thread_up_to_four_and_one_on_a_gpu():
    assert [default_jobs(n, on_gpu=False) for n in (1, 2, 3, 16)] == [1, 2, 3, 4]
    assert default_jobs(16, on_gpu=True) == 1


def test_the_line_before_the_runs_says_how_many_go_at_a_time_on_how_many_threads(capsys):
    say_jobs(10, "fine-tunings", 2, 2)
    say_jobs(3, "students", 4, 16)
    say_jobs(5, "fine-tunings", 1, 2)  # one after another here: nothing to say
    say_jobs(1, "students", 2, 2)
    assert capsys.readouterr().out.splitlines() == [
        "10 fine-tunings, 2 at a time on 1 thread each (--jobs; each run's output in <its directory>.log)",
        "3 students, 3 at a time on 4 threads each (--jobs; each run's output in <its directory>.log)"]


def _killed(k: int) -> int:
    """The second run's process is killed by the system (as for memory)."""
    if k == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return k


def test_a_worker_killed_by_the_system_is_one_line_naming_its_log(tmp_path):
    logs = [tmp_path / f"run{k}.log" for k in range(2)]
    done = run_in_workers(_killed, [0, 1], jobs=2, threads=2, logs=logs)
    with pytest.raises(BertforgeError, match=r"a worker process ended before its run did, killed by the system or "
                                             r"out of memory \(its output: .*run\d\.log\): run again with fewer runs "
                                             r"at a time \(--jobs 1: one after another\)"):
        list(done)

"""Test support: `bertforge` in a forked child of the test process, for tests that kill a run part-way. The child
starts with torch and bertforge already imported, where a fresh interpreter spends about 2 seconds importing
them, and its torch threads are the test process's (the tests that compare runs bitwise set one). It is a real
process: a SIGKILL takes it down mid-write, and its exit code is what `main` returned. `kill_at` stops a run at
the N-th call of a function, in a child (`before`), a torchrun rank or, undone after the test, the test process.
`forked_ranks` runs `bertforge` as the ranks of one process group, each a forked child."""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import signal
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace


class Forked:
    """`bertforge ARGV` in a forked child, its stdout and stderr into `log`; `before` runs in the child first
    (a patch that stops it at a point). Read like subprocess.Popen: poll, send_signal, wait, returncode."""

    def __init__(self, argv: list, log: Path, before: Callable[[], None] | None = None):
        self.log, self.returncode = Path(log), None
        with warnings.catch_warnings():  # a thread of torch's may be alive; the child trains on the test's threads
            warnings.simplefilter("ignore", DeprecationWarning)
            self.pid = os.fork()
        if self.pid == 0:
            _child([str(a) for a in argv], self.log, before)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def wait(self, timeout: float = 300) -> int:
        """The exit code (minus the signal that killed it); a child still running after `timeout` seconds is
        killed and raises TimeoutError with the end of its output."""
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                self.send_signal(signal.SIGKILL)
                os.waitpid(self.pid, 0)
                raise TimeoutError(f"still running after {timeout:.0f} s: {self.output()[-2000:]}")
            time.sleep(0.02)
        return self.returncode

    def output(self) -> str:
        return self.log.read_text() if self.log.is_file() else ""


def kill_at(point: str, patch: Callable = setattr) -> None:
    """Makes this process SIGKILL itself (or send itself the signal named after N) at the N-th call of one
    function, named "module:name:N[:SIGNAL]" (a name may be Class.method): the optimizer step, a dev evaluation,
    `torch.save` (a checkpoint's trainer state, so the kill leaves a half-written checkpoint directory behind), or
    a step of the run's end. `patch` sets the function (pytest's monkeypatch.setattr undoes it after the test; a
    forked child or a torchrun rank keeps it)."""
    module, name, at, *how = point.split(":")
    *path, attr = name.split(".")
    owner = functools.reduce(getattr, path, importlib.import_module(module))
    real, calls = getattr(owner, attr), []

    def killing(*args, **kwargs):
        calls.append(1)
        if len(calls) == int(at):
            os.kill(os.getpid(), getattr(signal, how[0] if how else "SIGKILL"))
        return real(*args, **kwargs)

    patch(owner, attr, killing)


def _child(argv: list[str], log: Path, before: Callable[[], None] | None) -> None:
    """The child's whole life: never back into the caller (pytest), whatever happens."""
    code = 70
    try:
        with open(log, "w", buffering=1) as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
            try:
                from bertforge.cli import main

                if before:
                    before()
                code = main(argv)
            except BaseException:
                traceback.print_exc()
    finally:
        os._exit(code)


def forked_ranks(argv: list, log_dir: Path, *, world: int = 2, before: Callable[[], None] | None = None,
                 timeout: float = 240) -> SimpleNamespace:
    """`bertforge ARGV` as `world` ranks of one gloo process group, each a forked child set up as torchrun sets up
    its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE; MASTER_ADDR and MASTER_PORT of a store that this
    process holds, as torchrun's agent holds it, for `init_process_group`'s env:// rendezvous), on one torch thread,
    `before` run in each first. It spares torchrun's launcher and a fresh interpreter a rank (about 2 s of CPU each)
    to the tests of what several processes compute; the README's torchrun command itself is run by
    tests/test_distributed.py (and by the GPU check on a GPU; its CPU dry run forks its one rank). Waits for every
    rank: once one has failed the others get 20 s to stop (a rank left waiting in a collective would wait for gloo's
    30 minutes), and after `timeout` seconds every rank left is killed. Returns `returncode` (0, or the first rank's
    that failed, in rank order), and the ranks' output in rank order as `stdout` and `stderr` (both: each rank
    writes both into one log)."""
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # its port is ours until the end
    port = store.port

    def as_rank(rank: int) -> None:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
        torch.set_num_threads(1)
        if before:
            before()

    Path(log_dir).mkdir(parents=True, exist_ok=True)
    ranks = [Forked(argv, Path(log_dir) / f"rank{r}.log", before=functools.partial(as_rank, r)) for r in range(world)]
    deadline, failed_at = time.monotonic() + timeout, None
    while any(r.poll() is None for r in ranks):
        if failed_at is None and any(r.returncode for r in ranks):
            failed_at = time.monotonic()
        if time.monotonic() > deadline or (failed_at is not None and time.monotonic() > failed_at + 20):
            for r in ranks:
                r.send_signal(signal.SIGKILL)
        time.sleep(0.02)
    del store
    output = "".join(f"--- rank {n} ---\n{r.output()}" for n, r in enumerate(ranks))
    code = next((r.returncode for r in ranks if r.returncode), 0)
    return SimpleNamespace(returncode=code, stdout=output, stderr=output)

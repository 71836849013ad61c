"""Test support: `bertforge` in a forked child of the test process, for tests that kill a run part-way. The child
starts with torch and bertforge already imported, where a fresh interpreter spends about 2 seconds importing
them, and its torch threads are the test process's (the tests that compare runs bitwise set one). It is a real
process: a SIGKILL takes it down mid-write, and its exit code is what `main` returned."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path


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

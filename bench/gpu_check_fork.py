"""The dry run's processes, forked from one that has already imported torch and transformers' BERT.

On the GPU every part and every `bertforge` command of the check starts a fresh interpreter, as a user's would
(forking a process that holds a CUDA context is not safe). The dry run, which exists so that the script cannot
rot between the rare runs on a GPU, runs the same functions with the same arguments, but in children forked from
the check's process: a fresh interpreter spent ~2.8 s importing torch and ~5.4 s more importing transformers' BERT
(three parts compare against it) on a 2-core Zen 3 EPYC, about half of the dry run's 80 s. A forked child is a
real process all the same: a session of its own (a time box kills its process group), its own exit status, its
stdout and stderr captured. A command the GPU run starts under `torchrun --nproc-per-node 1` is forked too, with
the variables torchrun gives its one rank (`one_rank`): the launcher's own interpreter (~3.5 s a launch) is all it
leaves out, and a world of one process sets up no process group, so the rank runs as it would under torchrun
(`make test` runs the README's torchrun command under the real launcher).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path


def preload(env: dict[str, str], reference: bool) -> None:
    """The dry run's parent, once before its first fork: `env` (one thread a process) set first, so that torch
    reads it as a fresh child would, then torch (on one thread) and bertforge imported, and with `reference`
    transformers' BERT (for the parts that compare against it)."""
    os.environ.update(env)
    src = env.get("PYTHONPATH", "").split(os.pathsep)[0]
    if src and src not in sys.path:
        sys.path.insert(0, src)
    import torch

    # Where torch was imported before (a test's process), the variable came too late: one thread set here, so that
    # no forked part starts OpenMP threads of its own, which a command it forks in turn would find gone, waiting
    # forever on their lock (seen with two threads, the root's OpenMP team up before the first fork).
    torch.set_num_threads(1)

    import bertforge.cli  # noqa: F401

    if reference:
        import transformers

        transformers.BertForSequenceClassification  # noqa: B018  (transformers imports a model class on first use)


def _exit_code(e: SystemExit) -> int:
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


def _child(run: Callable[[], int | None], out: Path, err: Path) -> None:
    code = 1
    try:
        os.setsid()
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        # Python's streams onto those descriptors, whatever the parent had put in their place (a test's capture);
        # open until os._exit below
        sys.stdout, sys.stderr = (open(fd, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115
                                  for fd in (1, 2))
        code = run() or 0
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:  # noqa: BLE001  (reported on the child's stderr, as an interpreter would)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def start(run: Callable[[], int | None], out: Path, err: Path) -> int:
    """Forks a child that runs `run()` in a session of its own (its pid is its process group's), its stdout and
    stderr written to `out` and `err`; the child's pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _child(run, out, err)
    return pid


def forked(run: Callable[[], int | None], name: list[str], timeout: float) -> subprocess.CompletedProcess:
    """`run()` in a forked child in a session of its own; its return value is the exit status. Read like
    `subprocess.run(name, capture_output=True, text=True, timeout=timeout)`: a child still running after
    `timeout` seconds is killed with its process group and TimeoutExpired raised with what it printed."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-fork-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        pid = start(run, out, err)
        deadline = time.monotonic() + timeout
        while not (done := os.waitpid(pid, os.WNOHANG))[0]:
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise subprocess.TimeoutExpired(name, timeout, out.read_text(errors="replace"),
                                                err.read_text(errors="replace"))
            time.sleep(0.02)
        return subprocess.CompletedProcess(name, os.waitstatus_to_exitcode(done[1]),
                                           out.read_text(errors="replace"), err.read_text(errors="replace"))


def bertforge_main(args: list[str]) -> Callable[[], int]:
    """`bertforge ARGS` as a function for `forked`."""

    def run() -> int:
        from bertforge.cli import main

        return main(list(args))

    return run


def one_rank(args: list[str]) -> Callable[[], int]:
    """`torchrun --standalone --nproc-per-node 1 -m bertforge ARGS` as a function for `forked`: the rank's
    variables as torchrun sets them (a free loopback port for its rendezvous), then `bertforge ARGS`."""

    def run() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", GROUP_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="gpu-check-dry-run")
        return bertforge_main(args)()

    return run

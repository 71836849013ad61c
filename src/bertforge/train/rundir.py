"""A pretraining run directory (`--out`) belongs to one run and one process at a time.

`claim_run_dir` refuses a directory that holds anything (another run, or unrelated files) unless the run is
resumed, and takes an exclusive `flock` on `.lock` inside it, so a second process on the same directory stops
at once with an `error:` line. The operating system drops the lock when the process ends, however it ends
(SIGKILL too), so a killed run never leaves a stale lock behind; the `.lock` file stays, holding the pid of
the last process that locked it, which a refusal names. Temporaries a killed run left (`.NAME.*.tmp`, see
`bertforge.files`) do not count as contents and are removed once the lock is held.

A run records its resolved configuration in `RUN_CONFIG` (`write_run_config`); `bertforge.train.resume` compares
a resumed or reused run with it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bertforge.errors import BertforgeError
from bertforge.files import write_json

LOCK_FILE = ".lock"
RUN_CONFIG = "run_config.json"  # a run's resolved configuration, in its directory
_TEMPORARY = re.compile(r"\..+\.tmp")  # what bertforge.files's atomic writes leave when killed midway


class RunDir:
    """A claimed run directory; `release()` (or leaving the `with` block) unlocks it."""

    def __init__(self, path: Path, fd: int | None, created: bool):
        self.path, self._fd, self._created = path, fd, created

    def release(self) -> None:
        if self._fd is None:
            return
        if self._created and [p.name for p in self.path.iterdir()] == [LOCK_FILE]:
            (self.path / LOCK_FILE).unlink()  # nothing was written: leave no trace of a run that never started
            self.path.rmdir()
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _stale_temporaries(path: Path) -> list[Path]:
    found = [p for p in path.iterdir() if _TEMPORARY.fullmatch(p.name)]
    checkpoints = path / "checkpoints"
    if checkpoints.is_dir():
        found += [p for p in checkpoints.iterdir() if _TEMPORARY.fullmatch(p.name)]
    return found


def used_dir_refusal(path: Path, allow: tuple[str, ...] = ()) -> BertforgeError | None:
    """The refusal of an --out that is a file, or a directory with anything in it but the lock and the entries
    named in `allow`; None for a new or empty directory."""
    if path.exists() and not path.is_dir():
        return BertforgeError(f"--out {path} is a file; give a directory for the run")
    contents = sorted(p.name for p in path.iterdir() if p.name != LOCK_FILE and p.name not in allow) \
        if path.is_dir() else []
    if not contents:
        return None
    shown = ", ".join(contents[:4]) + (", ..." if len(contents) > 4 else "")
    return BertforgeError(f"--out {path} is not empty ({shown}): continue its run with --resume, or give a new "
                          f"directory")


def claim_run_dir(out_dir: str | Path, *, resume: bool, allow: tuple[str, ...] = ()) -> RunDir:
    """Lock `out_dir` (created if missing) for this process; refuses a file, a directory another process holds,
    and, without `resume`, a directory with anything in it but the entries named in `allow`."""
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise used_dir_refusal(path)
    created = not path.exists()
    lock_existed = (path / LOCK_FILE).exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)  # the umask decides, as for every output
    except OSError as e:
        raise BertforgeError(f"cannot use --out {path}: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.read(fd, 32).decode("ascii", "replace").strip()
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise BertforgeError(f"--out {path} is in use by another bertforge process"
                                 f"{f' (pid {holder})' if holder else ''}: wait for it to end or give another "
                                 f"directory") from None
        raise BertforgeError(f"cannot lock --out {path} ({e.strerror}): give a directory on a local disk") from None
    run = RunDir(path, fd, created)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        for stale in _stale_temporaries(path):  # nobody else writes here while we hold the lock
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
        refusal = None if resume else used_dir_refusal(path, allow)
        if refusal is not None:
            if not lock_existed:  # leave a directory we refuse as it was
                (path / LOCK_FILE).unlink()
            raise refusal
    except BaseException:
        run.release()
        raise
    return run


def write_run_config(out_dir: Path, **sections: Any) -> None:
    """The resolved configuration of a run, as JSON, into out_dir/run_config.json."""
    def plain(x):
        if hasattr(x, "__dataclass_fields__"):
            return {k: plain(v) for k, v in asdict(x).items()}
        if isinstance(x, dict):
            return {str(k): plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if isinstance(x, Path):
            return os.fspath(x)
        return x

    write_json(Path(out_dir) / RUN_CONFIG, {k: plain(v) for k, v in sections.items()})

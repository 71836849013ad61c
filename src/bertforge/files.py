"""Files: atomic file and directory writes, reading text and JSON files, and the cache directory. (Progress bars
and the JSONL metrics log are in `progress.py`.)

Everything the product writes goes through here, so an interrupted run leaves either the old file or the new
one, never half of one: write to a temporary name in the same directory, fsync, then `os.replace`. A write
that fails because the output does not fit (a full disk or quota, a file-size limit) is raised as an OSError
with that errno naming the output the user asked for, not the temporary; `os_error_message` makes the CLI's
one-line error of it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import resource
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bertforge.errors import BertforgeError


def cache_dir() -> Path:
    """bertforge's cache directory: $XDG_CACHE_HOME/bertforge, by default ~/.cache/bertforge."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "bertforge"


@contextlib.contextmanager
def open_text(path: str | os.PathLike, *, newline: str | None = None) -> Iterator[Any]:
    """Open a user's UTF-8 text file for reading (a leading byte-order mark skipped). Bytes that are not UTF-8,
    met anywhere while the `with` block reads, end in a BertforgeError naming the file, line and byte rather
    than a UnicodeDecodeError from deep inside a reader."""
    path = Path(path)
    with open(path, encoding="utf-8-sig", newline=newline) as f:
        try:
            yield f
        except UnicodeDecodeError:
            raise BertforgeError(not_utf8_message(path)) from None


def not_utf8_message(path: Path) -> str:
    """Where `path` stops being UTF-8, as a one-line error message (found again from the bytes: a text
    stream decodes in chunks, so its error does not say which line)."""
    offset = 0
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):  # b"\n" never occurs inside a multi-byte UTF-8 sequence
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return (f"{path}:{line_no}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {offset + e.start}); "
                        f"convert the file to UTF-8, e.g. iconv -f latin1 -t utf-8")
            offset += len(raw)
    return f"{path} is not UTF-8 text: convert the file to UTF-8"


def read_json_object(path: str | os.PathLike, *, what: str, fix: str, missing: str | None = None,
                     error: type[BertforgeError] = BertforgeError) -> dict:
    """The JSON object in the UTF-8 file `path` (a leading byte-order mark skipped). A file that is missing,
    unreadable, not UTF-8, not JSON or not an object raises `error`, one line naming the file and ending in `fix`
    (`missing`, when given, is the whole message for a missing file; `what` says what the object holds)."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8-sig") as f:
            value = json.load(f)
    except FileNotFoundError:
        raise error(missing or f"{path} is missing: {fix}") from None
    except UnicodeDecodeError:  # before ValueError, which it is
        raise error(not_utf8_message(path)) from None
    except OSError as e:  # a directory in its place, no permission
        raise error(f"cannot read {path} ({e.strerror}): {fix}") from None
    except ValueError as e:  # json.JSONDecodeError
        raise error(f"{path} is not valid JSON ({e}): {fix}") from None
    if not isinstance(value, dict):
        raise error(f"{path} must hold a JSON object of {what}: {fix}")
    return value


# The errors that mean an output does not fit where it is written. EFBIG: past the file system's largest file,
# or the process's file-size limit (`ulimit -f`; Python ignores its SIGXFSZ, so the write fails instead).
DISK_FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
             errno.EFBIG: "file too large"}
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how safetensors' and tokenizers' writers report one
_NEARLY_FULL = 1 << 20  # bytes still available on a device that a failed write has filled


def os_error_message(e: OSError) -> str | None:
    """The one-line message for an OSError the user's machine causes rather than a bug: an output that does not
    fit (DISK_FULL), or a file where a directory must be made. None for any other."""
    where = e.filename
    if e.errno in DISK_FULL:
        fix = "free space or choose another --out"
        if e.errno == errno.EFBIG:
            fix = "raise the file-size limit (ulimit -f) or choose another --out on a file system without one"
        elif where is not None and cache_dir() in Path(where).parents:
            fix = "free space or set XDG_CACHE_HOME to a directory on another disk"
        return f"{DISK_FULL[e.errno]} writing {where or 'the output'}: {fix}"
    if e.errno in (errno.EEXIST, errno.ENOTDIR) and where is not None:
        path = Path(where)
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        if blocker == path:
            return f"{path} is a file, not a directory: choose another --out or move the file"
        if blocker is not None:
            return f"cannot make the directory {path}: {blocker} is a file; choose another --out or move the file"
    return None


def _disk_full(exc: BaseException, written: Path) -> int | None:
    """The DISK_FULL errno behind `exc`, raised while writing `written` (a file or directory), else None.
    Python's writers set errno; Rust's put "(os error N)" in the message; torch.save to a path (RuntimeError)
    and numpy's tofile (OSError without errno) say nothing usable, so for those the file system is asked."""
    if isinstance(exc, BertforgeError):
        return None
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno if exc.errno in DISK_FULL else None
    found = _RUST_OS_ERROR.search(str(exc))
    if found:
        code = int(found.group(1))
        return code if code in DISK_FULL else None
    if not isinstance(exc, OSError | RuntimeError):
        return None
    with contextlib.suppress(OSError):
        fs = os.statvfs(written)
        if fs.f_bavail * fs.f_frsize < _NEARLY_FULL:
            return errno.ENOSPC
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        files = written.rglob("*") if written.is_dir() else [written]
        if limit != resource.RLIM_INFINITY and any(p.is_file() and p.stat().st_size >= limit for p in files):
            return errno.EFBIG
    return None


@contextlib.contextmanager
def _naming_the_output(tmp: Path, path: Path) -> Iterator[None]:
    """Re-raise a write into the temporary `tmp` that failed for lack of room as OSError(DISK_FULL errno) naming
    what it becomes under `path`: the temporary is gone by the time the user reads the message."""
    try:
        yield
    except Exception as e:
        code = _disk_full(e, tmp)
        if code is None:
            raise
        failed = Path(e.filename) if isinstance(e, OSError) and e.filename is not None else tmp
        if failed == tmp or tmp in failed.parents:
            failed = path / failed.relative_to(tmp)
        raise OSError(code, os.strerror(code), str(failed)) from e


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _umask() -> int:
    """The process umask (read by setting it, so set it straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it is renamed over `path`, on error removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        with _naming_the_output(tmp, path):
            yield tmp
            # mkstemp makes 0600 (and a writer may replace the file with its own): give it the mode open() would
            os.chmod(tmp, 0o666 & ~_umask())
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def _lock_nowait(directory: Path) -> int | None:
    """An open descriptor of `directory` holding an exclusive flock, or None when another process holds it."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def remove_stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Remove the temporary directories (`.NAME.*.tmp`) that `atomic_dir(path)` calls killed midway left
    beside `path`; returns them. A temporary whose writer still runs is locked by it and kept."""
    path = Path(path)
    removed = []
    with contextlib.suppress(OSError):  # no parent yet, or unreadable: nothing of ours to clean
        for p in path.parent.iterdir():
            if not (p.name.startswith(f".{path.name}.") and p.name.endswith(".tmp") and p.is_dir()
                    and not p.is_symlink()):
                continue
            fd = _lock_nowait(p)
            if fd is None:
                continue
            try:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
            finally:
                os.close(fd)
    return removed


def replace_dir(new: Path, path: Path) -> None:
    """Put the finished directory `new` in place of `path`: an existing `path` is moved aside to its `.old` name
    and deleted only after `new` is in place, so a crash at any moment leaves a complete directory under `path` or
    under its `.old` name; if the move fails, the previous version goes back under `path`."""
    old = path.with_name(f".{path.name}.old")
    if path.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(path, old)
    try:
        os.replace(new, path)
    except OSError:
        if old.exists() and not path.exists():
            os.replace(old, path)  # the previous version stays in place, not in a name the next call clears
        raise
    _fsync_dir(path.parent)
    if old.exists():
        shutil.rmtree(old)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory beside `path`; on success it replaces `path` whole.

    An existing `path` is moved aside first and deleted only after the new one is in place, so a crash at
    any moment leaves a complete directory under `path` or under its `.old` name. The temporary is flocked
    while in use; those a killed process left (unlocked: the system drops a dead process's locks) are removed
    when the next `atomic_dir(path)` starts.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; give the finished directory the usual mode
    lock = _lock_nowait(tmp)
    try:
        with _naming_the_output(tmp, path):
            yield tmp
        replace_dir(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if lock is not None:
            os.close(lock)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a JSONL file; a torn last line (a crash mid-write) is ignored."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes as hex, read a megabyte at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()

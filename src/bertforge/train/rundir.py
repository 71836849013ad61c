"""A pretraining run directory (`--out`) belongs to one run and one process at a time.

`claim_run_dir` refuses a directory that holds anything (another run, or unrelated files) unless the run is
resumed, and takes an exclusive `flock` on `.lock` inside it, so a second process on the same directory stops
at once with an `error:` line. The operating system drops the lock when the process ends, however it ends
(SIGKILL too), so a killed run never leaves a stale lock behind; the `.lock` file stays, holding the pid of
the last process that locked it, which a refusal names. Temporaries a killed run left (`.NAME.*.tmp`, see
`bertforge.io`) do not count as contents and are removed once the lock is held.

`check_resume` compares a resumed run's options with the run_config.json it recorded: what shapes the numbers
the checkpoint continues from (model, data, tokenizer, batch, optimizer and schedule, --steps, masking, seed...)
is refused with the list of differences; what does not (`CHANGEABLE_ON_RESUME`) is returned, to be recorded.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
from pathlib import Path

from bertforge.errors import BertforgeError

LOCK_FILE = ".lock"
_TEMPORARY = re.compile(r"\..+\.tmp")  # what bertforge.io's atomic writes leave when killed midway


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


# -- resuming: what a run may change ------------------------------------------------------------------------

# run_config.json entries a resumed run may change; each is applied and recorded. Everything else (model, data,
# tokenizer, batch sizes, optimizer, learning rate and schedule, --steps, masking, seed, precision, processes)
# shapes the numbers the checkpoint continues from, so `--resume` refuses a different value.
CHANGEABLE_ON_RESUME = frozenset({
    "data",  # the path: the data itself is compared through its manifest
    "loop.log_every", "loop.eval_every", "loop.save_every", "loop.keep_last", "loop.progress", "loop.device",
    "loop.compile", "data_options.num_workers",
})


def _differences(old, new, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, recorded, new) for every leaf that differs. A key on one side only is skipped: it comes from
    another bertforge version, not from the user."""
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key in old:
            if key in new:
                found += _differences(old[key], new[key], f"{prefix}.{key}" if prefix else str(key))
        return found
    return [] if old == new else [(prefix, old, new)]


_FLAG_NAMES = {"masked_lm_prob": "mask-prob", "num_workers": "workers"}  # where the option's name is not the field's
_TOP_LEVEL_OPTIONS = ("max_seq_len", "dropout", "init")  # run_config.json keys that are options of their own


def _flag(key: str) -> str:
    section, _, name = key.partition(".")
    if section in ("loop", "data_options") and name and "." not in name:
        return "--" + _FLAG_NAMES.get(name, name.replace("_", "-"))
    if key in _TOP_LEVEL_OPTIONS:
        return "--" + key.replace("_", "-")
    return key


def check_resume(path: Path, new: dict) -> list[dict]:
    """Compare a resumed run's configuration `new` (run_config.json's sections, as JSON values) with the one
    `path`/run_config.json recorded. Raises BertforgeError listing what may not change; returns the changes that
    may (to record). The tokenizer is checked first, with its own message."""
    recorded_file = Path(path) / "run_config.json"
    if not recorded_file.is_file():
        return []
    try:
        recorded = json.loads(recorded_file.read_text(encoding="utf-8"))
    except ValueError:
        raise BertforgeError(f"{recorded_file} is not valid JSON, so --resume cannot check that the run continues "
                             f"unchanged: restore the file or start a new run") from None
    old_fp = (recorded.get("manifest") or {}).get("tokenizer_fingerprint")
    new_fp = (new.get("manifest") or {}).get("tokenizer_fingerprint")
    if old_fp and new_fp and old_fp != new_fp:
        raise BertforgeError(f"--resume: the run in {path} was trained with tokenizer {old_fp}, but --data "
                             f"{new.get('data')} was prepared with tokenizer {new_fp}: resume with the run's data "
                             f"({recorded.get('data')}), or prepare the corpus with the run's tokenizer "
                             f"(`bertforge prepare --tokenizer {path}`)")
    refused, allowed, data_keys = [], [], []
    for key, old, value in _differences({k: v for k, v in recorded.items() if k != "resumes"}, new):
        if key in CHANGEABLE_ON_RESUME:
            allowed.append({"option": key, "recorded": old, "now": value})
        elif key.startswith("manifest."):
            data_keys.append(key.partition(".")[2])
        elif key == "loop.steps" and isinstance(old, int) and isinstance(value, int) and value > old:
            refused.append(f"--steps {old} -> {value} (the learning-rate schedule ends at step {old} and cannot be "
                           f"extended: to train further, start a new run from this one's model with --init {path})")
        elif key.startswith("budget.") or key == "budget":
            refused.append(f"the time budget (--minutes): {json.dumps(old)} -> {json.dumps(value)}")
        else:
            refused.append(f"{_flag(key)} {json.dumps(old)} -> {json.dumps(value)}")
    if data_keys:
        shown = ", ".join(data_keys[:3]) + (", ..." if len(data_keys) > 3 else "")
        refused.insert(0, f"the data: {new.get('data')} is not the data the run was started on ({recorded.get('data')};"
                          f" manifest differs in {shown})")
    refused = list(dict.fromkeys(refused))  # --seed is both the loop's and the data's: say it once
    if refused:
        raise BertforgeError(f"--resume cannot change what the run in {path} was started with: {'; '.join(refused)}."
                             f" Resume with the recorded values (run_config.json), or start a new run in a new --out")
    return allowed

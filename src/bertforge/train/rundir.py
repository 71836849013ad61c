"""A pretraining run directory (`--out`) belongs to one run and one process at a time.

`claim_run_dir` refuses a directory that holds anything (another run, or unrelated files) unless the run is
resumed, and takes an exclusive `flock` on `.lock` inside it, so a second process on the same directory stops
at once with an `error:` line. The operating system drops the lock when the process ends, however it ends
(SIGKILL too), so a killed run never leaves a stale lock behind; the `.lock` file stays, holding the pid of
the last process that locked it, which a refusal names. Temporaries a killed run left (`.NAME.*.tmp`, see
`bertforge.files`) do not count as contents and are removed once the lock is held.

A run records its resolved configuration in `RUN_CONFIG` (`write_run_config`); `bertforge.train.rundir` compares
a resumed or reused run with it.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bertforge.errors import BertforgeError
from bertforge.files import read_json_object, write_json
from bertforge.train.checkpoints import checkpoints, recorded_total_steps

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


# run_config.json entries a resumed run may change; each is applied and recorded. Everything else (model, data,
# tokenizer, batch sizes, optimizer, learning rate and schedule, --steps, masking, seed, precision, processes)
# shapes the numbers the checkpoint continues from, so `--resume` refuses a different value.
CHANGEABLE_ON_RESUME = frozenset({
    "data",  # the path: the data itself is compared through its manifest
    "loop.log_every", "loop.eval_every", "loop.save_every", "loop.save_minutes", "loop.keep_last", "loop.progress",
    "loop.device", "loop.compile", "data_options.num_workers",
    # fine-tuning's options (its loop's are above)
    "options.save_every", "options.save_minutes", "options.keep_last", "options.progress", "options.device",
    "options.compile", "options.eval_batch_size",
})


@dataclass(frozen=True)
class Change:
    key: str  # dotted: "loop.lr"
    recorded: Any
    now: Any


def read_run_config(run_dir: Path) -> dict | None:
    """The configuration the run in `run_dir` recorded; None when it has none. Refuses a file that is not JSON."""
    path = Path(run_dir) / RUN_CONFIG
    if not path.is_file():
        return None
    return read_json_object(path, what="the run's settings", fix="--resume cannot check that the run continues "
                            "unchanged without it: restore the file or start a new run")


def changes(recorded: Mapping, now: Mapping, keys: Iterable[str] | None = None) -> list[Change]:
    """What differs between a run's `recorded` settings and those asked for `now`. Without `keys`: every leaf
    (dotted key) of the nested dicts, skipping a key found on one side only (it comes from another bertforge
    version, not from the user). With `keys`: those top-level keys, a missing one counting as None."""
    if keys is not None:
        return [Change(k, recorded.get(k), now.get(k)) for k in keys if recorded.get(k) != now.get(k)]
    return [Change(*d) for d in _leaf_differences(recorded, now)]


def _leaf_differences(old, new, prefix: str = "") -> list[tuple[str, object, object]]:
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        found = []
        for key in old:
            if key in new:
                found += _leaf_differences(old[key], new[key], f"{prefix}.{key}" if prefix else str(key))
        return found
    return [] if old == new else [(prefix, old, new)]


def resume_refusal(path: Path, refused: list[str]) -> BertforgeError:
    return BertforgeError(f"--resume cannot change what the run in {path} was started with: {'; '.join(refused)}."
                          f" Resume with the recorded values ({RUN_CONFIG}), or start a new run in a new --out")


_FLAG_NAMES = {"masked_lm_prob": "mask-prob", "num_workers": "workers"}  # where the option's name is not the field's
# run_config.json keys that are options of their own (fine-tuning sweeps' too)
_TOP_LEVEL_OPTIONS = ("max_seq_len", "dropout", "init", "seeds", "grid", "task")
_TASK_KEYS = {"task.task": "--task", "task.max_length": "--max-length"}  # fine-tuning's task, as it records it


def _flag(key: str) -> str:
    section, _, name = key.partition(".")
    if section == "spec" and name:  # recorded by command-line name (pretrain/run.py)
        return "--" + name.replace("_", "-")
    if section in ("loop", "data_options", "options") and name and "." not in name:
        return "--" + _FLAG_NAMES.get(name, name.replace("_", "-"))
    if key in _TASK_KEYS or key.startswith(("task.options.", "task_options.")):
        return _TASK_KEYS.get(key) or "--" + key.rpartition(".")[2].replace("_", "-")
    if key in _TOP_LEVEL_OPTIONS:
        return "--" + key.replace("_", "-")
    return key


def check_resume(path: Path, new: dict) -> list[dict]:
    """Compare a resumed run's configuration `new` (run_config.json's sections, as JSON values) with the one
    `path`/run_config.json recorded. Raises BertforgeError listing what may not change; returns the changes that
    may (to record). The tokenizer is checked first, with its own message."""
    recorded = read_run_config(path)
    if recorded is None:
        return []
    old_fp = (recorded.get("manifest") or {}).get("tokenizer_fingerprint")
    new_fp = (new.get("manifest") or {}).get("tokenizer_fingerprint")
    if old_fp and new_fp and old_fp != new_fp:
        raise BertforgeError(f"--resume: the run in {path} was trained with tokenizer {old_fp}, but --data "
                             f"{new.get('data')} was prepared with tokenizer {new_fp}: resume with the run's data "
                             f"({recorded.get('data')}), or prepare the corpus with the run's tokenizer "
                             f"(`bertforge prepare --tokenizer {path}`)")
    refused, allowed, data_keys = [], [], []
    for c in changes({k: v for k, v in recorded.items() if k != "resumes"}, new):
        key, old, value = c.key, c.recorded, c.now
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
        raise resume_refusal(path, refused)
    return allowed


def _plain(x: Any) -> Any:
    return dataclasses.asdict(x) if dataclasses.is_dataclass(x) else str(x)


def resume_history(out_dir: Path, run_config: dict, minutes: float | None, *, verbose: bool,
                   complete_ok: bool = False) -> list[dict]:
    """The resumed run's history of changed options (for run_config.json), after `check_resume` refused what may
    not change and a run whose schedule has ended was refused (unless `complete_ok`: fine-tuning then only puts
    the finished run in place). Nothing is compared when no checkpoint was written: the run starts again from
    step 0."""
    found = checkpoints(out_dir)
    if not found or read_run_config(out_dir) is None:
        return []
    plain = json.loads(json.dumps(run_config, default=_plain))
    if minutes is not None and plain.get("budget"):
        plain["budget"]["minutes"] = minutes  # the plan is reloaded on resume: compare the budget asked for now
    changed = check_resume(out_dir, plain)
    steps = recorded_total_steps(out_dir, plain["loop"]["steps"])  # a budget re-planned it
    if found[-1][0] >= steps and not complete_ok:
        raise BertforgeError(f"the run in {out_dir} is complete (checkpoint at step {found[-1][0]} of {steps}) and "
                             f"its learning-rate schedule has ended: to train further, start a new run from its "
                             f"model with --init {out_dir} and a new --out")
    history = read_run_config(out_dir).get("resumes") or []
    if changed:
        history.append({"step": found[-1][0], "changed": changed})
        if verbose:
            print("--resume: " + ", ".join(f"{c['option']} {c['recorded']} -> {c['now']}" for c in changed),
                  flush=True)
    return history


# A stacked run's settings, as run_config.json's "stack" records them, and the option each comes from.
_STACK_OPTIONS = {"fraction": "--stack-fraction", "minutes": "the time budget (--minutes):", "steps": "--steps",
                  "length_fraction": "--stack-length-fraction", "mask_prob": "--stack-mask-prob"}


def check_stack(out_dir: Path, stack: dict, stage_dirs: Iterable[Path]) -> BertforgeError | None:
    """A resumed stacked run asked for a different split, budget or length than it was started with (said in
    the whole run's terms, before a stage compares its own share), or was not stacked at all."""
    for path in stage_dirs:
        try:
            recorded = read_run_config(path)
        except BertforgeError:
            continue  # unreadable: the stage's own check says so
        if recorded is None:
            continue  # not started
        before = recorded.get("stack")
        if not isinstance(before, dict):
            return BertforgeError(f"the run in {out_dir} was not stacked: resume it with --stack-fraction 0")
        before = {"length_fraction": 1.0, "mask_prob": None, **before}  # runs from before these options
        changed = [f"{_STACK_OPTIONS[c.key]} {json.dumps(c.recorded)} -> {json.dumps(c.now)}"
                   for c in changes(before, stack, keys=_STACK_OPTIONS)]
        if changed:
            return resume_refusal(out_dir, changed)
    return None

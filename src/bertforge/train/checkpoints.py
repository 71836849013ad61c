"""A training run's resumable state: `checkpoints/step-N/` in the run directory, each holding the model (as the
run saves it), `trainer_state.pt` (optimizer, scheduler, every rank's random number generators, the data
position, the schedule's current length and the budget spent) and `state.json`, the same figures readable.

Not to be confused with `bertforge.model_files`, which reads and writes model files: a checkpoint here is what
`--resume` continues from.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bertforge.errors import BertforgeError
from bertforge.files import atomic_dir, read_jsonl, write_json, write_text
from bertforge.model_files import load_state, read_weights, unwrap
from bertforge.train import distributed

STATE_FILE = "trainer_state.pt"
STATE_JSON = "state.json"
CHECKPOINTS_DIR = "checkpoints"
METRICS_FILE = "metrics.jsonl"


def rng_state() -> dict:
    """This process's random number generators; a checkpoint holds one per rank (dropout masks differ by rank)."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under out_dir/checkpoints, oldest first."""
    root = Path(out_dir) / CHECKPOINTS_DIR
    found = []
    if root.is_dir():
        for p in root.iterdir():
            m = re.fullmatch(r"step-(\d+)", p.name)
            if m and (p / STATE_FILE).is_file():
                found.append((int(m.group(1)), p))
    return sorted(found)


@dataclass
class Resumed:
    """What a checkpoint gives back beyond the weights and optimizer: where the run goes on from."""

    step: int
    position: dict
    total_steps: int | None  # the schedule's length when it was written (a time budget re-plans it)
    budget_spent: float | None  # seconds of a time budget used up to it
    best: dict | None  # the best evaluation so far (fine-tuning's best/)


@dataclass(frozen=True)
class Saved:
    """What a checkpoint holds of a run: the model (written by `save_model`), the optimizer and the schedule."""

    model: nn.Module
    save_model: Callable[[nn.Module, Path], None]
    optimizer: torch.optim.Optimizer
    scheduler: Any


def save_checkpoint(out_dir: Path, step: int, saved: Saved, record: dict, *, dist: distributed.Dist,
                    keep_last: int) -> None:
    """Write checkpoints/step-`step`/ (on the main process; every rank must call it: the random number
    generators are gathered) and prune all but the newest `keep_last`. `record`: {"data_position", "best",
    "total_steps", and with a time budget "budget_spent_s"}, written beside the state as JSON too."""
    rng = distributed.gather_objects(rng_state(), dist)  # a collective: every rank calls it
    if not dist.is_main:
        return
    with atomic_dir(Path(out_dir) / CHECKPOINTS_DIR / f"step-{step}") as tmp:
        saved.save_model(saved.model, tmp)
        torch.save({"step": step, "optimizer": saved.optimizer.state_dict(), "scheduler": saved.scheduler.state_dict(),
                    "rng": rng, "world_size": dist.world_size, **record}, tmp / STATE_FILE)
        write_json(tmp / STATE_JSON, {"step": step, **record})
    for _, old in checkpoints(out_dir)[:-keep_last or None]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(out_dir: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler,
                    dist: distributed.Dist) -> Resumed | None:
    """Restore the newest intact checkpoint into `model`, `optimizer`, `scheduler` and the random number
    generators; None when there is none. One whose files cannot be read whole (a disk that filled up, a copy cut
    short) is set aside as step-N.corrupt, so that later pruning (`keep_last`) never counts it as the newest."""
    out_dir = Path(out_dir)
    found = checkpoints(out_dir)
    if not found:
        if dist.is_main:
            print(f"--resume: no checkpoint in {out_dir / CHECKPOINTS_DIR}; starting from step 0")
            truncate_metrics(out_dir, 0)  # what a run killed before its first checkpoint logged
        return None
    unreadable = []
    net = unwrap(model)
    # a model of several parts (ELECTRA's generator and discriminator) reads and loads its own files
    read, load = getattr(net, "read_weights", read_weights), getattr(net, "load_weights", None)
    for step, path in reversed(found):
        try:
            state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
            weights = read(path)
            rng, position = state["rng"], state["data_position"]
            optimizer_state, scheduler_state = state["optimizer"], state["scheduler"]
        except Exception as e:  # noqa: BLE001 (any failure to read means the same: this checkpoint is unusable)
            reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            unreadable.append(f"{path.name} ({reason})")
            if dist.is_main:
                _set_aside(path, reason)
            continue
        if state.get("world_size", 1) != dist.world_size:
            raise BertforgeError(f"{path} was written by {state['world_size']} process(es), not "
                                 f"{dist.world_size}: resume with the same --nproc-per-node")
        if load is not None:
            load(weights, source=str(path))
        else:
            load_state(net, weights, source=str(path), verbose=False)
        try:
            optimizer.load_state_dict(optimizer_state)
        except ValueError as e:  # torch: "... a parameter group that doesn't match the size of optimizer's group"
            raise BertforgeError(f"{path} holds the optimizer state of other trained weights than this run trains "
                                 f"(a run without NSP started by bertforge before its pooler was frozen?): start a "
                                 f"new run from its model with --init {path}") from e
        scheduler.load_state_dict(scheduler_state)
        set_rng_state(rng[dist.rank] if isinstance(rng, list) else rng)  # a dict: before per-rank states
        if dist.is_main:
            print(f"resumed from {path} (step {step})" + (f", the newest intact checkpoint; skipped "
                                                          f"{', '.join(unreadable)}" if unreadable else ""))
            truncate_metrics(out_dir, step)
        total = state.get("total_steps")
        return Resumed(step=step, position=position, total_steps=int(total) if total is not None else None,
                       budget_spent=state.get("budget_spent_s"), best=state.get("best"))
    raise BertforgeError(f"--resume: no checkpoint in {out_dir / CHECKPOINTS_DIR} can be read "
                         f"({'; '.join(unreadable)}): start the run again in a new --out")


def _set_aside(path: Path, reason: str) -> None:
    aside = path.with_name(f"{path.name}.corrupt")
    shutil.rmtree(aside, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.replace(path, aside)
    print(f"--resume: checkpoint {path} is unreadable ({reason}); moved it to {aside.name} and "
          f"trying the previous one", flush=True)


def recorded_total_steps(out_dir: Path, default: int) -> int:
    """The schedule's length the newest checkpoint recorded (a time budget re-plans it), else `default`."""
    found = checkpoints(out_dir)
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError, IndexError):  # the trainer reports a bad one
        return int(json.loads((found[-1][1] / STATE_JSON).read_text())["total_steps"])
    return default


def truncate_metrics(out_dir: Path, step: int) -> None:
    """Drop records a killed run logged after its last checkpoint, so the log has each step once."""
    path = Path(out_dir) / METRICS_FILE
    if path.is_file():
        kept = [r for r in read_jsonl(path) if r.get("step", 0) <= step]
        write_text(path, "".join(json.dumps(r) + "\n" for r in kept))

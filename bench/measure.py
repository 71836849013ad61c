"""What every bench reports: the median of its repeats with their min and max, and ratios of medians.

A best run flatters whichever side had the luckiest repeat; the median with its spread shows how steady
each side is. The benches import this as `measure` (they run as scripts, so bench/ is on the path).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch


def spread(values: Sequence[float], fmt: str = ",.1f") -> str:
    """'median (min-max)' of the repeats, e.g. '326.1 (322.0-331.4)'."""
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def ratio(ours: Sequence[float], theirs: Sequence[float], higher_is_better: bool = True) -> float:
    """Ratio of medians: how many times better `ours` is (rates: ours / theirs; times: theirs / ours)."""
    a, b = statistics.median(ours), statistics.median(theirs)
    return a / b if higher_is_better else b / a


def pin_device(name: str) -> torch.device:
    """The --device of a bench, checked: every side of the bench runs on it."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: CUDA is not available here; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device {name}: the benches run on cpu or cuda")
    return device


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so a timer stopped after it counts the work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)

"""Progress of long jobs and their machine-readable record: a tqdm bar on a terminal or plain lines in a log
(`progress_reporter`), and the append-only JSONL metrics log (`MetricsLog`)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

PLAIN_PROGRESS_SECONDS = 60.0  # between two plain progress lines: ~1.5k short lines a day, not 70 MB of frames


def progress_reporter(total: int, *, desc: str, unit: str, enabled: bool = True, initial: int = 0,
                      interval: float = PLAIN_PROGRESS_SECONDS, stream: Any = None) -> Any:
    """A progress reporter with tqdm's `update`, `set_postfix` and `close`: a tqdm bar when `stream` (stderr)
    is a terminal; otherwise one plain line every `interval` seconds and one at the end, since a bar's
    carriage-return frames pile up into one endless line in a log file. `enabled=False`: silent. `initial`:
    units already done (a resumed run), counted in the total but not in the rate."""
    stream = sys.stderr if stream is None else stream
    if enabled and stream.isatty():
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, unit_scale=unit == "B",
                    dynamic_ncols=True, file=stream)
    return PlainProgress(total, desc=desc, unit=unit, interval=interval, stream=stream if enabled else None,
                         initial=initial)


def counted(n: float, noun: str) -> str:
    """n and the noun, plural unless n is 1: "1 epoch", "2.5 epochs", "1 thread", "5 seeds"."""
    return f"{n:g} {noun}{'' if n == 1 else 's'}"


def _amount(n: float, unit: str) -> str:
    if unit != "B":
        return f"{n:g}" if isinstance(n, float) else str(n)
    for prefix in ("", "k", "M", "G", "T"):
        if abs(n) < 1000 or prefix == "T":
            return f"{n:.0f} B" if not prefix else f"{n:.1f} {prefix}B"
        n /= 1000
    return str(n)


class PlainProgress:
    """Progress as whole lines (`desc: n/total unit (p%), rate, postfix`), at most one per `interval` seconds;
    `stream=None` reports nothing."""

    def __init__(self, total: int, *, desc: str, unit: str, interval: float, stream: Any, initial: int = 0):
        self.total, self.desc, self.unit, self.interval, self.stream = total, desc, unit, interval, stream
        self.n, self.postfix = initial, {}
        self._initial = initial
        self._start = self._last = time.monotonic()
        self._shown = -1

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.stream is not None and time.monotonic() - self._last >= self.interval:
            self._line()

    def set_postfix(self, refresh: bool = False, **values: Any) -> None:
        self.postfix = values

    def close(self) -> None:
        if self.stream is not None and self._shown != self.n:
            self._line()
        self.stream = None

    def _line(self) -> None:
        now = time.monotonic()
        self._last, self._shown = now, self.n
        seconds = now - self._start
        parts = [f"{self.desc}: {_amount(self.n, self.unit)}"]
        if self.total:
            parts[0] += f"/{_amount(self.total, self.unit)} ({100 * self.n / self.total:.0f}%)"
        if self.unit != "B":
            parts[0] += f" {self.unit}s"
        if seconds > 0:
            rate = (self.n - self._initial) / seconds
            parts.append(f"{_amount(rate, 'B')}/s" if self.unit == "B" else f"{rate:.3g} {self.unit}s/s")
        parts += [f"{k} {v}" for k, v in self.postfix.items()]
        print(", ".join(parts), file=self.stream, flush=True)


class MetricsLog:
    """Append-only `metrics.jsonl`: one JSON object per line, written at once so a crash loses nothing.

    Each record gets a wall-clock `time`. A record that cannot be written whole (a full disk) is cut off again,
    so the file stays whole lines. `enabled=False` (non-zero DDP ranks) makes every call a no-op.
    """

    def __init__(self, path: str | os.PathLike, *, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        self._fd: int | None = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)

    def log(self, **record: Any) -> None:
        if self._fd is None:
            return
        line = (json.dumps({"time": round(time.time(), 3), **record}) + "\n").encode("utf-8")
        end = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            written = 0
            while written < len(line):  # a write can be short, the next one then says why
                written += os.write(self._fd, line[written:])
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, end)
            raise OSError(e.errno, e.strerror, str(self.path)) from e

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

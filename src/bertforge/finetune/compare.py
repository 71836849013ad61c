"""Does pretraining pay? Two starting points fine-tuned on one task, each at its own learning rate.

The protocol (the demo's and bench/pays.py's, written once here): each side (the pretrained model, and the same
architecture and tokenizer from random weights, `from_scratch`) fine-tunes at every learning rate of its grid on the
first `select_seeds` seeds; it keeps the lr of the best mean dev score over them (the first of equals, in the grid's
order) and runs the remaining seeds at it. Seed k is `template.options.seed + k`. Each run is
`bertforge.finetune.sweep.finetune_scored`: its best dev model scored on the test split; a finished run is read
back, an interrupted one continues. Reported per side: its runs at the chosen lr (the selection seeds' included),
their mean and sample standard deviation on dev and test; and the difference of the test means (dev where the task
has no test labels).

`compare_sides` plans the runs in two rounds (every side's selection runs, then every side's remaining seeds) and
hands each round to `runner`, which may run them one after another (`score_runs`, the default) or several at a time
(bench/pays.py: worker processes); each run's result depends on its config alone.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bertforge.errors import BertforgeError
from bertforge.finetune.config import FinetuneConfig
from bertforge.finetune.sweep import finetune_scored


@dataclass(frozen=True)
class Side:
    """One starting point: the template's `init` (its weights, or with `from_scratch` only its architecture and
    tokenizer), its learning rates, and where its runs go."""

    name: str  # "pretrained", "scratch", ...: the key of its results
    from_scratch: bool
    run_dir: Callable[[float, int], Path]  # (lr, seed number k) -> that run's output directory
    lrs: tuple[float, ...] | None = None  # its grid; None: compare_sides' `lrs`
    options: Mapping[str, Any] = field(default_factory=dict)  # more FinetuneOptions fields for this side's runs


@dataclass(frozen=True)
class Run:
    """One fine-tuning of a side: seed number `k` (seed `config.options.seed`) at `lr`, its complete config."""

    side: str
    lr: float
    k: int
    config: FinetuneConfig

    @property
    def seed(self) -> int:
        return self.config.options.seed


@dataclass
class SideResult:
    """A side's chosen lr, its runs at it, their means and spreads; the grid's mean dev score per lr."""

    name: str
    lr: float
    runs: list[dict]  # each {"lr", "seed", "dev", "test", ...}: what the runner returned
    grid_dev: dict[float, float]  # mean dev score over the selection seeds, per lr
    grid_runs: dict[float, list[dict]]  # the selection seeds' runs, per lr
    stats: dict[str, float] = field(default_factory=dict)  # dev_mean, dev_std, test_mean, test_std

    def __post_init__(self) -> None:
        for split in ("dev", "test"):
            values = [r[split] for r in self.runs]
            if values and all(v is not None for v in values):
                self.stats[f"{split}_mean"] = statistics.mean(values)
                self.stats[f"{split}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0


@dataclass
class Comparison:
    """Both sides, and the first side's mean less the second's (test, or dev without test labels)."""

    sides: dict[str, SideResult]
    difference: float
    split: str  # the split of `difference`: "test", or "dev"


def score_run(run: Run) -> dict:
    """`finetune_scored` of one run: {"lr", "seed", "dev", "test" (None without test labels), "seconds"}, each
    score the task's main metric."""
    scores = finetune_scored(run.config)
    main = _main_metric(Path(run.config.out_dir), scores["dev"])
    return {"lr": run.lr, "seed": run.seed, "dev": scores["dev"][main],
            "test": scores["test"][main] if scores["test"] else None, "seconds": scores["seconds"]}


def score_runs(runs: list[Run]) -> list[dict]:
    """The default runner: one run after another, in this process."""
    return [score_run(r) for r in runs]


def compare_sides(template: FinetuneConfig, sides: Sequence[Side], *, lrs: Sequence[float] = (), seeds: int,
                  select_seeds: int, runner: Callable[[list[Run]], list[dict]] = score_runs) -> Comparison:
    """Fine-tune every side of `sides` (two: the first's mean less the second's is the difference) by the module
    docstring's protocol: `seeds` seeds a side, its lr chosen on the first `select_seeds` by mean dev score."""
    if not 1 <= select_seeds <= seeds:
        raise BertforgeError(f"select_seeds {select_seeds} must be between 1 and seeds ({seeds})")
    grids = {s.name: tuple(s.lrs if s.lrs is not None else lrs) for s in sides}
    if len(sides) != 2 or len(grids) != 2 or not all(grids.values()):
        raise BertforgeError("compare_sides takes two sides of different names, each with at least one lr")
    chosen = range(select_seeds)
    first = [_run(template, s, lr, k) for s in sides for lr in grids[s.name] for k in chosen]
    done = iter(_checked(runner, first))
    grid_runs = {s.name: {lr: [next(done) for _ in chosen] for lr in grids[s.name]} for s in sides}
    grid_dev = {n: {lr: statistics.mean(r["dev"] for r in rs) for lr, rs in g.items()} for n, g in grid_runs.items()}
    best = {n: max(grids[n], key=grid_dev[n].__getitem__) for n in grids}  # the first of equals
    rest = [_run(template, s, best[s.name], k) for s in sides for k in range(select_seeds, seeds)]
    done = iter(_checked(runner, rest))
    results = {s.name: SideResult(s.name, best[s.name],
                                  grid_runs[s.name][best[s.name]] + [next(done) for _ in range(select_seeds, seeds)],
                                  grid_dev[s.name], grid_runs[s.name]) for s in sides}
    a, b = (results[s.name].stats for s in sides)
    split = "test" if "test_mean" in a and "test_mean" in b else "dev"
    return Comparison(results, a[f"{split}_mean"] - b[f"{split}_mean"], split)


def _run(template: FinetuneConfig, side: Side, lr: float, k: int) -> Run:
    options = {**side.options, "lr": lr, "seed": template.options.seed + k, "from_scratch": side.from_scratch}
    config = template.replace(out_dir=str(side.run_dir(lr, k)), resume=False).with_options(**options)
    return Run(side.name, lr, k, config)


def _checked(runner: Callable[[list[Run]], list[dict]], runs: list[Run]) -> list[dict]:
    results = list(runner(runs)) if runs else []
    if len(results) != len(runs):
        raise RuntimeError(f"the runner returned {len(results)} results for {len(runs)} runs")
    return results


def _main_metric(out: Path, dev: dict) -> str:
    """The task's main metric, from the run's metrics.json (`finetune` writes it); a one-metric task's only one."""
    try:
        return json.loads((out / "metrics.json").read_text())["main_metric"]
    except (OSError, ValueError, KeyError):
        if len(dev) == 1:
            return next(iter(dev))
        raise BertforgeError(f"{out} records no main metric: remove it to fine-tune it again") from None

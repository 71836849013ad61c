"""The one training loop: pretraining and every fine-tuning task run through `Trainer`.

Nothing here knows about BERT's heads or tasks. A task supplies
- data: an object with `batches(micro_batch_size, position=...)` returning an iterator of dict batches whose
  `.position` attribute (a small JSON-able dict) says where the next batch starts, so a run can resume;
- an `Objective`: per-term example counts of a batch (known before the forward pass) and per-term mean losses;
- optionally `evaluate(model) -> dict of metrics`, run every `eval_every` steps and at the end, on every rank:
  under several processes each evaluates its share and reduces the sums (`distributed.shard`,
  `distributed.all_reduce_sum`), so every rank returns the figures one process would.

Gradient accumulation is exact: each term's mean loss is re-weighted by its share of the global batch
(micro-batches x processes), so one process with batch 32, four micro-batches of 8, and two processes with
16 each all take the same step, whatever the number of masked tokens in each part.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from bertforge.device import autocast, pick_device, resolve_precision, to_device
from bertforge.errors import BertforgeError
from bertforge.files import atomic_dir, write_json
from bertforge.model_files import unwrap
from bertforge.options import LoopOptions
from bertforge.progress import MetricsLog, progress_reporter
from bertforge.train import distributed
from bertforge.train.checkpoints import (
    CHECKPOINTS_DIR,
    METRICS_FILE,
    Saved,
    checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from bertforge.train.optim import build_optimizer, build_scheduler, clipped_step, set_total_steps
from bertforge.train.prefetch import Prefetched

# LoopOptions, resolve_precision and autocast: imported from here by the loop's callers (declared below training)
__all__ = ["Hooks", "LoopOptions", "Objective", "Trainer", "TrainResult", "TrainingInterrupted", "autocast",
           "resolve_precision", "train_step"]


class Objective(Protocol):
    def counts(self, batch: dict) -> dict[str, float]:
        """Per loss term, how many examples (sequences, masked tokens, ...) this batch holds."""

    def losses(self, model: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
        """Per loss term, the mean loss over this batch's examples of that term."""


class TrainingInterrupted(Exception):
    """SIGINT/SIGTERM arrived; a checkpoint was written and the run can be resumed."""


@dataclass
class TrainResult:
    step: int
    final_metrics: dict[str, float]
    out_dir: Path


class _StopFlag:
    """Turns the first SIGINT/SIGTERM into a request to checkpoint and stop after the current step."""

    def __init__(self):
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:  # a second signal: stop now
            raise KeyboardInterrupt
        self.signal = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class NonFiniteLoss(Exception):
    """The step's loss was NaN or infinite; nothing was updated."""

    def __init__(self, value: float):
        super().__init__(f"the loss became {value}")
        self.value = value


def train_step(model: nn.Module, host: list[dict], *, objective: Objective, optimizer: torch.optim.Optimizer,
               dist: distributed.Dist, precision: str, clip: float) -> tuple[dict[str, float], int]:
    """One optimizer step over the micro-batches `host` (on the host; each moved to the device here): each term's
    mean loss weighted by its share of the global batch, gradients clipped to `clip` (0: not), the optimizer
    stepped. Returns the global mean of each loss term (and `grad_norm`, their norm before clipping, where clipped)
    and the global batch's tokens; raises NonFiniteLoss before the update when the loss is not finite. `Trainer`
    runs it, and so does `budget.time_steps`, which times it."""
    # counted on the host batches, before they move: no device sync per micro-batch
    local = [objective.counts(b) for b in host]
    names = list(local[0])
    tokens = sum(int(b["attention_mask"].sum()) for b in host if "attention_mask" in b)
    parts = [to_device(b, dist.device) for b in host]
    totals = distributed.all_reduce_sum([sum(float(c[n]) for c in local) for n in names] + [tokens], dist)
    global_counts, tokens = dict(zip(names, totals[:-1], strict=True)), int(totals[-1])
    # each term's share of the global mean, then the weighted loss, summed on the device and read once a step
    logged = torch.zeros(len(names) + 1, dtype=torch.float64, device=dist.device)
    model.train()
    for i, (batch, counts) in enumerate(zip(parts, local, strict=True)):
        sync = i == len(parts) - 1
        ctx = model.no_sync() if (dist.enabled and not sync) else contextlib.nullcontext()
        with ctx, autocast(dist.device, precision):
            term_losses = objective.losses(model, batch)
            weighted = [term_losses[n] * (counts[n] / global_counts[n]) for n in names if global_counts[n] > 0]
            loss = torch.stack(weighted).sum()
        (loss * dist.world_size).backward()  # DDP averages over processes; we want the sum of shares
        with torch.no_grad():
            for j, n in enumerate(names):
                if global_counts[n] > 0:
                    logged[j] += term_losses[n].double() * (counts[n] / global_counts[n])
            logged[-1] += loss.double()
    logged = distributed.all_reduce_sum(logged.tolist(), dist)
    total = logged[-1]
    if not math.isfinite(total):
        raise NonFiniteLoss(total)
    grad_norm = clipped_step(optimizer, model.parameters(), clip)
    optimizer.zero_grad(set_to_none=True)
    terms = {f"{n}_loss" if n != "loss" else n: v for n, v in zip(names, logged[:-1], strict=True)}
    terms["loss"] = total
    if grad_norm is not None:  # a 0-dim tensor on a GPU, read when the window's mean is logged
        terms["grad_norm"] = grad_norm
    return terms, tokens


@dataclass(frozen=True)
class Hooks:
    """What a training path adds to the loop: `evaluate(model) -> metrics`, `save_model(model, path)` (default:
    `save_pretrained`), `on_log(record)`, `final_dir` (default: the run directory), and a time budget's `Deadline`,
    which moves the end of the schedule to where the steps' wall time puts it (`config.steps`: the first plan)."""

    evaluate: Callable[[nn.Module], dict[str, float]] | None = None
    save_model: Callable[[nn.Module, Path], None] | None = None
    on_log: Callable | None = None
    final_dir: str | Path | None = None
    deadline: Any = None


class Trainer:
    """Runs `config.steps` optimizer steps of `objective` on `data`, writing into `out_dir`:
    metrics.jsonl, checkpoints/step-N/, the final model (via `save_model`, into `final_dir`, by default
    `out_dir` itself) and, with `best_metric`, the model of the best evaluation in best/."""

    def __init__(self, model: nn.Module, data: Any, objective: Objective, config: LoopOptions, out_dir: str | Path,
                 *, hooks: Hooks | None = None, dist: distributed.Dist | None = None, resume: bool = False):
        self.model, self.data, self.objective, self.config = model, data, objective, config
        hooks = hooks or Hooks()
        self.out_dir = Path(out_dir)
        self.final_dir = Path(hooks.final_dir) if hooks.final_dir is not None else self.out_dir
        self.evaluate_fn, self.resume = hooks.evaluate, resume
        self.save_model_fn = hooks.save_model or (lambda m, path: unwrap(m).save_pretrained(path))
        self.dist = dist or distributed.Dist(device=pick_device(config.device))
        self.on_log = hooks.on_log
        self.deadline = hooks.deadline
        self.total_steps = config.steps
        self.micro, self.accum = config.accumulation(self.dist.world_size)
        self.precision = resolve_precision(config.precision, self.dist.device)

    # -- checkpoints (bertforge.train.checkpoints) ------------------------------------------------------------------
    def _save_checkpoint(self, step: int, position: dict) -> None:
        plan = {"total_steps": self.total_steps}
        if self.deadline is not None:
            plan["budget_spent_s"] = self.deadline.spent_now()
        saved = Saved(self.model, self.save_model_fn, self.optimizer, self.scheduler)
        save_checkpoint(self.out_dir, step, saved, {"data_position": position, "best": self.best, **plan},
                        dist=self.dist, keep_last=self.config.keep_last)
        self._saved_at = time.monotonic()

    def _checkpoint_if_due(self, step: int, last: bool, signalled: bool, position: dict) -> None:
        """After a step: a checkpoint every `save_every` steps, when `save_minutes` have passed since the last
        one, at the end, and on SIGINT/SIGTERM (then the run stops). The ranks agree on the clock's and the
        signal's answers in one collective, so all of them save, or stop, at the same step."""
        cfg = self.config
        late = cfg.save_minutes > 0 and time.monotonic() - self._saved_at >= 60 * cfg.save_minutes
        signalled, late = distributed.any_ranks([signalled, late], self.dist)
        if (cfg.save_every and step % cfg.save_every == 0) or last or late or signalled:
            self._save_checkpoint(step, dict(position))
        if signalled and not last:
            raise TrainingInterrupted(f"stopped at step {step}; checkpoint saved in {self.out_dir / CHECKPOINTS_DIR}; "
                                      f"continue with --resume")

    def _resume(self) -> tuple[int, dict | None]:
        """The step and data position to go on from: the newest intact checkpoint's, or (0, None)."""
        resumed = load_checkpoint(self.out_dir, model=self.model, optimizer=self.optimizer,
                                  scheduler=self.scheduler, dist=self.dist)
        if resumed is None:
            return 0, None
        self.total_steps = resumed.total_steps or self.config.steps
        if self.total_steps != self.config.steps:  # a time budget re-planned it
            set_total_steps(self.scheduler, self.config.warmup_steps, self.total_steps)
        self.resumed_budget_spent, self.best = resumed.budget_spent, resumed.best
        return resumed.step, resumed.position

    # -- the loop ---------------------------------------------------------------------------------------
    def _start(self) -> tuple[int, dict | None]:
        """Seed, optimizer and schedule, then the checkpoint to resume from; refuses a finished run."""
        cfg = self.config
        torch.manual_seed(cfg.seed + self.dist.rank)
        self.model.to(self.dist.device)
        self.optimizer = build_optimizer(self.model, name=cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                         betas=tuple(cfg.betas), layer_lr_decay=cfg.layer_lr_decay,
                                         looked_up_rows=not self.dist.enabled)
        self.scheduler = build_scheduler(self.optimizer, cfg.warmup_steps, cfg.steps)
        self.best, self.resumed_budget_spent = None, None  # the best evaluation so far; a resumed budget's time
        self._saved_at = time.monotonic()  # `save_minutes` count from the start of this process's training
        start, position = self._resume() if self.resume else (0, None)
        if start >= self.total_steps:
            raise BertforgeError(f"{self.out_dir} already holds a checkpoint at step {start} >= --steps "
                                 f"{self.total_steps}: the run is finished; to train further, start a new run "
                                 f"from it with --init {self.out_dir} and a new --out")
        return start, position

    def _wrapped(self) -> nn.Module:
        """The model as the steps run it: compiled if asked, inside DDP under several processes."""
        model = self.model
        if self.config.compile:
            # A model that knows which of its parts have data-dependent shapes compiles the rest itself (BERT: its
            # encoder); any other model is compiled whole.
            compile_parts = getattr(model, "compile_encoder", None)
            if compile_parts is not None:
                compile_parts()
            else:
                model = torch.compile(model)
        if self.dist.enabled:
            d = self.dist
            model = nn.parallel.DistributedDataParallel(
                model, device_ids=[d.device.index] if d.device.type == "cuda" else None)
        return model

    def run(self) -> TrainResult:
        cfg, d = self.config, self.dist
        start, position = self._start()
        model = self.train_model = self._wrapped()
        batches = self.data.batches(self.micro, position=position) if position else self.data.batches(self.micro)
        if d.device.type == "cuda":  # the next batches made while the GPU trains (`prefetch`)
            batches = Prefetched(batches, depth=2 * self.accum, pin=True)
        ahead = contextlib.closing(batches) if isinstance(batches, Prefetched) else contextlib.nullcontext()
        metrics = MetricsLog(self.out_dir / METRICS_FILE, enabled=d.is_main)
        self.writer = _tensorboard(self.out_dir) if d.is_main else None
        final: dict[str, float] = {}
        if self.deadline is not None:
            self.deadline.begin(start, self.resumed_budget_spent)
        with ahead, _StopFlag() as stop, metrics, _progress(cfg, start, d.is_main, self.total_steps) as bar:
            window = _Window()
            step = start
            while step < self.total_steps:
                step += 1
                terms, tokens, waited = self._step(model, batches)
                window.add(terms, tokens, waited)
                lr = self.scheduler.get_last_lr()[0]
                self.scheduler.step()
                self._replan(step, bar)
                if step % cfg.log_every == 0 or step == self.total_steps:
                    self._log(step, window, lr, metrics)
                    window = _Window()
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{terms['loss']:.3f}", lr=f"{lr:.2e}", refresh=False)
                last = step == self.total_steps
                if (cfg.eval_every and step % cfg.eval_every == 0) or last:
                    final = self._evaluate(step, metrics, self.writer)
                self._checkpoint_if_due(step, last, stop.signal is not None, batches.position)
        if d.is_main:
            self.save_model_fn(self.model, self.final_dir)
        if self.writer is not None:
            self.writer.close()
        # Drop the DDP wrapper now: it holds the process group, which `distributed.teardown` should destroy while
        # the interpreter is alive. The two-process test's rank 1 aborted at exit ("terminate called without an
        # active exception") in 2 of 35 runs before this, in none of 45 after.
        self.train_model = None
        self.optimizer.release_rows()
        return TrainResult(step=self.total_steps, final_metrics=final, out_dir=self.out_dir)

    def _replan(self, step: int, bar) -> None:
        """Under a time budget, every `deadline.every` steps: the schedule's end moved to where the deadline is."""
        deadline = self.deadline
        if deadline is None or step % deadline.every or step >= self.total_steps:
            return
        total = deadline.steps(step, self.dist)
        if total != self.total_steps:
            self.total_steps = total
            set_total_steps(self.scheduler, self.config.warmup_steps, total)
            if bar is not None:
                bar.total = total

    def _log(self, step: int, window: _Window, lr: float, metrics: MetricsLog) -> None:
        record = {"step": step, "split": "train", **window.mean(), "lr": lr, **window.rates(self.dist)}
        if self.deadline is not None:
            record["planned_steps"] = self.total_steps
        metrics.log(**record)
        if self.writer is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.writer.add_scalar(f"train/{k}", v, step)
        if self.on_log is not None:
            self.on_log(record)

    def _step(self, model: nn.Module, batches: Iterator[dict]) -> tuple[dict[str, float], int, float]:
        """One optimizer step (`train_step`) on the next `accum` micro-batches: its loss terms, tokens, and seconds
        spent waiting for those batches. A loss that is not finite stops the run, naming the checkpoint."""
        asked = time.perf_counter()
        host = [next(batches) for _ in range(self.accum)]
        waited = time.perf_counter() - asked
        try:
            terms, tokens = train_step(model, host, objective=self.objective, optimizer=self.optimizer,
                                       dist=self.dist, precision=self.precision, clip=self.config.clip_grad_norm)
            return terms, tokens, waited
        except NonFiniteLoss as e:
            last = checkpoints(self.out_dir)
            where = f"the last good checkpoint is {last[-1][1]}" if last else "no checkpoint was written yet"
            raise BertforgeError(f"the loss became {e.value} at step {self.scheduler.last_epoch + 1}; {where} "
                                 f"(untouched). Lower --lr or check the data, then --resume or start again") from None

    def _evaluate(self, step: int, metrics: MetricsLog, writer) -> dict[str, float]:
        """Every rank evaluates (its share, reduced inside `evaluate_fn`); rank 0 logs and keeps the best model.
        No barrier: the evaluation's own collectives keep the ranks together, none waits idle through it."""
        if self.evaluate_fn is None:
            return {}
        model = unwrap(self.model)
        was_training = model.training
        model.eval()
        with torch.no_grad(), autocast(self.dist.device, self.precision):
            results = self.evaluate_fn(model)
        model.train(was_training)
        if self.dist.is_main:
            metrics.log(step=step, split="eval", **results)
            if writer is not None:
                for k, v in results.items():
                    writer.add_scalar(f"eval/{k}", v, step)
            print(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in results.items()), flush=True)
            key = self.config.best_metric
            if key is not None and key in results and (self.best is None or results[key] > self.best["value"]):
                self.best = {"metric": key, "value": results[key], "step": step}
                with atomic_dir(self.out_dir / "best") as tmp:
                    self.save_model_fn(self.model, tmp)
                    write_json(tmp / "metrics.json", {"step": step, **results})
        return results


class _Window:
    """Running sums between two log lines."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.steps, self.tokens, self.data_wait, self.start = 0, 0, 0.0, time.perf_counter()

    def add(self, terms: dict[str, float], tokens: int, data_wait: float) -> None:
        for k, v in terms.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.steps, self.tokens, self.data_wait = self.steps + 1, self.tokens + tokens, self.data_wait + data_wait

    def mean(self) -> dict[str, float]:
        return {k: float(v) / max(self.steps, 1) for k, v in self.sums.items()}

    def rates(self, d: distributed.Dist) -> dict[str, float]:
        seconds = time.perf_counter() - self.start
        # data_wait_s: per step, the time spent waiting for the next batches (a loader that keeps up: near 0)
        return {"tokens_per_s": self.tokens / seconds if seconds > 0 else 0.0, "step_time_s": seconds / self.steps,
                "data_wait_s": self.data_wait / self.steps}


@contextlib.contextmanager
def _progress(cfg: LoopOptions, start: int, enabled: bool, total: int):
    """A bar on a terminal, plain lines now and then when stderr is a log file (see `progress_reporter`)."""
    if not (enabled and cfg.progress):
        yield None
        return
    bar = progress_reporter(total, initial=start, desc="train", unit="step")
    try:
        yield bar
    finally:
        bar.close()


def _tensorboard(out_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter  # here: tensorboard is an optional dependency
    except Exception:  # not installed: no event files
        return None
    return SummaryWriter(log_dir=str(out_dir / "tensorboard"))

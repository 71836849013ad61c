"""`DistillConfig`: everything a distillation run is, made once and passed whole (`bertforge.distill.distill`).

Distillation is the third training path: a small student learns a fine-tuned teacher's outputs on the task's
examples and on unlabelled text (the transfer set), through fine-tuning's run machinery (`finetune.run.train_task`),
so `options` are fine-tuning's own (`FinetuneOptions`: lr, epochs, batch, seed, precision, checkpoints) and
`distill` adds what only distillation has (`DistillOptions`: temperature, the labels' weight, the transfer set, the
teacher's engine). What can be checked without reading a file is checked in `__post_init__`, each a one-line error
naming the fix; the teacher, the student and the data are checked when the run reads them.

Like `bertforge.finetune.config`, this module imports only the standard library and the option classes, so the
command line can build and check a config before torch is loaded.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bertforge.errors import BertforgeError
from bertforge.finetune.config import as_strings
from bertforge.options import DistillOptions, FinetuneOptions, cli_name

# A distilled student's peak learning rate: a tiny or mini student needs far more than a 110M-parameter BERT's 3e-5
# (the first try: 5e-4 for tiny, 82-83 on a review task against 78 fine-tuned on the labels alone).
DISTILL_LR = 5e-4


@dataclass(frozen=True)
class DistillConfig:
    """One distillation run: the teacher, the student, the task and its data, the transfer set, where it goes and
    how it trains. Paths may be given as `Path`s; they are kept as the strings run_config.json records."""

    teacher: str  # a fine-tuned model directory of `task` (task.json, labels), from `bertforge finetune`, or a
    #               transformers sequence classifier of another architecture (foreign.py)
    student: str  # a pretrained model directory with its own tokenizer, or a preset (tiny, mini, ...): random
    #               weights of that size over the teacher's tokenizer
    task: str  # the task's name (the teacher's task.json must name the same)
    data_dir: str  # the task's data directory (its train split is distilled on, its dev split picks the best model)
    out_dir: str  # where the student goes, an ordinary fine-tuned model directory (worked on in `<out>.partial/`)
    task_options: dict[str, Any] = field(default_factory=dict)  # the task's own options (csv: text_column, ...)
    transfer: tuple[str, ...] = ()  # unlabelled text (files, directories, globs as `prepare` reads) for the teacher
    options: FinetuneOptions = field(default_factory=lambda: FinetuneOptions(lr=DISTILL_LR))  # how the student trains
    distill: DistillOptions = field(default_factory=DistillOptions)  # temperature, alpha, transfer set, teacher engine
    cache_dir: str | None = None  # the teacher outputs' cache (default: ~/.cache/bertforge/teacher-outputs)
    resume: bool = False  # continue from the newest checkpoint in `<out_dir>.partial/`
    more_teachers: tuple[str, ...] = ()  # fine-tuned models of the same task and labels as `teacher`: the student
    #                                      learns the mean of all the teachers' outputs (an ensemble in one model)

    def __post_init__(self) -> None:
        as_strings(self, _NAMES)
        for name in ("transfer", "more_teachers"):
            value = getattr(self, name)
            value = (value,) if isinstance(value, str | Path) else value
            object.__setattr__(self, name, tuple(str(t) for t in value))
        if self.cache_dir is not None:
            object.__setattr__(self, "cache_dir", str(self.cache_dir))
        if not isinstance(self.options, FinetuneOptions):
            raise BertforgeError(f"DistillConfig.options is a {type(self.options).__name__}: give a FinetuneOptions")
        if not isinstance(self.distill, DistillOptions):
            raise BertforgeError(f"DistillConfig.distill is a {type(self.distill).__name__}: give a DistillOptions")
        if not isinstance(self.task_options, dict) or not all(isinstance(k, str) for k in self.task_options):
            raise BertforgeError(f"DistillConfig.task_options {self.task_options!r}: give a dict of option names "
                                 "to values, e.g. {'text_column': 'review'}")
        self._check_numbers()
        seen: set[Path] = set()
        for teacher in self.teachers:
            if Path(self.out_dir).resolve() == Path(teacher).resolve():
                raise BertforgeError(f"--out {self.out_dir} is the teacher {teacher}'s directory, which the student "
                                     "would replace: give a new directory")
            if Path(teacher).resolve() in seen:
                raise BertforgeError(f"--teacher {teacher} is given twice: give each teacher once")
            seen.add(Path(teacher).resolve())
        if self.options.from_scratch and self.options.reinit_layers:
            raise BertforgeError(f"--reinit-layers {self.options.reinit_layers} re-initialises pretrained layers and "
                                 "--from-scratch starts from random weights: drop one of them")

    @property
    def teachers(self) -> tuple[str, ...]:
        """`teacher` and `more_teachers`, in that order."""
        return (self.teacher, *self.more_teachers)

    def _check_numbers(self) -> None:
        t, a = self.distill.temperature, self.distill.alpha
        if not (isinstance(t, int | float) and math.isfinite(t) and t > 0):
            raise BertforgeError(f"--temperature {t}: give a finite number above 0 (2 is usual)")
        if not (isinstance(a, int | float) and math.isfinite(a) and a >= 0):
            raise BertforgeError(f"--alpha {a}: give a finite number, 0 or more (0: the teacher's outputs alone)")
        for f in dataclasses.fields(self.distill):  # the choices each option declares (--teacher-engine ...)
            value, choices = getattr(self.distill, f.name), f.metadata.get("choices")
            if choices and value not in choices:
                raise BertforgeError(f"--{cli_name(f).replace('_', '-')} {value!r}: give one of {', '.join(choices)}")

    def replace(self, **fields: Any) -> DistillConfig:
        """A copy with some fields replaced (`dataclasses.replace`), checked again."""
        return dataclasses.replace(self, **fields)

    def with_options(self, **fields: Any) -> DistillConfig:
        """A copy whose fine-tuning `options` have some fields replaced (lr, seed, from_scratch ...)."""
        return dataclasses.replace(self, options=dataclasses.replace(self.options, **fields))

    def with_distill(self, **fields: Any) -> DistillConfig:
        """A copy whose `distill` options have some fields replaced (temperature, alpha ...)."""
        return dataclasses.replace(self, distill=dataclasses.replace(self.distill, **fields))


_NAMES = {"teacher": "teacher's fine-tuned model directory", "student": "student's model directory or preset (tiny, "
          "mini, ...)", "task": "task name (sst2, csv, ...)", "data_dir": "task's data directory",
          "out_dir": "output directory"}

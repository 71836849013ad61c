"""`FinetuneConfig`: everything a fine-tuning run is, made once and passed whole.

`bertforge.finetune.run.finetune` takes it as its only argument; the sweeps (`bertforge.finetune.sweep`) and the
comparison of two starting points (`bertforge.finetune.compare`) take one as a template and derive each run's with
`dataclasses.replace` (another `out_dir`, other `options`). Nothing downstream asks whether a value was given: the
config says what the run is. What can be checked without reading a file is checked in `__post_init__`, each a
one-line error naming the fix; the task's name and options are checked by the task registry when the run starts
(it imports torch), the data and the model directory when they are read.

Like `bertforge.options`, this module imports only the standard library and the option classes, so the command
line can build and check a config before torch is loaded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bertforge.errors import BertforgeError
from bertforge.options import FinetuneOptions


@dataclass(frozen=True)
class FinetuneConfig:
    """One fine-tuning run (`bertforge.finetune.finetune`): the task, its data, where it starts and where it goes,
    and how it trains. Paths may be given as `Path`s; they are kept as the strings run_config.json records."""

    task: str  # a task name of `bertforge.tasks.TASKS`: sst2, mnli, squad, conll2003, csv, jsonl, ...
    data_dir: str  # the task's data directory in its official layout (or a file)
    init: str  # the model directory to start from: weights, config.json and tokenizer
    out_dir: str  # where the best dev model, metrics.json and predictions go (worked on in `<out_dir>.partial/`)
    task_options: dict[str, Any] = field(default_factory=dict)  # the task's own options (csv: text_column, ...)
    options: FinetuneOptions = field(default_factory=FinetuneOptions)  # how it trains (defaults: the paper's)
    resume: bool = False  # continue from the newest checkpoint in `<out_dir>.partial/`

    def __post_init__(self) -> None:
        as_strings(self, _NAMES)
        if not isinstance(self.options, FinetuneOptions):
            raise BertforgeError(f"FinetuneConfig.options is a {type(self.options).__name__}: give a "
                                 "FinetuneOptions")
        if not isinstance(self.task_options, dict) or not all(isinstance(k, str) for k in self.task_options):
            raise BertforgeError(f"FinetuneConfig.task_options {self.task_options!r}: give a dict of option names "
                                 "to values, e.g. {'text_column': 'review'}")
        if self.options.from_scratch and self.options.reinit_layers:
            raise BertforgeError(f"--reinit-layers {self.options.reinit_layers} re-initialises pretrained layers and "
                                 "--from-scratch starts from random weights: drop one of them")

    def replace(self, **fields: Any) -> FinetuneConfig:
        """A copy with some fields replaced (`dataclasses.replace`), checked again."""
        return dataclasses.replace(self, **fields)

    def with_options(self, **fields: Any) -> FinetuneConfig:
        """A copy whose `options` have some fields replaced (a sweep's lr and seed, one side's `from_scratch`)."""
        return dataclasses.replace(self, options=dataclasses.replace(self.options, **fields))


_NAMES = {"task": "task name (sst2, csv, ...)", "data_dir": "task's data directory", "init": "model directory to "
          "start from", "out_dir": "output directory"}


def as_strings(config: Any, names: dict[str, str]) -> None:
    """The fields `names` of the frozen `config` as the strings run_config.json records: a Path becomes its string,
    anything else but a non-empty string is refused in one line naming what to give (`names[field]`)."""
    for name, what in names.items():
        value = getattr(config, name)
        if isinstance(value, Path):
            object.__setattr__(config, name, str(value))
        elif not isinstance(value, str):
            raise BertforgeError(f"{type(config).__name__}.{name} is {value!r}: give a string or a Path")
        if not getattr(config, name).strip():
            raise BertforgeError(f"{type(config).__name__}.{name} is empty: give the {what}")

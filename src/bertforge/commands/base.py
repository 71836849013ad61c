"""Typed argument dataclasses become argparse subcommands.

A command is a dataclass of arguments (each field declared with `arg(..., help=...)`) plus a function that
takes an instance of it. Field types decide the parsing: `str`, `int`, `float`, `bool` (a `--x/--no-x`
switch), `list[str]` (one or more values), and `X | None` (optional). A numeric field's `bound` (`at_least(1)`,
`POSITIVE`, `PROBABILITY`, ...) is checked where the value arrives, on the command line or in a `--config`
file, so an impossible value is an `error:` line before any work starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bertforge.errors import BertforgeError


@dataclasses.dataclass(frozen=True)
class Bound:
    """The values a numeric option may take: `lo` and `hi` (None: unbounded), each included unless `*_open`;
    `why` is added to the refusal."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    why: str = ""

    def describe(self) -> str:
        if self.hi is None:
            return f"above {self.lo}" if self.lo_open else f"at least {self.lo}"
        if self.lo is None:
            return f"below {self.hi}" if self.hi_open else f"at most {self.hi}"
        return f"in {'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"

    def because(self, why: str) -> Bound:
        return dataclasses.replace(self, why=why)

    def admits(self, value: float) -> bool:
        above = self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)
        below = self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        return above and below


def at_least(n: int, why: str = "") -> Bound:
    return Bound(lo=n, why=why)


POSITIVE = Bound(lo=0, lo_open=True)  # a learning rate, a number of epochs, minutes
PROBABILITY = Bound(lo=0, hi=1, lo_open=True, hi_open=True)  # a share that must leave some of both sides
FRACTION = Bound(lo=0, hi=1, hi_open=True)  # a share that may be zero but not all (dropout, warmup, held out)
MIN_SEQ_LEN = at_least(8)  # the least `prepare` makes instances for
SEED = Bound(lo=0, hi=2**32 - 1, why="a seed is a 32-bit number")


def arg(default: Any = dataclasses.MISSING, *, help: str, positional: bool = False, short: str | None = None,
        choices: list[str] | None = None, metavar: str | None = None, bound: Bound | None = None) -> Any:
    """Declare one command-line argument as a dataclass field; a numeric one with the `bound` its values keep."""
    meta = {"help": help, "positional": positional, "short": short, "choices": choices, "metavar": metavar,
            "bound": bound}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda d=default: list(d), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def precision_arg() -> Any:
    """`--precision`, the same for every training command."""
    return arg("auto", choices=["auto", "fp32", "bf16"],
               help="bf16 autocast (weights and optimizer stay fp32) or fp32; auto: bf16 on CUDA devices with "
                    "native bf16, fp32 elsewhere (bf16 pays on CPUs with AVX512-BF16 or AMX, about 1.6x)")


def seed_arg(default: int, help: str = "random seed") -> Any:
    """A `--seed`: every command's takes the same values."""
    return arg(default, help=help, bound=SEED)


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand: `name` may have two words (`vocab train`)."""

    name: str
    args: type
    run: Callable[[Any], int | None]
    help: str
    description: str = ""
    trains: bool = False  # a training command: the CLI keeps freed CPU memory for it (train/memory.py)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1:
            return inner[0], True
    return tp, False


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _number_problem(value: float, bound: Bound | None) -> str | None:
    """Why `value` is refused (None: it is not): not finite, or outside `bound`."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, not {value}"
    if bound is not None and not bound.admits(value):
        return f"must be {bound.describe()}, not {value}" + (f" ({bound.why})" if bound.why else "")
    return None


def _command_line_type(tp: type, bound: Bound | None) -> Callable[[str], Any]:
    """argparse's `type` for a field: converts, and raises ArgumentTypeError (one `error:` line) on a refusal."""
    if tp not in (int, float):
        return tp

    def convert(text: str) -> Any:
        try:
            value = tp(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {_KINDS[tp]}, not {text!r}") from None
        problem = _number_problem(value, bound)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    convert.__name__ = tp.__name__
    return convert


def _json_value(tp: Any, value: Any, meta: typing.Mapping) -> Any:
    """A `--config` file's value for a field of type `tp`, checked as the command line checks it; ValueError
    says why it is refused."""
    tp, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise ValueError("must not be null")
    if typing.get_origin(tp) is list:
        if not isinstance(value, list):
            raise ValueError(f"must be a list, not {json.dumps(value)}")
        return [_json_value(typing.get_args(tp)[0], v, meta) for v in value]
    fits = isinstance(value, str) if tp is str else isinstance(value, bool) if tp is bool else (
        isinstance(value, (int, float) if tp is float else int) and not isinstance(value, bool))
    if not fits:
        raise ValueError(f"must be {_KINDS[tp]}, not {json.dumps(value)}")
    if meta.get("choices") and value not in meta["choices"]:
        raise ValueError(f"must be one of {', '.join(meta['choices'])}, not {json.dumps(value)}")
    if tp in (int, float):
        value = tp(value)
        problem = _number_problem(value, meta.get("bound"))
        if problem:
            raise ValueError(problem)
    return value


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        tp, _ = _unwrap_optional(hints[f.name])
        kwargs: dict[str, Any] = {"help": meta.get("help", "")}
        if meta.get("choices"):
            kwargs["choices"] = meta["choices"]
        if meta.get("metavar"):
            kwargs["metavar"] = meta["metavar"]
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        if typing.get_origin(tp) is list:
            kwargs["type"] = _command_line_type(typing.get_args(tp)[0], meta.get("bound"))
            kwargs["nargs"] = "+" if not has_default else "*"
        elif tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _command_line_type(tp, meta.get("bound"))
        if meta.get("bound") is not None:
            kwargs["help"] += f"; {meta['bound'].describe()}"
        if has_default:
            kwargs["default"] = default
            if tp is not bool and default is not None and "(default" not in kwargs["help"]:
                kwargs["help"] += f" (default: {default})"
        if meta.get("positional"):
            if has_default and "nargs" not in kwargs:
                kwargs["nargs"] = "?"
            parser.add_argument(f.name, **kwargs)
        else:
            names = [flag_name(f.name)] + ([meta["short"]] if meta.get("short") else [])
            if not has_default:
                kwargs["required"] = True
            parser.add_argument(*names, dest=f.name, **kwargs)


def build_args(cls: type, namespace: argparse.Namespace) -> Any:
    return cls(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)})


def merge_config_file(args: Any, path: str | None) -> Any:
    """`args` with the options of the JSON file `path` (an object keyed by field name, e.g. "batch_size") filled
    in where the command line left the default; every value is checked as on the command line, and a refusal
    is a BertforgeError naming the option and the file."""
    if path is None:
        return args
    try:
        values = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BertforgeError(f"cannot read --config {path}: {e}") from None
    if not isinstance(values, dict):
        raise BertforgeError(f"--config {path} must hold a JSON object of options, e.g. {{\"lr\": 0.001}}")
    cls = type(args)
    hints = typing.get_type_hints(cls)
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(by_name))
    if unknown:
        raise BertforgeError(f"--config {path} has unknown options {unknown}; see the command's --help for them")
    merged = {}
    for key, value in values.items():
        f = by_name[key]
        if key == "config" or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING):
            raise BertforgeError(f"--config {path}: {flag_name(key)} is given on the command line only")
        try:
            value = _json_value(hints[key], value, f.metadata)
        except ValueError as e:
            raise BertforgeError(f"--config {path}: {flag_name(key)} {e}") from None
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if getattr(args, key) == default:  # not given on the command line, which wins
            merged[key] = value
    return dataclasses.replace(args, **merged)


def check_output_file(path: str | None, flag: str = "--out") -> None:
    """Refuse, before any work, an output file name that is an existing directory."""
    if path is not None and Path(path).is_dir():
        raise BertforgeError(f"{flag} {path} is a directory; give a file name (e.g. {Path(path) / 'out.jsonl'})")


def emit_jsonl(records: typing.Iterable[dict], out: str | None, what: str) -> None:
    """Write one JSON object per line to `out` (atomically, then say how many) or, without `out`, to stdout."""
    lines = [json.dumps(r, ensure_ascii=False) + "\n" for r in records]
    if out:
        from bertforge.io import write_text

        write_text(out, "".join(lines))
        print(f"{len(lines)} {what} written to {out}")
    else:
        sys.stdout.write("".join(lines))

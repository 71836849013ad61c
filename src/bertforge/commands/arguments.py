"""Commands' arguments as typed dataclasses, and the argparse parsers made from them.

A command is a dataclass of arguments plus a function that takes an instance of it. Each field is an option
declared with `bertforge.options.option` (help, default, choices, a numeric `bound`); a command that runs a
library entry point takes that entry point's options from its option class (`command_args(LoopOptions, ...)`)
rather than declaring them again, and hands them back with one conversion (`options_from`).

Field types decide the parsing: `str`, `int`, `float`, `bool` (a `--x/--no-x` switch), `list[str]` (one or more
values), and `X | None` (optional). A numeric field's `bound` is checked where the value arrives, on the command
line or in a `--config` file, so an impossible value is an `error:` line before any work starts. Every value
resolves through `build_args`: the command line's, else the `--config` file's, else the declared default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING
from pathlib import Path
from typing import Any

from bertforge.bounds import Bound
from bertforge.errors import BertforgeError
from bertforge.files import read_json_object
from bertforge.options import cli_name, default_of, redeclare


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand: `name` may have two words (`vocab train`)."""

    name: str
    args: type
    run: Callable[[Any], int | None]
    help: str
    description: str = ""
    # the CLI keeps freed CPU memory for it (train/memory.py): the training commands and those that run a model
    # over a file of texts, whose big activations would otherwise pay page faults on every batch
    keeps_freed_memory: bool = False


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1:
            return inner[0], True
    return tp, False


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def command_args(*sources: type, defaults: Mapping[str, Any] | None = None,
                 optional: Mapping[str, str] | None = None) -> Callable[[type], type]:
    """A class decorator that makes a command's argument dataclass (keyword-only): the class's own fields, declared
    with `option`, then every option of the option classes `sources` under its command-line name. A name the class
    declares itself, or that several sources have, is one argument, which `options_from` gives to each of them.
    `defaults` gives some options the command's own default; those named in `optional` default to None, for the
    command to fill in (from a recipe, say), and get that text added to their help."""
    defaults, optional = defaults or {}, optional or {}

    def make(cls: type) -> type:
        declared: dict[str, tuple[Any, Any, dict]] = {}  # name -> (type, default, option metadata)
        for name, tp in typing.get_type_hints(cls).items():
            f = cls.__dict__[name]
            declared[name] = (tp, default_of(f), dict(f.metadata))
        for source in sources:
            summary = (source.__doc__ or "").strip().split("\n")[0].rstrip(".")
            title = f"{source.__name__}: {summary[:1].lower()}{summary[1:]}"  # its options' group in --help
            hints = typing.get_type_hints(source)
            for f in dataclasses.fields(source):
                name, tp = cli_name(f), hints[f.name]
                if "help" in f.metadata and name not in declared:
                    if typing.get_origin(tp) is tuple:  # a list on the command line; `options_from` checks its length
                        tp = list[typing.get_args(tp)[0]]
                    declared[name] = (tp, default_of(f), {**f.metadata, "group": title})
        for name, default in defaults.items():
            tp, _, meta = declared[name]
            declared[name] = (tp, default, meta)
        for name, note in optional.items():
            tp, _, meta = declared[name]
            declared[name] = (tp | None, None, {**meta, "help": f"{meta['help']} ({note})"})
        made = dataclasses.make_dataclass(
            cls.__name__, [(name, tp, redeclare(meta, default)) for name, (tp, default, meta) in declared.items()],
            kw_only=True, namespace={"__doc__": cls.__doc__, "__module__": cls.__module__})
        made.__qualname__ = cls.__qualname__
        return made

    return make


def options_from(cls: type, args: Any) -> Any:
    """The library's option class `cls` with each of its options as the command's `args` hold it (under its
    command-line name); an option the command does not have keeps its default. A list given for a tuple of
    fixed length is refused unless it has that length."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        name = cli_name(f)
        if not hasattr(args, name):
            continue
        value = getattr(args, name)
        tp, _ = _unwrap_optional(hints[f.name])
        if typing.get_origin(tp) is tuple and value is not None:
            value, size = tuple(value), len(typing.get_args(tp))
            if len(value) != size:
                raise BertforgeError(f"{flag_name(name)} {' '.join(map(str, value))}: give {size} values, e.g. "
                                     f"{' '.join(map(str, default_of(f)))}")
        values[f.name] = value
    return cls(**values)


_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _number_problem(value: float, bound: Bound | None, shown: str | None = None) -> str | None:
    """Why `value` (given as `shown`) is refused (None: it is not): not finite, or outside `bound`."""
    shown = str(value) if shown is None else shown
    if isinstance(value, float) and not math.isfinite(value):  # nan, inf, -inf, and 1e400, which floats to inf
        return f"must be a finite number, not {shown}"
    if bound is not None and not bound.admits(value):
        return f"must be {bound.describe()}, not {shown}" + (f" ({bound.why})" if bound.why else "")
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
        problem = _number_problem(value, bound, text.strip())
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
        shown = json.dumps(value)  # NaN, Infinity: Python's json reads them, and 1e400 as Infinity
        try:
            value = tp(value)
        except OverflowError:  # an integer too large for a float
            value = math.inf
        problem = _number_problem(value, meta.get("bound"), shown)
        if problem:
            raise ValueError(problem)
    return value


def _help(meta: typing.Mapping, tp: Any, default: Any) -> str:
    """An option's `--help` text: its declared help, its bound and its default (argparse's %-escapes added)."""
    text = meta.get("help", "")
    if meta.get("bound") is not None:
        text += f"; {meta['bound'].describe()}"
    if default not in (MISSING, None, []) and "(default" not in text:
        shown = ("on" if default else "off") if tp is bool else (
            " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default)
        text += f" (default: {shown})"
    return text.replace("%", "%%")


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """An argument of `parser` for each field of `cls`, those of an option class in a group of their own. None
    has a default in the namespace (argparse.SUPPRESS): `build_args` tells what the command line gave."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        meta, default = f.metadata, default_of(f)
        tp, _ = _unwrap_optional(hints[f.name])
        kwargs: dict[str, Any] = {"help": _help(meta, tp, default), "default": argparse.SUPPRESS}
        if meta.get("choices"):
            kwargs["choices"] = meta["choices"]
        if meta.get("metavar"):
            kwargs["metavar"] = meta["metavar"]
        if typing.get_origin(tp) is list:
            kwargs["type"] = _command_line_type(typing.get_args(tp)[0], meta.get("bound"))
            kwargs["nargs"] = "+" if default is MISSING else "*"
        elif tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _command_line_type(tp, meta.get("bound"))
        group = meta.get("group")
        if group and group not in groups:
            groups[group] = parser.add_argument_group(group)
        target = groups[group] if group else parser
        if meta.get("positional"):
            if default is not MISSING and "nargs" not in kwargs:
                kwargs["nargs"] = "?"
            target.add_argument(f.name, **kwargs)
        else:
            names = [flag_name(f.name)] + ([meta["short"]] if meta.get("short") else [])
            target.add_argument(*names, dest=f.name, required=default is MISSING, **kwargs)


def build_args(cls: type, namespace: argparse.Namespace) -> Any:
    """`cls`'s arguments: each option as the command line gave it, else as the `--config` file gives it (for a
    command that has one), else its declared default. So the command line always wins, whatever its value."""
    given = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls) if hasattr(namespace, f.name)}
    return cls(**{**read_config_file(cls, given.get("config")), **given})


def read_config_file(cls: type, path: str | None) -> dict[str, Any]:
    """The options of the JSON file `path` (an object keyed by field name, e.g. "batch_size") for the arguments
    `cls`, each checked as on the command line; a refusal is a BertforgeError naming the option and the file."""
    if path is None:
        return {}
    values = read_json_object(path, what="options", fix='--config takes a JSON object of options, e.g. {"lr": 0.001}')
    hints = typing.get_type_hints(cls)
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(by_name))
    if unknown:
        raise BertforgeError(f"--config {path} has unknown options {unknown}; see the command's --help for them")
    checked = {}
    for key, value in values.items():
        f = by_name[key]
        if key == "config" or default_of(f) is MISSING:
            raise BertforgeError(f"--config {path}: {flag_name(key)} is given on the command line only")
        try:
            checked[key] = _json_value(hints[key], value, f.metadata)
        except ValueError as e:
            raise BertforgeError(f"--config {path}: {flag_name(key)} {e}") from None
    return checked


def check_output_file(path: str | None, flag: str = "--out") -> None:
    """Refuse, before any work, an output file name that is an existing directory."""
    if path is not None and Path(path).is_dir():
        raise BertforgeError(f"{flag} {path} is a directory; give a file name (e.g. {Path(path) / 'out.jsonl'})")


def emit_jsonl(records: typing.Iterable[dict], out: str | None, what: str) -> None:
    """Write one JSON object per line to `out` (atomically, then say how many) or, without `out`, to stdout."""
    lines = [json.dumps(r, ensure_ascii=False) + "\n" for r in records]
    if out:
        from bertforge.files import write_text

        write_text(out, "".join(lines))
        print(f"{len(lines)} {what} written to {out}")
    else:
        sys.stdout.write("".join(lines))

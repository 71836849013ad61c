"""Typed argument dataclasses become argparse subcommands.

A command is a dataclass of arguments (each field declared with `arg(..., help=...)`) plus a function that
takes an instance of it. Field types decide the parsing: `str`, `int`, `float`, `bool` (a `--x/--no-x`
switch), `list[str]` (one or more values), and `X | None` (optional).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any


def arg(default: Any = dataclasses.MISSING, *, help: str, positional: bool = False, short: str | None = None,
        choices: list[str] | None = None, metavar: str | None = None) -> Any:
    """Declare one command-line argument as a dataclass field."""
    meta = {"help": help, "positional": positional, "short": short, "choices": choices, "metavar": metavar}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda d=default: list(d), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def precision_arg() -> Any:
    """`--precision`, the same for every training command."""
    return arg("auto", choices=["auto", "fp32", "bf16"],
               help="bf16 autocast (weights and optimizer stay fp32) or fp32; auto: bf16 on CUDA, fp32 on the CPU "
                    "(bf16 pays on CPUs with AVX512-BF16 or AMX, about 1.6x)")


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand: `name` may have two words (`vocab train`)."""

    name: str
    args: type
    run: Callable[[Any], int | None]
    help: str
    description: str = ""


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1:
            return inner[0], True
    return tp, False


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
            kwargs["type"] = typing.get_args(tp)[0]
            kwargs["nargs"] = "+" if not has_default else "*"
        elif tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = tp
        if has_default:
            kwargs["default"] = default
            if tp is not bool and default is not None and "(default" not in kwargs["help"]:
                kwargs["help"] += f" (default: {default})"
        flag = "--" + f.name.replace("_", "-")
        if meta.get("positional"):
            if has_default and "nargs" not in kwargs:
                kwargs["nargs"] = "?"
            parser.add_argument(f.name, **kwargs)
        else:
            names = [flag] + ([meta["short"]] if meta.get("short") else [])
            if not has_default:
                kwargs["required"] = True
            parser.add_argument(*names, dest=f.name, **kwargs)


def build_args(cls: type, namespace: argparse.Namespace) -> Any:
    return cls(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)})


def emit_jsonl(records: typing.Iterable[dict], out: str | None, what: str) -> None:
    """Write one JSON object per line to `out` (atomically, then say how many) or, without `out`, to stdout."""
    import json
    import sys

    lines = [json.dumps(r, ensure_ascii=False) + "\n" for r in records]
    if out:
        from bertforge.io import write_text

        write_text(out, "".join(lines))
        print(f"{len(lines)} {what} written to {out}")
    else:
        sys.stdout.write("".join(lines))

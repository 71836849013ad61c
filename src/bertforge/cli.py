"""The `bertforge` command line.

    bertforge vocab train --corpus texts/ --vocab-size 30522 --out tok/
    bertforge prepare     --corpus texts/ --tokenizer tok/ --out data/
    bertforge pretrain    --data data/ --model mini --out runs/mini
    bertforge finetune    --task sst2 --data glue/SST-2 --init runs/mini --out runs/sst2
    bertforge demo

Under torchrun (DDP; gloo on CPU, NCCL on GPUs), the same commands:

    torchrun --nproc-per-node 2 -m bertforge pretrain --data data/ --model mini --out runs/mini
"""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
import typing

from bertforge import __version__
from bertforge.commands.arguments import Command, add_dataclass_arguments, build_args
from bertforge.errors import BertforgeError
from bertforge.train.memory import keep_freed_memory

# Every module listed here exposes COMMANDS: list[Command]. Order is the order of `bertforge --help`.
COMMAND_MODULES = [
    "bertforge.commands.model",
    "bertforge.commands.vocab",
    "bertforge.commands.data",
    "bertforge.commands.train",
    "bertforge.commands.finetune",
    "bertforge.commands.distill",
    "bertforge.commands.infer",
    "bertforge.commands.export",
    "bertforge.commands.serve",
    "bertforge.commands.demo",
    "bertforge.commands.env",
]


def _commands() -> list[Command]:
    commands: list[Command] = []
    for name in COMMAND_MODULES:
        commands.extend(importlib.import_module(name).COMMANDS)
    return commands


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, except that a bad command line is one line, `error: ...`, and exit status 2 (the
    subcommands' parsers are of this class too)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def build_parser(command: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line; with `command` (the words at the head of `main`'s argv) the parser `main` needs:
    the command they name alone, or where they name none every command with only its name and help (for
    `bertforge --help` and an unknown command's error). On a 2-core Zen 3 the whole parser takes ~20 ms to build,
    one command's 2-3 ms: the tests call `main` over a thousand times."""
    parser = ArgumentParser(
        prog="bertforge", description="Train BERT end to end: vocabulary, pretraining, fine-tuning, inference.",
        epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"bertforge {__version__}")
    top = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    commands = _commands()
    named = [cmd for cmd in commands if command and command[:len(cmd.name.split())] == cmd.name.split()]
    for cmd in named or commands:
        words = cmd.name.split()
        container = top
        if len(words) == 2:
            if words[0] not in groups:
                group = top.add_parser(words[0], help=f"{words[0]} commands")
                groups[words[0]] = group.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
            container = groups[words[0]]
        sub = container.add_parser(words[-1], help=cmd.help, description=cmd.description or cmd.help,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
        if command is None or named:
            add_dataclass_arguments(sub, cmd.args)
        sub.set_defaults(_command=cmd)
    return parser


def _command_words(argv: list[str]) -> list[str]:
    """The words before the first option: the command's name (and whatever else, which argparse then refuses)."""
    words = []
    for arg in argv:
        if arg.startswith("-"):
            break
        words.append(arg)
    return words


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command_words(argv))
    try:
        ns = parser.parse_args(argv)
    except SystemExit as e:
        if e.code == 2:  # a bad command line, already said in one `error:` line; --help and --version exit 0
            return 2
        raise
    cmd: Command | None = getattr(ns, "_command", None)
    if cmd is None:
        parser.print_help()
        return 0
    if cmd.keeps_freed_memory:
        keep_freed_memory()  # for training and batch inference, process-wide; BERTFORGE_SYSTEM_MALLOC=1 opts out
    try:
        return cmd.run(build_args(cmd.args, ns)) or 0
    except BertforgeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the machine's, not a bug: a full disk, a file where --out wants a directory
        from bertforge.files import os_error_message  # here only: bertforge.files loads tqdm, which --help need not

        message = os_error_message(e)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def run() -> typing.NoReturn:
    """The `bertforge` program (the installed command, `python -m bertforge`, torchrun's ranks): `main`, then an
    exit that leaves the command's heap to the operating system. Python's shutdown runs a garbage collection over
    every object still alive (torch's modules, a model, compiled graphs): on a 2-core Zen 3, 0.6 s after
    `bertforge predict` had printed its answer, 2 s after a compiled training. Frozen (`gc.freeze`), they are
    out of that collection, and the command ends 0.1-0.2 s after its last line; atexit handlers and the modules'
    own finalisation still run, and every file the command writes is closed before `main` returns."""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run()

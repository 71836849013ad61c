"""Every `bertforge` command shown in README.md and docs/ parses with the real command line: a renamed or removed
option, a missing subcommand or a value of the wrong type fails here. Relative links between the pages resolve."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from bertforge.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def shown_commands(text: str) -> list[str]:
    """`bertforge ...` lines of the page's ```bash blocks (continuation lines joined, comments dropped); a
    `torchrun ... -m bertforge ...` line counts from `bertforge` on."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if "-m bertforge " in line:
                line = "bertforge " + line.split("-m bertforge ", 1)[1]
            if line.startswith("bertforge "):
                commands.append(line)
    return commands


def test_the_pages_show_commands():
    assert len(shown_commands((REPO / "README.md").read_text())) >= 10


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shown_command_parses(page):
    parser = build_parser()
    for command in shown_commands(page.read_text()):
        words = [w for w in shlex.split(command)[1:] if w != "..."]
        try:
            parser.parse_args(words)
        except SystemExit as e:
            pytest.fail(f"{page.name}: `{command}` does not parse (exit {e.code})")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    for target in re.findall(r"\]\(([^)#]+)\)", page.read_text()):
        if "://" not in target:
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"

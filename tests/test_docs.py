"""Every `bertforge` command shown in README.md and docs/ parses with the real command line: a renamed or removed
option, a missing subcommand or a value of the wrong type fails here. Relative links between the pages resolve, and so
do their anchors."""

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


def heading_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but hyphens dropped, spaces made hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_heading_anchor_follows_githubs_rule():
    assert heading_anchor("Pretraining in bf16: the masked-LM head's shapes (2026-12-02)") == \
        "pretraining-in-bf16-the-masked-lm-heads-shapes-2026-12-02"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_anchors_name_a_heading(page):
    for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text()):
        if "://" in target:
            continue
        linked = (page.parent / target) if target else page
        anchors = {heading_anchor(h) for h in re.findall(r"^#+ (.*)$", linked.read_text(), flags=re.M)}
        assert anchor in anchors, f"{page.name} links to {target or page.name}#{anchor}, which names no heading there"


README_MAX_LINES = 120
STATUS_MAX_LINES = 15


def section(text: str, title: str) -> list[str]:
    """The lines of a `## title` section, its heading included, up to the next `## ` heading (trailing blank lines
    dropped); [] when the page has no such section."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == f"## {title}"]
    if not starts:
        return []
    end = next((i for i in range(starts[0] + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    body = lines[starts[0]:end]
    while body and not body[-1].strip():
        body.pop()
    return body


def test_the_readme_is_a_front_door_not_a_notebook():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, "README.md is over 120 lines: move detail into docs/"
    status = section(text, "Status")
    assert status, "README.md has no `## Status` section"
    assert len(status) <= STATUS_MAX_LINES, (
        f"README.md's Status is {len(status)} lines (at most {STATUS_MAX_LINES}): a short paragraph and the table of "
        "what the demo shows; the history belongs in docs/experiments/")


def test_the_readme_links_the_architecture_and_the_design():
    links = set(re.findall(r"\]\(([^)#]+)", (REPO / "README.md").read_text()))
    for page in ("docs/architecture.md", "docs/design.md"):
        assert page in links, f"README.md does not link {page}"


def repository_files(root: Path = REPO) -> list[Path]:
    skip = {".git", ".venv"}
    found = []
    for path in root.rglob("*"):
        parts = path.relative_to(root).parts
        if skip.intersection(parts) or any(p.endswith(".egg-info") or p == "__pycache__" for p in parts):
            continue
        if path.is_file():
            found.append(path)
    return found


@pytest.mark.slow  # reads every file of the repository
def test_no_file_cites_the_design_notes_outside_the_repository():
    """The design lives in docs/design.md; a note outside the repository is not the project's to cite."""
    # the name is split so that this file does not match itself
    name = "DESIGN" + ".md"
    citing = [str(p.relative_to(REPO)) for p in repository_files() if name.encode() in p.read_bytes()]
    assert not citing, f"these files cite {name}, which is not in the repository (use docs/design.md): {citing}"

"""The GPU check's outputs: report.json (everything every part measured) and summary.md (the table below, then
each part's figures), and the short table the check prints last."""

from __future__ import annotations

import json
from pathlib import Path


def summary_table(report: dict) -> str:
    """One line per part: ok or FAILED, its seconds, its headline figures (or its error's first line)."""
    rows = [("part", "status", "s", "figures")]
    for name, part in report["parts"].items():
        status = "ok" if part["ok"] else "FAILED"
        text = part.get("headline", "") if part["ok"] else _last_line(part.get("error"))
        if not part["ok"] and part.get("headline"):
            text = f"{part['headline']} | {text}"
        rows.append((name, status, f"{part.get('seconds', 0):.0f}", text))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"| {r[0]:<{widths[0]}} | {r[1]:<{widths[1]}} | {r[2]:>{widths[2]}} | {r[3]}" for r in rows]
    lines.insert(1, f"|{'-' * (widths[0] + 2)}|{'-' * (widths[1] + 2)}|{'-' * (widths[2] + 2)}|---")
    mode = "CPU dry run" if report["dry_run"] else "GPU"
    total = report.get("seconds")
    head = f"GPU check ({mode}), {report['started']}" + (f", {total:.0f} s" if total is not None else "")
    return "\n".join([head, *lines])


def _last_line(error: str | None) -> str:
    """The line of an error that names it (a traceback's last), cut to fit the table."""
    lines = (error or "").strip().splitlines()
    return (lines[-1] if lines else "no error text")[:160]


def write_report(out: Path, report: dict) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    parts = []
    for name, part in report["parts"].items():
        figures = {k: v for k, v in part.items() if k not in ("headline",)}
        parts.append(f"## {name}\n\n```json\n{json.dumps(figures, indent=1, default=str)}\n```\n")
    (out / "summary.md").write_text(f"# GPU check\n\n```\n{summary_table(report)}\n```\n\n" + "\n".join(parts))

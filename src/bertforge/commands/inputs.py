"""The input files of `bertforge predict`, `fill-mask` and `embed` (--input FILE): JSONL records or plain text.
Only the command line reads these files; the library's engines take records and texts."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from bertforge.errors import BertforgeError
from bertforge.files import open_text


def read_input_records(path: str | Path) -> list[dict]:
    """Input records from a file: JSONL (one object per line, e.g. {"text": ...}) when the file is named
    .jsonl/.json or its first non-blank line is a JSON object; otherwise plain text, one {"text"} per
    non-blank line."""
    path = Path(path)
    if not path.is_file():
        raise BertforgeError(f"input file {path} does not exist")
    with open_text(path) as f:
        lines = [(n, line.strip()) for n, line in enumerate(f, 1) if line.strip()]
    if not lines:
        raise BertforgeError(f"{path} holds no inputs")
    if path.suffix.lower() not in (".jsonl", ".json") and not _is_json_object(lines[0][1]):
        return [{"text": line} for _, line in lines]
    records = []
    for n, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise BertforgeError(f"{path}:{n} is not valid JSON ({e.msg}); write one object per line") from None
        if not isinstance(record, dict):
            raise BertforgeError(f"{path}:{n}: expected a JSON object like {{\"text\": ...}}")
        records.append(record)
    return records


def _is_json_object(line: str) -> bool:
    if not line.startswith("{"):
        return False
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def record_texts(records: Sequence[dict], source: str) -> list[str]:
    """The "text" of every record (fill-mask and embed take texts alone); `source` names the file in errors."""
    texts = []
    for n, r in enumerate(records, 1):
        text = r.get("text")
        if not isinstance(text, str):
            raise BertforgeError(f"{source}: input {n} has no \"text\" string (keys: {sorted(r)})")
        texts.append(text)
    return texts

"""Reading a pretraining corpus: files, directories and globs of `.txt`, `.jsonl` and their `.gz`.

Formats (DESIGN.md "Formats"):
- `doc`: a `.txt` file is one document; paragraphs are separated by blank lines, lines inside a paragraph
  are joined, and paragraphs are split into sentences (`sentences.split_sentences`).
- `lines`: BERT's format: one sentence per line, a blank line between documents.
- `jsonl`: one JSON object per line, its `text` field one document (treated like `doc`).
`auto` (the default) picks `doc` or `lines` for each `.txt` from a sample of its first lines.

Bad input never stops a run: invalid UTF-8 is replaced and counted, binary and unreadable files are skipped,
bad JSON lines are skipped, a path given twice is read once, and a line of any length is read in pieces of
`max_line_bytes`, never whole. Everything skipped is counted in a `ReadStats`. `prepare` reads units in worker
processes; `vocab train` reads them in order (`read_sentences`).

A file is read as one or more `Unit`s: large uncompressed `lines`/`jsonl` files are cut into byte ranges that
each own the documents (or records) that start inside them, so one big file is read by several workers.
"""

from __future__ import annotations

import codecs
import dataclasses
import glob
import gzip
import io
import json
import os
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from bertforge.data.sentences import split_complete, split_sentences
from bertforge.errors import BertforgeError

FORMATS = ("auto", "doc", "lines")
SUFFIXES = (".txt", ".jsonl", ".txt.gz", ".jsonl.gz")
MAX_LINE_BYTES = 1 << 20
SAMPLE_BYTES = 1 << 16
END = None  # yielded by `read_unit` after the last sentence of each document

_REPLACED = [0]  # invalid UTF-8 bytes replaced in this process (the codec error handler counts here)


def _count_and_replace(err: UnicodeDecodeError) -> tuple[str, int]:
    _REPLACED[0] += err.end - err.start
    return "\ufffd", err.end


codecs.register_error("bertforge-replace", _count_and_replace)


@dataclasses.dataclass
class ReadStats:
    """What reading found: counts that add up across units, and the files skipped with the reason."""

    counts: Counter = dataclasses.field(default_factory=Counter)
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def add(self, other: ReadStats) -> None:
        self.counts.update(other.counts)
        self.skipped.extend(other.skipped)

    def summary(self) -> dict:
        reasons = Counter(reason for _, reason in self.skipped)
        return {"counts": dict(sorted(self.counts.items())), "skipped_files": dict(sorted(reasons.items())),
                "skipped_examples": [{"path": p, "reason": r} for p, r in self.skipped[:20]]}


@dataclasses.dataclass(frozen=True)
class Unit:
    """A byte range `[start, end)` of one file, read as `fmt`; `end=-1` means to the end of the file."""

    path: str
    fmt: str  # doc | lines | jsonl
    start: int = 0
    end: int = -1


def expand_inputs(patterns: str | os.PathLike | Iterable[str | os.PathLike],
                  stats: ReadStats | None = None) -> list[Path]:
    """Files named, files under directories (recursively, by suffix) and glob matches; sorted, deduplicated.

    A path met twice (named twice, or under two of the patterns) is read once; `stats` counts the repeats as
    skipped ("duplicate path")."""
    if isinstance(patterns, str | os.PathLike):
        patterns = [patterns]
    patterns = [os.fspath(p) for p in patterns]
    found: list[Path] = []
    for pattern in patterns:
        p = Path(pattern).expanduser()
        if p.is_dir():
            found.extend(q for q in sorted(p.rglob("*")) if q.is_file() and q.name.endswith(SUFFIXES))
        elif p.is_file():
            found.append(p)
        else:
            matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
            if not matches:
                raise BertforgeError(f"corpus path {pattern!r} matches no file: give files, directories or globs")
            for m in matches:
                q = Path(m)
                if q.is_dir():
                    found.extend(r for r in sorted(q.rglob("*")) if r.is_file() and r.name.endswith(SUFFIXES))
                elif q.is_file():
                    found.append(q)
    out, seen = [], set()
    for q in found:
        key = str(q.resolve())
        if key in seen:
            if stats is not None:
                stats.skipped.append((str(q), "duplicate path"))
        else:
            seen.add(key)
            out.append(q)
    if not out:
        raise BertforgeError(f"no .txt, .jsonl or .gz files found under {patterns}: check --corpus")
    return out


def _open_binary(path: str) -> io.BufferedIOBase:
    if path.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def _inner_name(path: str) -> str:
    return path[:-3] if path.endswith(".gz") else path


_TEXT_CONTROLS = bytes(range(32)).translate(None, b"\t\n\r\f\v\x1b")


def _looks_binary(sample: bytes) -> bool:
    """NUL bytes, more than 5% control bytes, or more than 30% invalid UTF-8 (random bytes are about 50%;
    Latin-1 text read as UTF-8 a few percent): not text."""
    if not sample or b"\x00" in sample:
        return bool(sample)
    controls = len(sample) - len(sample.translate(None, _TEXT_CONTROLS))
    invalid = sample.decode("utf-8", errors="replace").count("\ufffd")
    return controls > 0.05 * len(sample) or invalid > 0.3 * len(sample)


def detect_txt_format(sample: str) -> str:
    """`lines` if the sample looks like one sentence per line with blank lines between documents, else `doc`.

    BERT's format has short lines that end like sentences and rarely hold two sentences; paragraphs (one per
    line) hold several sentences, and hard-wrapped prose has lines that do not end like sentences.
    """
    lines = [ln.strip() for ln in (sample.splitlines()[:-1] or sample.splitlines())[:200]]
    text_lines = [ln for ln in lines if ln]
    if len(text_lines) < 2:
        return "doc"
    ends = sum(1 for ln in text_lines if ln.rstrip("\"')]\u201d\u2019").endswith((".", "!", "?", "\u2026")))
    multi = sum(1 for ln in text_lines if len(split_sentences(ln)) > 1)
    blocks = max(1, sum(1 for a, b in zip([""] + lines, lines, strict=False) if not a and b))
    if ends >= 0.6 * len(text_lines) and multi <= 0.2 * len(text_lines) and len(text_lines) / blocks >= 1.5:
        return "lines"
    return "doc"


def plan_units(paths: list[Path], fmt: str = "auto", *, chunk_bytes: int = 64 << 20,
               stats: ReadStats | None = None) -> list[Unit]:
    """One unit per file, except that large uncompressed line-based files are cut into byte ranges.

    Only files that may be cut are opened here (to decide their format); the rest are checked for binary
    content and their format is detected by the worker that reads them (`read_unit`).
    """
    if fmt not in FORMATS:
        raise BertforgeError(f"unknown corpus format {fmt!r}: use one of {', '.join(FORMATS)}")
    stats = stats if stats is not None else ReadStats()
    units: list[Unit] = []
    for p in paths:
        path = str(p)
        inner = _inner_name(path)
        file_fmt = "jsonl" if inner.endswith(".jsonl") else fmt
        try:
            size = os.path.getsize(path)
        except OSError as e:
            stats.skipped.append((path, f"unreadable ({type(e).__name__})"))
            continue
        if size <= chunk_bytes or path.endswith(".gz") or file_fmt == "doc":
            units.append(Unit(path, file_fmt))
            continue
        resolved = _resolve_format(path, file_fmt, stats)
        if resolved is None:
            continue
        if resolved == "doc":
            units.append(Unit(path, resolved))
        else:
            units.extend(Unit(path, resolved, s, min(s + chunk_bytes, size)) for s in range(0, size, chunk_bytes))
    return units


def _resolve_format(path: str, fmt: str, stats: ReadStats) -> str | None:
    """The format to read `path` as, or None (recorded in `stats`) if it is empty, binary or unreadable."""
    chunks: list[bytes] = []
    try:
        with _open_binary(path) as f:
            while sum(map(len, chunks)) < SAMPLE_BYTES and (chunk := f.read(8192)):
                chunks.append(chunk)
    except (OSError, EOFError, zlib.error) as e:
        if not chunks:  # a damaged file whose start is readable is read up to the damage
            stats.skipped.append((path, f"unreadable ({type(e).__name__})"))
            return None
    sample = b"".join(chunks)
    if not sample:
        stats.skipped.append((path, "empty file"))
        return None
    if _looks_binary(sample):
        stats.skipped.append((path, "binary file"))
        return None
    if fmt != "auto":
        return fmt
    return detect_txt_format(sample.decode("utf-8", errors="replace"))


def _lines(f: io.BufferedIOBase, decoder, max_line_bytes: int, stats: ReadStats,
           path: str) -> Iterator[tuple[int, str, bool]]:
    """(byte offset, text, complete) for each line piece; a line longer than `max_line_bytes` comes in pieces,
    all but the last with complete=False. Newlines are stripped. A read error (a truncated .gz) ends the
    file early, as if it ended there, and is recorded in `stats`: what was read before it is kept."""
    offset = f.tell()
    while True:
        try:
            raw = f.readline(max_line_bytes)
        except (OSError, EOFError, zlib.error) as e:
            stats.skipped.append((path, f"read error part way ({type(e).__name__})"))
            raw = b""
        if not raw:
            tail = decoder.decode(b"", final=True)
            if tail:
                yield offset, tail, True
            return
        complete = raw.endswith(b"\n")
        text = decoder.decode(raw, final=False)
        if complete:
            text = text.rstrip("\r\n")
        yield offset, text, complete
        offset += len(raw)


class _Paragraph:
    """Accumulates the text of one paragraph and emits its sentences, holding at most ~max_chars of it."""

    def __init__(self, max_chars: int, stats: ReadStats):
        self.parts: list[str] = []
        self.size = 0
        self.max_chars = max_chars
        self.stats = stats

    def add(self, text: str) -> list[str]:
        self.parts.append(text)
        self.size += len(text)
        if self.size <= self.max_chars:
            return []
        # Too long to hold: emit all sentences but the last, which may continue in the next piece.
        self.stats.counts["long_paragraph_pieces"] += 1
        sentences, rest = split_complete("".join(self.parts))
        if not sentences:
            sentences, rest = split_sentences(rest), ""  # no boundary in max_chars of text: cut it here
        self.parts, self.size = [rest], len(rest)
        return sentences

    def flush(self) -> list[str]:
        text = "".join(self.parts)
        self.parts, self.size = [], 0
        return split_sentences(text)


def _prose_sentences(pieces: Iterator[tuple[str, bool]], max_chars: int,
                     stats: ReadStats) -> Iterator[str | None]:
    """Sentences of prose given as (line piece, complete); a blank line ends a paragraph; `None` marks a
    paragraph end (callers ignore it for `doc`)."""
    para = _Paragraph(max_chars, stats)
    at_line_start = True
    for text, complete in pieces:
        if at_line_start and complete and not text.strip():
            yield from para.flush()
        else:
            yield from para.add(text + (" " if complete else ""))
        at_line_start = complete
    yield from para.flush()


def read_unit(unit: Unit, stats: ReadStats, *, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[str | None]:
    """Stream one unit as sentences (`str`), with `END` (None) after the last sentence of each document.

    Documents without any sentence are counted as `empty_documents` and not yielded.
    """
    before = _REPLACED[0]
    stats.counts["units"] += 1
    if unit.start == 0 and unit.end < 0:  # a whole file, not yet looked at
        fmt = _resolve_format(unit.path, unit.fmt, stats)
        if fmt is None:
            return
        unit = dataclasses.replace(unit, fmt=fmt)
    try:
        with _open_binary(unit.path) as f:
            decoder = codecs.getincrementaldecoder("utf-8")(errors="bertforge-replace")
            if unit.fmt == "doc":
                yield from _read_doc(f, decoder, stats, max_line_bytes, unit.path)
            elif unit.fmt == "lines":
                yield from _read_lines(f, decoder, unit, stats, max_line_bytes)
            else:
                yield from _read_jsonl(f, decoder, unit, stats, max_line_bytes)
    except (OSError, EOFError, zlib.error) as e:
        # A truncated .gz or a file that vanished: keep what was read, note the rest as lost.
        stats.skipped.append((unit.path, f"read error part way ({type(e).__name__})"))
    finally:
        stats.counts["invalid_utf8_bytes_replaced"] += _REPLACED[0] - before


def _emit_document(sentences: Iterator[str | None], stats: ReadStats) -> Iterator[str | None]:
    n = 0
    for s in sentences:
        if s is None:
            continue
        n += 1
        yield s
    if n:
        stats.counts["documents"] += 1
        stats.counts["sentences"] += n
        yield END
    else:
        stats.counts["empty_documents"] += 1


def _strip_bom(pieces: Iterator[tuple[int, str, bool]]) -> Iterator[tuple[int, str, bool]]:
    first = True
    for offset, text, complete in pieces:
        if first and text.startswith("\ufeff"):
            text = text[1:]
        first = False
        yield offset, text, complete


def _read_doc(f, decoder, stats: ReadStats, max_line_bytes: int, path: str) -> Iterator[str | None]:
    pieces = ((t, c) for _, t, c in _strip_bom(_lines(f, decoder, max_line_bytes, stats, path)))
    yield from _emit_document(_prose_sentences(pieces, max_line_bytes, stats), stats)


def _seek_line_start(f, start: int) -> None:
    """Position `f` at the first line that starts at or after byte `start`."""
    if start == 0:
        return
    f.seek(start - 1)
    if f.read(1) != b"\n":
        while True:  # skip the rest of a line that began before `start`, in bounded pieces
            raw = f.readline(MAX_LINE_BYTES)
            if not raw or raw.endswith(b"\n"):
                break


def _read_lines(f, decoder, unit: Unit, stats: ReadStats, max_line_bytes: int) -> Iterator[str | None]:
    """BERT format. A unit owns the documents that follow a blank line starting inside it (and the first
    document of the file if it starts at 0); it reads past its end to finish its last document.
    Sentences stream out as they are read: a document of any size is never held whole."""
    _seek_line_start(f, unit.start)
    end = unit.end if unit.end >= 0 else float("inf")
    owning = unit.start == 0
    n = 0  # sentences of the current document so far
    long_piece = _Paragraph(max_line_bytes, stats)
    at_line_start, in_long = True, False

    def close() -> Iterator[None]:
        nonlocal n
        if n:
            stats.counts["documents"] += 1
            stats.counts["sentences"] += n
            yield END
        n = 0

    for offset, text, complete in _strip_bom(_lines(f, decoder, max_line_bytes, stats, unit.path)):
        blank = at_line_start and complete and not text.strip()
        if blank:
            if owning:
                yield from close()
            if offset >= end:
                return
            owning = True
        elif owning:
            if not complete or in_long:
                # A line longer than max_line_bytes: split it as prose, in bounded pieces.
                if at_line_start:
                    stats.counts["long_lines"] += 1
                out = long_piece.add(text) + (long_piece.flush() if complete else [])
            else:
                out = [text.strip()] if text.strip() else []
            n += len(out)
            yield from out
        in_long = not complete
        at_line_start = complete
    if owning:
        yield from close()


def _read_jsonl(f, decoder, unit: Unit, stats: ReadStats, max_line_bytes: int) -> Iterator[str | None]:
    """One JSON object per line with a `text` field; a unit owns the lines that start inside it."""
    _seek_line_start(f, unit.start)
    end = unit.end if unit.end >= 0 else float("inf")
    at_line_start = True
    for offset, text, complete in _strip_bom(_lines(f, decoder, max_line_bytes, stats, unit.path)):
        if at_line_start and offset >= end:
            return
        if not at_line_start or not complete:
            # A record longer than max_line_bytes: skipped piece by piece, never held whole.
            if at_line_start:
                stats.counts["jsonl_records_too_long"] += 1
            at_line_start = complete
            continue
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError:
            stats.counts["jsonl_bad_lines"] += 1
            continue
        value = record.get("text") if isinstance(record, dict) else None
        if not isinstance(value, str):
            stats.counts["jsonl_records_without_text"] += 1
            continue
        pieces = ((ln, True) for ln in value.split("\n"))
        yield from _emit_document(_prose_sentences(pieces, max_line_bytes, stats), stats)


def read_sentences(paths: list[Path], stats: ReadStats | None = None, *, fmt: str = "auto",
                   progress: Any = None) -> Iterator[str]:
    """The sentences of every file in order, without document ends: text to count (`vocab train`), read exactly
    as `prepare` reads it. `progress` (`bertforge.io.progress_reporter`) advances by each unit's bytes."""
    stats = stats if stats is not None else ReadStats()
    for unit in plan_units(paths, fmt, stats=stats):
        yield from (s for s in read_unit(unit, stats) if s is not END)
        if progress is not None:
            progress.update(_unit_bytes(unit))


def _unit_bytes(unit: Unit) -> int:
    if unit.end >= 0:
        return unit.end - unit.start
    try:
        return os.path.getsize(unit.path)
    except OSError:  # it vanished while it was read (counted in the stats)
        return 0

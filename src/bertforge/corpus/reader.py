"""Reading a corpus's units as sentences, with a document end after each document: `read_unit` (one unit, as
`prepare`'s workers read them) and `read_sentences` (every file in order, as `vocab train` reads them). Invalid
UTF-8 is replaced and counted, bad JSON lines are skipped, and a line of any length is read in pieces of
`max_line_bytes`, never whole (see the package docstring)."""

from __future__ import annotations

import codecs
import dataclasses
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bertforge.corpus.columnar import arrow_texts, parquet_texts
from bertforge.corpus.inputs import TEXT_FIELD, ReadStats, Unit, plan_units, resolve_format
from bertforge.corpus.sentences import split_complete, split_sentences
from bertforge.corpus.streams import READ_ERRORS, open_binary

MAX_LINE_BYTES = 1 << 20
END = None  # yielded by `read_unit` after the last sentence of each document

_REPLACED = [0]  # invalid UTF-8 bytes replaced in this process (the codec error handler counts here)


def _count_and_replace(err: UnicodeDecodeError) -> tuple[str, int]:
    _REPLACED[0] += err.end - err.start
    return "\ufffd", err.end


codecs.register_error("bertforge-replace", _count_and_replace)


def _lines(f: io.BufferedIOBase, decoder, max_line_bytes: int, stats: ReadStats,
           path: str) -> Iterator[tuple[int, str, bool]]:
    """(byte offset, text, complete) for each line piece; a line longer than `max_line_bytes` comes in pieces,
    all but the last with complete=False. Newlines are stripped. A read error (a truncated .gz) ends the
    file early, as if it ended there, and is recorded in `stats`: what was read before it is kept."""
    offset = f.tell()
    while True:
        try:
            raw = f.readline(max_line_bytes)
        except READ_ERRORS as e:
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
    if unit.fmt in ("parquet", "arrow"):
        texts = (parquet_texts(unit.path, unit.field, unit.start, unit.end, stats) if unit.fmt == "parquet"
                 else arrow_texts(unit.path, unit.field, stats))
        for text in texts:
            yield from _text_document(text, stats, max_line_bytes)
        return
    if unit.start == 0 and unit.end < 0:  # a whole file, not yet looked at
        fmt = resolve_format(unit.path, unit.fmt, stats)
        if fmt is None:
            return
        unit = dataclasses.replace(unit, fmt=fmt)
    try:
        with open_binary(unit.path) as f:
            decoder = codecs.getincrementaldecoder("utf-8")(errors="bertforge-replace")
            if unit.fmt == "doc":
                yield from _read_doc(f, decoder, stats, max_line_bytes, unit.path)
            elif unit.fmt == "lines":
                yield from _read_lines(f, decoder, unit, stats, max_line_bytes)
            else:
                yield from _read_jsonl(f, decoder, unit, stats, max_line_bytes)
    except READ_ERRORS as e:
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
    """One JSON object per line with a `unit.field` field (`text`); a unit owns the lines that start inside it."""
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
        value = record.get(unit.field) if isinstance(record, dict) else None
        if not isinstance(value, str):
            stats.counts["jsonl_records_without_text"] += 1
            continue
        yield from _text_document(value, stats, max_line_bytes)


def _text_document(value: str, stats: ReadStats, max_line_bytes: int) -> Iterator[str | None]:
    """One document given as a string (a JSON record's or a table row's text), read as prose."""
    pieces = ((ln, True) for ln in value.split("\n"))
    yield from _emit_document(_prose_sentences(pieces, max_line_bytes, stats), stats)


def read_sentences(paths: list[Path], stats: ReadStats | None = None, *, fmt: str = "auto",
                   text_field: str = TEXT_FIELD, progress: Any = None) -> Iterator[str]:
    """The sentences of every file in order, without document ends: text to count (`vocab train`), read exactly
    as `prepare` reads it. `progress` (`bertforge.progress.progress_reporter`) advances by each unit's bytes."""
    stats = stats if stats is not None else ReadStats()
    for unit in plan_units(paths, fmt, stats=stats, text_field=text_field):
        yield from (s for s in read_unit(unit, stats) if s is not END)
        if progress is not None:
            progress.update(unit_bytes(unit))


def unit_bytes(unit: Unit) -> int:
    """The bytes of the file a unit covers (what progress counts)."""
    if unit.end >= 0:
        return unit.end - unit.start
    try:
        return os.path.getsize(unit.path) - unit.start
    except OSError:  # it vanished while it was read (counted in the stats)
        return 0

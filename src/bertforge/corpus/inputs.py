"""Which files a corpus is, and how each is read: paths, directories and globs expanded to files, binary and
empty files told apart from text, a `.txt` file's format detected, and large files cut into byte-range `Unit`s
(see the package docstring). What is skipped, and why, is counted in a `ReadStats`."""

from __future__ import annotations

import dataclasses
import glob
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from bertforge.corpus.columnar import parquet_ranges
from bertforge.corpus.sentences import split_sentences
from bertforge.corpus.streams import COMPRESSIONS, READ_ERRORS, compression_of, inner_name, open_binary, require
from bertforge.errors import BertforgeError

FORMATS = ("auto", "doc", "lines")
TEXT_FIELD = "text"  # the JSON field, Parquet or Arrow column that holds a document, unless told otherwise
COLUMNAR = (".parquet", ".arrow")  # one document per row (`columnar`)
SUFFIXES = (".txt", ".jsonl", *(s + c for s in (".txt", ".jsonl") for c in COMPRESSIONS), *COLUMNAR)
SAMPLE_BYTES = 1 << 16  # what format detection and the binary check look at
SUMMARY_EXAMPLES = 20  # skipped files a summary names


@dataclasses.dataclass
class ReadStats:
    """What reading found: counts that add up across units, and the files skipped with the reason."""

    counts: Counter = dataclasses.field(default_factory=Counter)
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def add(self, other: ReadStats) -> None:
        self.counts.update(other.counts)
        self.skipped.extend(other.skipped)

    def skipped_note(self) -> str:
        """How many files were skipped and why the first was, for an error that found no text."""
        if not self.skipped:
            return "0 files skipped"
        path, reason = self.skipped[0]
        return f"{len(self.skipped)} files skipped; the first, {path}: {reason}"

    def summary(self) -> dict:
        reasons = Counter(reason for _, reason in self.skipped)
        return {"counts": dict(sorted(self.counts.items())), "skipped_files": dict(sorted(reasons.items())),
                "skipped_examples": [{"path": p, "reason": r} for p, r in self.skipped[:SUMMARY_EXAMPLES]]}

    @staticmethod
    def merge_summaries(summaries: list[dict]) -> dict:
        """The `summary` of the stats of several reads taken in order, from their summaries."""
        counts: Counter = Counter()
        reasons: Counter = Counter()
        for s in summaries:
            counts.update(s["counts"])
            reasons.update(s["skipped_files"])
        examples = [e for s in summaries for e in s["skipped_examples"]][:SUMMARY_EXAMPLES]
        return {"counts": dict(sorted(counts.items())), "skipped_files": dict(sorted(reasons.items())),
                "skipped_examples": examples}


@dataclasses.dataclass(frozen=True)
class Unit:
    """A byte range `[start, end)` of one file, read as `fmt`; `end=-1` means to the end of the file."""

    path: str
    fmt: str  # doc | lines | jsonl | parquet | arrow
    start: int = 0
    end: int = -1
    field: str = TEXT_FIELD  # jsonl, parquet and arrow: the field or column that holds the text


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
        raise BertforgeError(f"no .txt, .jsonl (optionally .gz, .bz2, .xz, .zst), .parquet or .arrow files found "
                             f"under {patterns}: check --corpus")
    return out


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
               stats: ReadStats | None = None, text_field: str = TEXT_FIELD) -> list[Unit]:
    """One unit per file, except that large uncompressed line-based files and Parquet files of several row groups
    are cut into byte ranges.

    Only files that may be cut are opened here (to decide their format, or to read a Parquet file's footer);
    the rest are checked for binary content and their format is detected by the worker that reads them
    (`read_unit`). A missing optional dependency is refused here, before any work.
    """
    if fmt not in FORMATS:
        raise BertforgeError(f"unknown corpus format {fmt!r}: use one of {', '.join(FORMATS)}")
    stats = stats if stats is not None else ReadStats()
    _require_readers([str(p) for p in paths])
    units: list[Unit] = []
    for p in paths:
        path = str(p)
        file_fmt = _file_format(path, fmt)
        try:
            size = os.path.getsize(path)
        except OSError as e:
            stats.skipped.append((path, f"unreadable ({type(e).__name__})"))
            continue
        if file_fmt == "parquet":
            ranges, problem = parquet_ranges(path, text_field, chunk_bytes)
            if problem:
                stats.skipped.append((path, problem))
            units.extend(Unit(path, file_fmt, s, e, text_field) for s, e in ranges)
            continue
        if size <= chunk_bytes or compression_of(path) or file_fmt in ("doc", "arrow"):
            units.append(Unit(path, file_fmt, field=text_field))
            continue
        resolved = resolve_format(path, file_fmt, stats)
        if resolved is None:
            continue
        if resolved == "doc":
            units.append(Unit(path, resolved))
        else:
            units.extend(Unit(path, resolved, s, min(s + chunk_bytes, size), text_field)
                         for s in range(0, size, chunk_bytes))
    return units


def _file_format(path: str, fmt: str) -> str:
    inner = inner_name(path)
    for suffix, file_fmt in ((".jsonl", "jsonl"), (".parquet", "parquet"), (".arrow", "arrow")):
        if inner.endswith(suffix):
            return file_fmt
    return fmt


def _require_readers(paths: list[str]) -> None:
    """Refuse, in one line naming the extra to install, a corpus whose files need a missing optional module."""
    if any(p.endswith(".zst") for p in paths):
        require("zstandard")
    if any(p.endswith(COLUMNAR) for p in paths):
        require("pyarrow")
        require("pyarrow.parquet")


def resolve_format(path: str, fmt: str, stats: ReadStats) -> str | None:
    """The format to read `path` as, or None (recorded in `stats`) if it is empty, binary or unreadable."""
    chunks: list[bytes] = []
    try:
        with open_binary(path) as f:
            while sum(map(len, chunks)) < SAMPLE_BYTES and (chunk := f.read(8192)):
                chunks.append(chunk)
    except READ_ERRORS as e:
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

"""Columnar corpora: Parquet files (the Hugging Face Hub's datasets) and Arrow files (`datasets.save_to_disk`),
one document per row in the text column (`text` unless told). Read with pyarrow, batch by batch, so memory is
bounded by a row group (Parquet) or a record batch (Arrow), never the file.

A Parquet file is cut into units by row group: a unit is a byte range of the file and owns the row groups that
start inside it, as a line-based unit owns the lines that start inside it, so workers read a large file in
parallel and in the same order. An Arrow file is one unit: `save_to_disk` writes the IPC *stream* format, which
has no index of its batches (the IPC *file* format, which has one, is read too).

A file without the column, or whose column is not text, is skipped with that reason; a row whose value is null
is counted (`rows_without_text`) and skipped; a file damaged part way keeps the rows read before the damage.
"""

from __future__ import annotations

from collections.abc import Iterator

from bertforge.corpus.streams import require

BATCH_ROWS = 1024  # rows converted to Python strings at a time
_ARROW_FILE_MAGIC = b"ARROW1"  # the IPC file format starts with it; the stream format does not


def _text_type(pa, column_type) -> bool:
    return pa.types.is_string(column_type) or pa.types.is_large_string(column_type) or (
        hasattr(pa.types, "is_string_view") and pa.types.is_string_view(column_type))


def column_problem(schema, field: str) -> str | None:
    """Why `schema` cannot be read for the column `field`, or None if it can."""
    pa = require("pyarrow")
    if field not in schema.names:
        shown = ", ".join(schema.names[:8]) + (", ..." if len(schema.names) > 8 else "")
        return f"no column {field!r} (columns: {shown}; name one with --text-field)"
    column_type = schema.field(field).type
    if not _text_type(pa, column_type):
        return f"column {field!r} is {column_type}, not text (name another with --text-field)"
    return None


def _row_group_offset(row_group) -> int:
    """Where a row group's data starts in the file: the first page of its first column."""
    column = row_group.column(0)
    offsets = [column.data_page_offset]
    if column.has_dictionary_page and column.dictionary_page_offset:
        offsets.append(column.dictionary_page_offset)
    return min(offsets)


def parquet_ranges(path: str, field: str, chunk_bytes: int) -> tuple[list[tuple[int, int]], str | None]:
    """Byte ranges of `path` that each start at a row group and span about `chunk_bytes` (at least one row group),
    or the reason the file cannot be read."""
    pq = require("pyarrow.parquet")
    pa = require("pyarrow")
    try:
        meta = pq.ParquetFile(path).metadata
        schema = meta.schema.to_arrow_schema()
    except (OSError, pa.ArrowException) as e:
        return [], f"unreadable ({type(e).__name__})"
    problem = column_problem(schema, field)
    if problem:
        return [], problem
    offsets = [_row_group_offset(meta.row_group(i)) for i in range(meta.num_row_groups)]
    starts = []
    for offset in offsets:
        if not starts or offset - starts[-1] >= chunk_bytes:
            starts.append(offset)
    ends = starts[1:] + [-1]
    return list(zip(starts, ends, strict=True)), None


def parquet_texts(path: str, field: str, start: int, end: int, stats) -> Iterator[str]:
    """The text of each row of the row groups that start in [start, end) (end -1: the end of the file)."""
    pq = require("pyarrow.parquet")
    f = pq.ParquetFile(path)
    offsets = [_row_group_offset(f.metadata.row_group(i)) for i in range(f.metadata.num_row_groups)]
    groups = [i for i, offset in enumerate(offsets) if start <= offset and (end < 0 or offset < end)]
    # One row group at a time: given them all, pyarrow's reader buffers ahead and its memory grows with the file.
    batches = (b for g in groups for b in f.iter_batches(batch_size=BATCH_ROWS, row_groups=[g], columns=[field]))
    yield from _texts((b.column(0) for b in batches), path, stats)


def arrow_texts(path: str, field: str, stats) -> Iterator[str]:
    """The text of each row of an Arrow IPC file, stream format (as `save_to_disk` writes it) or file format."""
    pa = require("pyarrow")
    with pa.OSFile(path) as source:
        is_file_format = source.read(len(_ARROW_FILE_MAGIC)) == _ARROW_FILE_MAGIC
        source.seek(0)
        try:
            if is_file_format:
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            else:
                reader = pa.ipc.open_stream(source)
                batches = iter(reader)
        except pa.ArrowException as e:
            stats.skipped.append((path, f"unreadable ({type(e).__name__})"))
            return
        problem = column_problem(reader.schema, field)
        if problem:
            stats.skipped.append((path, problem))
            return
        index = reader.schema.get_field_index(field)
        yield from _texts((b.column(index) for b in batches), path, stats)


def _texts(columns: Iterator, path: str, stats) -> Iterator[str]:
    """The strings of each column piece; nulls counted and skipped. Damage part way ends the file there, keeping
    what came before, as for a truncated compressed file."""
    pa = require("pyarrow")
    try:
        for column in columns:
            for value in column.to_pylist():
                if value is None:
                    stats.counts["rows_without_text"] += 1
                else:
                    yield value
    except pa.ArrowException as e:
        stats.skipped.append((path, f"read error part way ({type(e).__name__})"))

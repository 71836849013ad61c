"""Reading a pretraining corpus: files, directories and globs of `.txt` and `.jsonl` (plain, `.gz`, `.bz2`, `.xz`
or `.zst`), Parquet (`.parquet`) and Arrow (`.arrow`, as `datasets.save_to_disk` writes it).

Formats (the "Corpus" item of docs/data.md):
- `doc`: a `.txt` file is one document; paragraphs are separated by blank lines, lines inside a paragraph
  are joined, and paragraphs are split into sentences (`sentences.split_sentences`).
- `lines`: BERT's format: one sentence per line, a blank line between documents.
- `jsonl`: one JSON object per line, its `text` field one document (treated like `doc`).
- `parquet`, `arrow`: one row per document, its `text` column read like a `jsonl` record's field (`columnar`).
The field or column is `text` unless `text_field` names another.
`auto` (the default) picks `doc` or `lines` for each `.txt` from a sample of its first lines.

Bad input never stops a run: invalid UTF-8 is replaced and counted, binary and unreadable files are skipped,
bad JSON lines and rows without text are skipped, a path given twice is read once, and a line of any length is
read in pieces of `max_line_bytes`, never whole. Everything skipped is counted in a `ReadStats`. `prepare` reads
units in worker processes; `vocab train` reads them in order (`read_sentences`).

A file is read as one or more `Unit`s (`inputs.plan_units`): large uncompressed `lines`/`jsonl` files are cut
into byte ranges that each own the documents (or records) that start inside them, and Parquet files into byte
ranges that own the row groups that start inside them, so one big file is read by several workers. Compressed
files are read whole, as they decompress (`streams`).

Modules: `inputs` (files, formats and units), `reader` (units to sentences), `sentences` (sentence splitting),
`streams` (decompression, optional dependencies), `columnar` (Parquet and Arrow).
The corpus reader sits below the tokenizer and `bertforge.data`: `vocab train` (`Tokenizer.train`) and
`prepare` both read through it, and it imports neither.
"""

from bertforge.corpus.inputs import (
    FORMATS,
    SUFFIXES,
    TEXT_FIELD,
    ReadStats,
    Unit,
    detect_txt_format,
    expand_inputs,
    plan_units,
)
from bertforge.corpus.reader import END, MAX_LINE_BYTES, read_sentences, read_unit, unit_bytes
from bertforge.corpus.sentences import split_sentences

__all__ = ["END", "FORMATS", "MAX_LINE_BYTES", "SUFFIXES", "TEXT_FIELD", "ReadStats", "Unit", "detect_txt_format",
           "expand_inputs", "plan_units", "read_sentences", "read_unit", "split_sentences", "unit_bytes"]

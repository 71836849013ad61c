"""Reading a pretraining corpus: files, directories and globs of `.txt`, `.jsonl` and their `.gz`.

Formats (the "Corpus" item of docs/data.md):
- `doc`: a `.txt` file is one document; paragraphs are separated by blank lines, lines inside a paragraph
  are joined, and paragraphs are split into sentences (`sentences.split_sentences`).
- `lines`: BERT's format: one sentence per line, a blank line between documents.
- `jsonl`: one JSON object per line, its `text` field one document (treated like `doc`).
`auto` (the default) picks `doc` or `lines` for each `.txt` from a sample of its first lines.

Bad input never stops a run: invalid UTF-8 is replaced and counted, binary and unreadable files are skipped,
bad JSON lines are skipped, a path given twice is read once, and a line of any length is read in pieces of
`max_line_bytes`, never whole. Everything skipped is counted in a `ReadStats`. `prepare` reads units in worker
processes; `vocab train` reads them in order (`read_sentences`).

A file is read as one or more `Unit`s (`inputs.plan_units`): large uncompressed `lines`/`jsonl` files are cut
into byte ranges that each own the documents (or records) that start inside them, so one big file is read by
several workers.

Modules: `inputs` (files, formats and units), `reader` (units to sentences), `sentences` (sentence splitting).
The corpus reader sits below the tokenizer and `bertforge.data`: `vocab train` (`Tokenizer.train`) and
`prepare` both read through it, and it imports neither.
"""

from bertforge.corpus.inputs import FORMATS, SUFFIXES, ReadStats, Unit, detect_txt_format, expand_inputs, plan_units
from bertforge.corpus.reader import END, MAX_LINE_BYTES, read_sentences, read_unit
from bertforge.corpus.sentences import split_sentences

__all__ = ["END", "FORMATS", "MAX_LINE_BYTES", "SUFFIXES", "ReadStats", "Unit", "detect_txt_format", "expand_inputs",
           "plan_units", "read_sentences", "read_unit", "split_sentences"]

"""CoNLL-2003 named entities (token classification), and any file in the same column format.

Files: train.txt, valid.txt, test.txt (or the original eng.train, eng.testa, eng.testb). One word per line,
space-separated columns `word POS chunk NER` (the first column is the word, the last the tag), a blank line
between sentences, `-DOCSTART-` lines skipped. Tags may be IOB1 (the original files), IOB2 or IOBES; the
model learns them as they are and the entity score treats them exactly as conlleval does.

The tag of a word is learned and predicted on its first sub-token. decode() turns the head's logits
(per feature (T, num_labels), or padded (N, T, num_labels)) back into one tag per word; entities() turns
the tags of an example into character spans of its text (what `predict` shows).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bertforge.errors import BertforgeError
from bertforge.files import open_text
from bertforge.tasks.base import Feature, TaggedExample, Task, split_file, where
from bertforge.tasks.classification import as_array
from bertforge.tasks.features import tagging_features
from bertforge.tasks.metrics import chunks, conll_scores, split_tag

_FILES = {"train": ["train.txt", "eng.train"], "dev": ["valid.txt", "dev.txt", "eng.testa"],
          "test": ["test.txt", "eng.testb"]}
STANDARD_LABELS = ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC")
_WORD = re.compile(r"\w+(?:[-'.&]\w+)*|\S")  # words for raw text: "U.S", "don't", "New-York", "," ...


def read_conll(path: Path) -> list[TaggedExample]:
    examples: list[TaggedExample] = []
    words: list[str] = []
    tags: list[str] = []
    first_line = 0
    width, width_line = 0, 0  # the column count of the first token line: the tag is the last column of every line

    def flush() -> None:
        if words:
            examples.append(TaggedExample(id=str(len(examples)), words=list(words), tags=list(tags),
                                          source=where(path, first_line)))
            words.clear()
            tags.clear()

    with open_text(path) as f:
        for line_no, line in enumerate(f, 1):
            columns = line.split()
            if not columns:
                flush()
                continue
            if columns[0] == "-DOCSTART-":
                flush()
                continue
            if len(columns) < 2:
                raise BertforgeError(f"{where(path, line_no)}: expected 'word ... tag' columns, found "
                                     f"{line.strip()!r}; separate columns with spaces, sentences with blank lines")
            if not width:
                width, width_line = len(columns), line_no
            elif len(columns) != width:
                raise BertforgeError(f"{where(path, line_no)}: {len(columns)} columns, but line {width_line} has "
                                     f"{width}; the tag is the last column, so every line needs the same columns "
                                     f"(word ... TAG): fix the line or the file's mix of formats")
            if not words:
                first_line = line_no
            words.append(columns[0])
            tags.append(columns[-1])
    flush()
    if not examples:
        raise BertforgeError(f"{path} has no sentences; expected lines of 'word POS chunk TAG' separated by "
                             "blank lines")
    return examples


def _order(tag: str) -> tuple[int, str, str]:
    prefix, kind = split_tag(tag)
    return (0 if tag == "O" else 1, kind, prefix)


class ConllTask(Task):
    name = "conll2003"
    kind = "token_classification"
    main_metric = "f1"

    def read(self, data_path: str | Path, split: str) -> list[TaggedExample]:
        return read_conll(split_file(data_path, split, _FILES, self.name))

    def label_list(self, examples: Sequence[TaggedExample]) -> list[str]:
        """The 9 standard CoNLL-2003 tags when the data uses no others (stable ids across datasets), else
        every tag in the data: O first, then by entity type."""
        if self.labels is None:
            seen = {t for ex in examples for t in (ex.tags or [])}
            self.labels = list(STANDARD_LABELS) if seen <= set(STANDARD_LABELS) else sorted(seen, key=_order)
        return self.labels

    def example(self, text: str) -> TaggedExample:
        """An untagged example from raw text, split into words and punctuation marks."""
        found = list(_WORD.finditer(text))
        return TaggedExample(id="0", words=[m.group() for m in found], text=text,
                             spans=[m.span() for m in found], source="<input>")

    def features(self, examples: Sequence[TaggedExample], tokenizer: Any, max_length: int,
                 label_map: dict[str, int] | None = None, windows: int = 1) -> list[Feature]:
        if label_map is None:
            if self.labels is None:
                self.label_list(examples)
            label_map = self.label_map()
        return tagging_features(examples, tokenizer, max_length, label_map)

    def decode(self, examples: Sequence[TaggedExample], features: Sequence[Feature], outputs: Any) -> list[list[str]]:
        """One tag per word per example, from each word's first sub-token; a word the tokenizer dropped
        (e.g. only control characters) gets "O"."""
        labels = self.labels or []
        default = "O" if "O" in labels else labels[0]
        tags = [[default] * len(ex.words) for ex in examples]
        seen = [set() for _ in examples]
        for f, logits in zip(features, _per_feature(outputs, len(features)), strict=True):
            i = f["example_index"]
            ids = as_array(logits)[: len(f["input_ids"])].argmax(axis=-1)
            for pos, w in enumerate(f["word_ids"]):
                if w is not None and w not in seen[i]:
                    seen[i].add(w)
                    tags[i][w] = labels[int(ids[pos])]
        return tags

    def references(self, examples: Sequence[TaggedExample]) -> list[list[str]]:
        missing = next((ex for ex in examples if ex.tags is None), None)
        if missing is not None:
            raise BertforgeError(f"{missing.source}: no gold tags to score against; evaluate on a tagged split")
        return [list(ex.tags) for ex in examples]

    def metric(self, predictions: Sequence[Sequence[str]], references: Sequence[Sequence[str]]) -> dict[str, float]:
        return conll_scores(predictions, references)

    def entities(self, example: TaggedExample, tags: Sequence[str]) -> list[dict[str, Any]]:
        """Entities of one example as {"type", "start", "end", "text"}, character offsets into its text."""
        found = []
        for kind, first, last in chunks(tags):
            start, end = example.spans[first][0], example.spans[last][1]
            found.append({"type": kind, "start": start, "end": end, "text": example.text[start:end]})
        return found


def _per_feature(outputs: Any, n: int) -> Sequence[Any]:
    if isinstance(outputs, (list, tuple)):
        if len(outputs) != n:
            raise ValueError(f"{len(outputs)} logits arrays for {n} features")
        return outputs
    array = as_array(outputs)
    if array.ndim != 3 or array.shape[0] != n:
        raise ValueError(f"expected logits of shape ({n}, T, num_labels), got {array.shape}")
    return array

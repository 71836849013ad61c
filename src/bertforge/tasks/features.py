"""Examples -> model features, and features -> padded tensors.

A feature is a dict of plain Python lists, unpadded (padding happens per batch in `collate`):

    input_ids, token_type_ids   [CLS] A [SEP] (B [SEP]); (C, T) nested lists for multiple choice
    labels                      int (class id) | float (regression) | list[int] per token (tagging; -100 on
                                specials and on every sub-token but a word's first) | absent (no gold label)
    example_index               the example a feature came from (tagging, QA and a long single text read in
                                windows may split one example into several features)

The tokenizer is a bertforge.Tokenizer (or anything with its `encode`, `encode_many`, `encode_batch`, `tokenize_ids`,
`cls_id`, `sep_id`); offsets are character spans in the text given to `encode`.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import Any

import torch

from bertforge.data.padding import pad_ids, pad_rows
from bertforge.errors import BertforgeError
from bertforge.tasks.base import IGNORE_INDEX, ChoiceExample, Feature, TaggedExample, TextExample

_BATCH = 1024  # texts per tokenizer call


def encode_ids(tokenizer: Any, texts: Sequence[str], pairs: Sequence[str] | None,
               max_length: int) -> tuple[list[list[int]], list[list[int]]]:
    """(ids, type_ids) per text (or pair) with specials, truncated longest-first to `max_length`: the tokens of
    `encode_many` without its offsets and word ids, through the tokenizer's id path (a cache of each distinct
    word's pieces), which costs a fraction of full encodings on short texts."""
    ids: list[list[int]] = []
    types: list[list[int]] = []
    for i in range(0, len(texts), _BATCH):
        chunk_pairs = list(pairs[i:i + _BATCH]) if pairs is not None else None
        batch = tokenizer.encode_batch(list(texts[i:i + _BATCH]), chunk_pairs, max_length=max_length,
                                       truncation=True, padding=False)
        ids += batch.ids
        types += batch.type_ids
    return ids, types


def encode_plain(tokenizer: Any, texts: Sequence[str]) -> list:
    """Encodings (ids, offsets) of texts without special tokens or truncation."""
    out = []
    for i in range(0, len(texts), _BATCH):
        out.extend(tokenizer.encode_many(list(texts[i:i + _BATCH]), truncation=False, add_special_tokens=False))
    return out


def label_id(label: str, label_map: dict[str, int], source: str) -> int:
    try:
        return label_map[label]
    except KeyError:
        known = ", ".join(label_map)
        raise BertforgeError(f"{source}: unknown label {label!r} (the task's labels: {known}); fix the label, or "
                             "train with data that has it") from None


def window_starts(n: int, width: int, most: int) -> list[int]:
    """Where the windows of `width` tokens over a text of `n` start: one from the start, else consecutive windows to
    its end, the last moved back to end where the text ends (so every window is full); where that would take more
    than `most`, `most` windows spread evenly from the first tokens to the last."""
    last = n - width
    if last <= 0 or most == 1:
        return [0]
    count = -(-n // width)
    if count <= most:
        return [min(i * width, last) for i in range(count)]
    return [round(i * last / (most - 1)) for i in range(most)]


def window_ids(tokenizer: Any, texts: Sequence[str], max_length: int, windows: int) -> list[tuple[int, list[int]]]:
    """(text index, ids with specials) for each window of each text (`window_starts`): a text within `max_length`
    is its one window, the ids `encode_ids` gives it."""
    width = max_length - 2
    out = []
    for i in range(0, len(texts), _BATCH):
        for j, pieces in enumerate(tokenizer.tokenize_ids(list(texts[i:i + _BATCH])), i):
            out += [(j, [tokenizer.cls_id, *pieces[s:s + width], tokenizer.sep_id])
                    for s in window_starts(len(pieces), width, windows)]
    return out


def sequence_features(examples: Sequence[TextExample], tokenizer: Any, max_length: int,
                      label_map: dict[str, int] | None, regression: bool = False, windows: int = 1) -> list[Feature]:
    """Single sentences or sentence pairs, one feature per example; with `windows` above 1, a single text longer
    than `max_length` gives up to that many, its windows (`window_starts`), which `SequenceTask` averages."""
    has_pairs = any(ex.text_pair is not None for ex in examples)
    if windows > 1 and not has_pairs:
        windowed = window_ids(tokenizer, [ex.text for ex in examples], max_length, windows)
        owners, all_ids = [i for i, _ in windowed], [ids for _, ids in windowed]
        all_types = [[0] * len(ids) for ids in all_ids]
    else:
        pairs = [ex.text_pair or "" for ex in examples] if has_pairs else None
        all_ids, all_types = encode_ids(tokenizer, [ex.text for ex in examples], pairs, max_length)
        owners = range(len(examples))
    features = []
    for i, ids, types in zip(owners, all_ids, all_types, strict=True):
        ex = examples[i]
        feature: Feature = {"input_ids": ids, "token_type_ids": types, "example_index": i}
        if ex.label is not None:
            if regression:
                feature["labels"] = float(ex.label)
            else:
                if label_map is None:
                    raise ValueError("classification features need a label map")
                feature["labels"] = label_id(str(ex.label), label_map, ex.source)
        features.append(feature)
    return features


def choice_features(examples: Sequence[ChoiceExample], tokenizer: Any, max_length: int) -> list[Feature]:
    """Multiple choice: each (context, choice) pair encoded as [CLS] context [SEP] choice [SEP]."""
    n_choices = {len(ex.choices) for ex in examples}
    if len(n_choices) > 1:
        raise BertforgeError(f"examples have different numbers of choices ({sorted(n_choices)}); every example "
                             "needs the same number")
    texts = [ex.context for ex in examples for _ in ex.choices]
    pairs = [choice for ex in examples for choice in ex.choices]
    all_ids, all_types = encode_ids(tokenizer, texts, pairs, max_length)
    features, pos = [], 0
    for i, ex in enumerate(examples):
        n = len(ex.choices)
        feature: Feature = {"input_ids": all_ids[pos:pos + n], "token_type_ids": all_types[pos:pos + n],
                            "example_index": i}
        pos += n
        if ex.label is not None:
            feature["labels"] = int(ex.label)
        features.append(feature)
    return features


def word_index(spans: Sequence[tuple[int, int]], starts: Sequence[int], offset: tuple[int, int]) -> int | None:
    """The word whose character span holds the token starting at `offset[0]`, or None."""
    start, end = offset
    if end <= start:
        return None
    w = bisect_right(starts, start) - 1
    return w if w >= 0 and start < spans[w][1] else None


def _windows(word_ids: Sequence[int | None], limit: int) -> list[tuple[int, int]]:
    """Cut a token sequence into consecutive [a, b) pieces of at most `limit` tokens, at word boundaries
    where possible (a single word longer than `limit` is cut inside)."""
    def starts_word(p: int) -> bool:
        return word_ids[p] is None or word_ids[p] != word_ids[p - 1]

    if limit < 1:
        raise BertforgeError(f"max_length {limit + 2} leaves no room for tokens; use a larger max length")
    pieces, a, n = [], 0, len(word_ids)
    while a < n:
        b = min(a + limit, n)
        if b < n:
            cut = b
            while cut > a + 1 and not starts_word(cut):
                cut -= 1
            if starts_word(cut):
                b = cut
        pieces.append((a, b))
        a = b
    return pieces or [(0, 0)]


def tagging_features(examples: Sequence[TaggedExample], tokenizer: Any, max_length: int,
                     label_map: dict[str, int] | None) -> list[Feature]:
    """Token classification. The tag of a word goes on its first sub-token; a sentence longer than
    `max_length` becomes several features cut at word boundaries, so no word is lost. Each feature has
    `word_ids` (the example's word index per token, None for specials) for `tagging_predictions`."""
    features = []
    for i, (ex, enc) in enumerate(zip(examples, encode_plain(tokenizer, [ex.text for ex in examples]),
                                      strict=True)):
        starts = [s for s, _ in ex.spans]
        wids = [word_index(ex.spans, starts, tuple(off)) for off in enc.offsets]
        first = [w is not None and (p == 0 or wids[p - 1] != w) for p, w in enumerate(wids)]
        tag_ids = None
        if ex.tags is not None:
            if label_map is None:
                raise ValueError("tagging features need a label map")
            tag_ids = [label_id(tag, label_map, ex.source) for tag in ex.tags]
        for a, b in _windows(wids, max_length - 2):
            feature: Feature = {
                "input_ids": [tokenizer.cls_id, *enc.ids[a:b], tokenizer.sep_id],
                "token_type_ids": [0] * (b - a + 2),
                "word_ids": [None, *wids[a:b], None],
                "example_index": i,
            }
            if tag_ids is not None:
                feature["labels"] = [IGNORE_INDEX] + [
                    tag_ids[wids[p]] if first[p] else IGNORE_INDEX for p in range(a, b)] + [IGNORE_INDEX]
            features.append(feature)
    return features


def collate(features: Sequence[Feature], pad_id: int) -> dict[str, Any]:
    """Pad a batch of features on the right into torch tensors.

    Returns input_ids, token_type_ids, attention_mask (1 = real token, 0 = padding): (B, T), or (B, C, T)
    for multiple choice; and, when the features have them, labels ((B,) long, (B,) float for regression,
    (B, T) long padded with -100 for tagging) and start_positions/end_positions ((B,) long).
    """
    first_ids = features[0]["input_ids"]
    choices = bool(first_ids) and isinstance(first_ids[0], list)
    rows = [f["input_ids"] for f in features]
    types = [f["token_type_ids"] for f in features]
    if choices:  # pad the B * C sequences as rows, then give back the choice axis
        shape = (len(rows), len(rows[0]))
        if any(len(row) != shape[1] for row in rows):
            raise BertforgeError(f"multiple-choice inputs with {sorted({len(row) for row in rows})} choices in one "
                                 f"batch: give every input the same number of choices")
        rows = [seq for row in rows for seq in row]
        types = [seq for row in types for seq in row]
    ids, mask = pad_ids(rows, pad_id)
    width = ids.shape[-1]
    tt = pad_rows(types, 0, width=width)
    if choices:
        ids, tt, mask = (x.view(*shape, width) for x in (ids, tt, mask))  # (B, C, T)
    batch: dict[str, Any] = {"input_ids": ids, "token_type_ids": tt, "attention_mask": mask}
    if all("labels" in f for f in features):
        labels = [f["labels"] for f in features]
        if isinstance(labels[0], list):
            batch["labels"] = pad_rows(labels, IGNORE_INDEX, width=width)
        elif isinstance(labels[0], float):
            batch["labels"] = torch.tensor(labels, dtype=torch.float)
        else:
            batch["labels"] = torch.tensor(labels, dtype=torch.long)
    for key in ("start_positions", "end_positions"):
        if all(key in f for f in features):
            batch[key] = torch.tensor([f[key] for f in features], dtype=torch.long)
    return batch

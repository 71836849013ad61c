"""Next-sentence-prediction instances by the original algorithm (google-research/bert
`create_instances_from_document`), on token arrays.

A document is a list of sentences, each a 1-D array of token ids (no special tokens). Segments (sentences)
are accumulated until they reach a target length (`max_seq_len - 3`, or with probability `short_seq_prob`
a random length in [2, max_seq_len - 3]); the chunk is split at a random point into A and B. With
probability 0.5, and always when the chunk has one segment, B is instead taken from a random other document
(starting at a random sentence, up to the remaining target length) and the chunk's unused segments are
returned to be used again. Finally the pair is cut to `max_seq_len - 3` tokens, one token at a time from the
longer side (B on ties), from the front or the back at random.

Without NSP (`create_single_segment_instances`, the budget recipes' choice), an instance is one segment,
`[CLS] A [SEP]`: a run of one document's tokens filling the sequence.

Differences from the original, both where it could go wrong: the random document is drawn from the *other*
documents (the original retries 10 times and may end with the same one), and with a single document in the
split a single-segment chunk yields no instance rather than a same-document "NotNext".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from bertforge.tokenizer.truncation import longest_first


class Instance(NamedTuple):
    """One pair before masking. `is_random_next` is the NSP label (True = NotNext); `forced_random` says the
    chunk had a single segment, so B had to come from another document (no coin was tossed)."""

    tokens_a: np.ndarray
    tokens_b: np.ndarray
    is_random_next: bool
    forced_random: bool


def _cut(tokens: np.ndarray, keep: int, rng: np.random.Generator) -> np.ndarray:
    """Keep `keep` tokens; each removed token came off the front or the back with probability 1/2."""
    removed = len(tokens) - keep
    if removed <= 0:
        return tokens
    front = int(rng.binomial(removed, 0.5))
    return tokens[front:front + keep]


def truncate_pair(a: np.ndarray, b: np.ndarray, max_tokens: int,
                  rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The original `truncate_seq_pair`, in closed form: same lengths (the tokenizer's `longest_first` rule),
    same distribution of cut ends."""
    la, lb = longest_first(len(a), len(b), len(a) + len(b) - max_tokens)
    return _cut(a, la, rng), _cut(b, lb, rng)


def _concat(segments: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(segments) if len(segments) > 1 else np.asarray(segments[0])


def create_instances(document: Sequence[np.ndarray], doc_index: int, n_documents: int,
                     get_document: Callable[[int], Sequence[np.ndarray]], rng: np.random.Generator, *,
                     max_seq_len: int, short_seq_prob: float = 0.1) -> list[Instance]:
    """All instances from one document (`doc_index` of `n_documents`; `get_document(j)` returns another).
    A document is a sequence of sentences (1-D token arrays); only the sentences used are accessed."""
    max_tokens = max_seq_len - 3
    target = max_tokens
    if rng.random() < short_seq_prob:
        target = int(rng.integers(2, max_tokens + 1))
    instances: list[Instance] = []
    chunk: list[np.ndarray] = []
    length = 0
    i, n = 0, len(document)
    while i < n:
        segment = document[i]
        chunk.append(segment)
        length += len(segment)
        if i == n - 1 or length >= target:
            a_end = int(rng.integers(1, len(chunk))) if len(chunk) >= 2 else 1
            tokens_a = _concat(chunk[:a_end])
            forced = len(chunk) == 1
            if n_documents >= 2 and (forced or rng.random() < 0.5):
                target_b = target - len(tokens_a)
                other = int(rng.integers(0, n_documents - 1))
                other += other >= doc_index
                random_doc = get_document(other)
                start = int(rng.integers(0, len(random_doc)))
                pieces, got = [], 0
                for j in range(start, len(random_doc)):
                    seg = random_doc[j]
                    pieces.append(seg)
                    got += len(seg)
                    if got >= target_b:
                        break
                tokens_b = _concat(pieces)
                i -= len(chunk) - a_end  # the unused segments go back
                tokens_a, tokens_b = truncate_pair(tokens_a, tokens_b, max_tokens, rng)
                instances.append(Instance(tokens_a, tokens_b, True, forced))
            elif not forced:
                tokens_b = _concat(chunk[a_end:])
                tokens_a, tokens_b = truncate_pair(tokens_a, tokens_b, max_tokens, rng)
                instances.append(Instance(tokens_a, tokens_b, False, False))
            chunk, length = [], 0
        i += 1
    return instances


def create_single_segment_instances(document: Sequence[np.ndarray], rng: np.random.Generator, *, max_seq_len: int,
                                    short_seq_prob: float = 0.0) -> list[Instance]:
    """Instances of one segment (`tokens_b` empty) from one document: its tokens in order, cut into pieces of
    `max_seq_len - 2` ([CLS] and [SEP] take the rest), so every instance but the document's last fills the
    sequence; sentence boundaries are not kept. With probability `short_seq_prob` a piece's length is instead
    random in [2, max_seq_len - 2], as in the paired algorithm."""
    max_tokens = max_seq_len - 2
    tokens = _concat([np.asarray(x) for x in document]) if len(document) else np.zeros(0, np.int64)
    empty = np.zeros(0, tokens.dtype)
    instances: list[Instance] = []
    start = 0
    while start < len(tokens):
        size = int(rng.integers(2, max_tokens + 1)) if rng.random() < short_seq_prob else max_tokens
        instances.append(Instance(tokens[start:start + size], empty, False, False))
        start += size
    return instances

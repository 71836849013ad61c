"""How well a vocabulary covers a corpus (`corpus_summary`): the figures `vocab train` prints and writes into
vocab_summary.json."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

import numpy as np

from bertforge.tokenizer.training import COUNT_BATCH_CHARS, batches
from bertforge.tokenizer.wordpiece import Tokenizer

SUMMARY_TEXT_CHARS = 1 << 13  # the coverage summary encodes texts of at most about this many characters


def word_pieces(texts: Iterable[str], max_chars: int) -> Iterator[str]:
    """`texts`, each longer than `max_chars` cut at a space into pieces of about that size (the last word of a piece
    may continue in the next), so that no one text makes the engine build a huge encoding."""
    for text in texts:
        while len(text) > max_chars:
            cut = text.rfind(" ", 0, max_chars)
            cut = max_chars if cut <= 0 else cut
            yield text[:cut]
            text = text[cut:]
        yield text


def corpus_summary(tokenizer: Tokenizer, texts: Iterable[str], *, max_words: int | None = 10_000_000) -> dict:
    """How well the vocabulary covers a corpus, measured on its first `max_words` words (None: all).

    Words are the pre-tokens (a run of letters/digits, or one punctuation character or CJK ideograph).
    Returns vocab_size, texts, words, tokens, single_token_words (share of words that are one token),
    tokens_per_word, and unk_rate (share of tokens that are [UNK]; each [UNK] replaces a whole word).
    """
    n_texts = n_words = n_tokens = n_single = n_unk = 0
    for batch in batches(word_pieces(texts, SUMMARY_TEXT_CHARS), COUNT_BATCH_CHARS):
        encs = tokenizer._segments(batch)
        lengths = np.fromiter((len(e.ids) for e in encs), dtype=np.int64, count=len(encs))
        total = int(lengths.sum())
        n_texts += len(encs)
        if total == 0:
            continue
        words = np.fromiter(itertools.chain.from_iterable(e.word_ids for e in encs), dtype=np.int64, count=total)
        ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encs), dtype=np.int64, count=total)
        starts = np.zeros(total, dtype=bool)  # a word starts where the word id changes or a new text begins
        starts[0] = True
        starts[1:] = words[1:] != words[:-1]
        starts[np.cumsum(lengths)[:-1][lengths[1:] > 0]] = True
        run_lengths = np.diff(np.append(np.flatnonzero(starts), total))
        n_words += len(run_lengths)
        n_single += int((run_lengths == 1).sum())
        n_tokens += total
        n_unk += int((ids == tokenizer.unk_id).sum())
        if max_words is not None and n_words >= max_words:
            break
    return {"vocab_size": tokenizer.vocab_size, "texts": n_texts, "words": n_words, "tokens": n_tokens,
            "single_token_words": n_single / max(n_words, 1), "tokens_per_word": n_tokens / max(n_words, 1),
            "unk_rate": n_unk / max(n_tokens, 1)}

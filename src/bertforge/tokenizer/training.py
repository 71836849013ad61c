"""Learning a WordPiece vocabulary from a corpus, the same in every run.

The engine's WordPiece trainer counts words and learns merges in Rust on all cores, but left alone its vocabulary
changed from run to run (three processes, one corpus: three different vocab.txt files, and different token sets,
not only orders). It numbers the `##c` pieces in the iteration order of a hash map whose seed is random in every
process, and it breaks ties between equally frequent pairs by those numbers; when `limit_alphabet` cuts the
alphabet, it also drops among equally frequent characters in hash order. Threads are not the cause (its counts
are sums), nor is PYTHONHASHSEED (the maps are Rust's).

The rule that replaces the hash order: a first pass here counts the characters of the normalized words
(`count_alphabet`), keeps the `limit_alphabet` most frequent (on a tie, the lower code point), and hands the
engine the whole initial vocabulary in a fixed order, as tokens it must number first: the special tokens, the
kept characters by code point, then by code point the ## form of each one that occurs inside a word. The engine
then numbers only the pieces it learns, in the order it learns them, so its tie-breaks are the same in every
process. (One corner stays the engine's: its merge queue can hold two entries for the same pair with the same
count, when a piece is formed by two different merges, and takes them in the order of its heap. None of the
runs we compared, in separate processes over five corpora, has differed.)

vocab.txt is then: the special tokens ([PAD] = 0), the characters, their ## forms, the learned pieces.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import tokenizers
from tokenizers import trainers

from bertforge.corpus import TEXT_FIELD, ReadStats, expand_inputs, read_sentences
from bertforge.errors import BertforgeError
from bertforge.progress import progress_reporter
from bertforge.tokenizer.engine import CONTROL_BYTES, SURROGATES, pipeline, wordpiece
from bertforge.tokenizer.unicode import class_table
from bertforge.tokenizer.vocab import MAX_VOCAB_SIZE, SPECIAL_TOKENS, SUBWORD_PREFIX

COUNT_BATCH_CHARS = 1 << 20  # text normalized per call while counting characters
ENGINE_BATCH_CHARS = 1 << 16  # text per engine input while training: the engine holds 256 inputs at a time
_WORD_ENDS = " \t\n\r"  # after normalization only " " is left; the ASCII path sees the others


@dataclass(frozen=True)
class VocabOptions:
    """What a WordPiece vocabulary is learned with, besides the corpus: the same corpus and options give the same
    vocabulary, token for token (`Tokenizer.train`; `bertforge vocab train`'s flags of the same names, where
    --cased is lowercase=False)."""

    vocab_size: int = 30522  # tokens, the special tokens included (BERT: 30522)
    lowercase: bool = True  # uncased: lowercase and strip accents before learning (and tokenizing)
    min_frequency: int = 2  # merge only pieces that occur together at least this often
    limit_alphabet: int = 1000  # keep at most this many distinct characters, the most frequent: rarer ones are [UNK]
    text_field: str = TEXT_FIELD  # the .jsonl field, or the Parquet or Arrow column, that holds the text

    def __post_init__(self) -> None:
        if self.vocab_size <= len(SPECIAL_TOKENS):
            raise BertforgeError(f"vocab size {self.vocab_size} is too small: it must exceed the "
                                 f"{len(SPECIAL_TOKENS)} special tokens (BERT uses 30522)")
        if self.vocab_size > MAX_VOCAB_SIZE:
            raise BertforgeError(f"vocab size {self.vocab_size:,} is over the cap of {MAX_VOCAB_SIZE:,} tokens (BERT "
                                 f"uses 30,522; the largest vocabularies in use about 250,000): ask for fewer")
        if self.min_frequency < 0 or self.limit_alphabet < 1:
            raise BertforgeError(f"min_frequency must be >= 0 and limit_alphabet >= 1, got {self.min_frequency} "
                                 f"and {self.limit_alphabet}")


@dataclass(frozen=True)
class Alphabet:
    """The characters a vocabulary starts from (`count_alphabet`)."""

    chars: list[str]  # the kept characters, by code point
    continuations: list[str]  # "##c" for each kept c that occurs after another character of a word, by code point
    dropped: int  # distinct characters beyond `limit_alphabet`: they become [UNK]
    characters: int = 0  # characters of words counted, spaces excluded: no corpus can be split into more merges

    @property
    def initial_tokens(self) -> list[str]:
        """The vocabulary before any piece is learned: the least `vocab_size` that can be honoured."""
        return [*SPECIAL_TOKENS, *self.chars, *self.continuations]


def count_alphabet(texts: Iterable[str], *, lowercase: bool, limit_alphabet: int) -> Alphabet:
    """Count the characters of the words of `texts` as the engine's trainer sees them (normalized, split into
    words) and keep the `limit_alphabet` most frequent, ties going to the lower code point.

    ASCII text without control characters skips the normalizer: for it, normalizing is lowercasing (or nothing).
    """
    counts = np.zeros(sys.maxunicode + 1, np.int64)  # occurrences of each character
    inner = np.zeros(sys.maxunicode + 1, bool)  # seen after another character of its word
    word_end = class_table("split")  # punctuation and CJK are words of their own, spaces separate words
    word_end[[ord(c) for c in _WORD_ENDS]] = True
    normalizer = pipeline(lowercase)[0]

    def tally(batch: list[str], ascii_only: bool) -> None:
        if not batch:
            return
        text = "\n".join(batch)
        raw = text.encode("ascii") if ascii_only else b""
        if ascii_only and len(raw.translate(None, CONTROL_BYTES)) == len(raw):
            cps = np.frombuffer(raw.lower() if lowercase else raw, np.uint8)
        else:
            normalized = normalizer.normalize_str(SURROGATES.sub("\ufffd", text))
            cps = np.frombuffer(normalized.encode("utf-32-le"), np.uint32)
        found = np.bincount(cps)
        counts[:len(found)] += found
        in_word = ~word_end[cps]
        inner[cps[1:][in_word[1:] & in_word[:-1]]] = True

    for batch in batches(texts, COUNT_BATCH_CHARS):
        tally([t for t in batch if t.isascii()], True)
        tally([t for t in batch if not t.isascii()], False)
    counts[[ord(c) for c in _WORD_ENDS]] = 0
    seen = np.flatnonzero(counts)
    by_count = seen[np.lexsort((seen, -counts[seen]))]  # most frequent first, then by code point
    kept = np.sort(by_count[:limit_alphabet]).tolist()
    return Alphabet(chars=[chr(c) for c in kept], continuations=[SUBWORD_PREFIX + chr(c) for c in kept if inner[c]],
                    dropped=len(seen) - len(kept), characters=int(counts.sum()))


def train_vocab(files: str | os.PathLike | Iterable[str | os.PathLike], options: VocabOptions, *,
                show_progress: bool, strict: bool, stats: ReadStats | None) -> list[str]:
    """The tokens of a WordPiece vocabulary learned from a corpus, in id order (see `Tokenizer.train`).

    Two passes over the corpus, each with bounded memory: `count_alphabet`, then the engine's trainer.
    """
    o = options
    vocab_size, lowercase, text_field = o.vocab_size, o.lowercase, o.text_field
    stats = stats if stats is not None else ReadStats()
    paths = expand_inputs(files, stats)
    bar = progress_reporter(sum(p.stat().st_size for p in paths), desc="characters", unit="B",
                            enabled=show_progress)
    alphabet = count_alphabet(read_sentences(paths, stats, text_field=text_field, progress=bar), lowercase=lowercase,
                              limit_alphabet=o.limit_alphabet)
    bar.close()
    if not alphabet.chars:
        raise BertforgeError(f"no text to learn from in {len(paths)} corpus file(s) ({stats.skipped_note()}): "
                             "check the corpus paths")
    initial = alphabet.initial_tokens
    if strict and vocab_size < len(initial):
        raise BertforgeError(
            f"vocab size {vocab_size} is too small for this corpus: the {len(SPECIAL_TOKENS)} special tokens, "
            f"{len(alphabet.chars)} characters and {len(alphabet.continuations)} ## forms of them already make "
            f"{len(initial)} tokens; ask for at least {len(initial)} (more to learn any word pieces), or keep "
            f"fewer characters with a lower limit_alphabet (--limit-alphabet)")
    tk = tokenizers.Tokenizer(wordpiece())
    tk.normalizer, tk.pre_tokenizer = pipeline(lowercase)
    # The initial tokens as the trainer's "special tokens" make it number them first, in this order; the
    # initial alphabet with a limit of its own size keeps exactly these characters.
    # Each merge joins two symbols of a word, so a corpus of n word characters allows fewer than n merges: a
    # larger size changes nothing but what the engine reserves.
    trainer = trainers.WordPieceTrainer(
        vocab_size=min(vocab_size, len(initial) + alphabet.characters), min_frequency=o.min_frequency,
        special_tokens=initial, initial_alphabet=alphabet.chars, limit_alphabet=len(alphabet.chars),
        continuing_subword_prefix=SUBWORD_PREFIX, show_progress=show_progress)
    # What the first pass read; its stats are already counted.
    texts = read_sentences(paths, ReadStats(), text_field=text_field)
    tk.train_from_iterator(engine_inputs(texts, ENGINE_BATCH_CHARS), trainer=trainer)
    by_id = sorted(tk.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    vocab = [tok for tok, _ in by_id]
    # An engine that numbered tokens itself (an engine bug, or a character the count missed) would bring
    # the hash order back: refuse rather than write a vocabulary that differs from run to run.
    learned = vocab[len(initial):]
    if ([i for _, i in by_id] != list(range(len(by_id))) or vocab[:len(initial)] != initial
            or any(t.startswith(SUBWORD_PREFIX) and len(t) == len(SUBWORD_PREFIX) + 1 for t in learned)):
        raise RuntimeError("the engine's trained vocabulary does not start with the initial tokens in order")
    return vocab


def batches(texts: Iterable[str], max_chars: int) -> Iterator[list[str]]:
    """Consecutive texts in lists of about `max_chars` characters (more when one text is longer)."""
    batch: list[str] = []
    size = 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= max_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def engine_inputs(texts: Iterable[str], max_chars: int) -> Iterator[str]:
    """Texts joined by newlines (a space to the normalizer, so no word spans two texts) into engine inputs of
    about `max_chars`, lone surrogates replaced (see engine.SURROGATES)."""
    for batch in batches(texts, max_chars):
        text = "\n".join(batch)
        yield text if text.isascii() else SURROGATES.sub("\ufffd", text)

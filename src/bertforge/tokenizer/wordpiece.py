"""The Tokenizer: BERT's WordPiece tokenization (see the package docstring), loading and saving, encoding single
texts, pairs and batches, and decoding."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

from bertforge.corpus import ReadStats
from bertforge.errors import BertforgeError
from bertforge.files import write_json, write_text
from bertforge.tokenizer.encoding import BatchEncoding, Encoding, join_segments
from bertforge.tokenizer.engine import NOT_FAST, SURROGATES, backend
from bertforge.tokenizer.training import VocabOptions, train_vocab
from bertforge.tokenizer.truncation import truncated_lengths, truncation_strategy
from bertforge.tokenizer.vocab import (
    CLS,
    MASK,
    PAD,
    SEP,
    SPECIAL_TOKENS,
    SUBWORD_PREFIX,
    UNK,
    check_recorded_fingerprint,
    declared_lowercase,
    fingerprint,
    read_vocab,
)

_CHUNK_CACHE_SIZE = 1 << 18  # whitespace-separated chunks whose ids `Tokenizer._fast_ids` keeps (about 50 MB);
# the cache is emptied when a batch would overflow it. English prose: 33k distinct chunks in 8,000 paragraphs.
_CHUNK_GROUP = 256  # chunks per engine input when filling that cache


class Tokenizer:
    """BERT WordPiece tokenizer: `Tokenizer.train(...)`, `Tokenizer.from_pretrained(dir)`, `encode(...)`.

    `vocab` is the list of tokens (index = id); `lowercase` says whether text is lowercased and stripped of
    accents first (an "uncased" vocabulary). Picklable: worker processes get a copy without rebuilding.
    """

    def __init__(self, vocab: Sequence[str], *, lowercase: bool, _backend_json: str | None = None):
        vocab = list(vocab)
        missing = [t for t in SPECIAL_TOKENS if t not in vocab]
        if missing:
            raise BertforgeError(f"the vocabulary lacks the special token(s) {' '.join(missing)}; "
                                 "use a BERT vocab.txt or train one with `bertforge vocab train`")
        self.vocab = vocab
        self.lowercase = bool(lowercase)
        self._ids = {tok: i for i, tok in enumerate(vocab)}
        self._tk = (tokenizers.Tokenizer.from_str(_backend_json) if _backend_json is not None
                    else backend(vocab, self.lowercase))
        self._tk_fast = tokenizers.Tokenizer.from_str(self._tk.to_str())
        self._tk_fast.normalizer = None
        self._chunk_ids: dict[str, list[int]] = {}  # see _fast_ids
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (self._ids[t] for t in SPECIAL_TOKENS)
        self.special_ids = frozenset((self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id))
        self.is_subword = np.array([t.startswith(SUBWORD_PREFIX) and len(t) > len(SUBWORD_PREFIX)
                                    for t in vocab], dtype=bool)
        self.fingerprint = fingerprint(vocab, self.lowercase)

    # -- construction ------------------------------------------------------------------------------------

    @classmethod
    def train(cls, files: str | os.PathLike | Iterable[str | os.PathLike], options: VocabOptions | None = None, *,
              show_progress: bool = True, strict: bool = False, stats: ReadStats | None = None) -> Tokenizer:
        """Learn a WordPiece vocabulary from a corpus as `options` say (default: VocabOptions(), BERT's 30522
        tokens, uncased): files, directories or globs, read as `prepare` reads them (`bertforge.corpus`); `stats`
        (if given) counts what reading found and skipped.

            Tokenizer.train(["texts/"], VocabOptions(vocab_size=8000, min_frequency=1), show_progress=False)

        The same corpus and options give the same vocabulary, token for token, in every run. The result has
        fewer than `vocab_size` tokens when the corpus has no more pairs seen `min_frequency` times. A
        `vocab_size` below what the alphabet alone needs (the special tokens, the `limit_alphabet` most frequent
        characters and their ## forms) gives that alphabet, larger than asked; strict=True refuses it with a
        BertforgeError instead, before the vocabulary is learned. See `bertforge.tokenizer.training`.
        """
        options = options if options is not None else VocabOptions()
        vocab = train_vocab(files, options, show_progress=show_progress, strict=strict, stats=stats)
        return cls(vocab, lowercase=options.lowercase)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, lowercase: bool | None = None) -> Tokenizer:
        """Load a model/tokenizer directory (vocab.txt, optionally tokenizer.json/tokenizer_config.json) or a
        bare vocab.txt. `lowercase=None` detects the casing: the config files say it, or else a vocab without
        uppercase tokens is uncased. A lowercase vocab cannot be used cased (`lowercase=False` raises)."""
        path = Path(path)
        if path.is_dir():
            directory, vocab_file = path, path / "vocab.txt"
            if not vocab_file.is_file():
                raise BertforgeError(f"no vocab.txt in {path}: pass a model or tokenizer directory, or train "
                                     "one with `bertforge vocab train`")
        elif path.is_file():
            directory, vocab_file = None, path
        else:
            raise BertforgeError(f"tokenizer not found: {path} (pass a directory holding vocab.txt, or the file)")
        vocab = read_vocab(vocab_file)
        uncased_vocab = not any(t != t.lower() for t in vocab if not (t.startswith("[") and t.endswith("]")))
        if lowercase is None:
            declared = declared_lowercase(directory) if directory is not None else None
            lowercase = uncased_vocab if declared is None else declared
        if not lowercase and uncased_vocab:
            raise BertforgeError(f"{vocab_file} has no uppercase tokens, so it is a lowercase (uncased) "
                                 "vocabulary and cased text would mostly become [UNK]: load it with "
                                 "lowercase=True, or train a cased one with `bertforge vocab train --cased`")
        if directory is not None:
            check_recorded_fingerprint(directory, vocab)
        return cls(vocab, lowercase=lowercase)

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """Write vocab.txt (one token per line), tokenizer.json and tokenizer_config.json, each atomically.

        transformers' BertTokenizer/AutoTokenizer can load the directory.
        """
        directory = Path(directory)
        write_text(directory / "vocab.txt", "".join(t + "\n" for t in self.vocab))
        write_text(directory / "tokenizer.json", self._tk.to_str())
        write_json(directory / "tokenizer_config.json", {
            "tokenizer_class": "BertTokenizer", "do_lower_case": self.lowercase, "strip_accents": None,
            "tokenize_chinese_chars": True, "pad_token": PAD, "unk_token": UNK, "cls_token": CLS,
            "sep_token": SEP, "mask_token": MASK, "bertforge_fingerprint": self.fingerprint})

    def __getstate__(self) -> dict[str, Any]:
        return {"vocab": self.vocab, "lowercase": self.lowercase, "backend": self._tk.to_str()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["vocab"], lowercase=state["lowercase"], _backend_json=state["backend"])

    # -- vocabulary --------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def __len__(self) -> int:
        return len(self.vocab)

    def __repr__(self) -> str:
        casing = "uncased" if self.lowercase else "cased"
        return f"Tokenizer(vocab_size={self.vocab_size}, {casing}, fingerprint={self.fingerprint})"

    def id_to_token(self, i: int) -> str:
        return self.vocab[i]

    def token_to_id(self, tok: str) -> int | None:
        return self._ids.get(tok)

    def check_compatible(self, config: Any) -> None:
        """Raise BertforgeError unless a model config (anything with .vocab_size) fits this vocabulary."""
        if config.vocab_size != self.vocab_size:
            raise BertforgeError(
                f"the model has {config.vocab_size} token embeddings but the tokenizer has {self.vocab_size} "
                "tokens: use the tokenizer the model was trained with (its directory's vocab.txt), or set the "
                f"model's vocab_size to {self.vocab_size}")

    # -- encoding ----------------------------------------------------------------------------------------

    def tokenize_ids(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text: no special tokens, no truncation, no offsets (see `_token_ids`)."""
        return self._token_ids(texts)

    def tokenize_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """`tokenize_ids` of all texts as one array, and each text's token count (corpus preparation)."""
        ids = self._token_ids(texts)
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        return np.fromiter(itertools.chain.from_iterable(ids), np.int64, int(lengths.sum())), lengths

    def encode(self, text: str, pair: str | None = None, *, max_length: int | None = None,
               truncation: bool | str = True, add_special_tokens: bool = True) -> Encoding:
        """Encode a text, or a pair as `[CLS] A [SEP] B [SEP]`.

        truncation: True or "longest_first" (the longer segment first, see `longest_first`),
        "only_second" (question answering: keep the question whole), False (never). It only applies when
        max_length is given; max_length counts the special tokens.
        """
        a, b = self._segments([text]), None if pair is None else self._segments([pair])
        strategy = truncation_strategy(truncation, pair is not None)
        return self._assemble(a[0], None if b is None else b[0], max_length, strategy, add_special_tokens)

    def encode_many(self, texts: Sequence[str], pairs: Sequence[str] | None = None, *,
                    max_length: int | None = None, truncation: bool | str = True,
                    add_special_tokens: bool = True) -> list[Encoding]:
        """`encode` for many texts (or pairs) at once, on all cores: unpadded, with offsets and word ids."""
        texts, pairs, strategy = self._batch_inputs(texts, pairs, truncation)
        a_all = self._segments(texts)
        b_all = [None] * len(texts) if pairs is None else self._segments(pairs)
        return [self._assemble(a, b, max_length, strategy, add_special_tokens)
                for a, b in zip(a_all, b_all, strict=True)]

    def encode_batch(self, texts: Sequence[str], pairs: Sequence[str] | None = None, *,
                     max_length: int | None = None, truncation: bool | str = True,
                     padding: bool | str = "longest", add_special_tokens: bool = True) -> BatchEncoding:
        """Model inputs for many texts (or pairs) at once, on all cores; pad per `padding`.

        padding: "longest" (to the longest in the batch), "max_length" (to max_length), False (ragged).
        The ids come from the engine's pass without offset bookkeeping; `.encodings` (offsets, word ids,
        tokens per item) costs a second pass, made on first access: call `encode_many` when you need only those.
        """
        texts, pairs, strategy = self._batch_inputs(texts, pairs, truncation)
        if padding is True:
            padding = "longest"
        if padding not in ("longest", "max_length", False):
            raise ValueError(f"padding must be 'longest', 'max_length' or False, not {padding!r}")
        if padding == "max_length" and max_length is None:
            raise ValueError("padding='max_length' needs max_length")
        a_ids = self._token_ids(texts)
        b_ids = None if pairs is None else self._token_ids(pairs)
        len_a, len_b = [], None if b_ids is None else []
        for i, a in enumerate(a_ids):
            la, lb = self._lengths(len(a), None if b_ids is None else len(b_ids[i]), max_length, strategy,
                                   add_special_tokens)
            len_a.append(la)
            if len_b is not None:
                len_b.append(lb)
        batch = BatchEncoding(a_ids, b_ids, len_a, len_b,
                              specials=(self.cls_id, self.sep_id) if add_special_tokens else None, width=None,
                              pad_id=self.pad_id,
                              encodings=lambda: self.encode_many(texts, pairs, max_length=max_length,
                                                                 truncation=truncation,
                                                                 add_special_tokens=add_special_tokens))
        if padding:
            batch.width = max_length if padding == "max_length" else batch.longest
        return batch

    @staticmethod
    def _batch_inputs(texts: Sequence[str], pairs: Sequence[str] | None,
                      truncation: bool | str) -> tuple[list[str], list[str] | None, str | None]:
        texts = list(texts)
        pairs = None if pairs is None else list(pairs)
        if pairs is not None and len(pairs) != len(texts):
            raise ValueError(f"got {len(texts)} texts but {len(pairs)} pairs")
        return texts, pairs, truncation_strategy(truncation, pairs is not None)

    def _token_ids(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text without special tokens: fast-path texts (see `_segments`) through
        `_fast_ids`, the others through the engine."""
        fast = self._is_fast(texts)
        if all(fast):
            return self._fast_ids(texts)
        out: list = [None] * len(texts)
        idx = [i for i, f in enumerate(fast) if f]
        for i, ids in zip(idx, self._fast_ids([texts[i] for i in idx]), strict=True):
            out[i] = ids
        idx = [i for i, f in enumerate(fast) if not f]
        for i, enc in zip(idx, self._segments([texts[i] for i in idx], offsets=False), strict=True):
            out[i] = enc.ids
        return out

    def _fast_ids(self, texts: list[str]) -> list[list[int]]:
        """Token ids of fast-path texts, by whitespace-separated chunk from a cache that the engine fills.

        In a fast-path text every space, tab, newline and CR ends a word and nothing else is whitespace (see
        `NOT_FAST`), so `str.split()` cuts the text where the pre-tokenizer would, and a chunk ("citizens,")
        tokenizes alone as it does in context. Each distinct chunk goes through the engine once; after that a
        text costs a split and one dict lookup per chunk, in C (about 3x faster than the engine on English).
        """
        cache = self._chunk_ids
        chain, get = itertools.chain.from_iterable, cache.__getitem__

        def looked_up() -> list[list[int]]:  # raises KeyError for a chunk not in the cache
            return [list(chain(map(get, t.split()))) for t in texts]

        try:
            return looked_up()
        except KeyError:  # a chunk not seen before: fill the cache with all of this batch's new ones
            pass
        chunks = set(chain(t.split() for t in texts))
        missing = chunks.difference(cache)
        if len(cache) + len(missing) > _CHUNK_CACHE_SIZE:
            cache.clear()
            missing = chunks
        missing = list(missing)
        lowered = [c.lower() for c in missing] if self.lowercase else missing
        # One engine result per chunk would cost more than the tokenization: chunks go in groups joined by
        # " [SEP] " (they hold no "[", so every [SEP] in the result is a separator).
        groups = [" [SEP] ".join(lowered[i:i + _CHUNK_GROUP]) + " [SEP]" for i in range(0, len(lowered), _CHUNK_GROUP)]
        ids = np.fromiter(itertools.chain.from_iterable(
            e.ids for e in self._tk_fast.encode_batch_fast(groups, add_special_tokens=False)), np.int64)
        ends = np.flatnonzero(ids == self.sep_id)
        for chunk, a, b in zip(missing, (ends - np.diff(ends, prepend=-1) + 1).tolist(), ends.tolist(), strict=True):
            cache[chunk] = ids[a:b].tolist()
        try:
            return looked_up()
        except KeyError:  # another thread emptied the cache meanwhile: the engine alone, for this batch
            return [e.ids for e in self._segments(texts, offsets=False)]

    @staticmethod
    def _is_fast(texts: list[str]) -> list[bool]:
        try:
            return [t.isascii() and len(t.encode().translate(None, NOT_FAST)) == len(t) for t in texts]
        except AttributeError:
            raise TypeError(f"texts must be strings, got {sorted({type(t).__name__ for t in texts})}") from None

    def _segments(self, texts: list[str], *, offsets: bool = True) -> list[tokenizers.Encoding]:
        """Engine encodings of texts, without special tokens, on all cores.

        Fast path: for ASCII text without control characters or "[", the whole normalizer reduces to
        lowercasing (NFC, NFD, accents and sigma change nothing; tab/newline/CR split words in the
        pre-tokenizer), which Python does one-to-one, so offsets still index the original. A twin engine
        without normalizer takes those texts: about 2x faster on English. offsets=False skips the offset
        bookkeeping (the results' `.offsets` are then meaningless).
        """
        fast = self._is_fast(texts)
        method = "encode_batch" if offsets else "encode_batch_fast"
        out: list = [None] * len(texts)
        for engine, route in ((self._tk_fast, True), (self._tk, False)):
            idx = [i for i, f in enumerate(fast) if f is route]
            if not idx:
                continue
            batch = [texts[i] for i in idx]
            if route and self.lowercase:
                batch = [t.lower() for t in batch]
            elif not route:
                batch = [SURROGATES.sub("\ufffd", t) for t in batch]
            for i, enc in zip(idx, getattr(engine, method)(batch, add_special_tokens=False), strict=True):
                out[i] = enc
        return out

    @staticmethod
    def _lengths(len_a: int, len_b: int | None, max_length: int | None, strategy: str | None,
                 add_special_tokens: bool) -> tuple[int, int | None]:
        """Segment lengths after truncation (see `truncated_lengths`)."""
        n_special = (2 if len_b is None else 3) if add_special_tokens else 0
        return truncated_lengths(len_a, len_b, max_length, strategy, n_special)

    def _assemble(self, a: tokenizers.Encoding, b: tokenizers.Encoding | None, max_length: int | None,
                  strategy: str | None, add_special_tokens: bool) -> Encoding:
        """Truncate the special-free segment encodings by the reference's rule, then add [CLS]/[SEP]."""
        len_a, len_b = self._lengths(len(a.ids), None if b is None else len(b.ids), max_length, strategy,
                                     add_special_tokens)
        specials = (self.cls_id, self.sep_id) if add_special_tokens else None
        ids, type_ids = join_segments(a.ids[:len_a], None if b is None else b.ids[:len_b], specials)
        edge = [None] if add_special_tokens else []  # what the [CLS]/[SEP] positions get
        offsets, words = a.offsets[:len_a], a.word_ids[:len_a]
        if add_special_tokens:
            offsets, words = [(0, 0), *offsets, (0, 0)], [None, *words, None]
        if b is not None:
            offsets += b.offsets[:len_b] + [(0, 0)] * len(edge)
            words += b.word_ids[:len_b] + edge
        tokens = [self.vocab[i] for i in ids]
        return Encoding(ids, type_ids, [1] * len(ids), offsets, words, tokens)

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of token ids, as the reference decodes: tokens joined by spaces, `##` pieces glued to their
        word, then the spaces before . ? ! , and English contractions removed ("it ' s" -> "it's").

        Ids outside the vocabulary decode as [UNK]. (The engine's own decoder cleans token by token, so it
        leaves "it ' s" alone; hence this is done here.)
        """
        n = len(self.vocab)
        skip = self.special_ids if skip_special_tokens else frozenset()
        tokens = [self.vocab[i] if 0 <= i < n else UNK for i in map(int, ids) if i not in skip]
        text = " ".join(tokens).replace(" " + SUBWORD_PREFIX, "").strip()
        for before, after in _DECODE_CLEANUP:
            text = text.replace(before, after)
        return text


# The reference's clean_up_tokenization, applied in this order.
_DECODE_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                   (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))

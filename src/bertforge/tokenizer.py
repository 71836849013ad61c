"""WordPiece tokenization identical to BERT's reference tokenizer, run by the Rust `tokenizers` engine.

The pipeline is Google's `tokenization.py` (as ported by transformers' `BertTokenizerLegacy`), step by step:

1. drop NUL, U+FFFD and every character of Unicode category C* (control, format, unassigned, private use),
   except tab, newline and carriage return;
2. tab, newline, carriage return and Zs become a space (so do Zl/Zp, which Python's `str.split` breaks on);
3. NFC;
4. uncased only: lowercase (with Python's final-sigma rule), NFD, then drop non-spacing marks (Mn);
5. split on spaces and isolate every punctuation character (ASCII symbols and Unicode P*) and CJK ideograph;
6. greedy longest-match-first WordPiece with `##` continuations; a word over 100 characters, or one the
   vocabulary cannot spell, becomes a single [UNK].

The character classes are generated from Python's `unicodedata` (the tables the reference uses) and handed to
the engine as regular expressions. The engine's built-in BertNormalizer/BertPreTokenizer are not used: their
Unicode tables are older, and a sweep over every code point found 830k disagreements with the reference
(unassigned code points kept instead of dropped, newer punctuation not split, a shifted CJK range, no NFC).
So the tokenization of code points that a newer Python assigns can differ between Python versions, exactly
as the reference's does. ASCII text without control characters skips the normalizer (`Tokenizer._segments`).

Conventions:
- ids index `vocab` (the line number in vocab.txt); [PAD] [UNK] [CLS] [SEP] [MASK] must be in the vocab.
- Sequences are `[CLS] A [SEP]` and `[CLS] A [SEP] B [SEP]`; type ids 0 up to and including the first [SEP], 1 after.
- `offsets` are (start, end) character indices into the original string of the token's own segment
  (A or B); special tokens added around the segments get (0, 0).
- `word_ids` number the words (pre-tokens: a run of characters other than spaces, punctuation and CJK, or
  one punctuation character or CJK ideograph) within their own segment, from 0; None for the special tokens
  added around the segments. The pieces of an [UNK] word share one word id like any other.
- Truncation follows the reference (transformers' `truncate_sequences`), not the engine's: longest-first
  cuts the longer segment down to the shorter, then splits what remains, the odd token coming from B.
- Batches are padded on the right with [PAD], type id 0 and attention mask 0 (1 = real token).
- Special tokens written in the text ("[MASK]") are recognised as such, before any normalisation.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import gzip
import hashlib
import inspect
import itertools
import json
import os
import re
import sys
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
import torch
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers

from bertforge.errors import BertforgeError
from bertforge.io import cache_dir, write_json, write_text

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
SPECIAL_TOKENS = (PAD, UNK, CLS, SEP, MASK)  # the order `train` gives them: [PAD] = 0
MAX_WORD_CHARS = 100  # longer words become [UNK], as in the reference
SUBWORD_PREFIX = "##"

# CJK Unified Ideographs blocks, exactly the reference's list (the engine's own list differs at U+2B820).
_CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
               (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))
# ASCII symbols the reference splits although Unicode does not call them punctuation ("$", "^", "`", ...).
_ASCII_PUNCT_RANGES = ((33, 47), (58, 64), (91, 96), (123, 126))


# ---------------------------------------------------------------------------------------------------------
# The pipeline


_CLASS_NAMES = ("control", "space", "mark", "split", "cased", "case_ignorable")


@functools.cache
def _unicode_classes() -> dict[str, str]:
    """Regex character classes (Oniguruma syntax) built from this Python's Unicode tables.

    Keys: control (dropped), space (becomes " "), mark (Mn, dropped when uncased), split (isolated:
    punctuation and CJK), cased and case_ignorable (the context of Python's final-sigma rule). Building
    them takes about 0.3 s, so they are kept in the cache directory, keyed by the Unicode version and a hash
    of the code that builds them; unpickled tokenizers do not need them at all.
    """
    source = inspect.getsource(_build_unicode_classes) + inspect.getsource(_char_class) + repr(
        (_CJK_RANGES, _ASCII_PUNCT_RANGES))
    key = hashlib.sha256(f"{unicodedata.unidata_version} {sys.maxunicode} {source}".encode()).hexdigest()[:16]
    path = cache_dir() / f"unicode-classes-{key}.json"
    with contextlib.suppress(OSError, ValueError):
        cached = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(cached, dict) and set(cached) == set(_CLASS_NAMES) and all(
                isinstance(v, str) for v in cached.values()):
            return cached
    classes = _build_unicode_classes()
    with contextlib.suppress(OSError):  # a read-only home only costs the 0.3 s again next time
        write_json(path, classes)
    return classes


def _build_unicode_classes() -> dict[str, str]:
    n = sys.maxunicode + 1
    flags = {name: bytearray(n) for name in ("control", "space", "mark", "split")}
    letters: list[tuple[int, int]] = []  # runs that can hold cased or case-ignorable characters
    start = 0
    for cat, run in itertools.groupby(map(unicodedata.category, map(chr, range(n)))):
        end = start + sum(1 for _ in run)
        ones = b"\x01" * (end - start)
        if cat[0] == "C":
            flags["control"][start:end] = ones
        elif cat[0] == "Z":
            flags["space"][start:end] = ones  # Zs per the reference; Zl and Zp because str.split() splits there
        else:
            letters.append((start, end))
            if cat == "Mn":
                flags["mark"][start:end] = ones
            elif cat[0] == "P":
                flags["split"][start:end] = ones
        start = end
    for cp in (9, 10, 13):
        flags["control"][cp], flags["space"][cp] = 0, 1
    flags["control"][0xFFFD] = 1
    flags["control"][0xD800:0xE000] = bytes(0xE000 - 0xD800)  # surrogates cannot reach the engine anyway
    for lo, hi in _ASCII_PUNCT_RANGES + _CJK_RANGES:
        flags["split"][lo:hi + 1] = b"\x01" * (hi + 1 - lo)
    # Python lowercases a capital sigma to final "ς" when the nearest non-case-ignorable character before it
    # is cased and the nearest one after it is not. Probing str.lower() itself gives exactly its own sets.
    cased, ignorable = bytearray(n), bytearray(n)
    for lo, hi in letters:
        for cp in range(lo, hi):
            c = chr(cp)
            if (c + "Σ").lower()[-1] == "ς":
                cased[cp] = 1
            elif ("A" + c + "Σ").lower()[-1] == "ς":
                ignorable[cp] = 1
    flags["cased"], flags["case_ignorable"] = cased, ignorable
    return {name: _char_class(f) for name, f in flags.items()}


def _char_class(flags: bytearray) -> str:
    parts = []
    for m in re.finditer(rb"\x01+", flags):
        lo, hi = m.start(), m.end() - 1
        parts.append(f"\\x{{{lo:X}}}" if lo == hi else f"\\x{{{lo:X}}}-\\x{{{hi:X}}}")
    return "[" + "".join(parts) + "]"


def _pipeline(lowercase: bool) -> tuple[normalizers.Normalizer, pre_tokenizers.PreTokenizer]:
    """The reference's basic tokenization as an engine normalizer and pre-tokenizer."""
    u = _unicode_classes()
    steps = [normalizers.Replace(Regex(u["control"]), ""), normalizers.Replace(Regex(u["space"]), " "),
             normalizers.NFC()]
    if lowercase:
        # \K (keep) rather than a look-behind: Oniguruma's variable-length look-behind rescans the text
        # before every match, quadratic on long uppercase Greek.
        final_sigma = f"{u['cased']}{u['case_ignorable']}*\\K\u03a3(?!{u['case_ignorable']}*{u['cased']})"
        steps += [normalizers.Replace(Regex(final_sigma), "\u03c2"), normalizers.Lowercase(), normalizers.NFD(),
                  # The engine's NFD tables miss this Unicode 13 decomposition (Dives Akuru vowel sign O).
                  normalizers.Replace("\U00011938", "\U00011935\U00011930"),
                  normalizers.Replace(Regex(u["mark"]), "")]
    else:
        steps.append(normalizers.Replace("\U00011935\U00011930", "\U00011938"))  # ... nor its composition
    split = u["split"]
    # One regex pass: a word is a run of characters that are neither space nor split characters; each split
    # character is a word of its own. invert=True keeps the matches and drops the rest (the spaces).
    # Tab, newline and CR separate words too, for the fast path's un-normalized text (see Tokenizer._segments).
    words = pre_tokenizers.Split(Regex(f"[^ \\t\\n\\r{split[1:-1]}]+|{split}"), behavior="removed", invert=True)
    return normalizers.Sequence(steps), words


# ASCII text without these takes the fast path (see Tokenizer._segments): control characters need the
# normalizer to drop them, and "[" may open a special token, which is matched before lowercasing.
# As bytes for `bytes.translate`, which finds them about 4x faster than a regex search.
_NOT_FAST = bytes([*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F, ord("[")])
# Lone surrogates (from JSON escapes such as "\ud800") cannot enter the engine; the reference drops them (Cs),
# so they become U+FFFD, which it drops too: one character for one, offsets unchanged.
_SURROGATES = re.compile("[\ud800-\udfff]")
_CHUNK_CACHE_SIZE = 1 << 18  # whitespace-separated chunks whose ids `Tokenizer._fast_ids` keeps (about 50 MB);
# the cache is emptied when a batch would overflow it. English prose: 33k distinct chunks in 8,000 paragraphs.
_CHUNK_GROUP = 256  # chunks per engine input when filling that cache


def _backend(vocab: Sequence[str], lowercase: bool) -> tokenizers.Tokenizer:
    """The engine tokenizer for a vocabulary: pipeline, WordPiece, special tokens, post-processor, decoder."""
    ids = {tok: i for i, tok in enumerate(vocab)}  # a duplicated token keeps its last line, like the reference
    tk = tokenizers.Tokenizer(models.WordPiece(ids, unk_token=UNK, max_input_chars_per_word=MAX_WORD_CHARS,
                                               continuing_subword_prefix=SUBWORD_PREFIX))
    tk.normalizer, tk.pre_tokenizer = _pipeline(lowercase)
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    # We add [CLS]/[SEP] ourselves (see Tokenizer.encode); the template is for other readers of tokenizer.json.
    tk.post_processor = processors.TemplateProcessing(
        single=f"{CLS} $A {SEP}", pair=f"{CLS} $A {SEP} $B:1 {SEP}:1",
        special_tokens=[(CLS, ids[CLS]), (SEP, ids[SEP])])
    tk.decoder = decoders.WordPiece(prefix=SUBWORD_PREFIX, cleanup=True)
    return tk


def _truncated_lengths(len_a: int, len_b: int | None, excess: int, strategy: str) -> tuple[int, int | None]:
    """Segment lengths after removing `excess` tokens, by the reference's rule.

    longest_first: first cut the longer segment down to the shorter one, then take half of the rest from
    each, the odd token from B (`ceil` from B, `floor` from A). only_second: all from B.
    """
    if excess <= 0:
        return len_a, len_b
    if len_b is None:
        return max(len_a - excess, 0), None
    if strategy == "only_second":
        if excess > len_b:
            raise ValueError(f"cannot truncate only the second segment: removing {excess} tokens needs more "
                             f"than its {len_b}; shorten the first segment or raise max_length")
        return len_a, len_b - excess
    first = min(abs(len_b - len_a), excess)
    rest = excess - first
    if len_a > len_b:
        cut_a, cut_b = first + rest // 2, rest - rest // 2
    else:
        cut_a, cut_b = rest // 2, first + rest - rest // 2
    return max(len_a - cut_a, 0), max(len_b - cut_b, 0)


# ---------------------------------------------------------------------------------------------------------
# Results


@dataclass
class Encoding:
    """One encoded text or pair. All lists have one entry per token (see the module docstring)."""

    ids: list[int]
    type_ids: list[int]
    attention_mask: list[int]
    offsets: list[tuple[int, int]]
    word_ids: list[int | None]
    tokens: list[str]

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def sequence_ids(self) -> list[int | None]:
        """0 for tokens of A, 1 for tokens of B, None for the special tokens added around them."""
        return [None if w is None else t for w, t in zip(self.word_ids, self.type_ids, strict=True)]


def _join(a: list[int], b: list[int] | None, specials: tuple[int, int] | None) -> tuple[list[int], list[int]]:
    """(ids, type_ids) of `[CLS] a [SEP] b [SEP]` with specials = (cls_id, sep_id), or of a + b without."""
    if specials is not None:
        ids = [specials[0], *a, specials[1]]
        n_a = len(ids)
        if b is not None:
            ids += [*b, specials[1]]
    else:
        ids = list(a) if b is None else [*a, *b]
        n_a = len(a)
    return ids, [0] * n_a + [1] * (len(ids) - n_a)


class BatchEncoding:
    """A batch of model inputs: `ids`, `type_ids`, `attention_mask` are lists of equal-length lists (unless
    padding=False, or a row is longer than max_length with truncation off); `to_tensors()` gives them as
    tensors; `encodings` holds each item unpadded, with its offsets and word ids (computed on first access).

    Rows are assembled when first asked for: `to_tensors()` places the segments, special tokens and padding
    straight into arrays in a few vectorised steps, never building per-row Python lists; `ids` and friends
    build the lists on first read."""

    def __init__(self, a: list[list[int]], b: list[list[int]] | None, len_a: list[int], len_b: list[int] | None,
                 *, specials: tuple[int, int] | None, width: int | None, pad_id: int,
                 encodings: list[Encoding] | Callable[[], list[Encoding]]):
        self._a, self._b, self._len_a, self._len_b = a, b, len_a, len_b  # segments and their truncated lengths
        self._specials = specials  # (cls_id, sep_id), or None without special tokens
        self.width, self.pad_id = width, pad_id  # width None: no padding
        self._lists_cache: tuple[list[list[int]], list[list[int]], list[list[int]]] | None = None
        self._encodings = encodings

    def _rows(self) -> tuple[list[list[int]], list[list[int]]]:
        """Unpadded (ids, type_ids) per item: `[CLS] a [SEP] b [SEP]`, or a + b without special tokens."""
        ids, types = [], []
        b_all = self._b if self._b is not None else [None] * len(self._a)
        lb_all = self._len_b if self._len_b is not None else [0] * len(self._a)
        for a, b, la, lb in zip(self._a, b_all, self._len_a, lb_all, strict=True):
            row, row_types = _join(a[:la], None if b is None else b[:lb], self._specials)
            ids.append(row)
            types.append(row_types)
        return ids, types

    def _lists(self) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
        if self._lists_cache is None:
            rows, types = self._rows()
            width = self.width
            if width is None:
                self._lists_cache = rows, types, [[1] * len(r) for r in rows]
            else:
                # The rows are fresh lists: padded in place, from prebuilt pad rows (0.6x the time of building
                # new padded rows). A row longer than width stays as it is.
                pads, zeros, ones = [self.pad_id] * width, [0] * width, [1] * width
                mask = [ones[:n] + zeros[:width - n] if n <= width else [1] * n for n in map(len, rows)]
                for row, row_types in zip(rows, types, strict=True):
                    if (short := width - len(row)) > 0:
                        row += pads[:short]
                        row_types += zeros[:short]
                self._lists_cache = rows, types, mask
        return self._lists_cache

    @property
    def ids(self) -> list[list[int]]:
        return self._lists()[0]

    @property
    def type_ids(self) -> list[list[int]]:
        return self._lists()[1]

    @property
    def attention_mask(self) -> list[list[int]]:
        return self._lists()[2]

    @property
    def encodings(self) -> list[Encoding]:
        if callable(self._encodings):
            self._encodings = self._encodings()
        return self._encodings

    def __len__(self) -> int:
        return len(self._a)

    def _lengths(self):
        la = np.asarray(self._len_a, dtype=np.int64)
        lb = np.asarray(self._len_b, dtype=np.int64) if self._len_b is not None else np.zeros_like(la)
        n_special = 0 if self._specials is None else (2 if self._b is None else 3)
        return la, lb, la + lb + n_special

    @property
    def longest(self) -> int:
        """Tokens in the longest item, special tokens included."""
        return int(self._lengths()[2].max(initial=0))

    def __repr__(self) -> str:
        longest = self.longest
        return f"BatchEncoding(size={len(self)}, length={longest if self.width is None else max(self.width, longest)})"

    def to_tensors(self) -> dict[str, Any]:
        """{"input_ids", "token_type_ids", "attention_mask"}: torch LongTensors of shape (B, T)."""
        la, lb, lengths = self._lengths()
        width = self.width if self.width is not None else int(lengths.max(initial=0))
        if (lengths > width).any() or (self.width is None and (lengths != width).any()):
            raise ValueError("rows differ in length; encode with padding='longest' or 'max_length' first")
        n, cols = len(la), np.arange(width)
        if n == 0:
            empty = torch.zeros((0, width), dtype=torch.long)
            return {"input_ids": empty, "token_type_ids": empty.clone(), "attention_mask": empty.clone()}
        rows = np.arange(n)
        ids = np.full((n, width), self.pad_id, dtype=np.int64)
        types = np.zeros((n, width), dtype=np.int64)
        start = 0 if self._specials is None else 1  # where segment A begins
        a_end = start + la
        a_cells = (cols >= start) & (cols < a_end[:, None])  # (B, T), row-major like the flattened segments
        ids[a_cells] = np.fromiter(itertools.chain.from_iterable(map(itertools.islice, self._a, self._len_a)),
                                   dtype=np.int64, count=int(la.sum()))
        if self._specials is not None:
            cls, sep = self._specials
            ids[:, 0] = cls
            ids[rows, a_end] = sep
            a_end = a_end + 1
        if self._b is not None:
            b_cells = (cols >= a_end[:, None]) & (cols < (a_end + lb)[:, None])
            ids[b_cells] = np.fromiter(itertools.chain.from_iterable(map(itertools.islice, self._b, self._len_b)),
                                       dtype=np.int64, count=int(lb.sum()))
            types[b_cells] = 1
            if self._specials is not None:
                ids[rows, a_end + lb] = self._specials[1]
                types[rows, a_end + lb] = 1
        mask = (cols < lengths[:, None]).astype(np.int64)
        return {"input_ids": torch.from_numpy(ids), "token_type_ids": torch.from_numpy(types),
                "attention_mask": torch.from_numpy(mask)}


# ---------------------------------------------------------------------------------------------------------
# The tokenizer


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
                    else _backend(vocab, self.lowercase))
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
    def train(cls, files: str | os.PathLike | Iterable[str | os.PathLike], *, vocab_size: int = 30522,
              lowercase: bool = True, min_frequency: int = 2, limit_alphabet: int = 1000,
              show_progress: bool = True) -> Tokenizer:
        """Learn a WordPiece vocabulary from corpus files (paths, directories or globs; see `corpus_files`).

        The corpus is streamed; the engine counts words on all cores. The result may have fewer than
        `vocab_size` tokens when the corpus is small, or more when its alphabet alone is larger.
        """
        if vocab_size <= len(SPECIAL_TOKENS):
            raise BertforgeError(f"vocab size {vocab_size} is too small: it must exceed the "
                                 f"{len(SPECIAL_TOKENS)} special tokens (BERT uses 30522)")
        if min_frequency < 0 or limit_alphabet < 1:
            raise BertforgeError(f"min_frequency must be >= 0 and limit_alphabet >= 1, got {min_frequency} "
                                 f"and {limit_alphabet}")
        paths = corpus_files(files)
        tk = tokenizers.Tokenizer(models.WordPiece(unk_token=UNK, max_input_chars_per_word=MAX_WORD_CHARS,
                                                   continuing_subword_prefix=SUBWORD_PREFIX))
        tk.normalizer, tk.pre_tokenizer = _pipeline(lowercase)
        trainer = trainers.WordPieceTrainer(
            vocab_size=vocab_size, min_frequency=min_frequency, limit_alphabet=limit_alphabet,
            special_tokens=list(SPECIAL_TOKENS), continuing_subword_prefix=SUBWORD_PREFIX,
            show_progress=show_progress)
        tk.train_from_iterator(_batches(iter_corpus_texts(paths), 1000), trainer=trainer)
        by_id = sorted(tk.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
        if [i for _, i in by_id] != list(range(len(by_id))):
            raise RuntimeError("trained vocabulary ids are not contiguous")  # an engine bug, not user error
        return cls([tok for tok, _ in by_id], lowercase=lowercase)

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
        vocab = _read_vocab(vocab_file)
        uncased_vocab = not any(t != t.lower() for t in vocab if not (t.startswith("[") and t.endswith("]")))
        if lowercase is None:
            declared = _declared_lowercase(directory) if directory is not None else None
            lowercase = uncased_vocab if declared is None else declared
        if not lowercase and uncased_vocab:
            raise BertforgeError(f"{vocab_file} has no uppercase tokens, so it is a lowercase (uncased) "
                                 "vocabulary and cased text would mostly become [UNK]: load it with "
                                 "lowercase=True, or train a cased one with `bertforge vocab train --cased`")
        if directory is not None:
            _check_recorded_fingerprint(directory, vocab)
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

        truncation: True or "longest_first" (the longer segment first, see `_truncated_lengths`),
        "only_second" (question answering: keep the question whole), False (never). It only applies when
        max_length is given; max_length counts the special tokens.
        """
        a, b = self._segments([text]), None if pair is None else self._segments([pair])
        strategy = _strategy(truncation, pair is not None)
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
        return texts, pairs, _strategy(truncation, pairs is not None)

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
        `_NOT_FAST`), so `str.split()` cuts the text where the pre-tokenizer would, and a chunk ("citizens,")
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
            return [t.isascii() and len(t.encode().translate(None, _NOT_FAST)) == len(t) for t in texts]
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
                batch = [_SURROGATES.sub("\ufffd", t) for t in batch]
            for i, enc in zip(idx, getattr(engine, method)(batch, add_special_tokens=False), strict=True):
                out[i] = enc
        return out

    def _lengths(self, len_a: int, len_b: int | None, max_length: int | None, strategy: str | None,
                 add_special_tokens: bool) -> tuple[int, int | None]:
        """Segment lengths after truncation (see `_truncated_lengths`)."""
        if strategy is None or max_length is None:
            return len_a, len_b
        n_special = (2 if len_b is None else 3) if add_special_tokens else 0
        if max_length < n_special:
            raise ValueError(f"max_length {max_length} leaves no room for the {n_special} special tokens")
        return _truncated_lengths(len_a, len_b, len_a + (len_b or 0) + n_special - max_length, strategy)


    def _assemble(self, a: tokenizers.Encoding, b: tokenizers.Encoding | None, max_length: int | None,
                  strategy: str | None, add_special_tokens: bool) -> Encoding:
        """Truncate the special-free segment encodings by the reference's rule, then add [CLS]/[SEP]."""
        len_a, len_b = self._lengths(len(a.ids), None if b is None else len(b.ids), max_length, strategy,
                                     add_special_tokens)
        specials = (self.cls_id, self.sep_id) if add_special_tokens else None
        ids, type_ids = _join(a.ids[:len_a], None if b is None else b.ids[:len_b], specials)
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


def _strategy(truncation: bool | str | None, is_pair: bool) -> str | None:
    if truncation is True or truncation == "longest_first":
        return "longest_first"
    if truncation is False or truncation is None:
        return None
    if truncation == "only_second":
        if not is_pair:
            raise ValueError("truncation='only_second' needs a pair of texts")
        return "only_second"
    raise ValueError(f"truncation must be True, False, 'longest_first' or 'only_second', not {truncation!r}")


def _read_vocab(path: Path) -> list[str]:
    """vocab.txt: one token per line (Google format); a final newline is optional, CRLF is tolerated."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise BertforgeError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); a vocab.txt has one "
                             "token per line") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    vocab = [line[:-1] if line.endswith("\r") else line for line in lines]
    if not vocab:
        raise BertforgeError(f"{path} is empty; a vocab.txt has one token per line")
    return vocab


def fingerprint(vocab: Sequence[str], lowercase: bool) -> str:
    """The tokenizer's identity: 16 hex digits of a SHA-256 over its normalisation (cased/uncased) and its
    vocabulary in id order. Two vocabularies of the same size with one token moved differ. Prepared data
    (manifest.json) and model directories (tokenizer_config.json, `bertforge_fingerprint`) record it."""
    digest = hashlib.sha256(("uncased" if lowercase else "cased").encode())
    digest.update("\n".join(vocab).encode("utf-8"))
    return digest.hexdigest()[:16]


def recorded_fingerprint(directory: Path) -> str | None:
    """The fingerprint a directory's tokenizer_config.json records; None for directories written before it was
    recorded, and for other tools' directories."""
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        value = json.loads(config.read_text(encoding="utf-8")).get("bertforge_fingerprint")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _check_recorded_fingerprint(directory: Path, vocab: Sequence[str]) -> None:
    """A vocab.txt edited, shuffled or replaced after the directory was written would give every token the
    wrong id without any other sign: refuse it."""
    recorded = recorded_fingerprint(directory)
    if recorded is None:
        return
    declared = _declared_lowercase(directory)
    found = fingerprint(vocab, True if declared is None else declared)
    if found != recorded:
        raise BertforgeError(f"{directory / 'vocab.txt'} has tokenizer fingerprint {found}, but "
                             f"{directory / 'tokenizer_config.json'} records {recorded}: the vocabulary was changed "
                             f"after the directory was written, so token ids would not match the weights; restore "
                             f"the directory's own vocab.txt")


def _declared_lowercase(directory: Path) -> bool | None:
    """The casing a model directory's tokenizer_config.json or tokenizer.json declares, if any."""
    config = directory / "tokenizer_config.json"
    if config.is_file():
        value = json.loads(config.read_text(encoding="utf-8")).get("do_lower_case")
        if isinstance(value, bool):
            return value
    spec = directory / "tokenizer.json"
    if spec.is_file():
        norm = json.loads(spec.read_text(encoding="utf-8")).get("normalizer") or {}
        if norm.get("type") == "BertNormalizer":
            return bool(norm.get("lowercase", True))
        if norm.get("type") == "Sequence":
            return any(step.get("type") == "Lowercase" for step in norm.get("normalizers", []))
    return None


# ---------------------------------------------------------------------------------------------------------
# A small streaming corpus reader (the full one, with documents and sentences, lives in bertforge.data)

CORPUS_SUFFIXES = (".txt", ".jsonl", ".txt.gz", ".jsonl.gz")


def corpus_files(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    """Expand corpus paths: files as given, directories recursively (.txt/.jsonl, optionally .gz, sorted),
    globs (`**` allowed) sorted. Raises BertforgeError when a path matches nothing."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(CORPUS_SUFFIXES))
            if not found:
                raise BertforgeError(f"no corpus files in {p}: expected {', '.join(CORPUS_SUFFIXES)}")
            files += found
        elif p.is_file():
            if not p.name.endswith(CORPUS_SUFFIXES):
                raise BertforgeError(f"unsupported corpus file {p}: expected {', '.join(CORPUS_SUFFIXES)}")
            files.append(p)
        elif glob.has_magic(str(raw)):
            found = sorted(Path(f) for f in glob.glob(str(raw), recursive=True)
                           if os.path.isfile(f) and f.endswith(CORPUS_SUFFIXES))
            if not found:
                raise BertforgeError(f"no corpus files match {raw}")
            files += found
        else:
            raise BertforgeError(f"corpus path not found: {raw}")
    if not files:
        raise BertforgeError("no corpus given: pass files, directories or globs")
    return files


def iter_corpus_texts(files: Iterable[Path]) -> Iterator[str]:
    """Yield the non-blank lines of .txt files and the `text` field of .jsonl lines, one file at a time.

    Undecodable bytes become U+FFFD, which the tokenizer drops like the reference does.
    """
    for path in files:
        opener = gzip.open if path.name.endswith(".gz") else open
        is_jsonl = path.name.removesuffix(".gz").endswith(".jsonl")
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if not is_jsonl:
                    yield line.rstrip("\n")
                    continue
                try:
                    text = json.loads(line).get("text")
                except (json.JSONDecodeError, AttributeError):
                    raise BertforgeError(f"{path}:{lineno} is not a JSON object; a .jsonl corpus has one "
                                         '{"text": ...} object per line') from None
                if not isinstance(text, str):
                    raise BertforgeError(f'{path}:{lineno} has no string "text" field; a .jsonl corpus has '
                                         'one {"text": ...} object per line')
                yield _SURROGATES.sub("\ufffd", text)


def _batches(items: Iterable[str], size: int) -> Iterator[list[str]]:
    it = iter(items)
    while batch := list(itertools.islice(it, size)):
        yield batch


def corpus_summary(tokenizer: Tokenizer, texts: Iterable[str], *, max_words: int | None = 10_000_000) -> dict:
    """How well the vocabulary covers a corpus, measured on its first `max_words` words (None: all).

    Words are the pre-tokens (a run of letters/digits, or one punctuation character or CJK ideograph).
    Returns vocab_size, texts, words, tokens, single_token_words (share of words that are one token),
    tokens_per_word, and unk_rate (share of tokens that are [UNK]; each [UNK] replaces a whole word).
    """
    n_texts = n_words = n_tokens = n_single = n_unk = 0
    for batch in _batches(texts, 1000):
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

"""The character classes of BERT's basic tokenization, generated from this Python's Unicode tables.

The reference (`tokenization.py`) asks `unicodedata` about every character; the engine needs the same classes as
regular expressions. They are built here once per Unicode version and kept in the cache directory.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import itertools
import re
import sys
import unicodedata

import numpy as np

from bertforge.errors import BertforgeError
from bertforge.files import cache_dir, read_json_object, write_json

# CJK Unified Ideographs blocks, exactly the reference's list (the engine's own list differs at U+2B820).
CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
              (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))
# ASCII symbols the reference splits although Unicode does not call them punctuation ("$", "^", "`", ...).
ASCII_PUNCT_RANGES = ((33, 47), (58, 64), (91, 96), (123, 126))

CLASS_NAMES = ("control", "space", "mark", "split", "cased", "case_ignorable")


@functools.cache
def unicode_classes() -> dict[str, str]:
    """Regex character classes (Oniguruma syntax) built from this Python's Unicode tables.

    Keys: control (dropped), space (becomes " "), mark (Mn, dropped when uncased), split (isolated:
    punctuation and CJK), cased and case_ignorable (the context of Python's final-sigma rule). Building
    them takes about 0.3 s, so they are kept in the cache directory, keyed by the Unicode version and a hash
    of the code that builds them; unpickled tokenizers do not need them at all.
    """
    source = inspect.getsource(build_unicode_classes) + inspect.getsource(char_class) + repr(
        (CJK_RANGES, ASCII_PUNCT_RANGES))
    key = hashlib.sha256(f"{unicodedata.unidata_version} {sys.maxunicode} {source}".encode()).hexdigest()[:16]
    path = cache_dir() / f"unicode-classes-{key}.json"
    with contextlib.suppress(BertforgeError):  # no cache yet, or a damaged one: build it again
        cached = read_json_object(path, what="character classes", fix="it is rebuilt")
        if set(cached) == set(CLASS_NAMES) and all(isinstance(v, str) for v in cached.values()):
            return cached
    classes = build_unicode_classes()
    with contextlib.suppress(OSError):  # a read-only home only costs the 0.3 s again next time
        write_json(path, classes)
    return classes


def build_unicode_classes() -> dict[str, str]:
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
    for lo, hi in ASCII_PUNCT_RANGES + CJK_RANGES:
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
    return {name: char_class(f) for name, f in flags.items()}


def char_class(flags: bytearray) -> str:
    parts = []
    for m in re.finditer(rb"\x01+", flags):
        lo, hi = m.start(), m.end() - 1
        parts.append(f"\\x{{{lo:X}}}" if lo == hi else f"\\x{{{lo:X}}}-\\x{{{hi:X}}}")
    return "[" + "".join(parts) + "]"


def class_table(name: str) -> np.ndarray:
    """One of `unicode_classes()` as a boolean array indexed by code point."""
    table = np.zeros(sys.maxunicode + 1, dtype=bool)
    for lo, hi in re.findall(r"\\x\{([0-9A-F]+)\}(?:-\\x\{([0-9A-F]+)\})?", unicode_classes()[name]):
        table[int(lo, 16):int(hi or lo, 16) + 1] = True
    return table

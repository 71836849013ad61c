"""The engine's side of the tokenizer: the ASCII fast path gives what the full pipeline gives, and the Unicode
character classes are cached on disk (the rules themselves: test_tokenizer.py and test_tokenizer_parity.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bertforge.tokenizer import Tokenizer, unicode


@pytest.mark.parametrize("lowercase", [True, False])
def test_ascii_fast_path_equals_full_pipeline(lowercase):
    """Most ASCII texts skip the normalizer (Python lowercases them); that must give the same ids, offsets
    and word ids as the full pipeline on every two-character ASCII string and on random ASCII text."""
    ascii_chars = [chr(c) for c in range(128)]
    printable = ascii_chars[33:127]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *printable, *("##" + c for c in printable)]
    tok = Tokenizer(vocab, lowercase=lowercase)
    rng = np.random.default_rng(0)
    texts = [a + b for a in ascii_chars for b in ascii_chars]
    texts += ["".join(rng.choice(ascii_chars, size=40)) for _ in range(1000)]
    texts += ["".join(rng.choice(ascii_chars[9:14] + printable, size=40)) for _ in range(1000)]
    texts += ["Hello [MASK] World\tX\r\nY", "[MASK]"]
    routed = tok._segments(texts)
    full = tok._tk.encode_batch(texts, add_special_tokens=False)
    assert sum(tok._is_fast(texts)) > 0.5 * len(texts)  # the comparison mostly exercises the fast path
    for text, f, g in zip(texts, routed, full, strict=True):
        assert (f.ids, f.offsets, f.word_ids) == (g.ids, g.offsets, g.word_ids), repr(text)


@pytest.mark.slow  # builds the tables from unicodedata
def test_unicode_classes_are_cached_on_disk_and_a_bad_cache_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = unicode.build_unicode_classes()
    assert unicode.unicode_classes.__wrapped__() == built
    (path,) = (tmp_path / "bertforge").glob("unicode-classes-*.json")
    assert json.loads(path.read_text()) == built
    path.write_text('{"control": "[')  # truncated: ignored, rebuilt and rewritten
    assert unicode.unicode_classes.__wrapped__() == built
    assert json.loads(path.read_text()) == built
    planted = {name: "[a]" for name in built}  # a well-formed cache is believed, not rebuilt
    path.write_text(json.dumps(planted))
    assert unicode.unicode_classes.__wrapped__() == planted

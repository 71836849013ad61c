"""The tokenizer's rules on a toy vocabulary written here, its API and its files. Expected tokens are written
out by hand from BERT's rules (google-research/bert tokenization_test.py style). Elsewhere: parity with the
reference on real vocabularies (test_tokenizer_parity.py), training and `vocab train` (test_vocab_train.py),
the engine's fast path and character classes (test_tokenizer_engine.py)."""

from __future__ import annotations

import json
import multiprocessing
import pickle
import re
from types import SimpleNamespace

import numpy as np
import pytest

from bertforge.errors import BertforgeError
from bertforge.tokenizer import Tokenizer, corpus_summary, engine, fingerprint
from bertforge.tokenizer import wordpiece as wordpiece_module

# What keeps an ASCII text off the tokenizer's fast path, written out as a regex (the code uses a byte set):
# control characters other than tab, newline and CR, DEL, and "[".
NOT_FAST = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\[]")

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
         "want", "##want", "##ed", "wa", "un", "runn", "##ing", ",", "!", ".",
         "low", "lowest", "##est", "a", "##a", "abc", "ab", "##cde", "##d", "中", "国",
         "Low", "é", "x"]


@pytest.fixture(scope="module")
def uncased() -> Tokenizer:
    return Tokenizer(VOCAB, lowercase=True)


@pytest.fixture(scope="module")
def cased() -> Tokenizer:
    return Tokenizer(VOCAB, lowercase=False)


def toks(tok: Tokenizer, text: str) -> list[str]:
    return tok.encode(text, add_special_tokens=False).tokens


# -- WordPiece and basic tokenization rules ----------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("UNwant\u00e9d,running", ["un", "##want", "##ed", ",", "runn", "##ing"]),  # Google's own example
    ("unwantedX running", ["[UNK]", "runn", "##ing"]),       # one unknown piece makes the whole word [UNK]
    ("abcde", ["[UNK]"]),        # greedy longest-first: abc + ##d, then no ##e; it never backtracks to ab ##cde
    ("abcd", ["abc", "##d"]),
    ("lowest", ["lowest"]),      # the whole word wins over low + ##est
    ("lowestest", ["lowest", "##est"]),
    ("", []),
    ("  \t\n ", []),
    ("low,lowest!.", ["low", ",", "lowest", "!", "."]),      # punctuation is split off, one char per token
    ("中国low", ["中", "国", "low"]),                          # CJK ideographs are words of their own
    ("low\u200blow\x00est", ["[UNK]"]),           # zero-width and NUL are dropped: "lowlowest" has no ##low
    ("low\x00est", ["lowest"]),
    ("low\tlowest\u3000low\u2028a\xa0x", ["low", "lowest", "low", "a", "x"]),  # odd whitespace separates words
    ("L\u00f3w\u00c9st", ["lowest"]),             # uncased: lowercase and strip accents
    ("Lo\u0301w", ["low"]),                       # a combining accent goes too
    ("low [MASK]low [mask]", ["low", "[MASK]", "low", "[UNK]", "[UNK]", "[UNK]"]),  # "[" is not in VOCAB
    ("lo\ud800west x\udfff", ["lowest", "x"]),  # lone surrogates (a JSON escape can make them) are dropped
])
def test_uncased_rules(uncased, text, expected):
    assert toks(uncased, text) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("Low low", ["Low", "low"]),
    ("LOW", ["[UNK]"]),
    ("\u00e9 e\u0301", ["é", "é"]),              # cased keeps accents, composed (NFC) like the reference
    ("L\u00f3w", ["[UNK]"]),
])
def test_cased_rules(cased, text, expected):
    assert toks(cased, text) == expected


def test_word_length_limit(uncased):
    assert toks(uncased, "a" * 100) == ["a"] + ["##a"] * 99
    assert toks(uncased, "a" * 101) == ["[UNK]"]
    assert toks(uncased, "x " + "a" * 101 + " x") == ["x", "[UNK]", "x"]


# -- encoding, pairs, truncation ------------------------------------------------------------------------

def test_single_and_pair_layout(uncased):
    e = uncased.encode("low, lowest", "abcd")
    assert e.tokens == ["[CLS]", "low", ",", "lowest", "[SEP]", "abc", "##d", "[SEP]"]
    assert e.ids == [2, 15, 12, 16, 3, 20, 23, 3]
    assert e.type_ids == [0, 0, 0, 0, 0, 1, 1, 1]
    assert e.attention_mask == [1] * 8
    assert e.word_ids == [None, 0, 1, 2, None, 0, 0, None]
    assert e.offsets == [(0, 0), (0, 3), (3, 4), (5, 11), (0, 0), (0, 3), (3, 4), (0, 0)]
    assert e.sequence_ids == [None, 0, 0, 0, None, 1, 1, None]
    assert uncased.encode("low").tokens == ["[CLS]", "low", "[SEP]"]


def test_offsets_point_into_the_original_text(uncased):
    text = "  Lo\u0301w\u200b, LÓWEST\tabcd"
    e = uncased.encode(text, add_special_tokens=False)
    assert e.tokens == ["low", ",", "lowest", "abc", "##d"]
    assert [text[s:t] for s, t in e.offsets] == ["Lo\u0301w", ",", "LÓWEST", "abc", "d"]


def _a_words(n: int) -> str:
    return " ".join(["a"] * n)  # n words, one token each


@pytest.mark.parametrize(("len_a", "len_b", "max_length", "kept_a", "kept_b"), [
    (91, 148, 64, 31, 30),   # cut B to 91, then 121 more: 60 from A, 61 from B (the Rust engine: A 30, B 31)
    (148, 91, 64, 31, 30),   # A longer: the odd token still comes from B
    (10, 10, 15, 6, 6),      # tie, even excess 8: 4 and 4
    (10, 10, 14, 6, 5),      # tie, odd excess 9: A loses 4, B loses 5 (the Rust engine would cut A)
    (3, 50, 20, 3, 14),      # only the longer one needs cutting
    (5, 5, 13, 5, 5),        # fits: untouched
])
def test_longest_first_follows_the_reference(uncased, len_a, len_b, max_length, kept_a, kept_b):
    e = uncased.encode(_a_words(len_a), _a_words(len_b), max_length=max_length)
    assert e.type_ids.count(0) - 2 == kept_a and e.type_ids.count(1) - 1 == kept_b
    assert len(e.ids) == min(max_length, len_a + len_b + 3)


def test_only_second_and_single_truncation(uncased):
    e = uncased.encode(_a_words(10), _a_words(20), max_length=16, truncation="only_second")
    assert e.type_ids.count(0) - 2 == 10 and e.type_ids.count(1) - 1 == 3
    with pytest.raises(ValueError, match="only the second"):
        uncased.encode(_a_words(20), _a_words(5), max_length=16, truncation="only_second")
    e = uncased.encode("low lowest abcd low", max_length=5)
    assert e.tokens == ["[CLS]", "low", "lowest", "abc", "[SEP]"]
    assert len(uncased.encode(_a_words(50), max_length=8, truncation=False).ids) == 52
    assert len(uncased.encode(_a_words(50), max_length=8, add_special_tokens=False).ids) == 8


def test_truncation_keeps_offsets_and_word_ids(uncased):
    text, pair = "low, abcd lowest " * 5, "abcd lowest , unwanted " * 5
    full = uncased.encode(text, pair)
    cut = uncased.encode(text, pair, max_length=20)
    n_a = cut.type_ids.count(0) - 1  # [CLS] + kept A
    assert cut.offsets[:n_a] == full.offsets[:n_a] and cut.word_ids[:n_a] == full.word_ids[:n_a]
    b_full = full.type_ids.index(1)
    n_b = len(cut.ids) - n_a - 2
    assert cut.offsets[n_a + 1:-1] == full.offsets[b_full:b_full + n_b]
    assert cut.word_ids[n_a + 1:-1] == full.word_ids[b_full:b_full + n_b]


def test_bad_arguments(uncased):
    with pytest.raises(ValueError, match="truncation"):
        uncased.encode("a", max_length=4, truncation="sideways")
    with pytest.raises(ValueError, match="needs a pair"):
        uncased.encode("a", max_length=4, truncation="only_second")
    with pytest.raises(ValueError, match="no room"):
        uncased.encode("a", "a", max_length=2)
    with pytest.raises(ValueError, match="padding"):
        uncased.encode_batch(["a"], padding="left")
    with pytest.raises(ValueError, match="needs max_length"):
        uncased.encode_batch(["a"], padding="max_length")


def test_encode_many_is_encode_for_each_item(uncased):
    texts, pairs = ["low lowest", "a\tlow, x", "lo\u0301w [MASK] y"], ["x a", "low low low low", "a"]
    for kw in ({"max_length": 6}, {"max_length": 7, "truncation": "only_second"}, {"truncation": False}):
        many = uncased.encode_many(texts, pairs, **kw)
        assert many == [uncased.encode(t, p, **kw) for t, p in zip(texts, pairs, strict=True)]
        batch = uncased.encode_batch(texts, pairs, padding=False, **kw)
        assert batch.encodings == many and batch.ids == [e.ids for e in many]
    plain = uncased.encode_many(texts, add_special_tokens=False)
    assert [e.ids for e in plain] == uncased.tokenize_ids(texts)


def test_batch_padding(uncased):
    b = uncased.encode_batch(["low", "low lowest abcd"], ["a", "x"])
    assert b.ids == [[2, 15, 3, 18, 3, 0, 0, 0], [2, 15, 16, 20, 23, 3, 28, 3]]
    assert b.type_ids == [[0, 0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0, 1, 1]]
    assert b.attention_mask == [[1, 1, 1, 1, 1, 0, 0, 0], [1] * 8]
    assert [e.tokens for e in b.encodings][0] == ["[CLS]", "low", "[SEP]", "a", "[SEP]"]  # items stay unpadded
    fixed = uncased.encode_batch(["low", "a a a a a a a a a"], max_length=6, padding="max_length")
    assert [len(r) for r in fixed.ids] == [6, 6] and fixed.ids[0] == [2, 15, 3, 0, 0, 0]
    over = uncased.encode_batch(["low", "low low low low low"], max_length=5, padding="max_length", truncation=False)
    assert over.ids == [[2, 15, 3, 0, 0], [2] + [15] * 5 + [3]] and over.attention_mask == [[1, 1, 1, 0, 0], [1] * 7]
    assert over.type_ids == [[0] * 5, [0] * 7]
    ragged = uncased.encode_batch(["low", "low low"], padding=False)
    assert [len(r) for r in ragged.ids] == [3, 4]
    with pytest.raises(ValueError, match="differ in length"):
        ragged.to_tensors()
    t = b.to_tensors()
    assert set(t) == {"input_ids", "token_type_ids", "attention_mask"}
    assert t["input_ids"].shape == (2, 8) and t["input_ids"].dtype.is_floating_point is False
    assert t["attention_mask"].tolist() == b.attention_mask
    assert uncased.encode_batch([]).ids == []


def test_tensors_are_the_padded_lists(uncased):
    """to_tensors pads on its own (vectorised) path; it must give exactly what the padded lists hold."""
    texts, pairs = ["low", "low lowest abcd", "", "a a a"], ["a", "x", "low low", ""]
    for kw in ({}, {"max_length": 9, "padding": "max_length"}, {"max_length": 5}, {"add_special_tokens": False},
               {"max_length": 4, "add_special_tokens": False}):
        for p in (None, pairs):
            t = uncased.encode_batch(texts, p, **kw).to_tensors()  # before any list is built
            lists = uncased.encode_batch(texts, p, **kw)
            assert t["input_ids"].tolist() == lists.ids
            assert t["token_type_ids"].tolist() == lists.type_ids
            assert t["attention_mask"].tolist() == lists.attention_mask
    over = uncased.encode_batch(["low", "low low low low low"], max_length=5, padding="max_length", truncation=False)
    with pytest.raises(ValueError, match="differ in length"):
        over.to_tensors()
    assert uncased.encode_batch(["low", "a"], padding=False).to_tensors()["input_ids"].shape == (2, 3)


def test_tokenize_ids_has_no_special_tokens(uncased):
    assert uncased.tokenize_ids(["low lowest", "", "abcd!"]) == [[15, 16], [], [20, 23, 13]]


def _engine_ids(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """The ids as the engine alone gives them (no chunk cache)."""
    return [e.ids for e in tok._segments(texts, offsets=False)]


CHUNK_TEXTS = ["low lowest", "", "abcd!", "a\tlow,x\nLOW\r\nwanted", "  lowest!!low  ", "runnin", "unwanted.",
               "x" * 101 + ",low", "Low-Low"]


def test_chunk_cache_gives_the_engines_ids_cold_and_warm(uncased, cased):
    for tok in (uncased, cased):
        tok._chunk_ids.clear()
        expected = _engine_ids(tok, CHUNK_TEXTS)
        assert tok.tokenize_ids(CHUNK_TEXTS) == expected  # cold: every chunk through the engine
        assert "lowest!!low" in tok._chunk_ids and "" not in tok._chunk_ids
        assert tok.tokenize_ids(CHUNK_TEXTS) == expected  # warm: from the cache alone
        assert tok.tokenize_ids(CHUNK_TEXTS[::-1]) == expected[::-1]
    assert uncased._chunk_ids["Low-Low"] == [15, 1, 15] and cased._chunk_ids["Low-Low"] == [26, 1, 26]


def test_fast_path_check_is_the_regex_on_every_ascii_character(uncased):
    singles = [chr(c) for c in range(128)]
    assert uncased._is_fast(singles) == [NOT_FAST.search(c) is None for c in singles]
    assert sum(uncased._is_fast(singles)) == 128 - len(engine.NOT_FAST)
    assert uncased._is_fast(["plain text", "x[y", "caf\u00e9", "tab\tok", "bell\x07"]) == [True, False, False, True,
                                                                                          False]


def test_chunk_cache_is_emptied_when_a_batch_would_overflow_it(uncased, monkeypatch):
    monkeypatch.setattr(wordpiece_module, "_CHUNK_CACHE_SIZE", 6)
    uncased._chunk_ids.clear()
    assert uncased.tokenize_ids(["low a"]) == [[15, 18]]
    assert set(uncased._chunk_ids) == {"low", "a"}
    texts = ["lowest x, abc", "wanted runnin ab"]  # 6 new chunks: more than fit beside the 2 kept
    assert uncased.tokenize_ids(texts) == _engine_ids(uncased, texts)
    assert set(uncased._chunk_ids) == {"lowest", "x,", "abc", "wanted", "runnin", "ab"}
    assert uncased.tokenize_ids(["low a"]) == [[15, 18]]
    assert len(uncased._chunk_ids) == 2  # emptied again: 6 + 2 > 6


def test_tokenize_flat_is_tokenize_ids_concatenated(uncased):
    # Fast-path texts go through the chunk cache; the others (non-ASCII, "[", control characters) through the
    # engine: the two routes interleave, and a special token spelled in a slow text stays.
    texts = ["low lowest", "", "abcd!", "Lów [SEP] low", "unwanted\x07low", "  ", "LOW,low"] * 30
    flat, lengths = uncased.tokenize_flat(texts)
    expected = uncased.tokenize_ids(texts)
    assert lengths.tolist() == [len(e) for e in expected]
    assert flat.tolist() == [i for e in expected for i in e]
    assert uncased.sep_id in flat.tolist()
    assert uncased.tokenize_flat([])[0].tolist() == []


def test_decode(uncased):
    ids = uncased.encode("unwanted running, low!", "abcd").ids
    assert uncased.decode(ids) == "[CLS] unwanted running, low! [SEP] abcd [SEP]"
    assert uncased.decode(ids, skip_special_tokens=True) == "unwanted running, low! abcd"
    assert uncased.decode(np.array([15, 99999])) == "low [UNK]"


# -- vocabulary attributes ------------------------------------------------------------------------------

def test_vocabulary_attributes(uncased):
    assert (uncased.pad_id, uncased.unk_id, uncased.cls_id, uncased.sep_id, uncased.mask_id) == (0, 1, 2, 3, 4)
    assert uncased.special_ids == frozenset({0, 1, 2, 3, 4})
    assert uncased.vocab_size == len(VOCAB) == len(uncased)
    assert uncased.id_to_token(17) == "##est" and uncased.token_to_id("##est") == 17
    assert uncased.token_to_id("nope") is None
    assert uncased.is_subword.dtype == bool and uncased.is_subword.shape == (len(VOCAB),)
    assert np.flatnonzero(uncased.is_subword).tolist() == [6, 7, 11, 17, 19, 22, 23]


def test_fingerprint_depends_on_vocab_and_casing(uncased, cased):
    again = Tokenizer(list(VOCAB), lowercase=True)
    assert again.fingerprint == uncased.fingerprint
    assert len(uncased.fingerprint) == 16 and int(uncased.fingerprint, 16) >= 0
    assert cased.fingerprint != uncased.fingerprint
    assert Tokenizer(VOCAB + ["extra"], lowercase=True).fingerprint != uncased.fingerprint


def test_check_compatible(uncased):
    uncased.check_compatible(SimpleNamespace(vocab_size=len(VOCAB)))
    with pytest.raises(BertforgeError, match=rf"30522 token embeddings .* {len(VOCAB)} tokens") as e:
        uncased.check_compatible(SimpleNamespace(vocab_size=30522))
    assert "\n" not in str(e.value)


def test_missing_special_tokens_are_refused():
    with pytest.raises(BertforgeError, match=r"\[MASK\]"):
        Tokenizer(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "a"], lowercase=True)


def test_pickle_and_worker_processes(uncased):
    back = pickle.loads(pickle.dumps(uncased))
    assert back.fingerprint == uncased.fingerprint and back.vocab == uncased.vocab
    assert back.encode("low, abcd", "a").offsets == uncased.encode("low, abcd", "a").offsets
    with multiprocessing.get_context("fork").Pool(1) as pool:
        assert pool.map(uncased.tokenize_ids, [["low lowest"], ["abcd"]]) == [[[15, 16]], [[20, 23]]]


# -- files ----------------------------------------------------------------------------------------------

def test_save_and_load_round_trip(tmp_path, cased):
    cased.save_pretrained(tmp_path / "tok")
    assert (tmp_path / "tok" / "vocab.txt").read_text(encoding="utf-8").split("\n") == VOCAB + [""]
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert config["do_lower_case"] is False and config["tokenizer_class"] == "BertTokenizer"
    back = Tokenizer.from_pretrained(tmp_path / "tok")
    assert back.lowercase is False and back.fingerprint == cased.fingerprint
    assert back.encode("Low é!", "abcd").ids == cased.encode("Low é!", "abcd").ids


def test_tokenizer_json_loads_in_transformers(tmp_path, uncased):
    transformers = pytest.importorskip("transformers")
    uncased.save_pretrained(tmp_path)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert fast("UNwanted, low", "abcd")["input_ids"] == uncased.encode("UNwanted, low", "abcd").ids


def _write_vocab(path, tokens):
    path.write_text("".join(t + "\n" for t in tokens), encoding="utf-8")
    return path


def test_casing_detection(tmp_path):
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[unused0]"]
    lower = _write_vocab(tmp_path / "lower.txt", specials + ["the", "##s"])
    mixed = _write_vocab(tmp_path / "mixed.txt", specials + ["the", "The"])
    assert Tokenizer.from_pretrained(lower).lowercase is True
    assert Tokenizer.from_pretrained(mixed).lowercase is False
    assert Tokenizer.from_pretrained(mixed, lowercase=True).lowercase is True
    with pytest.raises(BertforgeError, match="no uppercase tokens.*lowercase=True") as e:
        Tokenizer.from_pretrained(lower, lowercase=False)
    assert "\n" not in str(e.value)
    # A directory's config files win over the guess.
    d = tmp_path / "dir"
    d.mkdir()
    _write_vocab(d / "vocab.txt", specials + ["the", "The"])
    (d / "tokenizer.json").write_text(json.dumps({"normalizer": {"type": "BertNormalizer", "lowercase": True}}))
    assert Tokenizer.from_pretrained(d).lowercase is True
    (d / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False}))
    assert Tokenizer.from_pretrained(d).lowercase is False


def test_load_errors(tmp_path):
    with pytest.raises(BertforgeError, match="tokenizer not found"):
        Tokenizer.from_pretrained(tmp_path / "nope")
    with pytest.raises(BertforgeError, match="no vocab.txt in"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(BertforgeError, match="empty"):
        Tokenizer.from_pretrained(tmp_path / "empty.txt")
    (tmp_path / "crlf.txt").write_bytes("\r\n".join(VOCAB).encode())
    assert Tokenizer.from_pretrained(tmp_path / "crlf.txt").vocab == VOCAB
    d = tmp_path / "broken"  # a tokenizer_config.json cut short: one line naming the file, not a traceback
    d.mkdir()
    _write_vocab(d / "vocab.txt", VOCAB)
    (d / "tokenizer_config.json").write_text('{"do_lower_case": tr')
    with pytest.raises(BertforgeError, match=r"tokenizer_config\.json is not valid JSON .*: restore") as e:
        Tokenizer.from_pretrained(d)
    assert "\n" not in str(e.value)
    assert Tokenizer.from_pretrained(d, lowercase=True).vocab == VOCAB  # the fingerprint check skips the file


def test_corpus_summary(uncased):
    # words: low | lowest | unwanted -> un ##want ##ed | xyz -> [UNK] | , ; and an empty text
    s = corpus_summary(uncased, ["low lowest", "", "unwanted xyz,"])
    assert (s["texts"], s["words"], s["tokens"]) == (3, 5, 7)
    assert s["single_token_words"] == pytest.approx(4 / 5)
    assert s["tokens_per_word"] == pytest.approx(7 / 5)
    assert s["unk_rate"] == pytest.approx(1 / 7)
    assert corpus_summary(uncased, ["low low low"], max_words=1)["words"] == 3  # stops after the batch


def test_fingerprint_is_vocabulary_order_and_casing(tmp_path):
    tok = Tokenizer(VOCAB, lowercase=True)
    assert tok.fingerprint == fingerprint(VOCAB, True) and len(tok.fingerprint) == 16
    moved = VOCAB[:5] + VOCAB[6:] + VOCAB[5:6]  # the same tokens, one in another place: another identity
    assert fingerprint(moved, True) != tok.fingerprint != fingerprint(VOCAB, False)
    tok.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["bertforge_fingerprint"] == tok.fingerprint
    assert Tokenizer.from_pretrained(tmp_path).fingerprint == tok.fingerprint
    (tmp_path / "vocab.txt").write_text("".join(t + "\n" for t in moved))
    with pytest.raises(BertforgeError, match=f"{fingerprint(moved, True)}.*records {tok.fingerprint}"):
        Tokenizer.from_pretrained(tmp_path)
    assert Tokenizer.from_pretrained(tmp_path / "vocab.txt").vocab == moved  # a bare vocab.txt records nothing

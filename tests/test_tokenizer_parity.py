"""Parity with BERT's reference tokenizer: transformers' BertTokenizerLegacy, the pure-Python port of Google's
tokenization.py (in transformers 5, `BertTokenizer` is the Rust one, which is not the reference).

On a varied sample of 10k texts built here (State of the Union prose plus accents, CJK, Arabic, Cyrillic,
Greek, emoji, control and zero-width characters, odd whitespace, very long words, numbers and punctuation
runs), ids must be 100% identical: uncased and cased, on the MiniLM package's vocab.txt and on vocabularies
we train (on half the sample), single texts and truncated pairs. A sweep over every assigned code point checks
the basic tokenization character by character.
"""

from __future__ import annotations

import functools
import itertools
import json
import random
import sys
import unicodedata
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bertforge.tokenizer import Tokenizer, VocabOptions

transformers = pytest.importorskip("transformers", reason="transformers is the reference (test dependency)")

N_TEXTS = 10_000

FRAGMENTS = {
    "accents": ["café", "naïve", "Ångström", "résumé", "Zürich", "São Paulo", "façade", "cafe\u0301",
                "A\u030angstro\u0308m", "Œuvre", "straße", "İstanbul", "ǅemal", "ﬁnancial", "Ærø", "Łódź",
                "crème brûlée", "piñata", "Dvořák", "ℌilbert", "Ⅻ", "ǈ", "ĳ"],
    "cjk": ["中文分词测试", "日本語のテキストです", "한국어 문장입니다", "漢字かなカナ交じり", "𠀀𪜀𫠠",
            "\uf900\ufa0e\ufa10", "北京大学", "東京都", "ｶﾀｶﾅ", "〇一二三", "ㄅㄆㄇ"],
    "arabic": ["مرحبا بالعالم", "اللغة العربية", "السَّلَامُ عَلَيْكُمْ", "٣٤٥ كتاب", "שָׁלוֹם עולם", "فارسی‌ها"],
    "cyrillic": ["Привет, мир!", "Ёлка", "ЁЖИК в тумане", "Україна", "Съешь же ещё этих мягких булок",
                 "Ђорђе"],
    "greek": ["ΟΔΟΣ", "Σίσυφος", "ΣΑΣ'Σ", "ὈΔΥΣΣΕΎΣ", "ἀρχὴ", "Ὅμηρος", "ΑΣ.Σ", "σοφός", "ΑΣ\u0301Σ"],
    "other_scripts": ["हिन्दी भाषा", "ภาษาไทย", "ᠮᠣᠩᠭᠣᠯ", "ქართული", "Հայերեն", "தமிழ்", "ꦗꦮ", "𑤸𑤸",
                      "\U00011935\U00011930", "ᏣᎳᎩ"],
    "emoji": ["😀", "👍🏽", "👨\u200d👩\u200d👧\u200d👦", "🇺🇸", "❤️", "🫨", "🧑\u200d💻", "✈︎", "🏳️\u200d🌈",
              "\U0001fae8", "©", "™", "☃"],
    "control": ["\x00", "\x07", "\x1b[31m", "\u200b", "\u200c", "\u200d", "\ufeff", "\u00ad", "\ufffd", "\x7f",
                "\u2066", "\U000e0001", "\ue000", "\U000f0000", "\x85", "\u061c", "\u0378", "\U0010fffd",
                "\ud800", "\udfff"],
    "space": ["\t", "\n", "\r\n", "\u00a0", "\u3000", "\u2028", "\u2029", "\x0b", "\x0c", "\u2003", "   ",
              "\u1680", "\u180e", "\u202f", "\u205f", "\x1c", "\x1f"],
    "long": ["a" * 100, "a" * 101, "supercalifragilistic" * 6, "x" * 250, "é" * 70, "e\u0301" * 70,
             "Pneumonoultramicroscopicsilicovolcanoconiosis", "ab" * 49 + "\u0301", "-" * 120, "中" * 120],
    "numbers": ["3.14159", "$1,000,000.00", "1e-10", "2024-05-09", "+44 (0)20 7946 0958", "100%", "½", "²",
                "١٢٣", "0x1F600", "12:30pm", "№7", "42nd", "1st,2nd"],
    "punct": ["...", "!!!???", "--", "—", "«»", "“quoted”", "(parens)", "[brackets]", "{braces}", "@#$%^&*",
              "~`|\\", "¿¡", "§¶", "•·", "⹕⹝", "'''", '"""', "!?!?!?!?!?", "…", "‹›", "‐‑‒–", "<b>x</b>",
              "http://example.com/a?b=c&d=e", "user@example.org", "don't", "rock'n'roll", "C++", "a/b\\c"],
    "special": ["[MASK]", "[mask]", "[CLS]", "[SEP]x", "a[MASK]b", "[UNK]", "[PAD]", "[ MASK ]", "[MASK][MASK]"],
}


def _sotu_sentences(shared_data: Path, n: int, rng: random.Random) -> list[str]:
    files = sorted((shared_data / "corpus" / "sotu").glob("*.txt"))
    paragraphs = [p for f in rng.sample(files, 25) for p in f.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    out = []
    while len(out) < n:
        p = rng.choice(paragraphs)
        words = p.split(" ")
        start = rng.randrange(len(words))
        out.append(" ".join(words[start:start + rng.choice([3, 8, 20, 40, 80, 400])]))
    return out


def _random_codepoints(rng: random.Random) -> str:
    chars = []
    for _ in range(rng.randint(1, 30)):
        cp = rng.choice([rng.randrange(0x20, 0x250), rng.randrange(0x250, 0x3000), rng.randrange(0x3000, 0x10000),
                         rng.randrange(0x10000, 0x30000), rng.randrange(0xE0000, 0x110000)])
        if not 0xD800 <= cp <= 0xDFFF:
            chars.append(chr(cp))
    return "".join(chars)


def build_sample(shared_data: Path, n: int = N_TEXTS, seed: int = 0) -> list[str]:
    """n texts: 40% State of the Union excerpts, 55% mixes of FRAGMENTS and English words, 5% random code
    points; a few empty or blank."""
    rng = random.Random(seed)
    prose = _sotu_sentences(shared_data, int(n * 0.4), rng)
    english = " ".join(prose[:200]).split()
    kinds = list(FRAGMENTS)
    texts = list(prose) + ["", " ", "\t\n", "\u200b"]
    separators = [" ", " ", " ", "", "\t", "\n", "  ", "\u00a0", ", ", "-"]
    while len(texts) < n:
        if rng.random() < 0.05:
            texts.append(_random_codepoints(rng))
            continue
        parts = []
        for _ in range(rng.randint(1, 14)):
            if rng.random() < 0.4:
                parts.append(rng.choice(english))
            else:
                parts.append(rng.choice(FRAGMENTS[rng.choice(kinds)]))
            parts.append(rng.choice(separators))
        texts.append("".join(parts))
    rng.shuffle(texts)
    return texts


@pytest.fixture(scope="module")
def sample(shared_data) -> list[str]:
    return build_sample(shared_data)


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory, shared_data, sample) -> Path:
    """Uncased and cased vocabularies trained on sotu plus a third of the sample (so that they hold pieces of
    its other scripts), saved, and loaded back by the tests."""
    root = tmp_path_factory.mktemp("parity-vocab")
    corpus = root / "corpus.jsonl"  # JSON: the sample's lone surrogates cannot be written as UTF-8 text
    files = sorted((shared_data / "corpus" / "sotu").glob("*.txt"))[-30:]
    texts = [f.read_text(encoding="utf-8") for f in files] + sample[::3]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    for casing in ("uncased", "cased"):
        Tokenizer.train([corpus], VocabOptions(vocab_size=6000, lowercase=casing == "uncased"),
                        show_progress=False).save_pretrained(root / casing)
    return root


class _Remembering:
    """A reference tokenizer stage (basic or WordPiece) that keeps its results: the parity sample repeats words
    and texts, and the reference, in pure Python, is most of this file's time. Every result is still the
    reference's own, computed once."""

    def __init__(self, stage):
        self.stage, self.results = stage, {}

    def __getattr__(self, name: str):  # never_split, do_lower_case, vocab, ...: the wrapped stage's
        return getattr(self.stage, name)

    def tokenize(self, text: str, **options) -> list[str]:
        key = (text, *((k, None if v is None else tuple(v)) for k, v in sorted(options.items())))
        if key not in self.results:
            self.results[key] = self.stage.tokenize(text, **options)
        return list(self.results[key])


def _remember_words(basic) -> None:
    """The reference's basic tokenization remembering the results of its steps on each whitespace-separated word
    (accents stripped, split at punctuation), which the sample repeats many times. A split depends on the word and
    on whether it is one never to split, nothing else."""
    basic._run_strip_accents = functools.cache(basic._run_strip_accents)
    original = basic._run_split_on_punc
    split = functools.cache(lambda word, kept: original(word, {word} if kept else None))
    basic._run_split_on_punc = lambda word, never_split=None: list(
        split(word, never_split is not None and word in never_split))


@pytest.fixture(scope="module")
def shared_basic() -> dict:
    return {}


def _reference(vocab_file: Path, lowercase: bool, shared_basic: dict):
    """transformers' BertTokenizerLegacy on `vocab_file`, its WordPiece remembering its results, and its basic
    tokenization (which depends on the casing, not on the vocabulary) shared with the others of its casing:
    the second vocabulary of a casing then costs only the reference's WordPiece."""
    from transformers import BertTokenizerLegacy

    ref = BertTokenizerLegacy(str(vocab_file), do_lower_case=lowercase)
    if lowercase not in shared_basic:
        shared_basic[lowercase] = _Remembering(ref.basic_tokenizer)
        _remember_words(ref.basic_tokenizer)
    shared = shared_basic[lowercase]
    settings = [{k: v for k, v in vars(stage).items() if not k.startswith("_run_")}  # not the remembering
                for stage in (shared.stage, ref.basic_tokenizer)]
    assert settings[0] == settings[1]  # the same basic tokenization, whichever vocabulary
    ref.basic_tokenizer = shared
    ref.wordpiece_tokenizer = _Remembering(ref.wordpiece_tokenizer)
    return ref


def _pair(minilm_dir: Path, trained_dir: Path, name: str, shared_basic: dict) -> tuple[Tokenizer, object]:

    vocab = {"minilm": minilm_dir, "trained": trained_dir}[name.split("-")[0]]
    lowercase = name.endswith("uncased")
    directory = vocab if name.startswith("minilm") else vocab / ("uncased" if lowercase else "cased")
    if name == "minilm-cased":
        # The MiniLM vocab is uncased; from_pretrained refuses it cased, but the cased pipeline can still
        # be compared on it (accented and capitalised words then become [UNK], a good test in itself).
        ours = Tokenizer(Tokenizer.from_pretrained(directory).vocab, lowercase=False)
    else:
        ours = Tokenizer.from_pretrained(directory, lowercase=lowercase)
    return ours, _reference(directory / "vocab.txt", lowercase, shared_basic)


# Texts per configuration. The reference tokenizes ~100k tokens/s, the bulk of this file's time: the whole sample
# on the real vocabulary, half of it on each one we train (their WordPiece differs, their basic tokenization is
# the same), a quarter on the MiniLM vocab used cased (an extra check).
CONFIGS = {"minilm-uncased": N_TEXTS, "minilm-cased": N_TEXTS // 4, "trained-uncased": N_TEXTS // 2,
           "trained-cased": N_TEXTS // 2}
MAX_LENGTHS = [4, 8, 13, 16, 32, 64, 128, 512]


@pytest.mark.slow  # 2-10 s each: thousands of sentences through both tokenizers
@pytest.mark.parametrize("name", CONFIGS)
def test_ids_identical_to_reference(name, sample, minilm_dir, trained_dir, shared_basic):
    ours, ref = _pair(minilm_dir, trained_dir, name, shared_basic)
    sample = sample[:CONFIGS[name]]
    token_id = functools.cache(ref.convert_tokens_to_ids)  # each distinct token converted once, by the reference
    ref_ids = [[token_id(token) for token in ref.tokenize(t)] for t in sample]
    our_ids = ours.tokenize_ids(sample)
    mismatches = [(t, r, o) for t, r, o in zip(sample, ref_ids, our_ids, strict=True) if r != o]
    assert not mismatches, f"{len(mismatches)} of {len(sample)} differ; first: {mismatches[0]!r}"
    assert sum(map(len, our_ids)) > 5 * len(sample)  # the sample is not trivially short
    flat, lengths = ours.tokenize_flat(sample)  # the grouped path corpus preparation takes
    assert lengths.tolist() == [len(r) for r in ref_ids]
    assert flat.tolist() == [i for r in ref_ids for i in r]
    if name == "minilm-uncased":
        assert sum(i.count(ours.unk_id) for i in our_ids) < 0.05 * sum(map(len, our_ids))

    # Pairs (consecutive texts) with every truncation the reference offers, through its own
    # prepare_for_model (what its __call__ runs after tokenizing); ours batched per setting.
    rng = random.Random(1)
    groups: dict[tuple[int, str], list[int]] = {}
    for i in range(len(sample) - 1):
        max_length = rng.choice(MAX_LENGTHS)
        strategy = "only_second" if i % 3 == 0 else "longest_first"
        if strategy == "only_second" and len(ref_ids[i]) + 3 - max_length > 0:
            strategy = "longest_first"  # B cannot absorb the cut: the reference overflows, we raise (see tests)
        groups.setdefault((max_length, strategy), []).append(i)
    for (max_length, strategy), idx in groups.items():
        got = ours.encode_batch([sample[i] for i in idx], [sample[i + 1] for i in idx], max_length=max_length,
                                truncation=strategy, padding=False)
        for k, (i, enc) in enumerate(zip(idx, got.encodings, strict=True)):
            want = ref.prepare_for_model(ref_ids[i], ref_ids[i + 1], truncation=strategy, max_length=max_length,
                                         return_token_type_ids=True)
            assert (enc.ids, enc.type_ids) == (want["input_ids"], want["token_type_ids"]), (
                sample[i], sample[i + 1], max_length, strategy)
            assert (got.ids[k], got.type_ids[k]) == (enc.ids, enc.type_ids)  # the batch's fast path agrees
    # Single texts truncated, and a batch.
    for i in range(0, len(sample), 7):
        want = ref.prepare_for_model(ref_ids[i], truncation=True, max_length=MAX_LENGTHS[i % len(MAX_LENGTHS)])
        assert ours.encode(sample[i], max_length=MAX_LENGTHS[i % len(MAX_LENGTHS)]).ids == want["input_ids"]
    batch = ours.encode_batch(sample[:64], sample[64:128], max_length=48, padding=False)
    for k, enc in enumerate(batch.encodings):
        want = ref.prepare_for_model(ref_ids[k], ref_ids[64 + k], truncation=True, max_length=48,
                                      return_token_type_ids=True)
        assert enc.ids == want["input_ids"] and enc.type_ids == want["token_type_ids"]


def test_reference_call_path_agrees(sample, minilm_pair):
    """The full reference __call__ (not tokenize + prepare_for_model) on a few hundred pairs; includes a tie
    (91 + 148 tokens to 64) that the reference cuts to A 31, B 30 and the Rust engine's own truncation to A 30, B 31."""
    ours, ref = minilm_pair
    for i in range(0, 600, 2):
        a, b = sample[i], sample[i + 1]
        want = ref(a, b, truncation="longest_first", max_length=24, return_token_type_ids=True)
        got = ours.encode(a, b, max_length=24)
        assert (got.ids, got.type_ids, got.attention_mask) == (
            want["input_ids"], want["token_type_ids"], want["attention_mask"])
    a, b = " ".join(["the"] * 91), " ".join(["war"] * 148)
    want = ref(a, b, truncation=True, max_length=64, return_token_type_ids=True)["token_type_ids"]
    assert want.count(0) - 2 == 31 and ours.encode(a, b, max_length=64).type_ids == want


@pytest.mark.slow
def test_decode_identical_to_reference(sample, minilm_pair):
    ours, ref = minilm_pair
    for text in sample[:1500]:
        ids = ours.encode(text).ids
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text


@pytest.mark.slow
def test_offsets_map_tokens_back_to_text(sample, minilm_dir):
    """A word's span, tokenized alone by the reference's basic tokenizer, gives its pieces joined (an [UNK]
    covers one whole word); pieces advance through the word, and between them lie only characters the
    reference drops. (Pieces may share a character: uncased Hangul syllables decompose into jamo pieces.)"""
    tok = Tokenizer.from_pretrained(minilm_dir)
    from transformers.models.bert.tokenization_bert_legacy import BasicTokenizer  # here: half a second to import

    basic = BasicTokenizer(do_lower_case=True)
    specials = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}
    checked = 0
    for text in sample[:3000]:
        e = tok.encode(text, add_special_tokens=False)
        prev_end = 0
        for _, group in itertools.groupby(zip(e.tokens, e.offsets, e.word_ids, strict=True), key=lambda x: x[2]):
            items = list(group)
            starts = [s for _, (s, _), _ in items]
            ends = [t for _, (_, t), _ in items]
            assert prev_end <= starts[0] and all(s < t for s, t in zip(starts, ends, strict=True)), text
            for k in range(1, len(items)):
                assert starts[k - 1] <= starts[k] and ends[k - 1] <= ends[k], text
                assert basic.tokenize(text[ends[k - 1]:starts[k]]) == [], text
            prev_end = ends[-1]
            span = text[starts[0]:ends[-1]]
            if span in specials:
                continue  # a special token written in the text
            pieces = basic.tokenize(span)
            word = [t for t, _, _ in items]
            if word == ["[UNK]"]:
                assert len(pieces) == 1, (text, span)
            else:  # a final sigma depends on its neighbours, which a span on its own lacks
                joined = "".join(t.removeprefix("##") for t in word).replace("ς", "σ")
                assert [p.replace("ς", "σ") for p in pieces] == [joined], (text, span, word)
            checked += 1
    assert checked > 50_000


def test_answers_round_trip_through_offsets(shared_data, minilm_dir):
    """QA: an answer (a run of whitespace-separated words of the context) maps to tokens whose offsets give
    back exactly the answer text, also in the second segment after truncation."""
    tok = Tokenizer.from_pretrained(minilm_dir)
    rng = random.Random(2)
    paragraphs = _sotu_sentences(shared_data, 300, rng)
    checked = 0
    for context in paragraphs:
        spans, pos = [], 0
        for word in context.split(" "):
            if word:
                spans.append((pos, pos + len(word)))
            pos += len(word) + 1
        if len(spans) < 3:
            continue
        i = rng.randrange(len(spans) - 2)
        j = min(len(spans) - 1, i + rng.randrange(3))
        a_start, a_end = spans[i][0], spans[j][1]
        e = tok.encode("what is the question?", context, max_length=384, truncation="only_second")
        inside = [k for k, (s, t) in enumerate(e.offsets)
                  if e.type_ids[k] == 1 and e.word_ids[k] is not None and s < a_end and t > a_start]
        if not inside or e.offsets[inside[-1]][1] < a_end:
            continue  # the answer was truncated away
        first, last = inside[0], inside[-1]
        assert context[e.offsets[first][0]:e.offsets[last][1]] == context[a_start:a_end]
        checked += 1
    assert checked > 200


@functools.cache  # both casings check the same code points
def _codepoint_sample() -> list[int]:
    """Every assigned code point (Python's tables), except that runs of over 1,000 consecutive code points of
    one category (CJK ideographs, Hangul syllables, Tangut: 110k of the 145k) keep their first and last 50
    and every 8th; plus 2,000 unassigned and private-use ones."""
    rng = random.Random(3)
    cps, other = [], []
    start = 0
    for cat, run in itertools.groupby(map(unicodedata.category, map(chr, range(sys.maxunicode + 1)))):
        end = start + sum(1 for _ in run)
        block = [cp for cp in range(start, end) if not 0xD800 <= cp <= 0xDFFF]
        if cat in ("Cn", "Co"):
            other += block
        elif len(block) > 1000:
            cps += block[:50] + block[50:-50:8] + block[-50:]
        else:
            cps += block
        start = end
    return cps + rng.sample(other, 2000)


@pytest.mark.slow  # every code point through both tokenizers
@pytest.mark.parametrize("lowercase", [True, False])
def test_every_character_is_handled_like_the_reference(lowercase):
    """Basic tokenization (cleaning, spacing, NFC, casing, accents, punctuation, CJK, final sigma) of each
    code point in context, compared with the reference's BasicTokenizer in chunks of 300 characters."""
    tok = Tokenizer(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], lowercase=lowercase)
    normalizer, pre_tokenizer = tok._tk.normalizer, tok._tk.pre_tokenizer
    from transformers.models.bert.tokenization_bert_legacy import BasicTokenizer

    basic = BasicTokenizer(do_lower_case=lowercase)

    def ours(text: str) -> list[str]:
        return [w for w, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text))]

    cps = _codepoint_sample()
    for k in range(0, len(cps), 300):
        chunk = " ".join(f"x{c}Y A{c}Σ.{c}" for c in map(chr, cps[k:k + 300]))
        if basic.tokenize(chunk) != ours(chunk):
            bad = [hex(cp) for cp in cps[k:k + 300]
                   if basic.tokenize(f"x{chr(cp)}Y A{chr(cp)}Σ.{chr(cp)}")
                   != ours(f"x{chr(cp)}Y A{chr(cp)}Σ.{chr(cp)}")]
            pytest.fail(f"code points handled unlike the reference: {bad[:20]}")


@pytest.fixture(scope="module")
def minilm_pair(minilm_dir, shared_basic):
    return Tokenizer.from_pretrained(minilm_dir), _reference(minilm_dir / "vocab.txt", True, shared_basic)


@settings(max_examples=300, deadline=None)
@given(text=st.text(st.characters(), max_size=60))
def test_random_text_matches_reference(text, minilm_pair):
    ours, ref = minilm_pair
    assert ours.tokenize_ids([text])[0] == ref.convert_tokens_to_ids(ref.tokenize(text))

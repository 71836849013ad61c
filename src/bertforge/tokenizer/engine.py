"""The reference's basic tokenization and WordPiece, assembled from the Rust `tokenizers` engine's parts.

The engine's built-in BertNormalizer/BertPreTokenizer are not used: their Unicode tables are older, and a sweep
over every code point found 830k disagreements with the reference (unassigned code points kept instead of
dropped, newer punctuation not split, a shifted CJK range, no NFC). The classes come from `unicode.py` instead.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from bertforge.tokenizer.unicode import unicode_classes
from bertforge.tokenizer.vocab import CLS, SEP, SPECIAL_TOKENS, SUBWORD_PREFIX, UNK

MAX_WORD_CHARS = 100  # longer words become [UNK], as in the reference

# Control characters other than tab, newline and CR, and DEL: the normalizer drops them. ASCII text without
# them normalizes to itself, lowercased when uncased (see Tokenizer._segments and training.count_alphabet).
# As bytes for `bytes.translate`, which finds them about 4x faster than a regex search.
CONTROL_BYTES = bytes([*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F])
# ASCII text without these takes the tokenizer's fast path: "[" may open a special token, which is matched
# before lowercasing.
NOT_FAST = CONTROL_BYTES + b"["
# Lone surrogates (from JSON escapes such as "\ud800") cannot enter the engine; the reference drops them (Cs),
# so they become U+FFFD, which it drops too: one character for one, offsets unchanged.
SURROGATES = re.compile("[\ud800-\udfff]")


def pipeline(lowercase: bool) -> tuple[normalizers.Normalizer, pre_tokenizers.PreTokenizer]:
    """The reference's basic tokenization as an engine normalizer and pre-tokenizer."""
    u = unicode_classes()
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


def wordpiece(vocab: dict[str, int] | None = None) -> models.WordPiece:
    """The WordPiece model: greedy longest-match-first with `##` continuations; None: empty, for training."""
    return models.WordPiece(vocab, unk_token=UNK, max_input_chars_per_word=MAX_WORD_CHARS,
                            continuing_subword_prefix=SUBWORD_PREFIX)


def backend(vocab: Sequence[str], lowercase: bool) -> tokenizers.Tokenizer:
    """The engine tokenizer for a vocabulary: pipeline, WordPiece, special tokens, post-processor, decoder."""
    ids = {tok: i for i, tok in enumerate(vocab)}  # a duplicated token keeps its last line, like the reference
    tk = tokenizers.Tokenizer(wordpiece(ids))
    tk.normalizer, tk.pre_tokenizer = pipeline(lowercase)
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    # We add [CLS]/[SEP] ourselves (see Tokenizer.encode); the template is for other readers of tokenizer.json.
    tk.post_processor = processors.TemplateProcessing(
        single=f"{CLS} $A {SEP}", pair=f"{CLS} $A {SEP} $B:1 {SEP}:1",
        special_tokens=[(CLS, ids[CLS]), (SEP, ids[SEP])])
    tk.decoder = decoders.WordPiece(prefix=SUBWORD_PREFIX, cleanup=True)
    return tk

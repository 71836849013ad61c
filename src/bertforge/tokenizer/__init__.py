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
the engine as regular expressions (`unicode.py`, `engine.py`). So the tokenization of code points that a newer
Python assigns can differ between Python versions, exactly as the reference's does. ASCII text without control
characters skips the normalizer (`Tokenizer._segments`).

Conventions:
- ids index `vocab` (the line number in vocab.txt); [PAD] [UNK] [CLS] [SEP] [MASK] must be in the vocab.
- Sequences are `[CLS] A [SEP]` and `[CLS] A [SEP] B [SEP]`; type ids 0 up to and including the first [SEP], 1 after.
- `offsets` are (start, end) character indices into the original string of the token's own segment
  (A or B); special tokens added around the segments get (0, 0).
- `word_ids` number the words (pre-tokens: a run of characters other than spaces, punctuation and CJK, or
  one punctuation character or CJK ideograph) within their own segment, from 0; None for the special tokens
  added around the segments. The pieces of an [UNK] word share one word id like any other.
- Truncation follows the reference (transformers' `truncate_sequences`), not the engine's: longest-first
  cuts the longer segment down to the shorter, then splits what remains, the odd token coming from B
  (`truncation.py`; pretraining instances use the same rule).
- Batches are padded on the right with [PAD], type id 0 and attention mask 0 (1 = real token).
- Special tokens written in the text ("[MASK]") are recognised as such, before any normalisation.

Modules: `wordpiece` (the Tokenizer), `engine` (the pipeline assembled from the engine's parts), `unicode` (the
character classes), `encoding` (result types), `truncation` (the pair rule), `vocab` (vocab.txt, special
tokens, fingerprints), `training` (learning a vocabulary), `coverage` (how well a vocabulary covers a corpus).
"""

from __future__ import annotations

from bertforge.tokenizer.coverage import corpus_summary
from bertforge.tokenizer.encoding import BatchEncoding, Encoding
from bertforge.tokenizer.training import Alphabet, VocabOptions, count_alphabet
from bertforge.tokenizer.truncation import longest_first
from bertforge.tokenizer.vocab import SPECIAL_TOKENS, fingerprint, recorded_fingerprint
from bertforge.tokenizer.wordpiece import Tokenizer

__all__ = ["SPECIAL_TOKENS", "Alphabet", "BatchEncoding", "Encoding", "Tokenizer", "VocabOptions", "corpus_summary",
           "count_alphabet", "fingerprint", "longest_first", "recorded_fingerprint"]

"""The vocabulary: its special tokens, vocab.txt, and the fingerprint that names a tokenizer.

ids index the vocabulary (the line number in vocab.txt); [PAD] [UNK] [CLS] [SEP] [MASK] must be in it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from bertforge.errors import BertforgeError
from bertforge.files import read_json_object

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
SPECIAL_TOKENS = (PAD, UNK, CLS, SEP, MASK)  # the order training gives them: [PAD] = 0
SUBWORD_PREFIX = "##"
# The largest vocabulary `vocab train` learns. The engine's trainer reserves memory for the size it is asked
# (1e9 tokens: a 70 GB allocation and an abort), and the largest vocabularies in use are about 250k tokens
# (XLM-R, mT5); a million is far past any use and costs the engine well under a gigabyte.
MAX_VOCAB_SIZE = 1_000_000


def read_vocab(path: Path) -> list[str]:
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
        value = _tokenizer_file(config).get("bertforge_fingerprint")
    except BertforgeError:
        return None
    return value if isinstance(value, str) else None


def check_recorded_fingerprint(directory: Path, vocab: Sequence[str]) -> None:
    """A vocab.txt edited, shuffled or replaced after the directory was written would give every token the
    wrong id without any other sign: refuse it."""
    recorded = recorded_fingerprint(directory)
    if recorded is None:
        return
    declared = declared_lowercase(directory)
    found = fingerprint(vocab, True if declared is None else declared)
    if found != recorded:
        raise BertforgeError(f"{directory / 'vocab.txt'} has tokenizer fingerprint {found}, but "
                             f"{directory / 'tokenizer_config.json'} records {recorded}: the vocabulary was changed "
                             f"after the directory was written, so token ids would not match the weights; restore "
                             f"the directory's own vocab.txt")


def declared_lowercase(directory: Path) -> bool | None:
    """The casing a model directory's tokenizer_config.json or tokenizer.json declares, if any."""
    config = directory / "tokenizer_config.json"
    if config.is_file():
        value = _tokenizer_file(config).get("do_lower_case")
        if isinstance(value, bool):
            return value
    spec = directory / "tokenizer.json"
    if spec.is_file():
        norm = _tokenizer_file(spec).get("normalizer") or {}
        if norm.get("type") == "BertNormalizer":
            return bool(norm.get("lowercase", True))
        if norm.get("type") == "Sequence":
            return any(step.get("type") == "Lowercase" for step in norm.get("normalizers", []))
    return None


def _tokenizer_file(path: Path) -> dict:
    return read_json_object(path, what="tokenizer settings",
                            fix="restore the directory's tokenizer files, or remove it to use vocab.txt alone")

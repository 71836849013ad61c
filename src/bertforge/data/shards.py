"""Prepared data on disk: memory-mapped token shards with sentence and document offsets, and a manifest.

Layout of DATA_DIR (all integers little-endian, raw arrays readable with `np.memmap`):

    manifest.json                     format, tokenizer fingerprint, vocab size, max_seq_len, counts, settings
    tokenizer/                        the tokenizer the shards were made with
    {split}-{k:05d}.tokens            token ids, dtype `manifest["dtype"]` (uint16 when the vocab fits)
    {split}-{k:05d}.sentences         int64, n_sentences + 1 offsets into .tokens
    {split}-{k:05d}.documents         int64, n_documents + 1 offsets into .sentences
    {split}-{k:05d}.json              the shard's counts and tokenizer fingerprint (a stray shard is refused)

Sentence i of a shard is tokens[sentences[i]:sentences[i+1]]; document d is sentences documents[d] to
documents[d+1]. Every sentence has at least one token, every document at least one sentence. Shards end on
document boundaries; `split` is `train` or `val` (chosen per document).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import BinaryIO

import numpy as np

from bertforge.errors import BertforgeError
from bertforge.files import read_json_object

FORMAT = "bertforge-pretraining-data/1"
# what readers of a manifest look up, besides its format
MANIFEST_KEYS = ("tokenizer_fingerprint", "vocab_size", "dtype", "max_seq_len", "counts", "splits", "reading")
SPLITS = ("train", "val")


HEAD_KEYS = ("format", "tokenizer_fingerprint", "vocab_size", "dtype", "max_seq_len", "settings")


def assemble_manifest(head: dict, shards: dict[str, list[dict]], inputs: dict, reading: dict) -> dict:
    """A manifest: `head` (its HEAD_KEYS), the shards of each split with their sums, the inputs and what
    reading them found (`ReadStats.summary`)."""
    splits = {}
    for split, metas in shards.items():
        splits[split] = {key: sum(m[key] for m in metas) for key in ("documents", "sentences", "tokens")}
        splits[split]["shards"] = metas
    return {**{key: head[key] for key in HEAD_KEYS},
            "counts": {s: {k: v for k, v in splits[s].items() if k != "shards"} for s in SPLITS},
            "splits": splits, "inputs": inputs, "reading": reading}


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


class ShardWriter:
    """Appends documents to `{split}-{k}` shards under `out`, starting a new shard once one holds
    `shard_tokens` tokens. Memory use is a constant: everything is appended to files as it comes."""

    def __init__(self, out: Path, split: str, *, dtype: np.dtype, shard_tokens: int, fingerprint: str):
        self.out, self.split, self.dtype = out, split, dtype
        self.shard_tokens, self.fingerprint = shard_tokens, fingerprint
        self.shards: list[dict] = []
        self._files = None

    def _open(self) -> None:
        name = f"{self.split}-{len(self.shards):05d}"
        self._name = name
        exts = ("tokens", "sentences", "documents")
        self._files = [open(self.out / f"{name}.{ext}", "wb") for ext in exts]  # noqa: SIM115 (see _close)
        self._n_tokens = self._n_sentences = self._n_documents = 0
        _append(self._files[1], np.zeros(1, np.int64), "<i8")
        _append(self._files[2], np.zeros(1, np.int64), "<i8")

    def _close(self) -> None:
        for f in self._files:
            f.close()
        meta = {"name": self._name, "tokens": self._n_tokens, "sentences": self._n_sentences,
                "documents": self._n_documents, "tokenizer_fingerprint": self.fingerprint}
        (self.out / f"{self._name}.json").write_text(json.dumps(meta, indent=2) + "\n")
        self.shards.append(meta)
        self._files = None

    def add(self, tokens: np.ndarray, sentence_lengths: np.ndarray, doc_sentence_counts: np.ndarray) -> None:
        """Append whole documents: `tokens` (N,) concatenated; `sentence_lengths` (S,) summing to N;
        `doc_sentence_counts` (D,) summing to S."""
        sent_ends = np.cumsum(sentence_lengths, dtype=np.int64)
        doc_sent_ends = np.cumsum(doc_sentence_counts, dtype=np.int64)
        d0 = 0
        while d0 < len(doc_sentence_counts):
            if self._files is None:
                self._open()
            s0 = int(doc_sent_ends[d0 - 1]) if d0 else 0
            t0 = int(sent_ends[s0 - 1]) if s0 else 0
            # The documents up to the first one that fills the shard go in; the shard closes after it.
            room = self.shard_tokens - self._n_tokens
            doc_token_ends = sent_ends[doc_sent_ends[d0:] - 1] - t0
            d1 = d0 + int(np.searchsorted(doc_token_ends, room, side="left")) + 1
            d1 = min(d1, len(doc_sentence_counts))
            s1 = int(doc_sent_ends[d1 - 1])
            t1 = int(sent_ends[s1 - 1])
            _append(self._files[0], tokens[t0:t1], self.dtype)
            _append(self._files[1], self._n_tokens + sent_ends[s0:s1] - t0, "<i8")
            _append(self._files[2], self._n_sentences + doc_sent_ends[d0:d1] - s0, "<i8")
            self._n_tokens += t1 - t0
            self._n_sentences += s1 - s0
            self._n_documents += d1 - d0
            if self._n_tokens >= self.shard_tokens:
                self._close()
            d0 = d1

    def finish(self) -> list[dict]:
        if self._files is not None:
            self._close()
        return self.shards


def _append(f: BinaryIO, values: np.ndarray, dtype: np.dtype | str) -> None:
    """Append `values` as `dtype` to `f` through the file's own write, not ndarray.tofile: tofile can lose a write
    that fails (a full disk) without a word, or raise an OSError without errno; `f.write` raises ENOSPC or EFBIG
    (at the latest when `f` is closed)."""
    f.write(np.ascontiguousarray(values, dtype=dtype).data)


class Document:
    """A document as a sequence of sentences: `doc[i]` is sentence i's token array (a view, made on access)."""

    __slots__ = ("_tokens", "_offsets")

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray):
        self._tokens, self._offsets = tokens, offsets

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._tokens[self._offsets[i]:self._offsets[i + 1]]


class Shard:
    """One shard, memory-mapped read-only. `document(d)` is a list of sentence token arrays (views)."""

    def __init__(self, data_dir: Path, meta: dict, dtype: np.dtype, fingerprint: str):
        self._args = (data_dir, meta, dtype, fingerprint)
        name = meta["name"]
        own = _json_object(data_dir / f"{name}.json")
        if own.get("tokenizer_fingerprint") != fingerprint:
            raise BertforgeError(
                f"shard {data_dir / name} was made with another tokenizer than {data_dir}/manifest.json says: "
                "do not mix shards; prepare the corpus again into a fresh directory")
        if own != meta:
            raise BertforgeError(f"shard {data_dir / name} does not match {data_dir}/manifest.json: prepare again")
        self.name = name
        self.n_documents = meta["documents"]
        self.tokens = _memmap(data_dir / f"{name}.tokens", dtype, meta["tokens"])
        self.sentences = _memmap(data_dir / f"{name}.sentences", np.dtype("<i8"), meta["sentences"] + 1)
        self.documents = _memmap(data_dir / f"{name}.documents", np.dtype("<i8"), meta["documents"] + 1)
        # Plain ndarray views of the same mapped memory: slicing them is several times cheaper.
        self._tokens, self._sentences, self._documents = map(np.asarray, (self.tokens, self.sentences,
                                                                          self.documents))

    def __reduce__(self):
        return Shard, self._args  # reopen the memmaps in the receiving process rather than copy them

    def document(self, d: int) -> Document:
        s0, s1 = int(self._documents[d]), int(self._documents[d + 1])
        return Document(self._tokens, self._sentences[s0:s1 + 1])

    def document_offsets(self) -> np.ndarray:
        """(D + 1,) each document's first token's offset into the shard's tokens, then the token count."""
        return self._sentences[self._documents]

    def document_token_counts(self) -> np.ndarray:
        """(D,) tokens per document."""
        return np.diff(self.document_offsets())


def _memmap(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    size = path.stat().st_size if path.exists() else -1
    if size != count * dtype.itemsize:
        raise BertforgeError(f"{path} is missing or has the wrong size (expected {count} values): prepare again")
    if count == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


def read_manifest(data_dir: str | Path) -> dict:
    path = Path(data_dir) / "manifest.json"
    if not path.is_file():
        raise BertforgeError(f"{data_dir} holds no prepared data (no manifest.json): run `bertforge prepare` first")
    manifest = _json_object(path)
    if manifest.get("format") != FORMAT:
        raise BertforgeError(f"{path} has format {manifest.get('format')!r}, expected {FORMAT!r}: prepare again")
    missing = [key for key in MANIFEST_KEYS if key not in manifest]
    if missing:
        raise BertforgeError(f"{path} lacks {', '.join(missing)}: prepare the data again")
    return manifest


def _json_object(path: Path) -> dict:
    """The JSON object `prepare` wrote to `path`; a file gone, cut short or altered is a BertforgeError."""
    return read_json_object(path, what="what `prepare` recorded", fix="prepare the data again")


def open_split(data_dir: str | Path, split: str, manifest: dict | None = None) -> list[Shard]:
    """The memory-mapped shards of one split, checked against the manifest."""
    if split not in SPLITS:
        raise BertforgeError(f"unknown split {split!r}: use one of {', '.join(SPLITS)}")
    data_dir = Path(data_dir)
    manifest = manifest or read_manifest(data_dir)
    dtype = np.dtype(manifest["dtype"])
    fp = manifest["tokenizer_fingerprint"]
    shards = [Shard(data_dir, meta, dtype, fp) for meta in manifest["splits"][split]["shards"]]
    vocab_size = int(manifest["vocab_size"])
    for shard in shards:
        # One pass over the tokens (about a second per GB, once per process: workers reopen shards unchecked).
        # An id past the vocabulary would index past the embedding table, in the middle of training.
        top = int(shard._tokens.max()) if len(shard._tokens) else 0
        if top >= vocab_size:
            raise BertforgeError(f"shard {data_dir / shard.name} holds token id {top}, but the tokenizer has "
                                 f"{vocab_size} tokens (ids 0-{vocab_size - 1}): the data was modified after it was "
                                 "prepared; prepare the corpus again into a fresh directory")
    return shards

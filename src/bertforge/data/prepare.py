"""`bertforge prepare`: corpus -> tokenized, sharded, memory-mapped pretraining data (format in shards.py).

Pipeline: the corpus is planned into units (files, or byte ranges of big files; `bertforge.corpus`); worker processes
read, sentence-split and tokenize units in batches and append each unit's tokens to temporary part files;
the main process appends finished parts, in unit order, to the train/val shards and deletes them. Memory is
bounded by the batch size, not the corpus; the output depends only on the inputs and the seed (not on the
number of workers): units are merged in a fixed order and the validation split is drawn per document from
an RNG keyed on (seed, unit).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bertforge.corpus import TEXT_FIELD, ReadStats, Unit, expand_inputs, plan_units, read_unit, unit_bytes
from bertforge.data.parts import part_range, plan_digest
from bertforge.data.shards import (
    FORMAT,
    SPLITS,
    Shard,
    ShardWriter,
    assemble_manifest,
    read_manifest,
    token_dtype,
)
from bertforge.errors import BertforgeError
from bertforge.files import atomic_dir, write_json
from bertforge.progress import progress_reporter
from bertforge.tokenizer import Tokenizer

BATCH_CHARS = 1 << 20  # text tokenized per call, per worker
MAX_DOC_TOKENS = 1 << 20  # longer documents are cut into pieces of about this size


@dataclass(frozen=True)
class PrepareOptions:
    """What prepared data is made with, besides the corpus and the tokenizer: the same corpus, tokenizer and options
    give the same shards, whatever the workers (`bertforge prepare`'s flags of the same names; `format` is
    --format)."""

    max_seq_len: int = 128  # the sequence length instances will be made for (recorded; BERT: 128, then 512)
    val_fraction: float = 0.01  # share of the documents held out for the val split, chosen at random by `seed`
    seed: int = 12345  # seed of the validation split
    format: str = "auto"  # .txt layout: doc, lines or auto (`bertforge.corpus.plan_units`)
    text_field: str = TEXT_FIELD  # the .jsonl field, or the Parquet or Arrow column, that holds the text
    shard_tokens: int = 1 << 25  # tokens per shard file at most
    chunk_bytes: int = 64 << 20  # big files are read in units of about this many bytes
    max_doc_tokens: int = MAX_DOC_TOKENS  # longer documents are cut into pieces of about this size

    def __post_init__(self) -> None:
        if self.max_seq_len < 8:
            raise BertforgeError(f"--max-seq-len {self.max_seq_len} is too small: use at least 8 (BERT uses 128 and "
                                 "512)")
        if not 0.0 <= self.val_fraction < 1.0:
            raise BertforgeError(f"--val-fraction {self.val_fraction} is out of range: use a value in [0, 1)")


def usable_cores() -> int:
    """The cores this process may run on: those of its CPU affinity (a Slurm job's or a container's share)
    where the system says, else all of the machine's."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS and Windows have no affinity call
        return os.cpu_count() or 1


def _load_tokenizer(tokenizer: Any):
    if isinstance(tokenizer, str | os.PathLike):
        path = Path(tokenizer)
        if not path.is_dir():
            raise BertforgeError(f"tokenizer directory {path} not found: train one with `bertforge vocab train`")
        return Tokenizer.from_pretrained(path)
    return tokenizer


class _Part:
    """Token, sentence-length and document files of one unit and one split, appended as batches finish."""

    def __init__(self, stem: Path, dtype: np.dtype):
        self.paths = [stem.with_suffix(s) for s in (".tok", ".sent", ".doc")]
        self._files: list | None = None  # opened on the first write: most units have no val documents
        self.dtype = dtype
        self.doc_sentences = 0  # sentences of the open document
        self.doc_tokens = 0
        self.cut = False  # the open document was just cut at max_doc_tokens

    @property
    def files(self) -> list:
        if self._files is None:
            self._files = [open(p, "wb") for p in self.paths]  # noqa: SIM115 (closed by close())
        return self._files

    def close(self) -> None:
        for f in self._files or ():
            f.close()


class _UnitWriter:
    """A worker's output for one unit: each document drawn to a split, its tokens and sentence lengths appended
    to that split's part files batch by batch, a document over `max_doc_tokens` cut into pieces."""

    def __init__(self, tok: Any, stats: ReadStats, index: int, tmp: str, seed: int, val_fraction: float,
                 max_doc_tokens: int):
        self.tok, self.stats, self.val_fraction, self.max_doc_tokens = tok, stats, val_fraction, max_doc_tokens
        dtype = token_dtype(tok.vocab_size)
        self.parts = {s: _Part(Path(tmp) / f"{index:08d}-{s}", dtype) for s in SPLITS}
        self.rng = np.random.default_rng([seed, index])
        self.specials = np.array(sorted(tok.special_ids - {tok.unk_id}))  # [UNK] stays: it stands for a real word
        self.current = self._draw_split()  # split of the open document

    def _draw_split(self) -> str:
        return "val" if self.rng.random() < self.val_fraction else "train"

    @staticmethod
    def _close_doc(part: _Part) -> None:
        if part.doc_sentences:
            part.files[2].write(np.array([part.doc_sentences], "<i4"))
        part.doc_sentences = part.doc_tokens = 0
        part.cut = False

    def flush(self, batch: list[str | None]) -> None:
        """Tokenize a batch of sentences and document ends (None) and append it to the part files."""
        stats = self.stats
        texts = [s for s in batch if s is not None]
        ids, lengths = _without_special(*self.tok.tokenize_flat(texts), self.specials, stats)
        run_start = pos = 0  # the sentences not yet written are ids[run_start:pos]
        run_lengths: list[int] = []
        j = 0  # index of the next sentence in ids/lengths
        for item in batch:
            part = self.parts[self.current]
            if item is None:
                _write(part, ids[run_start:pos], run_lengths)
                run_start, run_lengths = pos, []
                if part.doc_sentences == 0 and not part.cut:
                    stats.counts["documents_without_tokens"] += 1
                self._close_doc(part)
                self.current = self._draw_split()
                continue
            n = int(lengths[j])
            j += 1
            if not n:
                stats.counts["sentences_without_tokens"] += 1
                continue
            pos += n
            run_lengths.append(n)
            part.doc_sentences += 1
            part.doc_tokens += n
            part.cut = False
            if part.doc_tokens >= self.max_doc_tokens:
                _write(part, ids[run_start:pos], run_lengths)
                run_start, run_lengths = pos, []
                stats.counts["long_documents_cut"] += 1
                self._close_doc(part)
                part.cut = True
        _write(self.parts[self.current], ids[run_start:pos], run_lengths)

    def close(self) -> None:
        for part in self.parts.values():
            if part.doc_sentences:  # a unit ends with END after every document; this is defensive
                self._close_doc(part)
            part.close()


def _process_unit(task: tuple[int, Unit, str, int, float, int]) -> tuple[int, ReadStats]:
    """Worker: stream one unit into part files `{tmp}/{index}-{split}.*`; return its read statistics."""
    index, unit, tmp, seed, val_fraction, max_doc_tokens = task
    stats = ReadStats()
    writer = _UnitWriter(_WORKER_TOKENIZER, stats, index, tmp, seed, val_fraction, max_doc_tokens)
    batch: list[str | None] = []
    size = 0
    for item in read_unit(unit, stats):
        batch.append(item)
        if item is not None:
            size += len(item)
            stats.counts["characters"] += len(item)
        if size >= BATCH_CHARS:
            writer.flush(batch)
            batch, size = [], 0
    writer.flush(batch)
    writer.close()
    return index, stats


def _without_special(ids: np.ndarray, lengths: np.ndarray, specials: np.ndarray,
                     stats: ReadStats) -> tuple[np.ndarray, np.ndarray]:
    """Drop special tokens spelled out in the text ("[SEP]", "[MASK]"): they would fake structure."""
    found = np.isin(ids, specials)
    n_found = int(found.sum())
    if not n_found:
        return ids, lengths
    stats.counts["special_tokens_in_text_dropped"] += n_found
    text_of_token = np.repeat(np.arange(len(lengths)), lengths)
    return ids[~found], lengths - np.bincount(text_of_token[found], minlength=len(lengths))


def _write(part: _Part, ids: np.ndarray, lengths: list[int]) -> None:
    if not lengths:
        return
    # file.write, not ndarray.tofile: tofile loses a small write whose flush fails (a full disk) without a word
    part.files[0].write(ids.astype(part.dtype))
    part.files[1].write(np.asarray(lengths, "<i4"))


_WORKER_TOKENIZER: Any = None


def _init_worker(tokenizer: Any) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tokenizer
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def prepare(corpus: list[str], tokenizer: Any, out: str | os.PathLike, options: PrepareOptions | None = None, *,
            workers: int | None = None, part: tuple[int, int] | None = None, overwrite: bool = False,
            progress: bool = True) -> dict:
    """Tokenize `corpus` (files, directories, globs) with `tokenizer` (a Tokenizer or its directory) into
    shards under `out`, as `options` say (default: PrepareOptions()); return the manifest. `out` is replaced
    atomically when complete.

    `workers` defaults to every core this process may use (`usable_cores`). `part=(i, n)` prepares only the i-th
    of n parts of the corpus, for `join` to assemble (see `parts`).
    """
    o = options if options is not None else PrepareOptions()
    tok = _load_tokenizer(tokenizer)
    out = Path(out)
    check_out(out, tok.fingerprint, overwrite)
    workers = max(1, workers if workers is not None else usable_cores())
    stats = ReadStats()
    paths = expand_inputs(list(corpus), stats)
    _check_out_apart(out, corpus, paths)
    units = plan_units(paths, o.format, chunk_bytes=o.chunk_bytes, stats=stats, text_field=o.text_field)
    if not units:
        raise BertforgeError(f"no readable text in {list(corpus)} ({stats.skipped_note()}): "
                             "check --corpus")
    dtype = token_dtype(tok.vocab_size)
    sizes = [unit_bytes(u) for u in units]
    selected = range(len(units)) if part is None else part_range(sizes, *part)
    if part is not None and part[0] > 1:
        stats = ReadStats()  # what planning skipped is reported once, by part 1, as one machine reports it first

    with atomic_dir(out) as tmp_out:
        parts_dir = tmp_out / ".parts"  # each unit's tokens, until they are appended to the shards
        parts_dir.mkdir()
        writers = {s: ShardWriter(tmp_out, s, dtype=dtype, shard_tokens=o.shard_tokens, fingerprint=tok.fingerprint)
                   for s in SPLITS}
        tasks = [(i, units[i], str(parts_dir), o.seed, o.val_fraction, o.max_doc_tokens) for i in selected]
        _run_units(tasks, tok, workers, writers, stats, sizes, progress)
        shutil.rmtree(parts_dir)
        manifest = _manifest(tok, dtype, o, paths, {s: w.finish() for s, w in writers.items()}, stats)
        if part is not None:
            settings = {"seed": o.seed, "val_fraction": o.val_fraction, "format": o.format, "text_field": o.text_field,
                        "chunk_bytes": o.chunk_bytes, "max_doc_tokens": o.max_doc_tokens, "max_seq_len": o.max_seq_len}
            manifest["part"] = {"index": part[0], "count": part[1], "plan": plan_digest(units, sizes, settings),
                                "units": [selected.start, selected.stop], "shard_tokens": o.shard_tokens}
        elif manifest["splits"]["train"]["documents"] == 0:
            raise BertforgeError(f"no documents with text in {list(corpus)}: check --corpus (and --val-fraction)")
        check_shard_sizes(tmp_out, manifest)
        tok.save_pretrained(tmp_out / "tokenizer")
        write_json(tmp_out / "manifest.json", manifest)
    return manifest


def _run_units(tasks: list[tuple], tok: Any, workers: int, writers: dict[str, ShardWriter], stats: ReadStats,
               sizes: list[int], progress: bool) -> None:
    """Tokenize the units of `tasks` in workers and append their parts, in unit order, to the split writers."""
    parts_dir = Path(tasks[0][2]) if tasks else None
    bar = progress_reporter(sum(sizes[t[0]] for t in tasks), desc="prepare", unit="B", enabled=progress)
    try:
        with _unit_results(tasks, tok, workers) as results:
            for index, unit_stats in results:
                stats.add(unit_stats)
                for split, writer in writers.items():
                    _merge_part(parts_dir / f"{index:08d}-{split}", writer, writer.dtype)
                bar.update(sizes[index])
                bar.set_postfix(docs=stats.counts["documents"], refresh=False)
    finally:
        bar.close()


@contextlib.contextmanager
def _unit_results(tasks: list[tuple], tok: Any, workers: int) -> Iterator[Iterator[tuple[int, ReadStats]]]:
    """`_process_unit`'s results in unit order: run here with one worker (or one unit), else in a pool."""
    if workers == 1 or len(tasks) <= 1:
        _init_worker(tok)
        yield map(_process_unit, tasks)
        return
    ctx = multiprocessing.get_context("spawn" if os.name == "nt" else "fork")
    pool = ctx.Pool(min(workers, len(tasks)), initializer=_init_worker, initargs=(tok,))
    try:
        yield pool.imap(_process_unit, tasks, chunksize=1)
    finally:
        pool.terminate()
        pool.join()


def _merge_part(stem: Path, writer: ShardWriter, dtype: np.dtype) -> None:
    tok_p, sent_p, doc_p = (stem.with_suffix(s) for s in (".tok", ".sent", ".doc"))
    if not doc_p.exists():  # nothing was written for this split
        return
    lengths = np.fromfile(sent_p, "<i4")
    docs = np.fromfile(doc_p, "<i4")
    if len(docs):
        tokens = np.memmap(tok_p, dtype=dtype, mode="r") if tok_p.stat().st_size else np.zeros(0, dtype)
        writer.add(tokens, lengths, docs)
        del tokens
    for p in (tok_p, sent_p, doc_p):
        p.unlink()


def check_shard_sizes(out: Path, manifest: dict) -> None:
    """Every shard file has the size its counts give: a last guard against a short write (a full disk) that
    went unreported; an OSError here lets bertforge.files find out which limit was hit and say so."""
    dtype = np.dtype(manifest["dtype"])
    for split in SPLITS:
        for meta in manifest["splits"][split]["shards"]:
            try:
                Shard(out, meta, dtype, manifest["tokenizer_fingerprint"])
            except BertforgeError as e:
                raise OSError(f"a write was lost: {e}") from None


def check_out(out: Path, fingerprint: str, overwrite: bool) -> None:
    if not out.exists() or overwrite:
        return
    if not out.is_dir():
        raise BertforgeError(f"--out {out} exists and is not a directory: choose another --out")
    if (out / "manifest.json").is_file():
        old = read_manifest(out)
        if old.get("tokenizer_fingerprint") != fingerprint:
            raise BertforgeError(
                f"{out} holds data prepared with a different tokenizer ({old.get('tokenizer_fingerprint')}): "
                "choose another --out, or pass --overwrite to replace it")
        return
    if any(out.iterdir()):
        raise BertforgeError(f"--out {out} is a non-empty directory without prepared data: choose another --out "
                             "or pass --overwrite")


def _check_out_apart(out: Path, corpus: list[str], paths: list[Path]) -> None:
    """`out` is replaced whole when the data is complete: it must not hold the corpus (--overwrite would delete
    it) nor lie inside a corpus directory (the next read of that directory would find the data)."""
    target = out.resolve()
    for f in paths:
        f = f.resolve()
        if f == target or target in f.parents:
            raise BertforgeError(f"--out {out} holds corpus file {f}: replacing it would delete the corpus; choose "
                                 "an --out outside the corpus")
    for c in corpus:
        d = Path(c).expanduser().resolve()
        if d.is_dir() and (d == target or d in target.parents):
            raise BertforgeError(f"--out {out} is inside the corpus directory {c}: choose an --out outside it")


def _manifest(tok: Any, dtype: np.dtype, options: PrepareOptions, paths: list[Path],
              shards: dict[str, list[dict]], stats: ReadStats) -> dict:
    head = {"format": FORMAT, "tokenizer_fingerprint": tok.fingerprint, "vocab_size": tok.vocab_size,
            "dtype": dtype.str, "max_seq_len": options.max_seq_len,
            "settings": {"seed": options.seed, "val_fraction": options.val_fraction, "format": options.format}}
    inputs = {"files": len(paths), "bytes": sum(p.stat().st_size for p in paths)}
    return assemble_manifest(head, shards, inputs, stats.summary())

"""The teacher's outputs on the examples a student distils on: computed once, on the teacher's fastest engine, and
cached beside a manifest, so a repeated or resumed run never runs the teacher again.

The teacher tokenizes the raw examples itself (its own vocabulary, its own task.json's sequence length; a
transformers teacher, foreign.py, its own tokenizer up to the task's length) and its
outputs are kept per example: its logits (classification), its value (regression), its choices' scores (multiple
choice), or per word the logits on the word's first sub-token (tagging; NaN for a word its tokenizer dropped). The
student's features are matched to them by example and word (`objective.with_targets`), whatever its tokenizer.

A cache entry is a directory named by its key, `<cache>/<key>/`: `manifest.json` (what the outputs are of: the
teacher's files' sha256, the examples' texts' sha256 in order, the task, the sequence length, the engine and its
batch size), `logits.npy` (R x L float32, the rows of every example in order) and `offsets.npy` (example i's rows
are offsets[i]:offsets[i + 1]). The key is a digest of the manifest without the teacher's path, so a changed
teacher or text is another entry and a copied teacher finds its own. Entries are written whole (`atomic_dir`);
one that does not read back as its manifest says (cut short, edited, another format) is computed again, never
trusted.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bertforge.device import pick_device
from bertforge.distill.foreign import is_foreign, run_foreign
from bertforge.errors import BertforgeError
from bertforge.files import atomic_dir, cache_dir, file_sha256, write_json
from bertforge.infer import EngineOptions, Predictor
from bertforge.infer.checks import auto_streams, engine_device
from bertforge.options import DistillOptions
from bertforge.progress import progress_reporter
from bertforge.tasks import ChoiceExample, TaggedExample
from bertforge.tasks.runner import per_feature_outputs

FORMAT = 1  # of a cache entry; another format is another key
MANIFEST, LOGITS, OFFSETS = "manifest.json", "logits.npy", "offsets.npy"
_CHUNK = 4096  # features a progress step: the teacher runs each chunk's length-sorted batches
_IDENTITY_FILES = ("config.json", "vocab.txt", "tokenizer.json", "tokenizer_config.json", "task.json",
                   "special_tokens_map.json", "vocab.json", "merges.txt", "spiece.model", "sentencepiece.bpe.model")


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/bertforge/teacher-outputs, by default ~/.cache/bertforge/teacher-outputs."""
    return cache_dir() / "teacher-outputs"


def cache_root(cache: str | Path | None) -> Path:
    """The cache directory `cache` names (`--cache-dir`), else the default one."""
    return Path(cache) if cache is not None else default_cache_dir()


@dataclass(frozen=True)
class TeacherOutputs:
    """The teacher's outputs, one float32 array per example ((L,), (1,), (C,), or (W_i, L) per word for tagging),
    the cache key and manifest they are stored under, and whether they came from the cache."""

    outputs: list[np.ndarray]
    key: str
    manifest: dict
    cached: bool


def teacher_engine(options: DistillOptions, device: str | None) -> EngineOptions:
    """The engine `options.teacher_engine` names on the training's device: auto is int8 on a CPU (predict's fastest
    there), the device's native precision (bf16 where it has it) on a GPU."""
    choice = options.teacher_engine
    if choice == "int8" or (choice == "auto" and pick_device(device).type == "cpu"):
        return EngineOptions(quantize="int8")
    return EngineOptions(device=device, precision="auto" if choice == "auto" else choice)


def teacher_identity(teacher: Path) -> dict[str, Any]:
    """The teacher's path and the sha256 of each file that decides its outputs (weights, config, tokenizer, task)."""
    names = sorted(p.name for p in teacher.iterdir() if p.is_file() and (
        p.name in _IDENTITY_FILES or p.suffix in (".safetensors", ".bin") or p.name.endswith(".index.json")))
    return {"path": str(teacher.resolve()), "files": {n: file_sha256(teacher / n) for n in names}}


def example_texts(example: Any) -> Any:
    """What the teacher reads of an example (not its label)."""
    if isinstance(example, ChoiceExample):
        return [example.context, example.choices]
    if isinstance(example, TaggedExample):
        return example.words
    return [example.text, example.text_pair]


def texts_sha256(examples: Sequence[Any]) -> str:
    h = hashlib.sha256()
    for ex in examples:
        h.update(json.dumps(example_texts(ex), ensure_ascii=False).encode())
        h.update(b"\n")
    return h.hexdigest()


def cache_key(manifest: dict) -> str:
    """The entry's name: a digest of the manifest without the teacher's path."""
    return hashlib.sha256(json.dumps(_unkeyed(manifest), sort_keys=True).encode()).hexdigest()[:32]


def _unkeyed(manifest: dict) -> dict:
    return {**manifest, "teacher": {k: v for k, v in manifest["teacher"].items() if k != "path"}}


def teacher_outputs(teacher: str | Path, examples: Sequence[Any], options: DistillOptions, *, task: Any = None,
                    device: str | None = None, cache: str | Path | None = None,
                    progress: bool = True) -> TeacherOutputs:
    """The teacher's outputs on `examples`: the cache's entry when it holds them, else computed on the teacher's
    engine (`teacher_engine`) with a progress bar and stored in the cache first. A transformers teacher
    (foreign.py) reads the examples as `task` (its labels, `foreign_task`) up to the task's sequence length."""
    teacher = Path(teacher)
    engine = teacher_engine(options, device)
    foreign = is_foreign(teacher)
    if foreign and task is None:
        raise BertforgeError(f"--teacher {teacher} is a transformers model: give its task (foreign.foreign_task)")
    spec = ({"task": task.name, "labels": task.labels, "max_length": task.max_length} if foreign
            else json.loads((teacher / "task.json").read_text()))
    manifest = {"format": FORMAT, "teacher": teacher_identity(teacher), "examples": len(examples),
                "text_sha256": texts_sha256(examples), "task": spec.get("task"), "labels": spec.get("labels"),
                "max_length": spec.get("max_length"), "batch_size": options.teacher_batch_size,
                "engine": {"precision": engine.precision, "quantize": engine.quantize,
                           "device": engine_device(engine).type, **({"runtime": "transformers"} if foreign else {})}}
    key = cache_key(manifest)
    entry = cache_root(cache) / key
    found = read_entry(entry, manifest)
    if found is not None:
        return TeacherOutputs(found, key, manifest, cached=True)
    if foreign:
        outputs = run_foreign(teacher, examples, engine, options.teacher_batch_size, task.max_length, progress)
    else:
        outputs = run_teacher(teacher, examples, engine, options.teacher_batch_size, progress)
    write_entry(entry, manifest, outputs)
    return TeacherOutputs(outputs, key, manifest, cached=False)


def mean_outputs(members: Sequence[TeacherOutputs], orders: Sequence[Sequence[int] | None]) -> TeacherOutputs:
    """Several teachers' outputs as one teacher's: per example (per word for tagging) the mean of theirs, each
    teacher's labels first put in the first one's order (`orders[i]`: where teacher i holds each label; None: as
    they are). A word some teacher has no output for (NaN) takes the others' mean. One teacher is returned as it is;
    several get a key of their keys, and the manifest {"members": their keys}."""
    if len(members) == 1 and orders[0] is None:
        return members[0]
    flat = [_flat(m.outputs) for m in members]
    rows = [logits if order is None else logits[:, list(order)]
            for (logits, _), order in zip(flat, orders, strict=True)]
    offsets = flat[0][1]
    if len({r.shape for r in rows}) != 1 or any(not np.array_equal(o, offsets) for _, o in flat):
        raise BertforgeError(f"the teachers' outputs have other shapes ({', '.join(str(r.shape) for r in rows)}): "
                             "give teachers of the same task and labels")
    stacked = np.stack(rows)
    every = ~np.isnan(stacked)
    total = np.where(every, stacked, 0.0).sum(axis=0)
    counts = every.sum(axis=0).astype(np.float32)
    mean = np.divide(total, counts, out=np.full(total.shape, np.nan, np.float32), where=counts > 0)
    first = members[0].outputs
    keys = [m.key for m in members]
    return TeacherOutputs(_split(mean, offsets, per_word=bool(first) and first[0].ndim == 2),
                          hashlib.sha256(" ".join(keys).encode()).hexdigest()[:32], {"members": keys},
                          cached=all(m.cached for m in members))


def run_teacher(teacher: Path, examples: Sequence[Any], engine: EngineOptions, batch_size: int,
                progress: bool) -> list[np.ndarray]:
    """The teacher's outputs per example (see `TeacherOutputs`), run on `engine` in chunks with a progress bar."""
    predictor = Predictor(teacher, engine)
    tm, task = predictor.task_model, predictor.task
    label_map = task.label_map() if task.labels and task.kind in ("classification", "token_classification") else None
    features = task.features(list(examples), tm.tokenizer, tm.max_length, label_map)
    where = engine_device(engine)
    results: list[Any] = []
    bar = progress_reporter(len(features), desc="teacher", unit="input", enabled=progress)
    try:
        for i in range(0, len(features), _CHUNK):
            chunk = features[i:i + _CHUNK]
            streams = auto_streams("torch", where, -(-len(chunk) // batch_size))
            results += per_feature_outputs(tm.model, chunk, tm.tokenizer.pad_id, batch_size=batch_size, device=where,
                                           streams=streams)
            bar.update(len(chunk))
    finally:
        bar.close()
    if task.kind != "token_classification":
        return [np.asarray(r, dtype=np.float32).reshape(-1) for r in results]
    words = [np.full((len(ex.words), len(task.labels)), np.nan, dtype=np.float32) for ex in examples]
    seen: list[set] = [set() for _ in examples]
    for f, logits in zip(features, results, strict=True):
        i = f["example_index"]
        for pos, w in enumerate(f["word_ids"]):
            if w is not None and w not in seen[i]:
                seen[i].add(w)
                words[i][w] = logits[pos]
    return words


def _flat(outputs: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Every example's rows in one (R, L) float32 array (an example's output one row, a tagged sentence's a row a
    word), and where example i's rows start: offsets[i] (n + 1 of them). `_split` undoes it."""
    rows = [o.reshape(-1, o.shape[-1]) if o.ndim == 2 else o.reshape(1, -1) for o in outputs]
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
    width = rows[0].shape[1] if rows else 0
    logits = np.concatenate(rows).astype(np.float32) if rows else np.zeros((0, width), np.float32)
    return logits, offsets


def _split(logits: np.ndarray, offsets: np.ndarray, per_word: bool) -> list[np.ndarray]:
    """Each example's outputs from `_flat`'s rows: its rows (tagging), else its one row."""
    if per_word:
        return [logits[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
    return list(logits)


def write_entry(entry: Path, manifest: dict, outputs: Sequence[np.ndarray]) -> None:
    """The cache entry of `outputs`, written whole."""
    logits, offsets = _flat(outputs)
    with atomic_dir(entry) as tmp:
        np.save(tmp / LOGITS, logits)
        np.save(tmp / OFFSETS, offsets)
        write_json(tmp / MANIFEST, {**manifest, "rows": int(len(logits)), "width": int(logits.shape[1]),
                                    "per_word": bool(outputs) and outputs[0].ndim == 2})


def read_entry(entry: Path, manifest: dict) -> list[np.ndarray] | None:
    """The outputs of the cache entry `entry` when it holds what `manifest` describes, whole; None otherwise (absent,
    cut short, edited: the caller computes them again)."""
    try:
        stored = json.loads((entry / MANIFEST).read_text())
        described = {k: v for k, v in stored.items() if k not in ("rows", "width", "per_word")}
        if _unkeyed(described) != _unkeyed(manifest):
            return None
        logits = np.load(entry / LOGITS, allow_pickle=False)
        offsets = np.load(entry / OFFSETS, allow_pickle=False)
    except (OSError, ValueError, EOFError, TypeError, AttributeError, KeyError):
        return None
    n = manifest["examples"]
    if not (logits.dtype == np.float32 and logits.shape == (stored.get("rows"), stored.get("width"))
            and offsets.dtype == np.int64 and offsets.shape == (n + 1,) and offsets[0] == 0
            and offsets[-1] == len(logits) and bool(np.all(np.diff(offsets) >= 0))
            and not np.isinf(logits).any()):
        return None
    if not stored.get("per_word") and not (np.all(np.diff(offsets) == 1) and np.isfinite(logits).all()):
        return None
    return _split(logits, offsets, per_word=bool(stored.get("per_word")))

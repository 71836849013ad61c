"""`bertforge join`: the parts of a `prepare --shard I/N` run made into one prepared dataset, byte-identical to
what `prepare` makes of the whole corpus on one machine (see `parts`): the parts' documents appended in part
order to new shards, their counts summed, what reading found merged, the tokenizer copied from part 1.

The join refuses, in one line each, parts of another run: another tokenizer, another sequence length, another N,
another corpus or settings (the plan's digest), and a part missing or given twice.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from bertforge.corpus import ReadStats
from bertforge.data.prepare import check_out, check_shard_sizes
from bertforge.data.shards import SPLITS, ShardWriter, assemble_manifest, open_split, read_manifest
from bertforge.errors import BertforgeError
from bertforge.files import atomic_dir, write_json


def _part_manifests(parts: list[str | os.PathLike]) -> list[tuple[Path, dict]]:
    """The parts' directories and manifests in part order, checked to be all the parts of one run."""
    found: dict[int, tuple[Path, dict]] = {}
    first: tuple[Path, dict] | None = None
    for directory in map(Path, parts):
        m = read_manifest(directory)
        part = m.get("part")
        if not isinstance(part, dict):
            raise BertforgeError(f"{directory} is not a part of a `prepare --shard I/N` run (its manifest names no "
                                 "part): give the directories that `prepare --shard` wrote")
        first = first or (directory, m)
        _check_same_run(directory, m, *first)
        if part["index"] in found:
            raise BertforgeError(f"part {part['index']} of {part['count']} is given twice ({found[part['index']][0]} "
                                 f"and {directory}): give each part once")
        found[part["index"]] = (directory, m)
    if first is None:
        raise BertforgeError("no parts to join: give the directories that `prepare --shard I/N` wrote")
    count = first[1]["part"]["count"]
    missing = [i for i in range(1, count + 1) if i not in found]
    if missing:
        raise BertforgeError(f"part{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} of {count} "
                             f"{'are' if len(missing) > 1 else 'is'} missing: prepare "
                             f"{'them' if len(missing) > 1 else 'it'} with --shard {missing[0]}/{count} and join "
                             f"all {count}")
    return [found[i] for i in range(1, count + 1)]


def _check_same_run(directory: Path, m: dict, first_dir: Path, first: dict) -> None:
    part, first_part = m["part"], first["part"]
    if part["count"] != first_part["count"]:
        raise BertforgeError(f"{directory} is part {part['index']} of {part['count']}, {first_dir} of "
                             f"{first_part['count']}: join the parts of one run, all made with the same N")
    if m["tokenizer_fingerprint"] != first["tokenizer_fingerprint"]:
        raise BertforgeError(f"{directory} was prepared with another tokenizer ({m['tokenizer_fingerprint']}) than "
                             f"{first_dir} ({first['tokenizer_fingerprint']}): prepare every part with one --tokenizer")
    if m["max_seq_len"] != first["max_seq_len"]:
        raise BertforgeError(f"{directory} was prepared for --max-seq-len {m['max_seq_len']}, {first_dir} for "
                             f"{first['max_seq_len']}: prepare every part with one --max-seq-len")
    if part["plan"] != first_part["plan"]:
        raise BertforgeError(f"{directory} was prepared from another corpus or other settings than {first_dir} "
                             "(--corpus, --format, --text-field, --seed, --val-fraction): prepare every part with "
                             "the same ones")


def join(parts: list[str | os.PathLike], out: str | os.PathLike, *, overwrite: bool = False) -> dict:
    """Join the directories of all N parts of a `prepare --shard I/N` run (in any order) into `out`; return the
    manifest. `out` is replaced atomically when complete."""
    ordered = _part_manifests(parts)
    first_dir, first = ordered[0]
    out = Path(out)
    for directory, _ in ordered:
        if out.resolve() == directory.resolve():
            raise BertforgeError(f"--out {out} is one of the parts: choose another --out")
    check_out(out, first["tokenizer_fingerprint"], overwrite)
    dtype = np.dtype(first["dtype"])
    with atomic_dir(out) as tmp_out:
        writers = {s: ShardWriter(tmp_out, s, dtype=dtype, shard_tokens=first["part"]["shard_tokens"],
                                  fingerprint=first["tokenizer_fingerprint"]) for s in SPLITS}
        for directory, m in ordered:
            for split in SPLITS:
                for shard in open_split(directory, split, m):
                    writers[split].add(shard.tokens, np.diff(shard.sentences), np.diff(shard.documents))
        reading = ReadStats.merge_summaries([m["reading"] for _, m in ordered])
        manifest = assemble_manifest(first, {s: w.finish() for s, w in writers.items()}, first["inputs"], reading)
        if manifest["splits"]["train"]["documents"] == 0:
            raise BertforgeError(f"the {len(ordered)} parts hold no training documents: check the corpus they were "
                                 "prepared from (and --val-fraction)")
        check_shard_sizes(tmp_out, manifest)
        shutil.copytree(first_dir / "tokenizer", tmp_out / "tokenizer")
        write_json(tmp_out / "manifest.json", manifest)
    return manifest

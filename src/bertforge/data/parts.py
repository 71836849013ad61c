"""Preparing a corpus on many machines: `prepare --shard I/N` prepares the I-th of N parts, `join` (data/join.py)
makes them one prepared dataset, byte-identical to what one machine makes of the whole corpus.

Every machine plans the whole corpus into the same units (`bertforge.corpus.plan_units`: files, byte ranges of
large line-based files, row-group ranges of Parquet files; planning reads only samples and Parquet footers) and
prepares a contiguous run of them, about 1/N of the bytes. Units keep their global numbers, so each document
draws the same train/val split as on one machine, and the join appends the parts' documents in unit order.
A part records what makes it a part of this run and no other: the plan's digest, I and N.
"""

from __future__ import annotations

import hashlib
import json
import os

from bertforge.corpus import Unit
from bertforge.errors import BertforgeError


def parse_part(text: str) -> tuple[int, int]:
    """`"2/3"` -> (2, 3): the second of three parts, counted from 1."""
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise BertforgeError(f"--shard {text!r} is not I/N: give the part's number and the number of parts, "
                             "e.g. --shard 2/3 (counted from 1)") from None
    if not 1 <= index <= count:
        raise BertforgeError(f"--shard {text}: the part's number must be 1 to {count}, e.g. --shard 1/{count}")
    return index, count


def part_range(sizes: list[int], index: int, count: int) -> range:
    """The units of part `index` of `count` (from 1): a contiguous run whose ends are the unit boundaries nearest
    to (index-1)/count and index/count of the bytes. Parts of a corpus with fewer units than parts may be empty."""
    total = sum(sizes)
    ends = [0]  # bytes before each unit boundary
    for size in sizes:
        ends.append(ends[-1] + size)

    def boundary(k: int) -> int:  # nearest to k/count of the bytes, the earlier on a tie; exact in integers
        if k in (0, count):  # every unit, empty ones at either end too
            return 0 if k == 0 else len(sizes)
        return min(range(len(ends)), key=lambda i: abs(ends[i] * count - total * k))

    return range(boundary(index - 1), boundary(index))


def plan_digest(units: list[Unit], sizes: list[int], settings: dict) -> str:
    """What a part was prepared from: the units (paths relative to the corpus's common directory, as machines
    may mount it at different places), their sizes, and the settings that change the output."""
    paths = [u.path for u in units]
    root = os.path.commonpath([os.path.abspath(p) for p in paths]) if paths else ""
    if paths and os.path.isfile(root):
        root = os.path.dirname(root)
    plan = [[os.path.relpath(os.path.abspath(u.path), root), u.fmt, u.start, u.end, u.field, size]
            for u, size in zip(units, sizes, strict=True)]
    text = json.dumps({"units": plan, "settings": settings}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]

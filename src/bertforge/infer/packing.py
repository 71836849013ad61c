"""Packed (unpadded) inference: an encoder's token-wise work done over a batch's real tokens only.

A padded batch (B, T) of texts of different lengths costs every Linear layer and LayerNorm B x T rows, padding
included. `PackedEncoder` gathers the real tokens into one (S, H) matrix once (S: their count, rounded up a little
by `packed_rows`), runs each layer's products, GELU and LayerNorms on it, and only for the attention scatters the
query/key/value rows back into the padded (B, N, T, D) layout, where the padding mask applies as before; the
attention's output rows are gathered back. So a group of short texts of random lengths, such as the server's, need
not be cut into many small length-sorted batches to keep its padding low: its products see all its tokens at once.
The layers themselves run unchanged (`BertLayer.forward`, post-LN or pre-LN) on (1, S, H): only their attention is
wrapped (`PackedSelfAttention`), and it tells a packed call from a padded one by the `Packing` passed where the
padding mask would be.

The results are the padded path's up to float rounding (the products are blocked differently). CPU fp32 and
bf16 models are packed (`infer.transforms.prepare`); int8 models keep the fused int8 encoder, ONNX Runtime its
own graph. Measurements: `bertforge.serve.model.group_batch_size` and docs/benchmarks.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from bertforge.encoder import BertEncoder, BertSelfAttention, attend
from bertforge.infer.fused import FusedEncoder, KernelSelfAttention
from bertforge.linear import packed_rows
from bertforge.training_attention import TrainingPacking


@dataclass
class Packing:
    """Where a padded batch's real tokens are: what a packed layer's attention needs to lay them out again."""

    keep: torch.Tensor  # (B, T) bool: the real tokens
    rows: torch.Tensor  # (S,) long: their flat indices b * T + t, in order (the packed rows)
    mask: torch.Tensor | None  # (B, 1, 1, T) bool: the SDPA padding mask; None: no padding
    positions: torch.Tensor | None  # (B, P) long: the padded positions the last layer computes, or None
    batch: torch.Tensor  # (packed_rows(S),) long: each packed row's b, then the spare rows' (copies of the first)
    token: torch.Tensor  # (packed_rows(S),) long: and its t


class PackedSelfAttention(nn.Module):
    """A `BertSelfAttention` that also takes packed rows: called with a `Packing` instead of a mask, x is (1, S, H)
    and so is the output; with positions too (the packed rows of the packing's positions, (1, B x P)), the queries
    are those positions only and the output is (1, B x P, H). Called with a mask or None, it is the attention it
    wraps."""

    def __init__(self, attention: BertSelfAttention):
        super().__init__()
        self.inner = attention

    def forward(self, x: torch.Tensor, mask: torch.Tensor | Packing | None, positions: torch.Tensor | None = None,
                training_rows: TrainingPacking | None = None) -> torch.Tensor:
        if not isinstance(mask, Packing):  # training_rows: a training batch's real tokens (bertforge.encoder)
            return self.inner(x, mask, positions, training_rows)
        inner, packing = self.inner, mask
        B, T = packing.keep.shape
        N, D = inner.num_heads, inner.head_size
        qkv = inner.qkv(x[0])  # (packed_rows(S), 3H)
        # the real rows back in their padded places; zeros (not garbage) in the padding, which the mask leaves out
        # of every sum but whose products must stay finite
        padded = qkv.new_zeros(B * T, qkv.shape[1]).index_copy_(0, packing.rows, qkv[:packing.rows.numel()])
        q, k, v = padded.view(B, T, 3, N, D).permute(2, 0, 3, 1, 4).unbind(0)  # each (B, N, T, D)
        if positions is not None:  # the last layer: the queries at the packing's positions only
            q = q.gather(2, packing.positions[:, None, :, None].expand(-1, N, -1, D))  # (B, N, P, D)
            y = attend(q, k, v, packing.mask, 0.0)  # (B, N, P, D)
            return y.transpose(1, 2).reshape(1, -1, N * D)  # (1, B x P, H), row-major as the packed positions
        y = attend(q, k, v, packing.mask, 0.0)  # (B, N, T, D)
        return y.transpose(1, 2)[packing.batch, packing.token].view(1, -1, N * D)  # (1, packed_rows(S), H)


class PackedEncoder(nn.Module):
    """A `BertEncoder` (its own layers, their attention wrapped in `PackedSelfAttention`) that runs every batch in
    eval mode packed, padded or not; a model in training runs as the encoder does."""

    def __init__(self, encoder: BertEncoder):
        super().__init__()
        for layer in encoder.layer:
            if not isinstance(layer.attention, PackedSelfAttention):
                layer.attention = PackedSelfAttention(layer.attention)
        self.plain = encoder
        self.train(encoder.training)  # a new module is in training mode: take the encoder's, wrappers included

    @property
    def layer(self) -> nn.ModuleList:
        return self.plain.layer

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        """As `BertEncoder.forward`: x (B, T, H), mask (B, 1, 1, T) bool or None, positions (B, P) or None; the
        output (B, T, H) (zeros at the padding), or (B, P, H). Positions must be real tokens (a head reads
        [CLS] or [MASK]s): the padded path computes padding's positions too, this one does not."""
        if self.training:
            return self.plain(x, mask, positions)
        B, T, H = x.shape
        # a batch without padding runs packed too: its rows rounded as any other's, so that one text after another,
        # each of its own length, reuses a few shapes' primitives (`packed_rows`)
        keep = mask[:, 0, 0, :] if mask is not None else x.new_ones(B, T, dtype=torch.bool)
        rows = keep.reshape(-1).nonzero().squeeze(1)  # (S,)
        S = rows.numel()
        # spare rows up to packed_rows(S): copies of the first real one (finite; no real row ever reads them)
        gather = torch.cat([rows, rows[:1].expand(packed_rows(S) - S)])
        h = x.reshape(B * T, H).index_select(0, gather)[None]  # (1, packed_rows(S), H)
        packed_positions = None
        if positions is not None:  # each (b, t) of positions as its packed row
            row_of = keep.reshape(-1).cumsum(0).sub_(1).view(B, T)
            packed_positions = row_of.gather(1, positions).view(1, -1)  # (1, B x P)
        packing = Packing(keep, rows, mask, positions, gather // T, gather % T)
        last = len(self.layer) - 1
        for i, layer in enumerate(self.layer):
            h = layer(h, packing, packed_positions if i == last else None)
        if self.plain.final_norm is not None:
            h = self.plain.final_norm(h)
        if positions is not None:
            return h.view(B, positions.shape[1], H)
        return h.new_zeros(B * T, H).index_copy_(0, rows, h[0, :S]).view(B, T, H)


def pack_sequences(model: nn.Module) -> nn.Module:
    """Every BertEncoder of `model` replaced by a `PackedEncoder` of the same layers, in place, but those whose
    attention runs on the kernels (`fused.KernelSelfAttention`, which takes a padded batch)."""
    for name, child in model.named_children():
        if isinstance(child, BertEncoder):
            if not any(isinstance(layer.attention, KernelSelfAttention) for layer in child.layer):
                setattr(model, name, PackedEncoder(child))
        elif not isinstance(child, (PackedEncoder, FusedEncoder)):  # a fused encoder runs its own way
            pack_sequences(child)
    return model


def is_packed(model: nn.Module) -> bool:
    """Does `model` run its encoder packed (`pack_sequences`)?"""
    return any(isinstance(m, PackedEncoder) for m in model.modules())

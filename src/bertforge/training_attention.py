"""Attention for fp32 training on bertforge's CPU kernels (`kernels/attention_train.h`), on a padded batch or on its
real tokens alone.

`TrainingAttention` is the autograd function over the kernels. `TrainingPacking` takes a padded batch's real tokens
out into rows (B sequences, each its tokens in order, one after another), so that every product, LayerNorm, GELU and
dropout of the layers in between runs on real tokens only, as inference's packed encoder does; only attention needs
to know where each sequence starts, and the kernels take that (`offsets`). BERT-base fine-tuning on sentence pairs
batched by length still pads 8.4% of its positions (256 pairs, batch 32), Rotten Tomatoes snippets 3.1%: work the
padded batch does for nothing."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bertforge import kernels
from bertforge.dropout import draw_key


class TrainingAttention(torch.autograd.Function):
    """Attention with autograd on bertforge's fp32 CPU kernels: from the query/key/value product's output (B, T, 3H)
    to (B, T, H) in one pass a head, and the gradient back to (B, T, 3H) in one more, where the unfused path splits,
    copies and merges heads around two batched products (about ten passes each way). Packed (`offsets`, below): from
    (rows, 3H) to (rows, H). Dropout draws one key from torch's generator as `bertforge.dropout` does and drops the
    same probabilities (the same hash of their index in the padded batch's (B, N, T, T) probabilities), so a seed
    gives the same run on either path up to float rounding. A query with no key to attend gets zeros (the unfused
    path: NaN). On a 2-core Zen 4 (`bench/attention.py --training-kernels`), forward + backward with dropout 0.1:
    MiniLM-L6's 12 heads of 32 at 32 x 28 tokens 1.86 against 4.12 ms a layer (2.2x), 2.0x at 128 tokens, BERT-base's
    12 heads of 64 at 8 x 512 1.5x. `enabled` switches it off (A/B runs)."""

    enabled = True

    @staticmethod
    def applies(x: torch.Tensor, head_size: int, p: float, probabilities: int) -> bool:
        """Whether attention over x (the layer's input or its query/key/value product) can train on the kernels:
        fp32 on the CPU, heads of whole 16-float vectors, a dropout mask the kernels index (`probabilities`, the
        padded batch's B N T T, at most 2^32), not compiling, and the kernels built."""
        if torch.compiler.is_compiling() or not TrainingAttention.enabled:  # inductor fuses its own
            return False
        return (x.dtype == torch.float32 and x.device.type == "cpu" and head_size % 16 == 0 and p < 1
                and (p == 0 or probabilities <= 2**32) and kernels.available())

    @staticmethod
    def takes(qkv: torch.Tensor, mask: torch.Tensor | None, head_size: int, p: float) -> bool:
        """Whether a padded batch's qkv (B, T, 3H) trains on the kernels: as `applies` says, a gradient wanted, and
        a (B, 1, 1, T) bool mask or none."""
        B, T = qkv.shape[:2]
        probabilities = B * qkv.shape[2] // (3 * head_size) * T * T
        return (qkv.requires_grad and TrainingAttention.applies(qkv, head_size, p, probabilities)
                and (mask is None or (mask.dtype == torch.bool and mask.shape == (B, 1, 1, T))))

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, heads: int, mask: torch.Tensor | None, p: float,
                packing: TrainingPacking | None = None) -> torch.Tensor:
        ctx.heads, ctx.p, ctx.key = heads, p, draw_key() if p > 0 else 0
        ctx.packed = () if packing is None else (packing.offsets, packing.length)
        out, probs = torch.ops.bertforge.attention_train(qkv, heads, mask, p, ctx.key, *ctx.packed)
        ctx.save_for_backward(qkv, probs)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        qkv, probs = ctx.saved_tensors
        dqkv = torch.ops.bertforge.attention_train_backward(grad, qkv, probs, ctx.heads, ctx.p, ctx.key, *ctx.packed)
        return dqkv, None, None, None, None


@dataclass(frozen=True)
class TrainingPacking:
    """A padded batch's real tokens as rows: `index` their places among the batch's B x T positions (in order, so
    each sequence's tokens stay together and in order), sequence b rows offsets[b] .. offsets[b + 1]."""

    index: torch.Tensor  # (rows,) int64
    offsets: torch.Tensor  # (B + 1,) int64
    batch: int
    length: int  # T

    enabled = True  # False: encoders never pack (A/B runs and the tests' reference)

    @staticmethod
    def of(attention_mask: torch.Tensor) -> TrainingPacking:
        """attention_mask (B, T), 1 (or True) for real tokens."""
        real = attention_mask.bool()
        B, T = real.shape
        offsets = torch.zeros(B + 1, dtype=torch.long)
        torch.cumsum(real.sum(1), 0, out=offsets[1:])
        return TrainingPacking(real.reshape(-1).nonzero().squeeze(1), offsets, B, T)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, H) -> (rows, H), the real tokens'."""
        return x.reshape(self.batch * self.length, -1).index_select(0, self.index)

    def unpack(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (rows, H) -> (B, T, H), zeros at the padding."""
        out = rows.new_zeros(self.batch * self.length, rows.shape[1])
        return out.index_copy(0, self.index, rows).view(self.batch, self.length, -1)

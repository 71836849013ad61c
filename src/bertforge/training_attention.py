"""Attention for training on bertforge's CPU kernels (`kernels/attention_train.h`), in fp32 or under bf16 autocast, on
a padded batch or on its real tokens alone.

`TrainingAttention` is the autograd function over the kernels. `TrainingPacking` takes a padded batch's real tokens
out into rows (B sequences, each its tokens in order, one after another), so that every product, LayerNorm, GELU and
dropout of the layers in between runs on real tokens only, as inference's packed encoder does; only attention needs
to know where each sequence starts, and the kernels take that (`offsets`). BERT-base fine-tuning on sentence pairs
batched by length still pads 8.4% of its positions (256 pairs, batch 32), Rotten Tomatoes snippets 3.1%: work the
padded batch does for nothing.

On CUDA, under bf16 or fp16 autocast, the same packed rows attend through flash attention's variable-length form
(`VarlenAttention`: each sequence its own rows, given by the offsets), dropout drawn inside its kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bertforge import kernels
from bertforge.dropout import draw_key
from bertforge.linear import builds_per_shape, packed_rows

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class TrainingAttention(torch.autograd.Function):
    """Attention with autograd on bertforge's fp32 CPU kernels: from the query/key/value product's output (B, T, 3H)
    to (B, T, H) in one pass a head, and the gradient back to (B, T, 3H) in one more, where the unfused path splits,
    copies and merges heads around two batched products (about ten passes each way). Packed (`offsets`, below): from
    (rows, 3H) to (rows, H). Dropout draws one key from torch's generator as `bertforge.dropout` does and drops the
    same probabilities (the same hash of their index in the padded batch's (B, N, T, T) probabilities), so a seed
    gives the same run on either path up to float rounding. A query with no key to attend gets zeros (the unfused
    path: NaN). On a 2-core Zen 4 (`bench/attention.py --training-kernels`), forward + backward with dropout 0.1:
    MiniLM-L6's 12 heads of 32 at 32 x 28 tokens 1.86 against 4.12 ms a layer (2.2x), 2.0x at 128 tokens, BERT-base's
    12 heads of 64 at 8 x 512 1.5x. Under bf16 autocast the product's output is bf16, and so are the result and the
    gradient back: the kernels compute in fp32 and round each once, where the unfused path rounds the scores, the
    probabilities and each product's result to bf16. `enabled` switches it off (A/B runs)."""

    enabled = True

    @staticmethod
    def applies(x: torch.Tensor, head_size: int, p: float, probabilities: int) -> bool:
        """Whether attention over x (the layer's input or its query/key/value product) can train on the kernels:
        fp32 or bf16 on the CPU, heads of whole 16-float vectors, a dropout mask the kernels index (`probabilities`,
        the padded batch's B N T T, at most 2^32), not compiling, and the kernels built."""
        if torch.compiler.is_compiling() or not TrainingAttention.enabled:  # inductor fuses its own
            return False
        return (x.dtype in _KERNEL_DTYPES and x.device.type == "cpu" and head_size % 16 == 0 and p < 1
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
    each sequence's tokens stay together and in order), sequence b rows offsets[b] .. offsets[b + 1]. Where the
    products build a kernel for each new shape (`linear.builds_per_shape`: oneDNN's), the rows are rounded up
    (`linear.packed_rows`, at most 3.1% more) by spare rows after the sequences', copies of the first token, which
    attention leaves out (zeros out and back) and `unpack` drops: a new token count each step would build new
    kernels each step."""

    index: torch.Tensor  # (rows,) int64, on the mask's device: the real tokens', then the spare rows' (index[0])
    offsets: torch.Tensor  # (B + 1,) int64, on the host (the CPU kernels'); offsets[B] real tokens
    batch: int
    length: int  # T
    longest: int = 0  # the longest sequence's rows
    device_offsets: torch.Tensor | None = None  # offsets as int32 on the mask's CUDA device (flash attention's)

    enabled = True  # False: encoders never pack (A/B runs and the tests' reference)

    @staticmethod
    def of(attention_mask: torch.Tensor) -> TrainingPacking:
        """attention_mask (B, T), 1 (or True) for real tokens. On CUDA, the lengths come to the host once (the
        forward pass's one wait for the device: the step before ended by reading its losses, so little is queued)."""
        real = attention_mask.bool()
        B, T = real.shape
        lengths = real.sum(1).cpu()
        offsets = torch.zeros(B + 1, dtype=torch.long)
        torch.cumsum(lengths, 0, out=offsets[1:])
        on_device = None if real.device.type == "cpu" else offsets.to(real.device, torch.int32)
        index = real.reshape(-1).nonzero().squeeze(1)
        tokens = int(offsets[-1])
        if builds_per_shape(real.device) and tokens > 0:
            index = torch.cat([index, index[:1].expand(packed_rows(tokens) - tokens)])
        return TrainingPacking(index, offsets, B, T, int(lengths.max()), on_device)

    @property
    def tokens(self) -> int:
        """The real tokens' rows (the first ones; any after them are spare)."""
        return int(self.offsets[-1])

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, H) -> (rows, H), the real tokens'."""
        return x.reshape(self.batch * self.length, -1).index_select(0, self.index)

    def unpack(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (rows, H) -> (B, T, H), zeros at the padding (the spare rows dropped)."""
        out = rows.new_zeros(self.batch * self.length, rows.shape[1])
        n = self.tokens
        return out.index_copy(0, self.index[:n], rows[:n]).view(self.batch, self.length, -1)


class VarlenAttention(torch.autograd.Function):
    """Attention over packed rows on CUDA (`TrainingPacking`): torch's flash attention in its variable-length form
    (each sequence attends over its own rows, `device_offsets` and `longest`), from the query/key/value product's
    output (rows, 3H) to (rows, H) and back, dropout drawn inside the kernel by torch's CUDA generator. Flash
    attention takes bf16 and fp16 (the autocast's products) on GPUs of compute capability 8.0 and above, heads of
    up to 256 in multiples of 8; elsewhere the layers run on the padded batch with SDPA. The two operators are
    torch's own (`aten::_flash_attention_forward` and its backward), called as `torch.nn.attention.varlen` calls
    them, which has no dropout."""

    @staticmethod
    def applies(x: torch.Tensor, head_size: int) -> bool:
        """Whether training on x (the embeddings' output on the device) attends packed: CUDA under bf16 or fp16
        autocast, flash attention enabled and built for this GPU, heads it takes, not compiling."""
        if x.device.type != "cuda" or torch.compiler.is_compiling() or not torch.is_autocast_enabled("cuda"):
            return False
        return (torch.get_autocast_dtype("cuda") in (torch.bfloat16, torch.float16) and head_size % 8 == 0
                and head_size <= 256 and torch.backends.cuda.flash_sdp_enabled()
                and torch.cuda.get_device_capability(x.device) >= (8, 0))

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, heads: int, packing: TrainingPacking, p: float) -> torch.Tensor:
        rows, width = qkv.shape
        q, k, v = qkv.view(rows, 3, heads, width // (3 * heads)).unbind(1)  # each (rows, N, D), rows strided
        args = (packing.device_offsets, packing.device_offsets, packing.longest, packing.longest, p, False)
        out, lse, rng, unused, _ = flash_forward(q, k, v, args)
        ctx.args = args
        ctx.save_for_backward(q, k, v, out, lse, rng, unused)
        return out.view(rows, width // 3)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        q, k, v, out, lse, rng, unused = ctx.saved_tensors
        dq, dk, dv = flash_backward(grad.reshape(out.shape).contiguous(), (q, k, v, out, lse), ctx.args, (rng, unused))
        return torch.stack((dq, dk, dv), 1).view(q.shape[0], -1), None, None, None


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: tuple) -> tuple[torch.Tensor, ...]:
    """torch's flash attention over packed sequences, args (cu_q, cu_k, max_q, max_k, dropout, causal):
    (out, logsumexp, rng state, unused, debug mask). The tests stand a reference in for it on the CPU."""
    return torch.ops.aten._flash_attention_forward(q, k, v, *args, False)


def flash_backward(grad: torch.Tensor, saved: tuple, args: tuple, rng: tuple) -> tuple[torch.Tensor, ...]:
    """Its backward, saved (q, k, v, out, logsumexp), rng (rng state, unused) as the forward gave them:
    (dq, dk, dv)."""
    return torch.ops.aten._flash_attention_backward(grad, *saved, *args, *rng)

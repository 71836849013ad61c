"""A post-LN layer's residual block, `norm(residual + dropout(linear(y)))`, in CPU training: the Linear's product
without its bias, then the bias, dropout, the residual add and LayerNorm in one pass of bertforge's kernels, and their
gradients (the residual's, the product's, the bias's, LayerNorm's) in one pass back (`kernels/add_norm.h`).

Unfused, the block is five operators each way, each a pass over a (rows, H) activation with its own fixed cost:
MKL's addmm copies the bias into its output before multiplying, dropout, the add and LayerNorm forward; LayerNorm's
gradient, dropout's, the bias's column sums and autograd's add of the residual's two gradients back. Dropout's mask
is `bertforge.dropout`'s, drawn at the same point with the same key over the same elements, so a seed drops what it
dropped; the sums round otherwise (the bias is added after the product, not before it; LayerNorm's sums in vectors).

Where it applies: fp32 training on the CPU with the kernels built, torch's LayerNorm and bertforge's Linear and
Dropout modules, a width of whole 16-float vectors, a gradient wanted; and the same under bf16 autocast, where the
product is bf16 and the residual stream and the parameters fp32: the kernel reads the product as fp32, computes the
rest in fp32 as autocast's LayerNorm does, and rounds the product's gradient to bf16 once (unfused, the bias, dropout
and their gradients round to bf16 at each operator). Elsewhere (evaluation and inference, whose bits stay torch's;
fp16 autocast; other devices; `torch.compile`, tracing) the unfused operators. `enabled` off: never (A/B runs and the
tests' reference)."""

from __future__ import annotations

import torch
from torch import nn

from bertforge import kernels
from bertforge.dropout import Dropout, draw_key
from bertforge.linear import Linear, linear

enabled = True


class _AddNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                beta: torch.Tensor, eps: float, p: float) -> torch.Tensor:
        ctx.p, ctx.key, ctx.z_type = p, draw_key() if p > 0 else 0, z.dtype
        out, total, stats = torch.ops.bertforge.add_norm_train(z, bias, residual, weight, beta, eps, p, ctx.key)
        ctx.save_for_backward(total, stats, weight)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        total, stats, weight = ctx.saved_tensors
        dsum, dz, dbias, dweight, dbeta = torch.ops.bertforge.add_norm_train_backward(
            grad, total, stats, weight, ctx.p, ctx.key, ctx.z_type)
        wanted = ctx.needs_input_grad
        grads = (dz, dbias, dsum, dweight, dbeta)
        return tuple(g if w else None for g, w in zip(grads, wanted, strict=False)) + (None, None)


def _applies(y: torch.Tensor, residual: torch.Tensor, layer: nn.Module, norm: nn.Module, drop: nn.Module) -> bool:
    if not enabled or type(layer) is not Linear or type(norm) is not nn.LayerNorm or type(drop) is not Dropout:
        return False
    tensors = (y, residual, layer.weight, layer.bias, norm.weight, norm.bias)
    if any(t is None for t in tensors) or residual.shape[-1] % 16 or drop.p >= 1:
        return False
    # under bf16 autocast: the product's output bf16, the residual stream and the parameters fp32
    return kernels.trains_fp32(*tensors) or (kernels.trains_bf16_autocast(*tensors)
                                             and all(t.dtype == torch.float32 for t in tensors[1:]))


def add_norm(layer: nn.Module, y: torch.Tensor, residual: torch.Tensor, norm: nn.Module, drop: nn.Module
             ) -> torch.Tensor:
    """`norm(residual + drop(layer(y)))`: on the kernels where it applies (module docstring)."""
    if _applies(y, residual, layer, norm, drop):
        z = linear(y, layer.weight)
        p = drop.p if drop.training else 0.0
        return _AddNorm.apply(z, layer.bias, residual, norm.weight, norm.bias, norm.eps, p)
    return norm(residual + drop(layer(y)))

"""The encoder's GELU, the exact one (x Phi(x), Phi the standard normal's distribution function): in CPU training, fp32
or bf16, forward and gradient on bertforge's kernels (`kernels/gelu.h`).

torch's GELU evaluates erf to full precision, and its gradient evaluates erf and an exponential apart: on a 2-core
Zen 4, for MiniLM-L6's (914 x 1,536) GELU input, 0.52 ms forward and 1.18 ms backward in fp32, where the kernels take
0.42 and 0.52 (the gradient reuses the exponential inside erf); in bf16 (computed in fp32, rounded once) the gradient
1.0 against 0.51 ms, and 0.73 against 0.23 at the demo's tiny's (1,024 x 512). erf comes from Abramowitz and Stegun's
7.1.26, absolute error under 1.5e-7, as the int8 products' GELU: the outputs differ from torch's by about 1e-6, far
below training's noise. A MiniLM-L6 fine-tuning step (batch 32, fp32) ran 2-4% faster for it (28 and 64 tokens; steps
of either alternating in one process), an epoch of `bench/finetune.py` 8-12% (docs/benchmarks.md).

In fp32 a layer's GELU also takes the bias of the product before it (`linear_gelu`): the product runs without it, the
kernel adds it on the way in, and the gradient pass sums the bias's gradient as it goes, where MKL's addmm copied the
bias into the product's output first and autograd summed the gradient's columns in a pass of its own.

Elsewhere, torch's `F.gelu`: without a gradient (inference, evaluation: their bits stay torch's), in other dtypes, on
other devices, under `torch.compile` (inductor fuses its own) or tracing (an exported graph names no bertforge
op) and where the kernels cannot be built."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bertforge import kernels
from bertforge.linear import Linear, linear

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
fuses_bias = True  # False: `linear_gelu` never takes the bias into the GELU (A/B runs and the tests' reference)


class _Gelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return torch.ops.bertforge.gelu(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return torch.ops.bertforge.gelu_backward(grad, x)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """`F.gelu(x)`, on the kernels where a gradient is wanted of an fp32 or bf16 CPU tensor (module docstring)."""
    if (x.requires_grad and x.dtype in _KERNEL_DTYPES and x.device.type == "cpu" and torch.is_grad_enabled()
            and not torch.compiler.is_compiling() and not torch.jit.is_tracing() and kernels.available()):
        return _Gelu.apply(x)
    return F.gelu(x)


class _GeluBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, bias)
        return torch.ops.bertforge.gelu_bias(x, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x, bias = ctx.saved_tensors
        dx, dbias = torch.ops.bertforge.gelu_bias_backward(grad, x, bias)
        return dx, dbias if ctx.needs_input_grad[1] else None


def linear_gelu(layer: nn.Module, x: torch.Tensor, act) -> torch.Tensor:
    """`act(layer(x))`; where act is `gelu` and the kernels train it in fp32 (a bertforge Linear with a bias, widths
    of whole 16-float vectors), the product without the bias and the bias inside the GELU's kernels."""
    bias = getattr(layer, "bias", None)
    if (fuses_bias and act is gelu and type(layer) is Linear and bias is not None and bias.shape[0] % 16 == 0
            and kernels.trains_fp32(x, layer.weight, bias)):
        return _GeluBias.apply(linear(x, layer.weight), bias)
    return act(layer(x))

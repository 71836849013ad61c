"""The encoder's and the masked-LM head's Linear layers, with fp32 products on oneDNN's kernels where torch's
default (MKL) runs a slower code path.

torch multiplies fp32 matrices on the CPU with MKL, which on AMD CPUs runs its AVX2 code even where the CPU has
AVX-512; oneDNN, which torch also carries, uses AVX-512 there. On a 2-core Zen 5 EPYC (torch 2.13, the layers of a
MiniLM-L6 fine-tuning batch of 864 rows) oneDNN ran the forward and the input's gradient products 2.0-2.6x as fast
as MKL, and the weight's gradient 1.4-2.2x (bench/fp32_products.py). So there (`fp32_on_onednn`)
the layers' forward and both backward products run on `torch.ops.mkldnn._linear_pointwise`, the operator
torch's own compiler emits for CPU linear layers, on the weights as they are (no reordering: they change every
step). Elsewhere (Intel CPUs, whose MKL runs AVX-512 itself; CPUs without AVX-512; GPUs; bf16 autocast, where
oneDNN runs the products already; under torch.compile and while traced for an ONNX export) `Linear` is exactly
`nn.Linear`.

`BERTFORGE_FP32_PRODUCTS=onednn|mkl` overrides the choice (tests/test_pinned_results.py pins MKL so that its
digests are the same on every CPU)."""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from bertforge import cpu, kernels
from bertforge.errors import BertforgeError

ENV = "BERTFORGE_FP32_PRODUCTS"


@functools.cache
def has_onednn_linear() -> bool:
    """Does this torch build have oneDNN's linear operator (torch's own compiler calls it for CPU code; it is not
    a public API, so its absence means torch's operators)?"""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def fp32_on_onednn() -> bool:
    """Do fp32 training products run on oneDNN here: an AMD CPU with AVX-512 and a torch with the operator, or as
    `BERTFORGE_FP32_PRODUCTS` says."""
    chosen = os.environ.get(ENV, "").strip().lower()
    if chosen not in ("", "onednn", "mkl"):
        raise BertforgeError(f"{ENV}={chosen!r} is not a choice: set it to onednn or mkl, or unset it to choose by "
                             "the CPU")
    if chosen:
        return chosen == "onednn" and has_onednn_linear()
    return has_onednn_linear() and cpu.vendor() == "AuthenticAMD" and "avx512f" in cpu.cpu_flags()


def packed_rows(tokens: int) -> int:
    """The rows a packed batch of `tokens` real tokens runs at: `tokens` rounded up to a multiple of a thirty-second
    of the power of two below it (at least 8), so at most 3.1% more (or 7 rows). Why: oneDNN's products (inference's
    `infer.packed_linear.PackedLinear`, training's fp32 `Linear` here and bf16 autocast's) build and cache a primitive
    for every input shape, and each holds memory (0.6 MB for MiniLM's 384 x 1536 product, 1.6 MB for BERT-base's
    768 x 3072; 1,024 of them cached). A server's groups bring a new token count nearly every time: MiniLM fp32 over
    150 groups of 32-290 texts grew from 750 MB to 1.95 GB resident, still rising. Rounded, at most 192 row counts
    cover every batch up to 8,192 tokens: the same run levelled off at 1.02 GB after about 80 groups, and a server
    reuses its primitives. The int8 products round their rows the same way (`transforms.Int8Linear`). In training the
    building costs time: the demo's BERT-tiny pretraining on its real tokens built 12 primitives a step, 7 ms of a
    30 ms step on a 2-core Zen 4, where the padded batch's one shape built none (`training_attention.TrainingPacking`).
    """
    granule = max(8, 1 << max(0, tokens.bit_length() - 6))
    return -(-tokens // granule) * granule


def builds_per_shape(device: torch.device) -> bool:
    """Do training's products on `device` build a kernel for each new input shape: oneDNN's, in fp32 where
    `fp32_on_onednn` and under autocast on the CPU (bf16; fp16 autocast trains on the padded batch). (MKL and cuBLAS
    build none.)"""
    return device.type == "cpu" and (torch.is_autocast_enabled("cpu") or fp32_on_onednn())


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T + bias on oneDNN; either operand may be a transposed view."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _OneDnnLinear(torch.autograd.Function):
    """F.linear with its three products (y = x W^T + b, dx = dy W, dW = dy^T x) on oneDNN."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = _rows(x)
        ctx.save_for_backward(rows, weight)
        ctx.has_bias = bias is not None
        y = _product(rows, weight, bias)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, weight = ctx.saved_tensors
        g = _rows(grad)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _product(g, weight.t(), None).view(*grad.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            g_t, sums = _transposed(g)
            dw = _product(g_t, rows.t(), None)
            db = sums if ctx.has_bias and ctx.needs_input_grad[2] else None
        elif ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.sum(0)
        return dx, dw, db


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as a contiguous (M, K) matrix: a view where it is one, else a copy. oneDNN's operator takes other strides
    (the [CLS] rows of a (B, T, H) batch, T H floats apart) at a crawl: the weight gradient of a 128-wide layer over
    16 such rows took 3.8 ms on a 2-core Zen 4, 0.02 over the same rows copied, and of an 8,000-wide one 236 ms."""
    return x.reshape(-1, x.shape[-1]).contiguous()


def _transposed(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """g (M, N) as a row-major (N, M) matrix, and its column sums (the bias's gradient). oneDNN's operator takes its
    input only row-major, and made the copy of a transposed view itself, at about 5 GB/s: 6-7% of a MiniLM-L6
    fine-tuning step on a 2-core Zen 4. bertforge's kernel (kernels/transpose.h) does both in one pass, 5-8x faster
    at a fine-tuning batch's sizes; without the kernels, torch's copy and sum."""
    if kernels.available():
        return torch.ops.bertforge.transpose_sum(g)
    return g.t().contiguous(), g.sum(0)


def _applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # Compiling and tracing first: TorchDynamo must not reach the cached choice (a call into functools' cache
    # breaks its graph); then the choice, where every other CPU stops. oneDNN refuses empty products (a batch
    # without masked positions reaches the head with no rows).
    return (not torch.compiler.is_compiling() and not torch.jit.is_tracing() and fp32_on_onednn()
            and x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.numel() > 0 and weight.numel() > 0 and not torch.is_autocast_enabled("cpu"))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, its fp32 CPU products on oneDNN where `fp32_on_onednn` (the masked-LM head's product with the
    tied word embeddings or its sampled rows)."""
    if _applies(x, weight):
        return _OneDnnLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, state dict and initialisation), its fp32 CPU products on oneDNN where
    `fp32_on_onednn`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

"""Dropout whose random masks are cheap on the CPU.

`torch.nn.Dropout` draws its mask on the CPU with a Mersenne Twister, one number an element (`bernoulli_`): about
10 ns an element, 3.4 ms for one of MiniLM-L6's activations at batch 32 on short texts, and a fine-tuning step
draws 20 of them, 12% of the step. Here a mask is a counter-based hash of the element's index and a 64-bit key
that the call draws from torch's generator (so `torch.manual_seed` and the checkpoints' saved generator state
decide it, as they decide `nn.Dropout`'s): `bertforge.kernels` computes it and applies it in one pass over the
tensor, well under a nanosecond an element (`kernels/dropout.h`, where the hash is written down), and the backward
recomputes it from the key, so no mask is kept for it. Where the kernels cannot be built the same bits come from
torch's integer operators, slower but the same (a run does not depend on whether a compiler was there). The
result is dropout's: kept elements scaled by 1 / (1 - p), the gradient through the same mask.

On other devices (CUDA's dropout draws its masks in the same kernel, fast), under `torch.compile` (inductor
generates its own) and for p = 1 this is `torch.nn.functional.dropout`. `Dropout` is a drop-in `nn.Dropout`: no
parameters, so checkpoints and the Hugging Face layout are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bertforge import kernels
from bertforge.device import pick_device

_MASK = 0xFFFFFFFF
_MIX = (0x7FEB352D, 0x846CA68B)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """dropout.h's mix32 on int64 tensors holding 32-bit values (products wrap in 64 bits; the low 32 are kept)."""
    x = x ^ (x >> 16)
    x = (x * _MIX[0]) & _MASK
    x = x ^ (x >> 15)
    x = (x * _MIX[1]) & _MASK
    return x ^ (x >> 16)


def keep_mask_reference(n: int, p: float, key: int) -> torch.Tensor:
    """The keep mask (bool, n) of dropout.h from torch's operators: the kernel's bits, for machines without it."""
    k = key & 0xFFFFFFFFFFFFFFFF
    i = torch.arange(n, dtype=torch.int64)
    u = _mix32((_mix32(i ^ (k & _MASK)) + (k >> 32)) & _MASK)
    return u >= min(round(p * 2**32), _MASK)


def keep_mask(n: int, p: float, key: int) -> torch.Tensor:
    """Which of n elements dropout keeps at drop probability p (0 <= p < 1) for a 64-bit `key`: a bool tensor."""
    if kernels.available():
        return torch.ops.bertforge.keep_mask(n, p, key)
    return keep_mask_reference(n, p, key)


def load_kernels(device: str | None) -> None:
    """Loads the kernels dropout uses on the CPU (`device` one `bertforge.device.pick_device` takes); a machine's first
    run builds them, 10-20 s. The time-budgeted runs call it before their clock starts, so the build does not pass
    for slow training steps and cut the steps they plan."""
    if pick_device(device).type == "cpu":
        kernels.available()


def draw_key() -> int:
    """A key from torch's default CPU generator (one draw a call; checkpoints save and restore its state)."""
    return int(torch.empty((), dtype=torch.int64).random_())


def apply_keep_mask(x: torch.Tensor, p: float, key: int) -> torch.Tensor:
    """`x * keep * (1 / (1 - p))`, keep the mask `keep_mask(x.numel(), p, key)` shaped as x: in one pass of the
    kernels (fp32 and bf16; the mask is computed on the way, never stored), else with torch's operators. The same
    bits either way."""
    if x.dtype in (torch.float32, torch.bfloat16) and kernels.available():
        return torch.ops.bertforge.apply_keep_mask(x, p, key)
    return x * keep_mask(x.numel(), p, key).view(x.shape) * (1.0 / (1.0 - p))


class _Dropout(torch.autograd.Function):
    """Dropout whose backward recomputes the forward's mask from its key: a call keeps an int, not a mask."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        ctx.p, ctx.key = p, draw_key()
        return apply_keep_mask(x, p, ctx.key)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return apply_keep_mask(grad, ctx.p, ctx.key), None


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """`torch.nn.functional.dropout(x, p, training)` with the cheap masks where they apply (module docstring)."""
    if not training or p == 0:
        return x
    if x.device.type != "cpu" or p >= 1 or torch.compiler.is_compiling():
        return F.dropout(x, p, training=True)
    return _Dropout.apply(x, p)


class Dropout(nn.Dropout):
    """`nn.Dropout` drawing its masks with `dropout` (module docstring); `inplace` is not supported."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)

"""Devices for training and inference alike: which device a run uses, and a batch's copy onto it."""

from __future__ import annotations

import contextlib
import re

import torch

from bertforge import cpu
from bertforge.errors import BertforgeError
from bertforge.options import PRECISIONS


def _choices() -> str:
    """The --device values this build of torch knows."""
    return "cpu, cuda, cuda:N" + (", mps" if torch.backends.mps.is_built() else "")


def pick_device(requested: str | None = None) -> torch.device:
    """The device asked for (`cpu`, `cuda`, `cuda:1`, `mps`), else CUDA when there is one, else the CPU. Another
    name, or a device this machine lacks, is a BertforgeError here, rather than torch's RuntimeError (a name it
    does not know) or an AssertionError at the first tensor moved (cuda without CUDA)."""
    if not requested:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if requested in ("cpu", "meta"):  # meta: shapes without data, for tests that run the loop without arithmetic
        return torch.device(requested)
    cuda = re.fullmatch(r"cuda(?::(0|[1-9][0-9]*))?", requested)  # torch refuses an index with a leading 0
    if cuda:
        if not torch.cuda.is_available():
            raise BertforgeError(f"--device {requested}: CUDA is not available on this machine (torch "
                                 f"{torch.__version__}); use --device cpu")
        count = torch.cuda.device_count()
        if cuda.group(1) is not None and int(cuda.group(1)) >= count:
            raise BertforgeError(f"--device {requested}: this machine has {count} CUDA device(s), cuda:0 to "
                                 f"cuda:{count - 1}; choose one of those")
        return torch.device(requested)
    if requested == "mps" and torch.backends.mps.is_built():
        if not torch.backends.mps.is_available():
            raise BertforgeError("--device mps: MPS is not available on this machine; use --device cpu")
        return torch.device("mps")
    raise BertforgeError(f"--device {requested!r} is not a device: use one of {_choices()}")


def pick_precision(precision: str, device: torch.device, *, auto_bf16_on_cpu: bool) -> str:
    """The number format a model runs in on `device`, "fp32" or "bf16", for `precision` "auto", "fp32" or "bf16"
    (each caller checks its option's value first, with its own message): what training
    (`train.loop.resolve_precision`) and inference (`infer.checks`) both run.

    "auto" is bf16 where the device multiplies bf16 natively: a CUDA GPU with native bf16 (compute capability 8.0
    and newer) and, where `auto_bf16_on_cpu`, a CPU with bf16 instructions (AVX512-BF16 or AMX); fp32 elsewhere.
    The two uses differ on the CPU on purpose: inference passes True, as its bf16 only rounds a forward pass (on
    bench/inference.py's classifier within 0.3 points of fp32's accuracy, about twice as fast); training passes
    False and keeps fp32 on every CPU unless asked (bf16 autocast changes what the optimizer sees, so there it
    is opt-in, as in other training tools).

    An explicit bf16 where torch would only emulate it, slower than fp32, is refused, for training and inference
    alike: on a CPU without bf16 instructions (a BERT-mini training step at 32 x 64 on an AVX2-only AMD EPYC:
    10.3 s against 0.45 s in fp32) and on a CUDA GPU without native bf16 (a T4, a V100). There is no fp16 path.
    `torch.cuda.is_bf16_supported` asks the current device, which `distributed.setup` sets to the rank's."""
    native_cuda = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    if precision == "auto":
        native_cpu = auto_bf16_on_cpu and device.type == "cpu" and cpu.has_native_bf16()
        return "bf16" if native_cuda or native_cpu else "fp32"
    if precision == "bf16" and device.type == "cpu" and not cpu.has_native_bf16():
        raise BertforgeError("--precision bf16: this CPU has no bf16 dot products (AVX512-BF16 or AMX), so bf16 "
                             "would run slower than fp32; use --precision fp32, or auto to choose by the CPU")
    if precision == "bf16" and device.type == "cuda" and not native_cuda:
        name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "no CUDA device is available"
        raise BertforgeError(f"--precision bf16: {device} ({name}) has no native bf16 support; "
                             "use --precision fp32")
    return precision


def to_device(batch: dict, device: torch.device) -> dict:
    """A batch on `device`. On CUDA each tensor is copied from pinned host memory with `non_blocking`, so
    the copies of all micro-batches of a step are queued without waiting (from pageable memory a
    `non_blocking` copy is synchronous); the pinned buffers are not reused before their copies end (PyTorch's
    host allocator records the copy's stream). On the CPU the batch is returned as it is.

    An attention mask without padding stays on the host, so the model drops it (`attention_mask_for_sdpa`
    checks a host mask for free; on the device that check would wait for the GPU) and SDPA takes its unmasked
    kernels; the host mask still gives the training loop its token count without a device sync."""
    if device.type == "cpu":
        return batch
    out = {}
    for k, v in batch.items():
        stays = (not isinstance(v, torch.Tensor) or v.device == device
                 or (k == "attention_mask" and v.device.type == "cpu" and bool(v.all())))
        if not stays and device.type == "cuda" and v.device.type == "cpu" and not v.is_pinned():
            v = v.pin_memory()
        out[k] = v if stays else v.to(device, non_blocking=True)
    return out


def resolve_precision(precision: str, device: torch.device) -> str:
    """The precision a training run uses, "fp32" or "bf16": `device.pick_precision` for training, where "auto"
    is bf16 on a CUDA device with native bf16 and fp32 elsewhere, the CPU included (bf16 there is opt-in; see
    `pick_precision` for why inference differs). An explicit "bf16" torch would only emulate is refused."""
    if precision not in PRECISIONS:
        raise BertforgeError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    return pick_precision(precision, device, auto_bf16_on_cpu=False)


def autocast(device: torch.device, precision: str):
    """The forward pass's context for a resolved precision (`resolve_precision`)."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()

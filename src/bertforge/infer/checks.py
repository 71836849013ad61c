"""What an inference engine's options (`bertforge.options.EngineOptions`, which checks them together) give on
this machine: the device a model runs on, its dtype, and how many batches run at once. What only the machine can
refuse (a device it lacks, a bf16 it would only emulate) is refused here, in one line naming the option to change."""

from __future__ import annotations

import torch

from bertforge.batching import cpu_streams
from bertforge.device import pick_device, pick_precision
from bertforge.options import EngineOptions


def auto_streams(backend: str, device: torch.device, batches: int) -> int:
    """Batches run at once: `cpu_streams` on bertforge's engine; one on ONNX Runtime, whose session already
    has all the threads."""
    return 1 if backend == "onnx" else cpu_streams(device, batches)


def engine_device(options: EngineOptions) -> torch.device:
    """The device bertforge's own engine runs on for `options`: the CPU for int8, else `options.device` (default:
    CUDA when available); a device this machine lacks, or a bf16 the device would only emulate, is refused."""
    where = torch.device("cpu") if options.quantize == "int8" else pick_device(options.device)
    pick_precision(options.precision, where, auto_bf16_on_cpu=True)
    return where


def inference_dtype(precision: str, device: torch.device, quantize: str | None = None) -> torch.dtype:
    """The dtype a model runs in for `precision` on `device` (`device.pick_precision` for inference): `auto` is
    bf16 where the hardware multiplies bf16 natively (a CPU with AVX512-BF16 or AMX, a CUDA GPU with native bf16)
    and fp32 elsewhere; around int8 Linear layers (`quantize`) the model stays fp32.

    bf16 keeps 8 significant bits (each value rounded by up to 2^-8 of itself); on the fine-tuned MiniLM
    classifier of bench/inference.py its Rotten Tomatoes accuracy stayed within 0.3 points of fp32 on dev and
    test."""
    if precision == "auto" and quantize == "int8":
        return torch.float32
    return torch.bfloat16 if pick_precision(precision, device, auto_bf16_on_cpu=True) == "bf16" else torch.float32

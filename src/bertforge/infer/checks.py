"""The options of an inference engine checked together, and what they give: the device a model runs on, its
dtype, and how many batches run at once. Each refusal is one line naming the option to change."""

from __future__ import annotations

import torch

from bertforge.batching import cpu_streams
from bertforge.device import pick_device, pick_precision
from bertforge.errors import BertforgeError
from bertforge.options import INFERENCE_PRECISIONS

BACKENDS = ("torch", "onnx")


def check_backend(backend: str, device: str | None, precision: str) -> None:
    """`backend` is one of BACKENDS and goes with `device` and `precision`."""
    if backend not in BACKENDS:
        raise BertforgeError(f"--backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if backend == "onnx" and device not in (None, "cpu"):
        raise BertforgeError("--backend onnx runs ONNX Runtime on the CPU: drop --device, or --backend for the GPU")
    if backend == "onnx" and precision == "bf16":
        raise BertforgeError("--backend onnx runs fp32 or int8 (--quantize int8): drop --precision bf16, or "
                             "--backend onnx for bf16 on bertforge's own engine")


def auto_streams(backend: str, device: torch.device, batches: int) -> int:
    """Batches run at once: `cpu_streams` on bertforge's engine; one on ONNX Runtime, whose session already
    has all the threads."""
    return 1 if backend == "onnx" else cpu_streams(device, batches)


def check_quantize(quantize: str | None) -> None:
    if quantize not in (None, "none", "int8"):
        raise BertforgeError(f"--quantize {quantize!r}: only int8 is supported")


def check_options(quantize: str | None, device: str | None, precision: str = "fp32") -> torch.device:
    """The device inference runs on, once `quantize`, `device` and `precision` are known to go together."""
    check_quantize(quantize)
    if precision not in INFERENCE_PRECISIONS:
        raise BertforgeError(f"--precision {precision!r}: use one of {', '.join(INFERENCE_PRECISIONS)}")
    if quantize == "int8" and device not in (None, "cpu"):
        raise BertforgeError("--quantize int8 runs on the CPU only: drop --device or --quantize")
    if quantize == "int8" and precision == "bf16":
        raise BertforgeError("--quantize int8 picks the number formats around its int8 products itself (fp32, and "
                             "bf16 where that is faster and the CPU multiplies it natively): drop --precision bf16, "
                             "or --quantize for bf16 alone")
    where = torch.device("cpu") if quantize == "int8" else pick_device(device)
    pick_precision(precision, where, auto_bf16_on_cpu=True)  # refuses a bf16 the device would only emulate
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

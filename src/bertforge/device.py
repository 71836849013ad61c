"""Devices for training and inference alike: which device a run uses, and a batch's copy onto it."""

from __future__ import annotations

import torch


def pick_device(requested: str | None = None) -> torch.device:
    """The device asked for (`cpu`, `cuda`, `cuda:1`), else CUDA when there is one, else the CPU."""
    if requested:
        return torch.device(requested)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


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

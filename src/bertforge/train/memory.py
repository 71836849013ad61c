"""CPU memory allocation for training and batch inference: keep freed memory for reuse instead of handing it back
to the system.

glibc serves large requests (above 32 MB at most) with fresh mmap pages and returns them on free, so every
training step pays page faults and kernel zeroing for each big activation (a base model's 32 x 128 x 3072
GELU input is 48 MB). Measured here: a (4096 x 768) @ (768 x 3072) matmul runs at 153 GFLOP/s into a new
output and 180 into a reused one; transformers' `base` pretraining step runs 17% faster under it
(bench/pretrain_step.py: 214 -> 250 tokens/s), and a budget's timed steps run ~40% slower without it. PyTorch's
CUDA allocator caches for the same reason.

Inference over a file of texts pays the same: on an AVX512 EPYC (2026-11-27, bench/inference.py, MiniLM, texts
of 16-128 tokens) the fp32 model ran 1.37x faster under it and the int8 one 1.58x, most of the difference in the
elementwise passes (the GELU, the int8 activations' quantization) over freshly mapped pages.

The setting is process-wide: freed memory stays with the process (its resident size stays near its peak), so
no library function makes it. The `bertforge` commands that train (pretrain, finetune, demo) or run a model over
a file (predict, evaluate, embed, fill-mask) apply it before they start (`bertforge.cli.main`); a Python user
opts in with one call before training or a batch of predictions:

    from bertforge.train.memory import keep_freed_memory
    keep_freed_memory()

Set BERTFORGE_SYSTEM_MALLOC=1 to leave the allocator alone (the call then does nothing).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# mallopt parameters, from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_TRIM_THRESHOLD = 1 << 30  # free memory at the top of the heap is returned beyond 1 GiB only

_applied: bool | None = None


def wanted() -> bool:
    """Whether this process should keep freed memory: not opted out (BERTFORGE_SYSTEM_MALLOC=1), and on Linux,
    where glibc's mallopt may exist (`keep_freed_memory` finds out)."""
    return os.environ.get("BERTFORGE_SYSTEM_MALLOC") != "1" and sys.platform.startswith("linux")


def keep_freed_memory() -> bool:
    """Serve every allocation from the reusable heap (glibc only; elsewhere a no-op). True if applied."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if not wanted():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    return _applied

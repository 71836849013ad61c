"""What this x86 CPU can do, from the kernel's flags (Linux; elsewhere every answer is False).

Two features change what pays on the CPU:
- bf16 dot products (AVX512-BF16, AMX-BF16): bf16 autocast trains BERT about 1.6x faster than fp32, and
  inference in bf16 (`bertforge.infer`, precision="bf16" or "auto") runs about 1.7x faster than fp32;
- int8 dot products accumulating into int32 (AVX512-VNNI, AVX-VNNI, AMX-INT8): int8 kernels can take
  full 8-bit activations. Without them, fbgemm sums pairs of u8 x s8 products in int16, which can
  saturate, so torch quantizes activations to 7 bits there.
"""

from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_native_bf16() -> bool:
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def has_int8_dot_product() -> bool:
    return bool(cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"})

"""What this x86 CPU can do, from the kernel's flags (Linux; elsewhere every answer is False).

Two features change what pays on the CPU:
- bf16 dot products (AVX512-BF16, AMX-BF16): bf16 autocast trains BERT about 1.6x faster than fp32, and
  inference in bf16 (`bertforge.infer`, precision="bf16" or "auto") runs about 1.7x faster than fp32;
- int8 dot products accumulating into int32 (AVX512-VNNI, AVX-VNNI, AMX-INT8): int8 kernels can take full
  8-bit weights and activations. Without them (AVX2 alone), the kernels sum pairs of u8 x s8 products in
  int16, which saturates past 32,767: 2 x 255 x 127 can exceed it, 2 x 255 x 63 cannot, so there int8
  inference keeps 8-bit activations and quantizes weights to 7 bits (`int8_weight_bits`).
"""

from __future__ import annotations

import functools


@functools.cache
def cpuinfo_field(name: str) -> str:
    """The first value of the field `name` in /proc/cpuinfo ("flags", "vendor_id", "model name"), or "" where
    there is none (not Linux, or no such field)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return ""


@functools.cache
def cpu_flags() -> frozenset[str]:
    return frozenset(cpuinfo_field("flags").split())


def vendor() -> str:
    """The CPU's vendor_id ("GenuineIntel", "AuthenticAMD"), or "" where it is not known."""
    return cpuinfo_field("vendor_id")


def has_native_bf16() -> bool:
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def has_int8_dot_product() -> bool:
    return bool(cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"})


def has_avx2() -> bool:
    return "avx2" in cpu_flags()


def int8_weight_bits() -> int | None:
    """Bits of int8 weights that the CPU's u8 x s8 kernels sum without saturating, with 8-bit activations:
    8 with int32 dot products, 7 with AVX2's int16 pair sums, None where neither is known (no x86 flags)."""
    if has_int8_dot_product():
        return 8
    return 7 if has_avx2() else None

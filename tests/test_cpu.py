"""CPU feature detection (`bertforge.cpu`), which picks bf16 for the demo and the int8 weight bits."""

from __future__ import annotations

import bertforge.cpu as cpu


def test_features_come_from_the_kernels_flags(monkeypatch):
    cases = {frozenset({"avx2", "fma"}): (False, False, 7), frozenset({"avx512f", "avx512_vnni"}): (False, True, 8),
             frozenset({"avx512_bf16", "avx512_vnni", "avx2"}): (True, True, 8),
             frozenset({"amx_bf16", "amx_int8"}): (True, True, 8), frozenset({"avx_vnni", "avx2"}): (False, True, 8),
             frozenset({"sse4_2"}): (False, False, None), frozenset(): (False, False, None)}
    for flags, expected in cases.items():
        monkeypatch.setattr(cpu, "cpu_flags", lambda flags=flags: flags)
        assert (cpu.has_native_bf16(), cpu.has_int8_dot_product(), cpu.int8_weight_bits()) == expected, flags


def test_this_machines_flags_are_read():
    flags = cpu.cpu_flags()
    with open("/proc/cpuinfo") as f:
        line = next((x for x in f if x.startswith("flags")), "flags :")
    assert flags == frozenset(line.split(":", 1)[1].split())

"""`bertforge env`: the facts a bug report needs, as lines and as JSON; CUDA devices shown from a stand-in
torch.cuda, since this machine has none."""

from __future__ import annotations

import contextlib
import json
import platform
import types

import numpy as np
import torch

from bertforge import __version__
from bertforge.cli import main


def _json(capsys) -> dict:
    assert main(["env", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_lines_name_every_section(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    starts = [line.split(":", 1)[0] for line in out.splitlines()]
    assert starts == ["versions", "os", "cpu", "cpu flags", "torch threads", "cuda", "allocator",
                      "distributed backends", "torchrun"]
    assert f"bertforge {__version__}" in out and f"torch {torch.__version__}" in out
    assert f"torch threads: {torch.get_num_threads()}" in out


def test_json_holds_versions_threads_and_backends(capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    facts = _json(capsys)
    v = facts["versions"]
    assert (v["bertforge"], v["torch"], v["numpy"], v["python"]) == (
        __version__, torch.__version__, np.__version__, platform.python_version())
    assert facts["torch"]["threads"] == torch.get_num_threads()
    assert facts["cuda"] == {"available": torch.cuda.is_available(), "devices": facts["cuda"]["devices"]}
    assert "gloo" in facts["distributed"]["backends"]
    assert facts["distributed"]["torchrun"] == {}
    assert set(facts["cpu"]["flags"]) <= {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni",
                                          "amx_bf16", "amx_int8", "amx_tile"}


def test_allocator_setting_and_torchrun_variables_are_reported(capsys, monkeypatch):
    monkeypatch.setenv("BERTFORGE_SYSTEM_MALLOC", "1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "29500")
    facts = _json(capsys)
    assert facts["allocator"] == {"BERTFORGE_SYSTEM_MALLOC": "1", "commands_keep_freed_memory": False}
    assert facts["distributed"]["torchrun"] == {"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "BERTFORGE_SYSTEM_MALLOC=1; training and batch inference leave the system allocator alone" in out
    assert "torchrun: RANK=1 WORLD_SIZE=2 MASTER_PORT=29500" in out


def test_cuda_devices_with_name_capability_memory_and_bf16(capsys, monkeypatch):
    """Two stand-in GPUs: an A100 (8.0, native bf16) and a T4 (7.5, bf16 emulated only)."""
    gpus = [types.SimpleNamespace(name="NVIDIA A100-SXM4-40GB", major=8, minor=0, total_memory=40 * 2**30),
            types.SimpleNamespace(name="Tesla T4", major=7, minor=5, total_memory=15 * 2**30)]
    current = [0]

    @contextlib.contextmanager
    def device(i):
        current[0] = i
        yield

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: gpus[i])
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: gpus[current[0]].major >= 8 or including_emulation)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90100)
    facts = _json(capsys)
    assert facts["cuda"]["devices"] == [
        {"index": 0, "name": "NVIDIA A100-SXM4-40GB", "capability": "8.0", "memory_gib": 40.0, "bf16": True},
        {"index": 1, "name": "Tesla T4", "capability": "7.5", "memory_gib": 15.0, "bf16": False}]
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "cuda:0: NVIDIA A100-SXM4-40GB, capability 8.0, 40.0 GiB, bf16 yes" in out
    assert "cuda:1: Tesla T4, capability 7.5, 15.0 GiB, bf16 no (auto trains in fp32)" in out

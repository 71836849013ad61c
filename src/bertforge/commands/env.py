"""`bertforge env`: what a bug report needs, in one block to paste.

    bertforge env          # human-readable
    bertforge env --json   # the same facts as one JSON object

Versions (bertforge, Python, torch, numpy, tokenizers, transformers when installed), the OS, the CPU and the
flags that change what pays on it, torch's threads, every CUDA device (name, compute capability, memory,
native bf16), the CPU allocator setting of the training commands, the distributed backends this torch has and
the torchrun variables when set.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from bertforge import cpu
from bertforge.commands.arguments import Command
from bertforge.options import option
from bertforge.train import memory

# CPU flags worth a line in a bug report: the vector widths and the bf16/int8 dot products (see bertforge.cpu).
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8", "amx_tile")
# Variables torchrun sets for each process; the first four decide what `distributed.setup` does.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID")
PACKAGES = ("bertforge", "torch", "numpy", "tokenizers", "transformers")


@dataclass
class EnvArgs:
    json: bool = option(False, help="print one JSON object instead of lines")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    return cpu.cpuinfo_field("model name") or platform.processor() or platform.machine()


def _cuda_devices() -> list[dict[str, Any]]:
    import torch

    devices = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        with torch.cuda.device(i):  # is_bf16_supported asks the current device
            # The question `--precision auto` asks (train/loop.py `resolve_precision`): native bf16, not emulated.
            bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        devices.append({"index": i, "name": props.name, "capability": f"{props.major}.{props.minor}",
                        "memory_gib": round(props.total_memory / 2**30, 1), "bf16": bf16})
    return devices


def collect() -> dict[str, Any]:
    """Every fact `bertforge env` prints, as plain JSON-able values."""
    import torch
    import torch.distributed as dist

    from bertforge.cpu import cpu_flags, has_int8_dot_product, has_native_bf16

    flags = cpu_flags()
    backends = []
    if dist.is_available():
        backends = [name for name, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                                          ("mpi", dist.is_mpi_available())) if ok]
    cuda_available = torch.cuda.is_available()
    return {
        "versions": {"python": platform.python_version(), **{p: _version(p) for p in PACKAGES}},
        "os": {"system": platform.system(), "release": platform.release(), "platform": platform.platform()},
        "cpu": {"model": _cpu_model(), "machine": platform.machine(), "logical_cpus": os.cpu_count(),
                "flags": [f for f in CPU_FLAGS if f in flags], "native_bf16": has_native_bf16(),
                "int8_dot_product": has_int8_dot_product()},
        "torch": {"threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
                  "cuda_build": torch.version.cuda,
                  "cudnn": torch.backends.cudnn.version() if cuda_available else None},
        "cuda": {"available": cuda_available, "devices": _cuda_devices() if cuda_available else []},
        # memory.py: the training and batch-inference commands keep freed CPU memory (glibc mallopt) unless this is 1.
        "allocator": {"BERTFORGE_SYSTEM_MALLOC": os.environ.get("BERTFORGE_SYSTEM_MALLOC"),
                      "commands_keep_freed_memory": memory.wanted()},
        "distributed": {"backends": backends,
                        "torchrun": {k: os.environ[k] for k in TORCHRUN_VARS if k in os.environ}},
    }


def _lines(facts: dict[str, Any]) -> list[str]:
    v, cpu, t, cuda = facts["versions"], facts["cpu"], facts["torch"], facts["cuda"]
    out = ["versions: " + ", ".join(f"{k} {v[k] or 'not installed'}" for k in ("bertforge", "python", *PACKAGES[1:])),
           f"os: {facts['os']['platform']}",
           f"cpu: {cpu['model']} ({cpu['logical_cpus']} logical CPUs, {cpu['machine']})",
           f"cpu flags: {' '.join(cpu['flags']) or 'none of ' + ' '.join(CPU_FLAGS)}; native bf16: "
           f"{'yes' if cpu['native_bf16'] else 'no'}; int8 dot product: {'yes' if cpu['int8_dot_product'] else 'no'}",
           f"torch threads: {t['threads']} (inter-op {t['interop_threads']}); CUDA build: {t['cuda_build'] or 'none'}"
           + (f", cuDNN {t['cudnn']}" if t["cudnn"] else "")]
    if cuda["devices"]:
        for d in cuda["devices"]:
            out.append(f"cuda:{d['index']}: {d['name']}, capability {d['capability']}, {d['memory_gib']} GiB, "
                       f"bf16 {'yes' if d['bf16'] else 'no (auto trains in fp32)'}")
    else:
        out.append("cuda: no device available")
    alloc = facts["allocator"]
    setting = alloc["BERTFORGE_SYSTEM_MALLOC"]
    out.append(f"allocator: BERTFORGE_SYSTEM_MALLOC={setting if setting is not None else '(unset)'}; training and "
               "batch inference " + ("keep freed CPU memory for reuse" if alloc["commands_keep_freed_memory"]
                                     else "leave the system allocator alone"))
    dist = facts["distributed"]
    out.append(f"distributed backends: {', '.join(dist['backends']) or 'none'}")
    run = dist["torchrun"]
    out.append("torchrun: " + (" ".join(f"{k}={v}" for k, v in run.items()) if run else "not set"))
    return out


def run(args: EnvArgs) -> None:
    facts = collect()
    if args.json:
        print(json.dumps(facts, indent=2))
    else:
        print("\n".join(_lines(facts)))


COMMANDS = [Command("env", EnvArgs, run, help="print versions, devices and settings for a bug report",
                    description=__doc__)]

"""The GPU check's step_profile part: where BERT-base's pretraining step at 256 x 128 spends its device time,
bertforge's and transformers' (the speed part's "kept" sides, eager), for the next speed work. The first H200 check
measured bertforge's step at 67.6 ms (1.35x transformers, 31.8% of the matmul rate by the work a step needs).

For each side: two steps warm, two profiled (torch.profiler, host and device). Figures per step: the wall time,
the device kernels' total time (the gap to the wall time is the GPU waiting on the host), that time by kind of
kernel (matmuls, attention, normalisation, optimizer, the rest, by the kernel's name), and the 12 costliest
kernels. Nothing is timed against anything: the speed part does that.
"""

from __future__ import annotations

import re
import time

import torch
from measure import sync
from pretrain_step import side_step

KINDS = [  # (kind, pattern on the kernel's name), first match wins
    ("matmul", r"gemm|nvjet|cutlass|xmma|matmul|addmm|aten::mm|aten::bmm|linear"),
    ("attention", r"flash|fmha|attention|efficient"),
    ("normalisation", r"layer_norm|layernorm|softmax|log_softmax|nll|cross_entropy"),
    ("optimizer", r"adam|foreach|multi_tensor|norm_kernel|clip"),
    ("dropout", r"dropout|bernoulli|philox|fused_dropout"),
]


def _kind(name: str) -> str:
    lower = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, lower):
            return kind
    return "other"


def profile_side(side: str, sizes: tuple, device: torch.device, steps: int = 2) -> dict:
    from torch.profiler import ProfilerActivity, profile

    preset, T, B, vocab = sizes
    step = side_step(side, preset, B, T, "bf16", device, vocab_size=vocab)
    for _ in range(2):
        step()
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync(device)
    wall = (time.perf_counter() - start) / steps
    by_name, launched = _kernel_ms(prof, device)
    by_name = {name: ms / steps for name, ms in by_name.items()}
    by_kind: dict[str, float] = {}
    for name, ms in by_name.items():
        by_kind[_kind(name)] = by_kind.get(_kind(name), 0.0) + ms
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return {"wall_ms": round(wall * 1e3, 2), "kernel_ms": round(sum(by_name.values()), 2),
            "by_kind_ms": {k: round(v, 2) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms": [[name[:100], round(ms, 3)] for name, ms in top],
            "kernels_per_step": launched // steps}


def _kernel_ms(prof, device: torch.device) -> tuple[dict[str, float], int]:
    """Milliseconds by kernel name over the profile, and how many kernels ran: the device's kernels on a GPU; in the
    dry run on the CPU, the operators' own host time (there the operators are the kernels)."""
    by_name: dict[str, float] = {}
    if device.type == "cuda":
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        for e in kernels:
            by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3
        return by_name, len(kernels)
    ops = [e for e in prof.key_averages() if e.key.startswith("aten::") and e.self_cpu_time_total > 0]
    for e in ops:
        by_name[e.key] = e.self_cpu_time_total / 1e3
    return by_name, sum(e.count for e in ops)


def step_profile(ctx) -> None:
    sizes = ("tiny", 32, 8, 1000) if ctx.dry else ("base", 128, 256, None)
    sides: dict[str, dict] = {}
    for side in ("ours-kept", "ref-kept"):
        if ctx.left() < 15:
            sides[side] = {"skipped": "time box spent"}
            continue
        try:
            sides[side] = profile_side(side, sizes, ctx.device)
        except Exception as e:  # recorded; the other side runs
            sides[side] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
        ctx.save(model=f"{sizes[0]}/{sizes[1]} x{sizes[2]}", sides=sides)
    cells = []
    for s, r in sides.items():
        if "wall_ms" in r:
            kinds = ", ".join(f"{k} {v}" for k, v in r["by_kind_ms"].items())
            cells.append(f"{s} {r['wall_ms']} ms, kernels {r['kernel_ms']} ms ({kinds})")
    ctx.save(headline="; ".join(cells) or "no side profiled")

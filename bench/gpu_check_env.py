"""The GPU check's environment part: `bertforge env`, the card and its driver, the dense bf16 matmul rate measured
here (the MFU denominator of the speed part), and `pytest -m cuda` on the files holding GPU tests (CUDA_TEST_FILES)."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from gpu_check_fork import bertforge_main, forked

REPO = Path(__file__).resolve().parents[1]


def matmul_rate(device: torch.device, n: int, repeats: int = 10) -> float:
    """Dense bf16 TFLOP/s of an n x n x n product into a preallocated output: the median of `repeats` timed
    products (CUDA events on a GPU, the wall clock on a CPU), after 3 warm-up products."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        torch.mm(a, b, out=c)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            torch.mm(a, b, out=c)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            torch.mm(a, b, out=c)
            times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times) / 1e12


def card(device: torch.device) -> dict:
    facts = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "python": sys.version.split()[0]}
    if device.type == "cuda":
        facts["card"] = torch.cuda.get_device_name(device)
        facts["memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    smi = shutil.which("nvidia-smi")
    if smi:
        q = subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=30)
        facts["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()
    return facts


CUDA_TEST_FILES = ("tests/test_cuda.py", "tests/test_varlen_attention.py")  # tests/test_gpu_check.py checks the list


def cuda_tests(ctx) -> dict:
    # without ../shared, conftest's `prepared` trains on synthetic documents when asked, so the CUDA tests run
    env = {**os.environ, "BERTFORGE_TESTS_SYNTHETIC_CORPUS": "1"}
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rs", "-p", "no:cacheprovider", *CUDA_TEST_FILES]
    timeout = max(10, ctx.left() - 5)
    try:
        if ctx.dry:  # pytest forked from this process, torch imported (`gpu_check_fork`)
            run = forked(functools.partial(_pytest_here, cmd[3:], env), cmd, timeout)
        else:
            run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        run = subprocess.CompletedProcess(e.cmd, -1, out + "\n= error: pytest stopped by the time box =", "")
    lines = run.stdout.strip().splitlines()
    summary = next((ln for ln in reversed(lines) if re.search(r"passed|failed|skipped|deselected|error", ln)), "")
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)", summary)}
    skips = [ln for ln in lines if ln.startswith("SKIPPED")]
    return {"summary": summary.strip("= "), "counts": counts, "skipped": skips,
            "exit": run.returncode,
            "tail": "\n".join(lines[-30:]) if run.returncode not in (0, 5) else ""}


def _pytest_here(args: list[str], env: dict[str, str]) -> int:
    import pytest

    os.chdir(REPO)
    os.environ.update(env)
    return int(pytest.main(args))


def environment(ctx) -> None:
    cmd = [sys.executable, "-m", "bertforge", "env", "--json"]
    if ctx.dry:  # forked from this process, torch imported (`gpu_check_fork`)
        env = forked(bertforge_main(cmd[3:]), cmd, 60)
    else:
        env = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    ctx.save(bertforge_env=json.loads(env.stdout) if env.returncode == 0 else env.stderr[-2000:], **card(ctx.device))
    n = 256 if ctx.dry else 8192
    rate = matmul_rate(ctx.device, n)
    ctx.save(matmul_bf16_tflops=round(rate, 3), matmul_shape=[n, n, n], headline=f"bf16 matmul {rate:.1f} TFLOP/s")
    tests = cuda_tests(ctx)
    ctx.save(cuda_tests=tests, headline=f"{ctx.result.get('card', 'cpu')}; bf16 matmul {rate:.1f} TFLOP/s; "
                                        f"pytest -m cuda: {tests['summary']}")
    on_gpu_failed = not ctx.dry and (tests["counts"].get("failed") or tests["counts"].get("skipped"))
    if tests["exit"] not in (0, 5) or on_gpu_failed:
        ctx.save(error=f"pytest -m cuda: {tests['summary'] or 'no summary line'}")

"""bench/gpu_check.py, the prepared GPU check (issue 44), with `--cpu-dry-run` as CI runs it: every part on the CPU
at tiny sizes, so the script cannot rot between the rare runs on a GPU. Its `main` runs in the test's process (see
`run_check`); one test starts the script as a command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

# each test runs the check, which starts many processes; the check sets torch to one thread in the process it
# forks its parts from, here this one, and `one_thread` puts the test's count back after
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import gpu_check  # noqa: E402
import gpu_check_fork  # noqa: E402
import torch  # noqa: E402

PARTS = ["env", "journey", "bf16", "speed", "finetune", "inference", "shapes", "step_profile", "data_wait"]
# figures each part must report when it is ok (beyond its headline)
FIGURES = {
    "env": ["torch", "matmul_bf16_tflops", "cuda_tests", "bertforge_env"],
    "journey": ["resume", "kill", "eval_steps", "checkpoints", "finetune_metrics", "device_vs_cpu_max_diff",
                "onnx_vs_torch_max_diff"],
    "bf16": ["losses_fp32", "losses_bf16", "within_tolerance", "last10_tolerance"],
    "speed": ["table", "matmul_bf16_tflops", "flops_note"],
    "finetune": ["rates", "ratio", "packed_over_padded"],
    "inference": ["rates", "ratio"],
    "shapes": ["variants", "profile_new_width"],
    "step_profile": ["sides", "model"],
    "data_wait": ["workers_0", "workers_2"],
}


def run_check(tmp_path: Path, capsys, *args: str) -> tuple[SimpleNamespace, dict]:
    """The check with `--cpu-dry-run`, its `main` called in this test's process: the dry run forks its parts (and
    their commands) from the process that runs it, here this one, which has torch and transformers imported
    already (a fresh interpreter spent ~8 s on them). Its exit status and what it printed, as `subprocess.run`
    gives them, and its report; the environment variables it sets for its children are put back after."""
    saved = dict(os.environ)
    try:
        code = gpu_check.main(["--cpu-dry-run", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
                               *args])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    printed = capsys.readouterr()
    run = SimpleNamespace(returncode=code, stdout=printed.out, stderr=printed.err)
    return run, json.loads((tmp_path / "out" / "report.json").read_text())


def table_of(stdout: str) -> list[str]:
    """The lines from the table's heading to the end of the output."""
    lines = stdout.rstrip().splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("GPU check ("))
    return lines[start:]


def test_the_dry_run_runs_every_part_and_prints_the_table_last(tmp_path, capsys):
    run, report = run_check(tmp_path, capsys)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert report["dry_run"] and list(report["parts"]) == PARTS
    for name, part in report["parts"].items():
        assert part["ok"] and part["error"] is None, (name, part.get("error"))
        assert part["headline"] and all(k in part for k in FIGURES[name]), (name, sorted(part))
    journey = report["parts"]["journey"]
    assert journey["resume"]["bitwise_equal"] and not journey["kill"]["finished_before_kill"]
    speed = report["parts"]["speed"]["table"]["tiny/32 x8"]
    assert speed["ours-kept"]["tokens_per_s"] > 0 and speed["ref-kept"]["mfu"] > 0
    # the table is the output's last lines: a heading, a rule, one row per part in order, each ok
    table = table_of(run.stdout)
    assert [row.split("|")[1].strip() for row in table[3:]] == PARTS
    assert all(row.split("|")[2].strip() == "ok" for row in table[3:])
    assert (tmp_path / "out" / "summary.md").read_text().count("\n## ") == len(PARTS)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["report.json", "summary.md"]


def test_a_failing_part_and_one_past_its_time_box_are_recorded_and_the_check_goes_on(tmp_path, capsys,
                                                                                      monkeypatch):
    """env fails, then bf16 (the next part, so the check went on) hangs and is stopped by its box of 1 s."""
    monkeypatch.setenv("GPU_CHECK_FAIL", "env")
    monkeypatch.setenv("GPU_CHECK_HANG", "bf16")
    run, report = run_check(tmp_path, capsys, "--parts", "env", "bf16", "--time-box", "1")
    assert run.returncode == 1
    env, bf16 = report["parts"]["env"], report["parts"]["bf16"]
    assert not env["ok"] and "env failed on purpose (GPU_CHECK_FAIL)" in env["error"]
    assert not bf16["ok"] and bf16["error"].startswith("stopped by its time box of 1 s") and bf16["seconds"] < 30
    rows = table_of(run.stdout)[3:]
    assert [row.split("|")[1].strip() for row in rows] == ["env", "bf16"]
    assert all(row.split("|")[2].strip() == "FAILED" for row in rows) and "failed on purpose" in rows[0]


def test_the_script_runs_as_a_command_and_refuses_a_missing_out():
    run = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--cpu-dry-run"], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2 and "error: --out is required" in run.stderr


def test_the_process_the_parts_are_forked_from_runs_torch_on_one_thread():
    """Even where torch came in before the check (this process): on two threads, with OpenMP's started, a command
    forked from a forked part waited forever on a lock of threads the fork had not copied."""
    torch.set_num_threads(2)
    torch.randn(512, 512) @ torch.randn(512, 512)
    gpu_check_fork.preload(dict(os.environ), reference=False)
    assert torch.get_num_threads() == 1


def test_the_check_runs_every_file_that_holds_gpu_tests():
    """The environment part runs `pytest -m cuda` on a list of files: a file with GPU tests left off it would never
    run on the rare GPU."""
    import re

    import gpu_check_env

    tests = Path(__file__).resolve().parent
    marked = re.compile(r"^@(gpu|pytest\.mark\.cuda)\b", re.M)  # a test decorated as a GPU test
    holding = {f"tests/{p.name}" for p in tests.glob("test_*.py") if marked.search(p.read_text())}
    assert holding == set(gpu_check_env.CUDA_TEST_FILES)

"""The GPU check: one command that measures bertforge's CUDA path on the card it runs on (issue 44), in at most
8 minutes on one H100, and writes `report.json` plus a readable `summary.md` under --out.

Each part is a function (the `PARTS` table) that runs in a child process of its own under a time box, so a part
that crashes, hangs or runs the card out of memory records its error and the check goes on to the next part.
A part saves its figures as it goes, so a part stopped by its time box still reports what it measured. The dry
run forks its parts and their `bertforge` commands (torchrun's one rank too) from its own process, which imports
torch and transformers once (`gpu_check_fork`): the check's logic is the same, without eight seconds of imports a
process.

    PYTHONPATH=src python3 bench/gpu_check.py --out gpu-report          # on the GPU machine, everything
    PYTHONPATH=src python3 bench/gpu_check.py --out r --parts env speed  # some parts
    PYTHONPATH=src python3 bench/gpu_check.py --cpu-dry-run --out r      # every part on the CPU, tiny sizes

Parts: env (versions, card, driver, the dense bf16 matmul rate, `pytest -m cuda`), journey (vocab train, prepare,
pretrain under torchrun with a SIGKILL and --resume, finetune, predict, export), bf16 (autocast against fp32
over 50 training steps), speed (the pretraining step against transformers: tokens/s, peak memory, MFU, eager and
compiled), finetune (fine-tuning steps with dynamic padding against transformers), inference (bf16 inference
against transformers), shapes (batches of many widths: each shape's first pass against its second, SDPA on and
off cuDNN, widths rounded to 8; a profile), step_profile (where BERT-base's pretraining step spends its device
time, both sides), data_wait (how long each training step waits for its batch). The table of results is printed
last. Nothing is downloaded: the check writes its own synthetic corpus and tasks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
# name -> (module, function, time box in seconds on the GPU). On an H200 the parts ran in 364 s without shapes,
# which took 54 s; TOTAL_SECONDS keeps the whole under 8 minutes.
PARTS: dict[str, tuple[str, str, int]] = {
    "env": ("gpu_check_env", "environment", 100),
    "journey": ("gpu_check_journey", "journey", 100),
    "bf16": ("gpu_check_speed", "bf16_against_fp32", 25),
    "speed": ("gpu_check_speed", "pretrain_speed", 150),
    "finetune": ("gpu_check_speed", "finetune_speed", 35),
    "inference": ("gpu_check_speed", "inference_speed", 20),
    "shapes": ("gpu_check_shapes", "shapes", 60),
    "step_profile": ("gpu_check_profile", "step_profile", 40),
    "data_wait": ("gpu_check_journey", "data_wait", 40),
}
REFERENCE_PARTS = {"speed", "finetune", "inference"}  # the parts that run transformers' BERT beside ours
DRY_RUN_BOX = 300  # seconds per part in the dry run: only a guard against a hang (a busy 2-core CI runner is slow)
GRACE = 10  # seconds past its time box before a part is stopped (it saves what it has at its deadline); at most
#             the box itself, so a part boxed in seconds (the check's own hang test) is stopped in seconds
TOTAL_SECONDS = 460  # parts start only while the check has run less than this (8 minutes in all)


class Context:
    """What a part gets: the device, the sizes (dry run or not), a work directory for its files, its deadline,
    and `result`, which `save` writes out so the parent reads it even if the part is stopped."""

    def __init__(self, name: str, dry: bool, work: Path, deadline: float, result_file: Path):
        import torch

        self.name, self.dry, self.work, self.deadline, self.result_file = name, dry, work, deadline, result_file
        self.device = torch.device("cpu" if dry else "cuda")
        self.result: dict = {}

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self, **figures) -> None:
        self.result.update(figures)
        tmp = self.result_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=str))
        tmp.replace(self.result_file)


def env_for_children(dry: bool) -> dict[str, str]:
    """The environment of every process the check starts: src/ first on the path, no warnings noise. In the dry
    run one CPU thread a process: its tiny models gain nothing from more, and a busy CI runner's threads that
    spin waiting for each other made the dry run several times slower."""
    path = os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore", **({"OMP_NUM_THREADS": "1"} if dry else {})}


def run_child(name: str, args: argparse.Namespace, work: Path, box: float) -> dict:
    """One part in a child process under its time box; its saved figures, with ok, seconds and any error. The dry
    run forks the child from this process, which has torch imported (`gpu_check_fork`)."""
    result_file = work / f"{name}.json"
    result_file.unlink(missing_ok=True)
    child_args = ["--child", name, "--work", str(work), "--deadline", str(time.time() + box)] + (
        ["--cpu-dry-run"] if args.cpu_dry_run else []) + (["--speed-jobs", *args.speed_jobs] if args.speed_jobs else [])
    start = time.time()
    error = None
    try:
        run = _start_child(child_args, box + min(GRACE, box), args.cpu_dry_run)
        if run.returncode:
            error = f"exit {run.returncode}: " + _tail(run.stderr or run.stdout)
    except subprocess.TimeoutExpired as e:  # both ways of starting the child give its stderr as text
        error = f"stopped by its time box of {box:.0f} s: " + _tail(e.stderr or "")
    figures = json.loads(result_file.read_text()) if result_file.is_file() else {}
    if figures.get("error") and error is None:
        error = figures["error"]
    return {"ok": error is None, "seconds": round(time.time() - start, 1), "error": error, **figures}


def _start_child(child_args: list[str], timeout: float, dry: bool) -> subprocess.CompletedProcess:
    """This script with `child_args`, in a session of its own, so that a part stopped by its time box takes the
    processes it started (torchrun, pytest) with it rather than leaving them on the GPU for the next part."""
    if dry:
        from gpu_check_fork import forked

        return forked(lambda: child(parse_args(child_args)), ["gpu_check.py", *child_args], timeout)
    cmd = [sys.executable, str(Path(__file__).resolve()), *child_args]
    proc = subprocess.Popen(cmd, env=env_for_children(dry), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a process outside the group holds the pipe: its output is lost
            err = ""
        raise subprocess.TimeoutExpired(cmd, timeout, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def child(args: argparse.Namespace) -> None:
    """Runs one part in this process (the parent started it); errors go to stderr and the exit status."""
    import importlib

    sys.path.insert(0, str(BENCH))
    module, function, _ = PARTS[args.child]
    # the check's own tests: a part that fails, a part that hangs
    if args.child in os.environ.get("GPU_CHECK_FAIL", "").split(","):
        raise RuntimeError(f"{args.child} failed on purpose (GPU_CHECK_FAIL)")
    if args.child in os.environ.get("GPU_CHECK_HANG", "").split(","):
        time.sleep(3600)
    work = Path(args.work)
    ctx = Context(args.child, args.cpu_dry_run, work / args.child, args.deadline, work / f"{args.child}.json")
    ctx.speed_jobs = args.speed_jobs
    ctx.work.mkdir(parents=True, exist_ok=True)
    getattr(importlib.import_module(module), function)(ctx)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="directory for report.json and summary.md (created)")
    p.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS), help="parts to run, in order")
    p.add_argument("--cpu-dry-run", action="store_true", help="every part on the CPU at tiny sizes (CI)")
    p.add_argument("--time-box", type=float, help="seconds for each part (default: each part's own; dry run: "
                   f"{DRY_RUN_BOX})")
    p.add_argument("--box", nargs="+", default=[], metavar="PART=SECONDS", help="a part's own time box")
    p.add_argument("--speed-jobs", nargs="+", metavar="ROW:SIDE", help="the speed part's jobs only, e.g. "
                   "base/128:ref-compiled large/128:ours-compiled (default: every row's)")
    p.add_argument("--work", help="directory for the parts' files (default: a new temporary one)")
    p.add_argument("--child", choices=list(PARTS), help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.child and not args.out:
        p.error("--out is required")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    from gpu_check_report import summary_table, write_report

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bertforge-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.cpu_dry_run:  # its parts are forked from this process, with torch and transformers imported once
        from gpu_check_fork import preload

        preload(env_for_children(True), reference=bool(REFERENCE_PARTS & set(args.parts)))
    start = time.time()
    report = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "dry_run": args.cpu_dry_run,
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "work": str(work), "parts": {}}
    for name in args.parts:
        left = TOTAL_SECONDS - (time.time() - start)
        own = dict(b.split("=", 1) for b in args.box)
        box = args.time_box or (DRY_RUN_BOX if args.cpu_dry_run else min(float(own.get(name, PARTS[name][2])), left))
        if left < 10 and not args.cpu_dry_run:
            report["parts"][name] = {"ok": False, "seconds": 0, "error": "not run: the check's time was spent"}
            continue
        print(f"[gpu_check] {name} (time box {box:.0f} s) ...", flush=True)
        report["parts"][name] = run_child(name, args, work, box)
        write_report(out, report)  # after every part: a check stopped from outside keeps what it measured
    report["seconds"] = round(time.time() - start, 1)
    write_report(out, report)
    print(summary_table(report), flush=True)
    return 0 if all(p["ok"] for p in report["parts"].values()) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(BENCH))
    sys.exit(main())

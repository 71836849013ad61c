"""Two gloo processes on the CPU: the README's command under torchrun, with evaluation and checkpoints on,
completes, and its resume is bitwise equal to an uninterrupted run; on two forked ranks (tests/forked.py, set up
as torchrun sets up its workers) evaluation equals one process's, fine-tuning evaluates, and every collective
gets its tensors on the process group's device.

The device check has no GPU to run on, so it declares one: the loop is told it runs on the `meta` device, and
moving to or creating on `meta` gives a CPU tensor tagged as being there. Every torch.distributed collective is
wrapped to refuse a tensor without the tag, that is one that a GPU run would have left on the CPU, where NCCL
refuses it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from forked import forked_ranks
from safetensors.torch import load_file

from bertforge.files import read_jsonl

pytestmark = pytest.mark.slow  # each test launches torchrun

SRC = Path(__file__).resolve().parents[1] / "src"
DECLARED = torch.device("meta")  # the device the checked run believes it is on


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}


def _torchrun(*args: str, logs: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """Two processes under torchrun, its agent's logs in `logs` (not a directory of its own in /tmp, which it leaves
    behind); a hang fails the test after `timeout` seconds instead of blocking it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--log-dir",
           str(logs), *args]
    try:
        return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"two processes did not finish in {timeout:.0f} s (a hang?): {str(e.stderr)[-2000:]}")


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "model.safetensors")


# --- the README's command, and its resume: per-rank random number generators ---------------------------------


def test_the_readme_command_completes_and_its_resume_is_bitwise_equal_to_an_uninterrupted_run(prepared, tmp_path):
    """The README's command with evaluation and checkpoints on completes under torchrun. Resumed from its step-3
    checkpoint (on two forked ranks), it ends bitwise where it ended: dropout is on (the preset's), so each rank
    draws its own masks, and the resumed ranks must continue their own streams."""
    args = ["pretrain", "--data", str(prepared), "--model", "tiny", "--steps", "6", "--batch-size", "8",
            "--warmup-steps", "2", "--eval-every", "3", "--eval-batches", "2", "--save-every", "3", "--log-every",
            "1", "--no-progress"]
    full = tmp_path / "full"
    run = _torchrun("-m", "bertforge", *args, "--out", str(full), logs=tmp_path / "torchrun")
    assert run.returncode == 0, run.stderr[-3000:]
    assert {"config.json", "model.safetensors", "vocab.txt"} <= {p.name for p in full.iterdir()}
    assert sorted(p.name for p in (full / "checkpoints").iterdir()) == ["step-3", "step-6"]
    evals = [r for r in read_jsonl(full / "metrics.jsonl") if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [3, 6]
    assert all(0 <= r["mlm_accuracy"] <= 1 and r["mlm_loss"] > 0 for r in evals)
    # What a run killed after its step-3 checkpoint leaves behind, taken from the uninterrupted run
    cut = tmp_path / "cut"
    shutil.copytree(full / "checkpoints" / "step-3", cut / "checkpoints" / "step-3")
    shutil.copy(full / "run_config.json", cut / "run_config.json")
    (cut / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in read_jsonl(full / "metrics.jsonl")
                                               if r["step"] <= 3))
    rng = torch.load(cut / "checkpoints" / "step-3" / "trainer_state.pt", weights_only=True)["rng"]
    assert len(rng) == 2 and not torch.equal(rng[0]["torch"], rng[1]["torch"])
    # resumed on two forked ranks, set up as torchrun sets up its workers (the launcher itself ran above)
    resumed = forked_ranks([*args, "--out", str(cut), "--resume"], tmp_path / "logs")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = _weights(full), _weights(cut)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    clock = ("time", "tokens_per_s", "step_time_s", "data_wait_s")
    la, lb = ([{k: v for k, v in r.items() if k not in clock} for r in read_jsonl(run / "metrics.jsonl")]
              for run in (full, cut))
    assert la == lb  # losses and evaluations, step by step


# --- two processes: one process's training and evaluation, every collective on the group's device ----------


def test_two_processes_match_one_with_every_collective_on_the_group_device(prepared, tiny_config_file, tmp_path,
                                                                          one_thread):
    """The same run in one process and in two: the same global batches with exact loss weighting give the same
    losses and weights up to float summation order, and evaluation sharded over the ranks gives one process's
    figures. The two processes run as checked ranks (see `_checked_rank`), so the same run also shows that every
    collective, the loop's and evaluation's and the checkpoints', gets its tensors on the group's device."""
    cfg = tiny_config_file(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    args = ["pretrain", "--data", str(prepared), "--model", cfg, "--steps", "4", "--batch-size", "8", "--lr",
            "1e-3", "--warmup-steps", "1", "--eval-every", "2", "--eval-batches", "3", "--save-every", "2",
            "--log-every", "1", "--precision", "fp32", "--no-progress"]
    from bertforge.cli import main

    assert main([*args, "--out", str(tmp_path / "one")]) == 0  # in this process, on one thread as each rank
    log = tmp_path / "collectives"
    log.mkdir()
    two = forked_ranks([*args, "--out", str(tmp_path / "two"), "--device", str(DECLARED)], tmp_path / "logs",
                       before=lambda: _checked_rank(log))
    assert two.returncode == 0, two.stderr[-3000:]

    records = {run: read_jsonl(tmp_path / run / "metrics.jsonl") for run in ("one", "two")}
    la, lb = ([r["loss"] for r in records[run] if r["split"] == "train"] for run in ("one", "two"))
    assert len(la) == len(lb) == 4
    assert la == pytest.approx(lb, abs=1e-4)
    a, b = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4, msg=k)
    ea, eb = ([r for r in records[run] if r["split"] == "eval"] for run in ("one", "two"))
    assert [r["step"] for r in ea] == [r["step"] for r in eb] == [2, 4]
    for x, y in zip(ea, eb, strict=True):
        assert x.keys() == y.keys()
        # the same 3 x 8 validation sequences; the weights agree to float summation order (1e-5, above), so
        # the figures do too, a masked-token count of 3 x 8 x ~9 leaves accuracy exact
        assert x["mlm_accuracy"] == y["mlm_accuracy"] and x["nsp_accuracy"] == y["nsp_accuracy"]
        assert x["mlm_loss"] == pytest.approx(y["mlm_loss"], rel=1e-4)

    for rank in (0, 1):
        seen = read_jsonl(log / f"rank{rank}.jsonl")
        tensors = [c for c in seen if c["device"] != "none"]
        assert {c["op"] for c in tensors} >= {"all_reduce"}, seen  # the check did see the loop's collectives
        assert {c["device"] for c in tensors} == {str(DECLARED)}, seen
        assert "all_gather_object" in {c["op"] for c in seen}, seen  # per-rank RNG states for checkpoints


# --- fine-tuning: sharded dev features gathered back in order ---------------------------------------------


def test_two_process_finetuning_evaluates_and_ends(tiny_model_dir, tmp_path):
    """Fine-tuning evaluates every epoch on sharded dev features gathered back in order; it must end, and its
    best dev scores must be what one process scores the kept model at."""
    from bertforge.tasks.runner import evaluate_examples, load_task_model

    data = tmp_path / "data"
    data.mkdir()
    words = {0: "dull boring slow", 1: "bright lovely great"}
    for split, n in (("train", 24), ("dev", 11)):  # 11: the ranks' shares differ in size
        rows = ["text,label"] + [f"the {words[i % 2]} speech number {i},{'pos' if i % 2 else 'neg'}"
                                 for i in range(n)]
        (data / f"{split}.csv").write_text("\n".join(rows) + "\n")
    args = ["finetune", "--task", "csv", "--data", str(data), "--init", str(tiny_model_dir), "--text-column",
            "text", "--label-column", "label", "--batch-size", "8", "--epochs", "2", "--lr", "1e-3",
            "--max-length", "32"]
    out = tmp_path / "run"
    run = forked_ranks(args + ["--out", str(out)], tmp_path / "logs")
    assert run.returncode == 0, run.stderr[-3000:]
    reported = json.loads((out / "metrics.json").read_text())
    assert len(reported["history"]) == 2
    assert len(json.loads((out / "predictions_dev.json").read_text())) == 11
    tm = load_task_model(out, device="cpu")
    scores, _ = evaluate_examples(tm, tm.task.read(data, "dev"))
    assert scores.keys() == reported["metrics"].keys()
    for k, v in scores.items():
        assert v == pytest.approx(reported["metrics"][k], abs=1e-9), k


TENSOR_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "gather",
                      "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
                      "send", "recv", "isend", "irecv")
OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
                      "barrier", "monitored_barrier")


def _declare_device(declared: torch.device) -> None:
    """Make `declared` a device whose tensors are CPU tensors tagged `_declared`: `.to(declared)`,
    `module.to(declared)` and factories with `device=declared` keep to the CPU and tag what they return."""
    def wants(args: tuple, kwargs: dict) -> bool:
        device = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))
        return device is not None and torch.device(device) == declared

    def to_cpu(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args = tuple("cpu" if isinstance(a, (str, torch.device)) else a for a in args)
        return args, {**kwargs, "device": "cpu"} if "device" in kwargs else kwargs

    def tagging(real):
        def call(*args, **kwargs):
            if not wants(args, kwargs):
                return real(*args, **kwargs)
            args, kwargs = to_cpu(args, kwargs)
            out = real(*args, **kwargs)
            out._declared = True
            return out
        return call

    real_tensor_to, real_module_to = torch.Tensor.to, torch.nn.Module.to
    torch.Tensor.to = lambda self, *a, **k: tagging(real_tensor_to)(self, *a, **k)
    torch.nn.Module.to = lambda self, *a, **k: self if wants(a, k) else real_module_to(self, *a, **k)
    for name in ("tensor", "as_tensor", "zeros", "ones", "full", "empty", "arange"):
        setattr(torch, name, tagging(getattr(torch, name)))


def _check_collectives(declared: torch.device, seen: _Logged) -> None:
    """Wrap every torch.distributed collective: record the device of what it gets and refuse any tensor that is
    not on `declared`."""
    import torch.distributed as dist

    def where(x) -> str:
        if isinstance(x, torch.Tensor):
            return str(declared) if getattr(x, "_declared", False) else str(x.device)
        return where(x[0]) if isinstance(x, (list, tuple)) and x else "none"

    def checked(name: str, real):
        def call(*args, **kwargs):
            device = where(args[0]) if args and name in TENSOR_COLLECTIVES else "none"
            seen.append({"op": name, "device": device})
            if name in TENSOR_COLLECTIVES and device != str(declared):
                raise RuntimeError(f"torch.distributed.{name} got a tensor on {device}, but the process group is "
                                   f"on {declared}")
            return real(*args, **kwargs)
        return call

    for name in TENSOR_COLLECTIVES + OBJECT_COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, checked(name, getattr(dist, name)))


class _Logged:
    """Where a rank's collectives go: a line of JSON each, written as it is called (a forked rank ends in
    `os._exit`, after which nothing of it runs)."""

    def __init__(self, path: Path):
        self.path = path

    def append(self, item: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(item) + "\n")


def _checked_rank(log: Path) -> None:
    """Makes this process the checked rank: on the declared device, every collective it calls recorded in
    `log`/rank<RANK>.jsonl."""
    _declare_device(DECLARED)
    _check_collectives(DECLARED, _Logged(log / f"rank{os.environ['RANK']}.jsonl"))

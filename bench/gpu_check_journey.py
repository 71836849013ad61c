"""The GPU check's journey part (what a user runs, through the command line, on a synthetic corpus the check
writes itself) and its data-wait part (how long each training step waits for its batch).

Journey: `vocab train`, `prepare`, `pretrain` under `torchrun --nproc-per-node 1` (the dry run forks its one rank)
with evaluation and checkpoints, the same run SIGKILLed after a checkpoint and continued with --resume and
compared with the uninterrupted run, `finetune` on a synthetic CSV task, `predict` on the device and on the CPU
(a model trained on the GPU read on the CPU), `export` to ONNX and `predict --backend onnx` against torch.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import csv
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from gpu_check_fork import bertforge_main, forked, one_rank, start  # noqa: E402
from support import make_documents, write_doc_corpus  # noqa: E402  (tests/support.py: the synthetic corpus)

# The resumed run's logged losses and final weights against the uninterrupted run's, where they are not bitwise
# equal: a GPU's atomically accumulated gradients (embedding backward, attention backward) differ in their last
# bits from run to run, and ~200 optimizer steps of a tiny model grow that to ~1e-4; 2% of a loss and 0.01 of a
# weight leave room for that and none for a resume that lost its optimizer state, schedule or data position.
LOSS_RTOL, WEIGHT_ATOL = 0.02, 0.01
PROB_ATOL = 0.01  # one model's probabilities on two devices (TF32 matmuls on the GPU) or two engines


def cli(ctx, *args: str, timeout: float | None = None, torchrun: bool = False) -> str:
    """Runs `python -m bertforge ARGS` (or under `torchrun_command()`); its stdout. A failure raises naming the
    command. The dry run forks `bertforge ARGS` (or torchrun's one rank) from this process instead of starting an
    interpreter (`gpu_check_fork`)."""
    cmd = (torchrun_command() if torchrun else [sys.executable, "-m", "bertforge"]) + list(args)
    start = time.time()
    timeout = timeout or max(5.0, ctx.left() - 2)
    try:
        if ctx.dry:
            run = forked((one_rank if torchrun else bertforge_main)(list(args)), cmd, timeout)
        else:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"`{' '.join(args[:2])}` was still running at the part's deadline, after "
                           f"{time.time() - start:.0f} s") from None
    seconds = ctx.result.setdefault("step_seconds", {})  # each command's seconds, summed over its runs
    name = args[0] if args[0] != "vocab" else "vocab train"
    seconds[name] = round(seconds.get(name, 0.0) + time.time() - start, 1)
    if run.returncode:
        tail = "\n".join(run.stderr.strip().splitlines()[-8:])
        raise RuntimeError(f"`{' '.join(args[:2])}` exited {run.returncode}: {tail}")
    return run.stdout


def prepared_data(ctx, seq_len: int) -> tuple[Path, Path, int]:
    """(tokenizer, prepared data, vocabulary size) of a synthetic corpus at `seq_len`, made once per check run."""
    root = ctx.work.parent / f"data-{seq_len}"
    if not (root / "data" / "manifest.json").is_file():
        # BERT-base's batch of 256 at 128 needs thousands of instances, so that an epoch (whose start may restart
        # the loader's workers) is not every few steps
        n_docs = 60 if ctx.dry else (1500 if seq_len >= 128 else 400)
        corpus = write_doc_corpus(root / "corpus", make_documents(n_docs, seed=7))
        cli(ctx, "vocab", "train", "--corpus", str(corpus), "--vocab-size", "1000", "--min-frequency", "1",
            "--out", str(root / "tok"), "--no-progress")
        cli(ctx, "prepare", "--corpus", str(corpus), "--tokenizer", str(root / "tok"), "--out", str(root / "data"),
            "--max-seq-len", str(seq_len), "--val-fraction", "0.1", "--workers", "2", "--no-progress")
    vocab = len((root / "tok" / "vocab.txt").read_text().splitlines())
    return root / "tok", root / "data", vocab


def pretrain_args(ctx, data: Path, model: Path, out: Path) -> list[str]:
    steps, save = (60, 10) if ctx.dry else (240, 80)
    return ["pretrain", "--data", str(data), "--model", str(model), "--out", str(out), "--steps", str(steps),
            "--batch-size", "8" if ctx.dry else "32", "--warmup-steps", "10", "--save-every", str(save),
            "--eval-every", str(steps // 2), "--eval-batches", "2", "--log-every", "1", "--seed", "1",
            "--device", ctx.device.type, "--no-progress"]


def torchrun_command() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "bertforge"]


def _children(pid: int) -> list[int]:
    """Every descendant of `pid` (from /proc), deepest first."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found += _children(int(entry.name)) + [int(entry.name)]
        except (OSError, IndexError, ValueError):
            continue
    return found


def killed_run(ctx, args: list[str], out: Path, after: int) -> dict:
    """Starts the run under torchrun (the dry run: its one rank forked), SIGKILLs its processes once checkpoint
    `after` exists; what it saw."""
    if ctx.dry:
        code = _killed_fork(ctx, args, out / "checkpoints" / f"step-{after}")
    else:
        proc = subprocess.Popen(torchrun_command() + args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)
        _wait_for(ctx, out / "checkpoints" / f"step-{after}", lambda: proc.poll() is None)
        for pid in _children(proc.pid) + [proc.pid]:  # the worker first: a crash of the training process itself
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        code = proc.wait()
    steps = sorted(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*"))
    return {"killed_after_checkpoints": steps, "finished_before_kill": (out / "model.safetensors").is_file(),
            "exit": code}


def _wait_for(ctx, target: Path, running) -> None:
    while not target.is_dir() and running() and ctx.left() > 5:
        time.sleep(0.02)


def _killed_fork(ctx, args: list[str], target: Path) -> int:
    """The dry run's killed run: torchrun's one rank forked, SIGKILLed with its process group; its exit status."""
    pid, status = start(one_rank(args), Path(os.devnull), ctx.work / "killed-run.log"), None

    def running() -> bool:  # reaps the child once it has ended; its status kept
        nonlocal status
        if status is None:
            done, code = os.waitpid(pid, os.WNOHANG)
            status = code if done else None
        return status is None

    _wait_for(ctx, target, running)
    if running():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        status = os.waitpid(pid, 0)[1]
    return os.waitstatus_to_exitcode(status)


def _losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in records if r.get("split") == "train"}  # the last record of each step


def compare_runs(a: Path, b: Path, after: int) -> dict:
    from safetensors.torch import load_file

    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    diff = max(float((wa[k].double() - wb[k].double()).abs().max()) for k in wa)
    la, lb = _losses(a), _losses(b)
    steps = [s for s in la if s > after]
    loss_rel = max(abs(la[s] - lb[s]) / abs(la[s]) for s in steps)
    digest = [hashlib.sha256((r / "model.safetensors").read_bytes()).hexdigest() for r in (a, b)]
    return {"bitwise_equal": digest[0] == digest[1], "max_weight_abs_diff": diff, "max_loss_rel_diff": loss_rel,
            "compared_steps": [min(steps), max(steps)], "loss_rtol": LOSS_RTOL, "weight_atol": WEIGHT_ATOL,
            "within_tolerance": diff <= WEIGHT_ATOL and loss_rel <= LOSS_RTOL}


def pretrain_and_resume(ctx, data: Path, model: Path) -> Path:
    whole, broken = ctx.work / "run", ctx.work / "run-killed"
    args = pretrain_args(ctx, data, model, whole)
    after = int(args[args.index("--save-every") + 1])
    # The uninterrupted run beside the one to kill: two runs of a tiny model share the card (or two CPU cores)
    # and the part takes one run's time less. The runs do not meet: each has its own --out and rendezvous port.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        uninterrupted = pool.submit(cli, ctx, *args, torchrun=True)
        kill = killed_run(ctx, pretrain_args(ctx, data, model, broken), broken, after)
        uninterrupted.result()
    evals = [json.loads(x)["step"] for x in (whole / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
    ctx.save(eval_steps=evals, checkpoints=sorted(p.name for p in (whole / "checkpoints").iterdir()), kill=kill)
    if kill["finished_before_kill"] or not kill["killed_after_checkpoints"]:
        raise RuntimeError(f"the SIGKILL did not land mid-run: {kill}")
    cli(ctx, *pretrain_args(ctx, data, model, broken), "--resume", torchrun=True)
    resume = compare_runs(whole, broken, max(kill["killed_after_checkpoints"]))
    ctx.save(resume=resume)
    if not (resume["bitwise_equal"] or resume["within_tolerance"]):
        raise RuntimeError(f"the resumed run left the uninterrupted one: {resume}")
    return whole


def write_task(root: Path, n_train: int) -> Path:
    """A CSV classification task: does the text mention war or peace (label "yes") or not ("no")."""
    docs = make_documents(n_train // 10 + 10, seed=11, min_sents=10, max_sents=12)
    sentences = [s for d in docs for s in d]
    root.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", sentences[:n_train]), ("dev", sentences[n_train:n_train + 40])):
        with open(root / f"{split}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["text", "label"])
            w.writerows([t, "yes" if {"war", "peace"} & set(t.lower().rstrip(".").split()) else "no"] for t in rows)
    (root / "texts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in sentences[-20:]))
    return root


def _predictions(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _prob_diff(a: list[dict], b: list[dict]) -> float:
    """Largest difference between two predictions files' numbers (labels must agree)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        for k, v in x.items():
            if isinstance(v, dict):
                worst = max([worst, *(abs(v[i] - y[k][i]) for i in v if isinstance(v[i], float))])
            elif isinstance(v, float):
                worst = max(worst, abs(v - y[k]))
            elif v != y[k]:
                return float("inf")
    return worst


def finetune_predict_export(ctx, model: Path) -> None:
    task = write_task(ctx.work / "task", 200 if ctx.dry else 1000)
    ft = ctx.work / "ft"
    cli(ctx, "finetune", "--task", "csv", "--data", str(task), "--init", str(model), "--out", str(ft), "--epochs", "1",
        "--batch-size", "16", "--max-length", "64", "--device", ctx.device.type, "--seed", "1", "--no-progress")
    metrics = json.loads((ft / "metrics.json").read_text()) if (ft / "metrics.json").is_file() else {}
    ctx.save(finetune_metrics=metrics)
    outs = {}
    for device in dict.fromkeys([ctx.device.type, "cpu"]):
        outs[device] = ctx.work / f"pred-{device}.jsonl"
        cli(ctx, "predict", "--model", str(ft), "--input", str(task / "texts.jsonl"), "--out", str(outs[device]),
            "--device", device)
    first = _predictions(outs[ctx.device.type])
    ctx.save(prediction_example=first[0], device_vs_cpu_max_diff=_prob_diff(first, _predictions(outs["cpu"])))
    cli(ctx, "export", "--format", "onnx", "--model", str(ft), "--out", str(ctx.work / "ft-onnx"))
    cli(ctx, "predict", "--model", str(ctx.work / "ft-onnx"), "--backend", "onnx", "--device", "cpu", "--input",
        str(task / "texts.jsonl"), "--out", str(ctx.work / "pred-onnx.jsonl"))
    onnx = _prob_diff(_predictions(outs["cpu"]), _predictions(ctx.work / "pred-onnx.jsonl"))
    ctx.save(onnx_vs_torch_max_diff=onnx)
    worst = max(ctx.result["device_vs_cpu_max_diff"], onnx)
    if worst > PROB_ATOL:
        raise RuntimeError(f"predictions differ by {worst} (> {PROB_ATOL}) between devices or engines")


def journey(ctx) -> None:
    try:
        _, data, vocab = prepared_data(ctx, 64)
        model = ctx.work / "model.json"
        sizes = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 256}
        model.write_text(json.dumps({"vocab_size": vocab, "max_position_embeddings": 64, **sizes}))
        run = pretrain_and_resume(ctx, data, model)
        finetune_predict_export(ctx, run)
    except Exception as e:  # recorded with what was measured; the check goes on
        ctx.save(error=str(e))
    r, nan = ctx.result, float("nan")
    resume = r.get("resume", {})
    kept = "bitwise" if resume.get("bitwise_equal") else f"loss within {resume.get('max_loss_rel_diff', nan):.1e}"
    steps = " ".join(f"{k} {v:.0f}s" for k, v in r.get("step_seconds", {}).items())
    moved = r.get("device_vs_cpu_max_diff", nan)
    ctx.save(headline=f"resume {kept}; {ctx.device.type} vs cpu predictions {moved:.1e}; "
                      f"onnx {r.get('onnx_vs_torch_max_diff', nan):.1e}; {steps}")


def timed_pretrain(args: list[str], out: Path) -> list[tuple[float, float]]:
    """Runs `bertforge pretrain ARGS` (logging every step) in this process; (data wait, step seconds) of every step,
    as the loop logs them in metrics.jsonl (`data_wait_s`, `step_time_s`: a step ends reading its losses, a device
    sync, so the two are comparable)."""
    from bertforge.cli import main
    from bertforge.files import read_jsonl

    if main([*args, "--out", str(out), "--log-every", "1"]):
        raise RuntimeError(f"`bertforge {' '.join(args[:1])}` failed (its error is above)")
    return [(r["data_wait_s"], r["step_time_s"]) for r in read_jsonl(out / "metrics.jsonl") if r["split"] == "train"]


def data_wait(ctx) -> None:
    """BERT-base at 128 (tiny at 64 in the dry run) on synthetic prepared data, with the batches loaded in the
    training process and by worker processes: the share of each step spent waiting for the batch."""
    seq = 64 if ctx.dry else 128  # the dry run reuses the journey's data
    _, data, vocab = prepared_data(ctx, seq)
    model = ctx.work / "model.json"
    from bertforge import BertConfig

    BertConfig.from_preset("tiny" if ctx.dry else "base", vocab_size=vocab).to_json(model)
    steps, batch = (8, 8) if ctx.dry else (25, 256)
    for workers in (0, 2):
        timing = timed_pretrain(["pretrain", "--data", str(data), "--model", str(model), "--steps", str(steps),
                                 "--batch-size", str(batch), "--warmup-steps", "2", "--workers", str(workers),
                                 "--device", ctx.device.type, "--no-progress"], ctx.work / f"run-{workers}")
        timed = timing[3:]  # the first steps warm the allocator and kernels up
        wait, total = sum(w for w, _ in timed), sum(s for _, s in timed)
        per_step = {"wait_share": round(wait / total, 4), "step_ms": round(1e3 * total / len(timed), 2),
                    "wait_ms": round(1e3 * wait / len(timed), 3)}
        ctx.save(**{f"workers_{workers}": per_step})
    r = ctx.result
    ctx.save(model=f"{'tiny' if ctx.dry else 'base'}/{seq} x{batch}",
             headline=f"data wait {r['workers_0']['wait_share']:.1%} of a step (loader in the training process), "
                      f"{r['workers_2']['wait_share']:.1%} (2 workers); step {r['workers_0']['step_ms']:.0f} ms")

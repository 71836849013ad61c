"""Files bertforge writes: progress into a log file as whole lines, file modes under the umask, temporaries of a
killed run removed, and a full disk or a file-size limit while a checkpoint, the metrics log, embeddings or
prepared data are written (one error line naming the output, nothing half written left)."""

from __future__ import annotations

import errno
import fcntl
import io
import json
import os
import resource
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch
from bad_inputs_support import labelled_csv, pretrain_args, refused
from support import file_digests

from bertforge.cli import main
from bertforge.data.shards import ShardWriter
from bertforge.files import atomic_dir, os_error_message, read_jsonl, write_text
from bertforge.model_files import read_weights
from bertforge.progress import MetricsLog, PlainProgress, progress_reporter
from bertforge.train.rundir import LOCK_FILE, claim_run_dir

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models train faster on one thread (conftest)

# -- progress -------------------------------------------------------------------------------------------------

def test_progress_into_a_file_is_whole_lines_at_an_interval():
    stream = io.StringIO()
    bar = progress_reporter(1000, desc="train", unit="step", interval=3600.0, stream=stream)
    assert isinstance(bar, PlainProgress)
    for _ in range(1000):
        bar.update(1)
    bar.set_postfix(loss="2.5")
    bar.close()
    text = stream.getvalue()
    assert "\r" not in text and text.count("\n") == 1  # nothing within the interval, one line at the end
    assert text.startswith("train: 1000/1000 (100%) steps") and "loss 2.5" in text
    chatty = io.StringIO()
    bar = progress_reporter(3, desc="prepare", unit="B", interval=0.0, stream=chatty)
    for _ in range(3):
        bar.update(1)
    bar.close()
    assert chatty.getvalue().count("\n") == 3
    silent = io.StringIO()
    bar = progress_reporter(3, desc="x", unit="B", enabled=False, stream=silent)
    bar.update(3)
    bar.close()
    assert silent.getvalue() == ""


@pytest.mark.slow  # a pretraining run and two fine-tuning runs
def test_training_progress_into_a_log_file_has_no_carriage_returns(toy, tmp_path, capsys):
    """Under pytest stderr is not a terminal: pretrain and finetune report plain lines (here the one at the
    end), and finetune's --no-progress reports none."""
    capsys.readouterr()
    argv = [a for a in pretrain_args(toy["data_a"], tmp_path / "run") if a != "--no-progress"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    assert "train: 6/6 (100%) steps" in err
    data = labelled_csv(tmp_path / "csv")
    finetune = ["finetune", "--task", "csv", "--data", str(data), "--init", str(toy["run"]), "--epochs", "1",
                "--batch-size", "8", "--device", "cpu"]
    assert main([*finetune, "--out", str(tmp_path / "ft")]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    assert "train: 4/4 (100%) steps" in err
    assert main([*finetune, "--out", str(tmp_path / "quiet"), "--no-progress"]) == 0
    assert "train:" not in capsys.readouterr().err


# -- files bertforge writes -----------------------------------------------------------------------------------

def test_every_written_file_gets_the_mode_the_umask_gives(toy, tmp_path):
    """Atomic writes go through a temporary file made 0600: the finished file must get 0666 & ~umask, like
    every other file (config.json, model.safetensors and manifest.json were left 0600)."""
    previous = os.umask(0o027)
    try:
        assert main(["prepare", "--corpus", str(toy["corpus"]), "--tokenizer", str(toy["data_a"] / "tokenizer"),
                     "--out", str(tmp_path / "data"), "--max-seq-len", "32", "--val-fraction", "0.1",
                     "--workers", "1", "--no-progress"]) == 0
        assert main(pretrain_args(tmp_path / "data", tmp_path / "run", steps=2)) == 0
    finally:
        os.umask(previous)
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode)
             for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    for name in ("data/manifest.json", "run/config.json", "run/model.safetensors", "run/run_config.json",
                 "run/vocab.txt", "run/checkpoints/step-2/model.safetensors"):
        assert name in modes
    assert {name: mode for name, mode in modes.items() if mode != 0o640} == {}


def _killed_midway(out: Path) -> Path:
    """What a `prepare` or `finetune` killed before it finished leaves beside --out: atomic_dir's temporary."""
    stale = out.parent / f".{out.name}.k1ll3d_x.tmp"
    (stale / ".parts").mkdir(parents=True)
    (stale / ".parts" / "part-0.tokens").write_bytes(b"\0" * 64)
    return stale


def test_temporaries_of_a_killed_prepare_or_finetune_are_removed_by_the_next_run(toy, tmp_path):
    data = tmp_path / "data"
    stale = _killed_midway(data)
    running = tmp_path / f".{data.name}.st1llrun.tmp"  # another process's, still writing: it holds the lock
    running.mkdir()
    fd = os.open(running, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    other = tmp_path / ".elsewhere.k1ll3d_x.tmp"  # beside another --out: not this run's
    other.mkdir()
    try:
        assert main(["prepare", "--corpus", str(toy["corpus"]), "--tokenizer", str(toy["data_a"] / "tokenizer"),
                     "--out", str(data), "--max-seq-len", "32", "--workers", "1", "--no-progress"]) == 0
    finally:
        os.close(fd)
    assert not stale.exists() and running.is_dir() and other.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([data.name, running.name, other.name])
    ft = tmp_path / "ft"
    stale = _killed_midway(ft)
    assert main(["finetune", "--task", "csv", "--data", str(labelled_csv(tmp_path / "csv")), "--init",
                 str(toy["run"]), "--out", str(ft), "--epochs", "0.3", "--batch-size", "8", "--device", "cpu",
                 "--no-progress"]) == 0
    assert not stale.exists() and (ft / "config.json").is_file()


def test_the_run_lock_gets_the_mode_the_umask_gives(tmp_path):
    """The run directory's .lock was made 0644 whatever the umask: under 002 every other output is 0664."""
    run = tmp_path / "run"
    previous = os.umask(0o002)
    try:
        with claim_run_dir(run, resume=False):
            write_text(run / "notes.txt", "an output beside it")
            modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in run.iterdir()}
    finally:
        os.umask(previous)
    assert modes == {LOCK_FILE: 0o664, "notes.txt": 0o664}


# -- a full disk ----------------------------------------------------------------------------------------------

def _leftovers(root: Path) -> list[str]:
    """Temporaries and set-aside copies of bertforge.files's atomic writes under `root`: none may stay."""
    return sorted(str(p) for p in root.rglob("*") if p.name.endswith((".tmp", ".old")))


def test_a_full_disk_while_saving_a_checkpoint_loses_nothing(toy, tmp_path, capsys, monkeypatch):
    """The device fills up while step-4's weights are written (safetensors raises what its Rust writer says):
    one error line naming the file, no half checkpoint, and --resume, once there is room, continues from step-2."""
    real = safetensors.torch.save_file
    saved = []

    def fill_up(tensors, filename, metadata=None):
        saved.append(filename)
        if len(saved) == 1:  # step-2's checkpoint fits
            return real(tensors, filename, metadata=metadata)
        Path(filename).write_bytes(b"\0" * 4096)  # what fitted
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    run = tmp_path / "run"
    with monkeypatch.context() as disk:
        disk.setattr(safetensors.torch, "save_file", fill_up)
        message = refused(capsys, pretrain_args(toy["data_a"], run), toy["data_a"])
    target = run / "checkpoints" / "step-4" / "model.safetensors"
    assert message == f"error: no space left on device writing {target}: free space or choose another --out"
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-2"] and _leftovers(tmp_path) == []
    assert read_weights(run / "checkpoints" / "step-2")  # whole
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2, 4]
    assert main(pretrain_args(toy["data_a"], run, "--resume")) == 0
    assert "resumed from" in capsys.readouterr().out
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [2, 4, 6]


def test_a_metrics_record_that_does_not_fit_is_cut_off_whole(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    log.log(step=1, loss=2.5)
    room = [10]  # bytes left on the device

    def write(fd, data):
        if not room[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = min(room[0], len(data))
        room[0] -= n
        return os.pwrite(fd, data[:n], os.fstat(fd).st_size)

    with monkeypatch.context() as disk:
        disk.setattr(os, "write", write)
        with pytest.raises(OSError) as e:
            log.log(step=2, loss=2.25)
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, str(path))
    assert [r["step"] for r in read_jsonl(path)] == [1] and path.read_text().endswith("}\n")
    log.log(step=2, loss=2.25)  # room again
    log.close()
    assert [r["step"] for r in map(json.loads, path.read_text().splitlines())] == [1, 2]


def test_a_write_past_the_file_size_limit_names_the_output(tmp_path):
    """torch.save to a path says only "unexpected pos" (a RuntimeError) when the write fails: bertforge.files finds the
    reason and names the directory being written, not its temporary, and leaves nothing behind."""
    out = tmp_path / "checkpoint"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(OSError) as e, atomic_dir(out) as tmp:
            torch.save({"weights": torch.zeros(10_000)}, tmp / "state.pt")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert (e.value.errno, e.value.filename) == (errno.EFBIG, str(out))
    assert isinstance(e.value.__cause__, RuntimeError)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, a device that is always full")
def test_shards_written_to_a_full_disk_raise_enospc(tmp_path):
    """ShardWriter appended with ndarray.tofile, which lost these writes without a word: no error, short files."""
    for ext in ("tokens", "sentences", "documents"):
        (tmp_path / f"train-00000.{ext}").symlink_to("/dev/full")
    writer = ShardWriter(tmp_path, "train", dtype=np.dtype("<u2"), shard_tokens=1000, fingerprint="f")
    with pytest.raises(OSError) as e:
        writer.add(np.arange(10), np.array([4, 6]), np.array([2]))
        writer.finish()
    assert e.value.errno == errno.ENOSPC
    assert os_error_message(e.value) == "no space left on device writing the output: free space or choose another --out"


@pytest.mark.slow  # a fresh process
def test_embeddings_past_the_file_size_limit_are_not_written_short(toy, tmp_path):
    """np.save into the file wrote the header and what fitted of the array, and the command exited 0 (the array
    went through ndarray.tofile, which lost the failed write). 2 x 128 float32 values do not fit in 300 bytes."""
    out = tmp_path / "vectors.npy"
    r = subprocess.run([sys.executable, "-m", "bertforge", "embed", "--model", str(toy["run"]), "--text", "a", "b",
                        "--out", str(out), "--device", "cpu"],
                       capture_output=True, text=True, timeout=300, preexec_fn=_file_size_limit(300), env=_untraced())
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"error: file too large writing {out}: raise the file-size limit (ulimit -f) or choose " \
                       f"another --out on a file system without one\n"
    assert list(tmp_path.iterdir()) == []
    assert main(["embed", "--model", str(toy["run"]), "--text", "a", "b", "--out", str(out), "--device", "cpu"]) == 0
    assert np.load(out).shape == (2, 128)


def _untraced() -> dict[str, str]:
    """This environment without coverage.py's variables: under `make coverage` the child would otherwise write
    its coverage data at exit, past the file-size limit the test sets, and say so on stderr."""
    return {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE")}


def _file_size_limit(limit: int):
    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    return limited


@pytest.mark.slow  # a fresh process
def test_prepare_past_the_file_size_limit_keeps_the_data_it_would_replace(toy, tmp_path):
    """The real thing, in a process of its own: the kernel refuses to grow a file past `ulimit -f` (EFBIG). The token
    shard (about 3 kB) does not fit in 2,000 bytes; the data prepared before stays as it was."""
    data = tmp_path / "data"
    shutil.copytree(toy["data_a"], data)
    before = file_digests(data, toy["corpus"])
    r = subprocess.run([sys.executable, "-m", "bertforge", "prepare", "--corpus", str(toy["corpus"]), "--tokenizer",
                        str(toy["data_a"] / "tokenizer"), "--out", str(data), "--overwrite", "--max-seq-len", "32",
                        "--workers", "1", "--no-progress"],
                       capture_output=True, text=True, timeout=300, preexec_fn=_file_size_limit(2000), env=_untraced())
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"error: file too large writing {data}: raise the file-size limit (ulimit -f) or choose " \
                       f"another --out on a file system without one\n"
    assert file_digests(data, toy["corpus"]) == before
    assert [p.name for p in tmp_path.iterdir()] == ["data"]


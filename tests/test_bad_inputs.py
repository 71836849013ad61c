"""Broken files and mismatched pieces, through the command line: each ends in exit status 2 with one `error:`
line and no traceback, and no input file or earlier output is modified. Covers tokenizer identity (--init,
--resume, a model directory whose vocab.txt changed), --resume with changed options, a corrupt latest
checkpoint, files that are not UTF-8, CoNLL files mixing column layouts, `prepare` into its own corpus, prepared
data with token ids past the vocabulary, a broken input or impossible output for every command, and a full disk
(or file-size limit) while a checkpoint, the metrics log or prepared data is written."""

from __future__ import annotations

import errno
import fcntl
import io
import json
import os
import random
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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import file_digests

from bertforge.checkpoint import read_weights
from bertforge.cli import _commands, main
from bertforge.data.shards import ShardWriter
from bertforge.device import pick_device
from bertforge.errors import BertforgeError
from bertforge.io import (
    MetricsLog,
    PlainProgress,
    atomic_dir,
    os_error_message,
    progress_reporter,
    read_jsonl,
    write_text,
)
from bertforge.tokenizer import Tokenizer, fingerprint
from bertforge.train.rundir import LOCK_FILE, claim_run_dir

WORDS = ["the", "a", "of", "river", "stone", "north", "winter", "light", "market", "king", "ship", "garden",
         "letter", "old", "new", "quiet", "bright", "road", "village", "tower", "song", "bread", "field", "iron",
         "cloud", "glass", "paper", "summer", "station", "forest", "harbour"]


def _corpus(root: Path) -> Path:
    rng = random.Random(0)
    corpus = root / "corpus"
    corpus.mkdir()
    for d in range(3):
        docs = []
        for _ in range(12):
            sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12))).capitalize() + "."
                         for _ in range(rng.randint(3, 6))]
            docs.append("\n".join(sentences))
        (corpus / f"part{d}.txt").write_text("\n\n".join(docs) + "\n")
    return corpus


def _pretrain(data: Path, out: Path, *extra: str, steps: int = 6) -> list[str]:
    return ["pretrain", "--data", str(data), "--out", str(out), "--model", "tiny", "--steps", str(steps),
            "--batch-size", "4", "--lr", "1e-3", "--warmup-steps", "1", "--save-every", "2", "--log-every", "2",
            "--eval-batches", "0", "--no-progress", "--device", "cpu", *extra]


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> dict[str, Path]:
    """A small corpus; tokenizer A trained on it and tokenizer B, the same tokens with two swapped (same size,
    another identity); data prepared with each; a pretraining run on A's data killed after step 4 of 6."""
    root = tmp_path_factory.mktemp("bad_inputs")
    corpus = _corpus(root)
    assert main(["vocab", "train", "--corpus", str(corpus), "--vocab-size", "200", "--out", str(root / "tok_a"),
                 "--no-progress"]) == 0
    tok_a = Tokenizer.from_pretrained(root / "tok_a")
    vocab = list(tok_a.vocab)
    vocab[-1], vocab[-2] = vocab[-2], vocab[-1]
    Tokenizer(vocab, lowercase=tok_a.lowercase).save_pretrained(root / "tok_b")
    for name in ("a", "b"):
        assert main(["prepare", "--corpus", str(corpus), "--tokenizer", str(root / f"tok_{name}"), "--out",
                     str(root / f"data_{name}"), "--max-seq-len", "32", "--val-fraction", "0.1", "--workers", "1",
                     "--no-progress"]) == 0
    run = root / "run"
    assert main(_pretrain(root / "data_a", run)) == 0
    shutil.rmtree(run / "checkpoints" / "step-6")  # as if killed after the checkpoint at step 4
    return {"root": root, "corpus": corpus, "data_a": root / "data_a", "data_b": root / "data_b", "run": run}


def refused(capsys, argv: list[str], *untouched: Path) -> str:
    """Run the CLI; assert exit 2, exactly one `error:` line on stderr, no traceback, `untouched` unchanged.
    Returns the message."""
    capsys.readouterr()
    before = file_digests(*untouched)
    status = main(argv)
    err = capsys.readouterr().err
    assert status == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert file_digests(*untouched) == before
    return lines[0]


def _copy_run(toy, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(toy["run"], out, ignore=shutil.ignore_patterns(".lock"))
    return out


# -- tokenizer identity -------------------------------------------------------------------------------------

def test_the_two_tokenizers_have_one_size_and_two_identities(toy):
    a = Tokenizer.from_pretrained(toy["data_a"] / "tokenizer")
    b = Tokenizer.from_pretrained(toy["data_b"] / "tokenizer")
    assert a.vocab_size == b.vocab_size and a.fingerprint != b.fingerprint
    assert json.loads((toy["run"] / "tokenizer_config.json").read_text())["bertforge_fingerprint"] == a.fingerprint


def test_init_from_a_model_with_another_tokenizer_is_refused(toy, tmp_path, capsys):
    a = Tokenizer.from_pretrained(toy["data_a"] / "tokenizer").fingerprint
    b = Tokenizer.from_pretrained(toy["data_b"] / "tokenizer").fingerprint
    out = tmp_path / "phase2"
    message = refused(capsys, _pretrain(toy["data_b"], out, "--init", str(toy["run"])), toy["run"], toy["data_b"])
    assert a in message and b in message and "bertforge prepare --tokenizer" in message
    assert not out.exists()


def test_resume_on_data_of_another_tokenizer_is_refused(toy, tmp_path, capsys):
    run = _copy_run(toy, tmp_path)
    a = Tokenizer.from_pretrained(toy["data_a"] / "tokenizer").fingerprint
    b = Tokenizer.from_pretrained(toy["data_b"] / "tokenizer").fingerprint
    message = refused(capsys, _pretrain(toy["data_b"], run, "--resume"), run, toy["data_b"])
    assert a in message and b in message


def test_a_model_directory_whose_vocab_changed_is_refused_and_an_old_one_loads(toy, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(toy["run"], model, ignore=shutil.ignore_patterns(".lock", "checkpoints", "tensorboard"))
    vocab = (model / "vocab.txt").read_text().splitlines()
    recorded = json.loads((model / "tokenizer_config.json").read_text())["bertforge_fingerprint"]
    vocab[-1], vocab[-3] = vocab[-3], vocab[-1]
    (model / "vocab.txt").write_text("\n".join(vocab) + "\n")
    for argv in (["fill-mask", "--model", str(model), "the [MASK] river"],
                 ["embed", "--model", str(model), "--text", "the river"]):
        message = refused(capsys, argv, model)
        assert recorded in message and fingerprint(vocab, True) in message and "vocab.txt" in message
    # a directory written before the fingerprint was recorded has nothing to check against
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["bertforge_fingerprint"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    assert main(["fill-mask", "--model", str(model), "the [MASK] river", "--json"]) == 0


# -- resume -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("extra", "expected"), [
    (["--lr", "5e-3"], ["--lr 0.001 -> 0.005"]),
    (["--batch-size", "8", "--mask-prob", "0.2"], ["--batch-size 4 -> 8", "--mask-prob 0.15 -> 0.2"]),
    (["--seed", "7"], ["--seed 12345 -> 7"]),
    (["--max-seq-len", "16"], ["--max-seq-len 32 -> 16"]),  # the data's length, now cut shorter
    (["--steps", "9"], ["--steps 6 -> 9", "cannot be extended"]),
])
def test_resume_refuses_options_that_shape_the_run(toy, tmp_path, capsys, extra, expected):
    run = _copy_run(toy, tmp_path)
    argv = _pretrain(toy["data_a"], run, "--resume")
    if extra[0] == "--steps":
        argv[argv.index("--steps") + 1] = extra[1]
    elif extra[0] == "--batch-size":
        argv[argv.index("--batch-size") + 1] = extra[1]
        argv += extra[2:]
    else:
        argv += extra
    message = refused(capsys, argv, run, toy["data_a"])
    for part in expected:
        assert part in message


def test_resume_on_other_data_of_the_same_tokenizer_is_refused(toy, tmp_path, capsys):
    run = _copy_run(toy, tmp_path)
    other = tmp_path / "other"
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "one.txt").write_text((toy["corpus"] / "part0.txt").read_text())
    assert main(["prepare", "--corpus", str(corpus), "--tokenizer", str(toy["data_a"] / "tokenizer"), "--out",
                 str(other), "--max-seq-len", "32", "--val-fraction", "0.1", "--workers", "1", "--no-progress"]) == 0
    assert "the data:" in refused(capsys, _pretrain(other, run, "--resume"), run)


def test_resume_applies_and_records_what_may_change(toy, tmp_path, capsys):
    run = _copy_run(toy, tmp_path)
    moved = tmp_path / "data_moved"  # the same data at another path is the same data
    shutil.copytree(toy["data_a"], moved)
    argv = _pretrain(moved, run, "--resume")
    argv[argv.index("--log-every") + 1] = "1"
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("--resume: ") and "loop.log_every 2 -> 1" in out
    config = json.loads((run / "run_config.json").read_text())
    assert config["loop"]["log_every"] == 1 and config["data"] == str(moved)
    assert config["resumes"][0]["step"] == 4
    assert {c["option"] for c in config["resumes"][0]["changed"]} == {"loop.log_every", "data"}
    steps = [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]
    assert steps == [2, 4, 5, 6]


def test_resume_of_a_finished_run_says_how_to_train_further(toy, tmp_path, capsys):
    run = _copy_run(toy, tmp_path)
    assert main(_pretrain(toy["data_a"], run, "--resume")) == 0
    assert "--init" in refused(capsys, _pretrain(toy["data_a"], run, "--resume"), run)


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(toy, tmp_path, capsys):
    run = _copy_run(toy, tmp_path)
    state = run / "checkpoints" / "step-4" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])  # a copy cut short
    capsys.readouterr()
    assert main(_pretrain(toy["data_a"], run, "--resume")) == 0
    out = capsys.readouterr().out
    assert "step-4 is unreadable" in out and "resumed from" in out and "(step 2)" in out
    assert (run / "checkpoints" / "step-4.corrupt").is_dir()
    assert (run / "checkpoints" / "step-6").is_dir()
    steps = [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]
    assert steps == [2, 4, 6]


def test_no_readable_checkpoint_is_an_error(toy, tmp_path, capsys):
    run = _copy_run(toy, tmp_path)
    for ckpt in (run / "checkpoints").iterdir():
        (ckpt / "model.safetensors").write_bytes(b"not weights")
    message = refused(capsys, _pretrain(toy["data_a"], run, "--resume"), toy["data_a"])
    assert "no checkpoint" in message and "can be read" in message


# -- files that are not what they should be -----------------------------------------------------------------

LATIN1 = "caf\xe9 au lait".encode("latin-1")


def _model_dir(toy) -> str:
    return str(toy["run"])


@pytest.mark.parametrize(("kind", "line"), [("csv", 4), ("jsonl", 3), ("conll", 4)])
def test_task_files_that_are_not_utf8(toy, tmp_path, capsys, kind, line):
    data = tmp_path / "data"
    data.mkdir()
    if kind == "csv":
        good = b"text,label\nfine words,1\nother words,0\n"
        (data / "train.csv").write_bytes(good + b'"' + LATIN1 + b'",1\n')
        (data / "dev.csv").write_bytes(good)
    elif kind == "jsonl":
        good = b'{"text": "fine", "label": "a"}\n{"text": "other", "label": "b"}\n'
        (data / "train.jsonl").write_bytes(good + b'{"text": "' + LATIN1 + b'", "label": "a"}\n')
        (data / "dev.jsonl").write_bytes(good)
    else:
        good = b"EU NNP B-NP B-ORG\nrejects VBZ B-VP O\n\n"
        (data / "train.txt").write_bytes(good + LATIN1.split()[0] + b" NN B-NP O\n")
        (data / "valid.txt").write_bytes(good)
    task = "conll2003" if kind == "conll" else kind
    message = refused(capsys, ["finetune", "--task", task, "--data", str(data), "--init", _model_dir(toy),
                               "--out", str(tmp_path / "ft")], data)
    assert f":{line}: not UTF-8" in message and "byte 0xe9" in message
    assert not (tmp_path / "ft").exists()


@pytest.mark.parametrize("command", ["fill-mask", "embed", "predict"])
def test_an_input_file_that_is_not_utf8(toy, tmp_path, capsys, command):
    path = tmp_path / "in.txt"
    path.write_bytes(b"a fine line\n" + LATIN1.replace(b"au", b"[MASK]") + b"\n")
    message = refused(capsys, [command, "--model", _model_dir(toy), "--input", str(path)], path)
    assert f"{path}:2: not UTF-8" in message


def test_a_conll_file_mixing_column_layouts(toy, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.txt").write_text("EU NNP B-NP B-ORG\nrejects VBZ B-VP O\n\nGerman JJ B-NP\ncall NN I-NP\n")
    (data / "valid.txt").write_text("EU NNP B-NP B-ORG\n")
    message = refused(capsys, ["finetune", "--task", "conll2003", "--data", str(data), "--init", _model_dir(toy),
                               "--out", str(tmp_path / "ft")], data)
    assert "train.txt:4: 3 columns, but line 1 has 4" in message


@pytest.mark.parametrize("where", ["same", "inside"])
def test_prepare_into_its_own_corpus_is_refused(toy, tmp_path, capsys, where):
    corpus = tmp_path / "corpus"
    shutil.copytree(toy["corpus"], corpus)
    out = corpus if where == "same" else corpus / "data"
    message = refused(capsys, ["prepare", "--corpus", str(corpus), "--tokenizer", str(toy["data_a"] / "tokenizer"),
                               "--out", str(out), "--overwrite", "--workers", "1", "--no-progress"], corpus)
    assert "corpus" in message and not (corpus / "data").exists()


def test_prepare_into_a_directory_holding_a_corpus_file_is_refused(toy, tmp_path, capsys):
    corpus = tmp_path / "texts"
    shutil.copytree(toy["corpus"], corpus)
    message = refused(capsys, ["prepare", "--corpus", str(corpus / "part0.txt"), "--tokenizer",
                               str(toy["data_a"] / "tokenizer"), "--out", str(corpus), "--overwrite", "--workers", "1",
                               "--no-progress"], corpus)
    assert "part0.txt" in message


def test_token_ids_past_the_vocabulary_are_refused_when_the_data_is_opened(toy, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(toy["data_a"], data)
    manifest = json.loads((data / "manifest.json").read_text())
    shard = data / f"{manifest['splits']['train']['shards'][0]['name']}.tokens"
    raw = bytearray(shard.read_bytes())
    raw[10:12] = (60000).to_bytes(2, "little")  # uint16 ids: room for 60000 in a ~150-token vocabulary
    shard.write_bytes(bytes(raw))
    message = refused(capsys, ["inspect", str(data)], data)
    assert "token id 60000" in message and f"{manifest['vocab_size']} tokens" in message
    assert "token id" in refused(capsys, _pretrain(data, tmp_path / "run"), data)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=st.binary(max_size=300))
def test_arbitrary_bytes_as_a_csv_task_file(toy, tmp_path_factory, capsys, content):
    """Whatever the bytes, `finetune --task csv` ends in an error: line (or trains: not at these sizes)."""
    data = tmp_path_factory.mktemp("csv")
    (data / "train.csv").write_bytes(b"text,label\n" + content)
    (data / "dev.csv").write_bytes(b"text,label\nsome words,1\n")
    capsys.readouterr()
    before = file_digests(data)
    status = main(["finetune", "--task", "csv", "--data", str(data), "--init", _model_dir(toy), "--out",
                   str(data / "ft"), "--epochs", "0.01", "--batch-size", "2"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert status == 0 or (status == 2 and len([x for x in err.splitlines() if x.startswith("error:")]) == 1)
    assert {k: v for k, v in file_digests(data).items() if "/ft/" not in k} == before


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


def _labelled_csv(data: Path) -> Path:
    data.mkdir()
    rows = [f"{w} {v} words,{i % 2}\n" for i, (w, v) in enumerate(zip(WORDS, reversed(WORDS), strict=True))]
    (data / "train.csv").write_text("text,label\n" + "".join(rows))  # 31 rows: 4 steps of 8
    (data / "dev.csv").write_text("text,label\n" + "".join(rows[:10]))
    return data


@pytest.mark.slow  # a pretraining run and two fine-tuning runs
def test_training_progress_into_a_log_file_has_no_carriage_returns(toy, tmp_path, capsys):
    """Under pytest stderr is not a terminal: pretrain and finetune report plain lines (here the one at the
    end), and finetune's --no-progress reports none."""
    capsys.readouterr()
    argv = [a for a in _pretrain(toy["data_a"], tmp_path / "run") if a != "--no-progress"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    assert "train: 6/6 (100%) steps" in err
    data = _labelled_csv(tmp_path / "csv")
    finetune = ["finetune", "--task", "csv", "--data", str(data), "--init", _model_dir(toy), "--epochs", "1",
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
        assert main(_pretrain(tmp_path / "data", tmp_path / "run", steps=2)) == 0
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
    assert main(["finetune", "--task", "csv", "--data", str(_labelled_csv(tmp_path / "csv")), "--init",
                 _model_dir(toy), "--out", str(ft), "--epochs", "0.3", "--batch-size", "8", "--device", "cpu",
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


# -- every command: broken files and impossible options -----------------------------------------------------

def _cut(path: Path, size: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:size])


@pytest.fixture(scope="module")
def broken(toy) -> dict[str, Path]:
    """Copies of the toy's model, data and tokenizer, each broken in one way, and other things in wrong places."""
    root = toy["root"] / "broken"
    root.mkdir()
    model_files = shutil.ignore_patterns(".lock", "checkpoints", "tensorboard", "metrics.jsonl", "*.png")
    found = {"run": toy["run"], "data": toy["data_a"], "corpus": toy["corpus"], "csv": _labelled_csv(root / "csv")}
    for name in ("cut_weights", "cut_weights_task", "odd_config", "cut_task", "not_utf8_task", "no_task"):
        found[name] = root / name
        shutil.copytree(toy["run"], found[name], ignore=model_files)
    _cut(found["cut_weights"] / "model.safetensors")
    _cut(found["cut_weights_task"] / "model.safetensors")
    task = {"task": "csv", "kind": "classification", "options": {}, "labels": ["0", "1"], "max_length": 32}
    (found["cut_weights_task"] / "task.json").write_text(json.dumps(task))
    (found["odd_config"] / "config.json").write_bytes(b"\xff\xfe{" + LATIN1)
    (found["cut_task"] / "task.json").write_text(json.dumps(task)[:20])
    (found["not_utf8_task"] / "task.json").write_bytes(LATIN1)
    (found["no_task"] / "task.json").write_text(json.dumps({**task, "task": None}))
    found["list_config"] = root / "list.json"
    found["list_config"].write_text("[1, 2]")
    found["labels_config"] = root / "labels.json"
    found["labels_config"].write_text(json.dumps({"id2label": {"first": "neg", "second": "pos"}}))
    found["heads_config"] = root / "heads.json"
    found["heads_config"].write_text(json.dumps({"hidden_size": 30, "num_attention_heads": 4}))
    for name in ("bad_manifest", "odd_manifest", "list_manifest", "bare_manifest", "cut_shard", "odd_shard"):
        found[name] = root / name
        shutil.copytree(toy["data_a"], found[name])
    (found["bad_manifest"] / "manifest.json").write_text("{'not': json}")
    (found["odd_manifest"] / "manifest.json").write_bytes(b'{"format": "' + LATIN1 + b'"}')
    (found["list_manifest"] / "manifest.json").write_text("[]")
    (found["bare_manifest"] / "manifest.json").write_text(json.dumps({"format": "bertforge-pretraining-data/1"}))
    (found["odd_shard"] / "train-00000.json").write_bytes(b'{"name": "' + LATIN1 + b'"}')
    _cut(found["cut_shard"] / "train-00000.sentences", 101)
    found["bad_vocab"] = root / "bad_vocab"
    shutil.copytree(toy["data_a"] / "tokenizer", found["bad_vocab"])
    (found["bad_vocab"] / "vocab.txt").write_bytes(b"[PAD]\n[UNK]\n" + LATIN1 + b"\n")
    found["binary_corpus"] = root / "corpus.bin"
    found["binary_corpus"].write_bytes(bytes(range(256)))
    found["a_file"] = root / "a_file"
    found["a_file"].write_text("not a directory\n")
    return found


def _case(command: str, what: str, argv: list[str], needle: str, *marks) -> pytest.param:
    return pytest.param(command, argv, needle, id=f"{command}: {what}", marks=marks)


def _pretrain_argv(data: str, *extra: str) -> list[str]:
    return _pretrain(Path(data), Path("{new}/run"), *extra, steps=2)


# Each command with a broken input file or an output in an impossible place; `{name}` is a path of `broken`,
# `{new}` a directory that must hold no file afterwards. Cases the suites elsewhere cover are not repeated:
# files that are not UTF-8 and CoNLL layouts above, bad task files in test_finetune.py, numeric options out of
# range in test_cli_validation.py.
EVERY_COMMAND = [
    _case("model info", "config.json holds a list", ["model", "info", "--model", "{list_config}"],
          "must hold a JSON object"),
    _case("model info", "config.json is not UTF-8", ["model", "info", "--model", "{odd_config}"], "config.json"),
    _case("model info", "config.json labels ids that are not numbers", ["model", "info", "--model", "{labels_config}"],
          "id2label"),
    _case("model smoke", "heads that do not divide the hidden size",
          ["model", "smoke", "--model", "{heads_config}", "--steps", "1"], "not divisible"),
    _case("model smoke", "--out is a file", ["model", "smoke", "--model", "tiny", "--steps", "1", "--out", "{a_file}"],
          "is a file"),
    _case("vocab train", "a corpus file of no known type",
          ["vocab", "train", "--corpus", "{binary_corpus}", "--out", "{new}/tok", "--no-progress"], "corpus"),
    _case("vocab train", "--out is a file",
          ["vocab", "train", "--corpus", "{corpus}", "--out", "{a_file}", "--no-progress"], "is a file"),
    _case("prepare", "a tokenizer whose vocab.txt is not UTF-8",
          ["prepare", "--corpus", "{corpus}", "--tokenizer", "{bad_vocab}", "--out", "{new}/data", "--workers", "1",
           "--no-progress"], "not UTF-8"),
    _case("prepare", "--out is a file",
          ["prepare", "--corpus", "{corpus}", "--tokenizer", "{run}", "--out", "{a_file}", "--workers", "1",
           "--no-progress"], "not a directory"),
    _case("inspect", "manifest.json is not JSON", ["inspect", "{bad_manifest}"], "is not valid JSON"),
    _case("inspect", "manifest.json is not UTF-8", ["inspect", "{odd_manifest}"], "manifest.json"),
    _case("inspect", "manifest.json holds a list", ["inspect", "{list_manifest}"], "manifest.json"),
    _case("inspect", "manifest.json holds the format alone", ["inspect", "{bare_manifest}"], "lacks"),
    _case("inspect", "a shard's .json is not UTF-8", ["inspect", "{odd_shard}"], "train-00000.json"),
    _case("inspect", "a shard file cut short", ["inspect", "{cut_shard}"], "wrong size"),
    _case("pretrain", "a shard file cut short", _pretrain_argv("{cut_shard}"), "wrong size"),
    _case("pretrain", "manifest.json holds a list", _pretrain_argv("{list_manifest}"), "manifest.json"),
    _case("pretrain", "a device that does not exist", _pretrain_argv("{data}", "--device", "gpu0"), "--device"),
    _case("pretrain", "--init weights cut short", _pretrain_argv("{data}", "--init", "{cut_weights}"),
          "cannot read weights"),
    _case("pretrain", "--model config.json is not UTF-8",
          _pretrain_argv("{data}", "--model", "{odd_config}/config.json"), "config.json"),
    _case("finetune", "--init weights cut short",
          ["finetune", "--task", "csv", "--data", "{csv}", "--init", "{cut_weights}", "--out", "{new}/ft"],
          "cannot read weights"),
    _case("finetune", "a device that does not exist",
          ["finetune", "--task", "csv", "--data", "{csv}", "--init", "{run}", "--out", "{new}/ft", "--device", "gpu0"],
          "--device"),
    _case("evaluate", "model weights cut short", ["evaluate", "--model", "{cut_weights_task}", "--data", "{csv}"],
          "cannot read weights"),
    _case("evaluate", "task.json cut short", ["evaluate", "--model", "{cut_task}", "--data", "{csv}"], "task.json"),
    _case("predict", "model weights cut short", ["predict", "--model", "{cut_weights_task}", "--text", "a"],
          "cannot read weights"),
    _case("predict", "task.json is not UTF-8", ["predict", "--model", "{not_utf8_task}", "--text", "a"], "task.json"),
    _case("predict", "task.json names no task", ["predict", "--model", "{no_task}", "--text", "a"], "task.json"),
    _case("fill-mask", "model weights cut short", ["fill-mask", "--model", "{cut_weights}", "a [MASK]"],
          "cannot read weights"),
    _case("fill-mask", "config.json is not UTF-8", ["fill-mask", "--model", "{odd_config}", "a [MASK]"],
          "config.json"),
    _case("embed", "model weights cut short", ["embed", "--model", "{cut_weights}", "--text", "a"],
          "cannot read weights"),
    _case("embed", "a device that does not exist", ["embed", "--model", "{run}", "--text", "a", "--device", "gpu0"],
          "--device"),
    _case("export", "model weights cut short", ["export", "--model", "{cut_weights}", "--out", "{new}/m.onnx"],
          "cannot read weights"),
    _case("export", "--out inside a file", ["export", "--model", "{run}", "--out", "{a_file}/m.onnx"], "is a file"),
    _case("demo", "--out is a file", ["demo", "--out", "{a_file}", "--cache", "{new}/cache"], "is a file"),
    _case("env", "an option it does not have", ["env", "--verbose"], "unrecognized arguments: --verbose"),
]


@pytest.mark.parametrize(("command", "argv", "needle"), EVERY_COMMAND)
def test_every_command_refuses_a_broken_input(broken, tmp_path, capsys, monkeypatch, command, argv, needle):
    def no_network(*args, **kwargs):
        pytest.fail("the demo fetched its data before refusing its --out")

    monkeypatch.setattr("bertforge.demo_data.fetch_demo_data", no_network)
    new = tmp_path / "new"
    argv = [a.replace("{new}", str(new)).format(**{k: str(v) for k, v in broken.items()}) for a in argv]
    inputs = [broken[k] for k in sorted(broken) if any(str(broken[k]) in a for a in argv)]
    assert needle in refused(capsys, argv, *inputs)
    assert not new.exists() or not [p for p in new.rglob("*") if p.is_file()]


def test_the_table_has_a_case_for_every_command():
    covered = {p.values[0] for p in EVERY_COMMAND if not p.marks}
    assert covered == {cmd.name for cmd in _commands()}


@pytest.mark.parametrize("command", [cmd.name for cmd in _commands()])
def test_an_option_no_command_has_is_one_error_line(command, capsys):
    refused(capsys, [*command.split(), "--no-such-option", "1"])


# -- devices --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_on_a_machine_without_it_is_one_error_line(toy, tmp_path, capsys, monkeypatch, device):
    """Was an AssertionError ("Torch not compiled with CUDA enabled") at the first tensor moved."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    new = tmp_path / "new"
    csv = _labelled_csv(tmp_path / "csv")
    expected = f"error: --device {device}: CUDA is not available on this machine (torch {torch.__version__}); " \
               f"use --device cpu"
    for argv in (["embed", "--model", str(toy["run"]), "--text", "a"], _pretrain(toy["data_a"], new / "run", steps=2),
                 ["finetune", "--task", "csv", "--data", str(csv), "--init", str(toy["run"]), "--out", str(new)]):
        argv = [*argv, "--device", device]  # the last --device given counts
        assert refused(capsys, argv, toy["run"], toy["data_a"], csv) == expected
    assert not new.exists() or not [p for p in new.rglob("*") if p.is_file()]


def test_pick_device_names_the_devices_there_are(monkeypatch):
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("meta") == torch.device("meta")  # tests/test_distributed.py runs the loop on it
    assert pick_device(None) == pick_device("") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for bad in ("gpu0", "CPU", "cuda:x", "cuda:-1", "cuda:01", "cuda:", "cuda:\u00b2", "cuda:1\n", "cpu:0", " cpu",
                "META"):
        with pytest.raises(BertforgeError, match="is not a device: use one of cpu, cuda, cuda:N"):
            pick_device(bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert pick_device("cuda:1") == torch.device("cuda:1") and pick_device("cuda") == torch.device("cuda")
    with pytest.raises(BertforgeError, match=r"has 2 CUDA device\(s\), cuda:0 to cuda:1"):
        pick_device("cuda:2")
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: True)  # a torch for Apple silicon, on another machine
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(BertforgeError, match="MPS is not available on this machine; use --device cpu"):
        pick_device("mps")
    with pytest.raises(BertforgeError, match="use one of cpu, cuda, cuda:N, mps$"):
        pick_device("gpu")


# -- a full disk ----------------------------------------------------------------------------------------------

def _leftovers(root: Path) -> list[str]:
    """Temporaries and set-aside copies of bertforge.io's atomic writes under `root`: none may stay."""
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
        message = refused(capsys, _pretrain(toy["data_a"], run), toy["data_a"])
    target = run / "checkpoints" / "step-4" / "model.safetensors"
    assert message == f"error: no space left on device writing {target}: free space or choose another --out"
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-2"] and _leftovers(tmp_path) == []
    assert read_weights(run / "checkpoints" / "step-2")  # whole
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2, 4]
    assert main(_pretrain(toy["data_a"], run, "--resume")) == 0
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
    """torch.save to a path says only "unexpected pos" (a RuntimeError) when the write fails: bertforge.io finds the
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
                       capture_output=True, text=True, timeout=300, preexec_fn=_file_size_limit(300))
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"error: file too large writing {out}: raise the file-size limit (ulimit -f) or choose " \
                       f"another --out on a file system without one\n"
    assert list(tmp_path.iterdir()) == []
    assert main(["embed", "--model", str(toy["run"]), "--text", "a", "b", "--out", str(out), "--device", "cpu"]) == 0
    assert np.load(out).shape == (2, 128)


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
                       capture_output=True, text=True, timeout=300, preexec_fn=_file_size_limit(2000))
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"error: file too large writing {data}: raise the file-size limit (ulimit -f) or choose " \
                       f"another --out on a file system without one\n"
    assert file_digests(data, toy["corpus"]) == before
    assert [p.name for p in tmp_path.iterdir()] == ["data"]

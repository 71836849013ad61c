"""Broken files and mismatched pieces, through the command line: each ends in exit status 2 with one `error:`
line and no traceback, and no input file or earlier output is modified. Covers tokenizer identity (--init,
--resume, a model directory whose vocab.txt changed), --resume with changed options, a corrupt latest
checkpoint, files that are not UTF-8, CoNLL files mixing column layouts, `prepare` into its own corpus, and
prepared data with token ids past the vocabulary."""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import random
import shutil
import stat
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bertforge.cli import main
from bertforge.io import PlainProgress, progress_reporter
from bertforge.tokenizer import Tokenizer, fingerprint

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


def _snapshot(*paths: Path) -> dict[str, str]:
    """Every file under `paths` and its SHA-256 (the run directory's .lock holds the last pid: not content)."""
    found = {}
    for top in paths:
        for p in sorted([top] if top.is_file() else top.rglob("*")):
            if p.is_file() and p.name != ".lock":
                found[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return found


def refused(capsys, argv: list[str], *untouched: Path) -> str:
    """Run the CLI; assert exit 2, exactly one `error:` line on stderr, no traceback, `untouched` unchanged.
    Returns the message."""
    capsys.readouterr()
    before = _snapshot(*untouched)
    status = main(argv)
    err = capsys.readouterr().err
    assert status == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert _snapshot(*untouched) == before
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
    before = _snapshot(data)
    status = main(["finetune", "--task", "csv", "--data", str(data), "--init", _model_dir(toy), "--out",
                   str(data / "ft"), "--epochs", "0.01", "--batch-size", "2"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert status == 0 or (status == 2 and len([x for x in err.splitlines() if x.startswith("error:")]) == 1)
    assert {k: v for k, v in _snapshot(data).items() if "/ft/" not in k} == before


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

"""Mismatched pieces and broken files, through the command line: each ends in exit status 2 with one `error:`
line and no traceback, and no input file or earlier output is modified. Covers tokenizer identity (--init,
--resume, a model directory whose vocab.txt changed), --resume with changed options, a corrupt latest
checkpoint, files that are not UTF-8, CoNLL files mixing column layouts, `prepare` into its own corpus and
prepared data with token ids past the vocabulary. A broken input for every command: test_bad_inputs_commands.py;
files bertforge writes, a full disk and file-size limits: test_bad_inputs_disk.py. The toy corpus, tokenizers,
data and run are conftest's `toy`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from bad_inputs_support import LATIN1, pretrain_args, refused
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import file_digests

from bertforge.cli import main
from bertforge.tokenizer import Tokenizer, fingerprint

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models train faster on one thread (conftest)


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
    message = refused(capsys, pretrain_args(toy["data_b"], out, "--init", str(toy["run"])), toy["run"], toy["data_b"])
    assert a in message and b in message and "bertforge prepare --tokenizer" in message
    assert not out.exists()


def test_resume_on_data_of_another_tokenizer_is_refused(toy, tmp_path, capsys):
    run = _copy_run(toy, tmp_path)
    a = Tokenizer.from_pretrained(toy["data_a"] / "tokenizer").fingerprint
    b = Tokenizer.from_pretrained(toy["data_b"] / "tokenizer").fingerprint
    message = refused(capsys, pretrain_args(toy["data_b"], run, "--resume"), run, toy["data_b"])
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
    argv = pretrain_args(toy["data_a"], run, "--resume")
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
    assert "the data:" in refused(capsys, pretrain_args(other, run, "--resume"), run)


def test_resume_applies_and_records_what_may_change(toy, tmp_path, capsys):
    run = _copy_run(toy, tmp_path)
    moved = tmp_path / "data_moved"  # the same data at another path is the same data
    shutil.copytree(toy["data_a"], moved)
    argv = pretrain_args(moved, run, "--resume")
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
    assert main(pretrain_args(toy["data_a"], run, "--resume")) == 0
    assert "--init" in refused(capsys, pretrain_args(toy["data_a"], run, "--resume"), run)


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(toy, tmp_path, capsys):
    run = _copy_run(toy, tmp_path)
    state = run / "checkpoints" / "step-4" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])  # a copy cut short
    capsys.readouterr()
    assert main(pretrain_args(toy["data_a"], run, "--resume")) == 0
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
    message = refused(capsys, pretrain_args(toy["data_a"], run, "--resume"), toy["data_a"])
    assert "no checkpoint" in message and "can be read" in message


# -- files that are not what they should be -----------------------------------------------------------------

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
    message = refused(capsys, ["finetune", "--task", task, "--data", str(data), "--init", str(toy["run"]),
                               "--out", str(tmp_path / "ft")], data)
    assert f":{line}: not UTF-8" in message and "byte 0xe9" in message
    assert not (tmp_path / "ft").exists()


@pytest.mark.parametrize("command", ["fill-mask", "embed", "predict"])
def test_an_input_file_that_is_not_utf8(toy, tmp_path, capsys, command):
    path = tmp_path / "in.txt"
    path.write_bytes(b"a fine line\n" + LATIN1.replace(b"au", b"[MASK]") + b"\n")
    message = refused(capsys, [command, "--model", str(toy["run"]), "--input", str(path)], path)
    assert f"{path}:2: not UTF-8" in message


def test_a_conll_file_mixing_column_layouts(toy, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.txt").write_text("EU NNP B-NP B-ORG\nrejects VBZ B-VP O\n\nGerman JJ B-NP\ncall NN I-NP\n")
    (data / "valid.txt").write_text("EU NNP B-NP B-ORG\n")
    message = refused(capsys, ["finetune", "--task", "conll2003", "--data", str(data), "--init", str(toy["run"]),
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
    assert "token id" in refused(capsys, pretrain_args(data, tmp_path / "run"), data)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=st.binary(max_size=300))
def test_arbitrary_bytes_as_a_csv_task_file(toy, tmp_path_factory, capsys, content):
    """Whatever the bytes, `finetune --task csv` ends in an error: line (or trains: not at these sizes)."""
    data = tmp_path_factory.mktemp("csv")
    (data / "train.csv").write_bytes(b"text,label\n" + content)
    (data / "dev.csv").write_bytes(b"text,label\nsome words,1\n")
    capsys.readouterr()
    before = file_digests(data)
    status = main(["finetune", "--task", "csv", "--data", str(data), "--init", str(toy["run"]), "--out",
                   str(data / "ft"), "--epochs", "0.01", "--batch-size", "2"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert status == 0 or (status == 2 and len([x for x in err.splitlines() if x.startswith("error:")]) == 1)
    assert {k: v for k, v in file_digests(data).items() if "/ft/" not in k} == before



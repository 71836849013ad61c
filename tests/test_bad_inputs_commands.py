"""Every command with a broken input file or an output in an impossible place, an option no command has, and
devices the machine does not have: exit status 2 with one `error:` line, no traceback, inputs untouched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from bad_inputs_support import LATIN1, labelled_csv, pretrain_args, refused

from bertforge.cli import _commands
from bertforge.device import pick_device
from bertforge.errors import BertforgeError

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models train faster on one thread (conftest)

# -- every command: broken files and impossible options -----------------------------------------------------

def _cut(path: Path, size: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:size])


@pytest.fixture(scope="module")
def broken(toy) -> dict[str, Path]:
    """Copies of the toy's model, data and tokenizer, each broken in one way, and other things in wrong places."""
    root = toy["root"] / "broken"
    root.mkdir()
    model_files = shutil.ignore_patterns(".lock", "checkpoints", "tensorboard", "metrics.jsonl", "*.svg")
    found = {"run": toy["run"], "data": toy["data_a"], "corpus": toy["corpus"], "csv": labelled_csv(root / "csv")}
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
    return pretrain_args(Path(data), Path("{new}/run"), *extra, steps=2)


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
    _case("pretrain", "ELECTRA with next-sentence prediction",
          _pretrain_argv("{data}", "--objective", "electra", "--nsp"), "--nsp"),
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
    _case("distill", "--teacher weights cut short",
          ["distill", "--teacher", "{cut_weights_task}", "--student", "{run}", "--task", "csv", "--data", "{csv}",
           "--out", "{new}/student", "--cache-dir", "{new}/cache"], "cannot read weights"),
    _case("distill", "--teacher's task.json names no task",
          ["distill", "--teacher", "{no_task}", "--student", "{run}", "--task", "csv", "--data", "{csv}",
           "--out", "{new}/student", "--cache-dir", "{new}/cache"], "task.json"),
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
    _case("serve", "model weights cut short", ["serve", "--model", "{cut_weights}", "--port", "0"],
          "model.safetensors"),
    _case("join", "a part that is a data directory of no --shard run", ["join", "{data}", "--out", "{new}/joined"],
          "--shard"),
    _case("env", "an option it does not have", ["env", "--verbose"], "unrecognized arguments: --verbose"),
]


@pytest.mark.parametrize(("command", "argv", "needle"), EVERY_COMMAND)
def test_every_command_refuses_a_broken_input(broken, tmp_path, capsys, monkeypatch, command, argv, needle):
    def no_network(*args, **kwargs):
        pytest.fail("the demo fetched its data before refusing its --out")

    monkeypatch.setattr("bertforge.demo.data.fetch_demo_data", no_network)
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
    csv = labelled_csv(tmp_path / "csv")
    expected = f"error: --device {device}: CUDA is not available on this machine (torch {torch.__version__}); " \
               f"use --device cpu"
    for argv in (["embed", "--model", str(toy["run"]), "--text", "a"],
                 pretrain_args(toy["data_a"], new / "run", steps=2),
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



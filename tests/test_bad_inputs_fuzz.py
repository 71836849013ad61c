"""Random input files and random option lists through the command line (issue 21's property, driven by
hypothesis): whatever comes in, a command ends in exit status 0, or in exit status 2 with one `error:` line and no
traceback, and leaves its input files as they were. A few examples per test, so the file runs in seconds;
test_bad_inputs*.py hold the written-out cases."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import file_digests

from bertforge.cli import build_parser, main

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models train faster on one thread (conftest)

FEW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def inputs(prepared, tiny_model_dir) -> dict[str, str]:
    """A tokenizer, data prepared with it, and an untrained tiny BERT with its pretraining heads."""
    return {"model": str(tiny_model_dir), "tokenizer": str(prepared / "tokenizer"), "data": str(prepared)}


def ends_well(capsys, argv: list[str]) -> int:
    """Run the CLI in this process; assert exit 0, or 2 with exactly one `error:` line; never a traceback."""
    capsys.readouterr()
    try:
        status = main(argv)
    except SystemExit as e:  # --help, as a random option
        status = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert status == 0 or (status == 2 and len([x for x in err.splitlines() if x.startswith("error:")]) == 1), err
    return status


# -- random bytes as an input file ------------------------------------------------------------------------------

# Pieces that make the bytes interesting to a reader: JSON, [MASK], blank lines, bytes that are not UTF-8.
PIECES = [b"", b"the river", b"a [MASK] stone", b'{"text": "old road"}', b'{"text": 3}', b"{", b"[MASK]", b"\xff",
          b"caf\xe9", b"\xef\xbb\xbf", b"\t,\t", b'{"steps": 1}', b"{}", b"[1, 2]", b"null", b"\x00"]
CONTENT = st.binary(max_size=300) | st.lists(st.sampled_from(PIECES), max_size=12).map(b"\n".join)

# The command line reading FILE, and the name FILE gets (what the reader goes by). A name under data/ replaces that
# file in a copy of the prepared data, at {work}/data.
FILE_COMMANDS = {
    "embed --input": ("in.txt", ["embed", "--model", "{model}", "--input", "{file}"]),
    "fill-mask --input": ("in.jsonl", ["fill-mask", "--model", "{model}", "--input", "{file}"]),
    "predict --input (not a fine-tuned model)": ("in.jsonl", ["predict", "--model", "{model}", "--input", "{file}"]),
    "vocab train --corpus": ("corpus.txt", ["vocab", "train", "--corpus", "{file}", "--out", "{out}/tok",
                                            "--vocab-size", "40", "--no-progress"]),
    "prepare --corpus": ("corpus.jsonl", ["prepare", "--corpus", "{file}", "--tokenizer", "{tokenizer}", "--out",
                                          "{out}/data", "--max-seq-len", "16", "--workers", "1", "--no-progress"]),
    "pretrain --config": ("run.json", ["pretrain", "--data", "{data}", "--out", "{out}/run", "--config", "{file}",
                                       "--model", "{model}/config.json", "--steps", "1", "--batch-size", "2",
                                       "--eval-batches", "0", "--save-every", "0", "--no-progress"]),
    "inspect (manifest.json)": ("data/manifest.json", ["inspect", "{work}/data"]),
    "inspect (a shard's .json)": ("data/train-00000.json", ["inspect", "{work}/data"]),
}


@FEW
@given(command=st.sampled_from(sorted(FILE_COMMANDS)), content=CONTENT)
def test_random_bytes_as_an_input_file(inputs, tmp_path_factory, capsys, command, content):
    name, argv = FILE_COMMANDS[command]
    work = tmp_path_factory.mktemp("fuzz")
    if name.startswith("data/"):
        shutil.copytree(inputs["data"], work / "data")
    file = work / name
    file.write_bytes(content)
    places = {**inputs, "file": str(file), "out": str(work / "out"), "work": str(work)}
    before = file_digests(file, *map(Path, inputs.values()))
    ends_well(capsys, [a.format(**places) for a in argv])
    assert file_digests(file, *map(Path, inputs.values())) == before


# -- random options -------------------------------------------------------------------------------------------

# The required part of each command line; the options drawn follow it.
BASE = {"inspect": ["inspect", "{data}"], "embed": ["embed", "--model", "{model}", "--text", "the river"],
        "fill-mask": ["fill-mask", "--model", "{model}", "a [MASK] stone"], "model info": ["model", "info"]}
VALUES = st.sampled_from(["0", "1", "-1", "3", "7.5", "1e9", "nan", "inf", "-inf", "x", "", "--", "[MASK]", "mean",
                          "cls", "int8", "train", "val", "the [MASK] road", "{model}", "{data}", "out.npy",
                          "out.jsonl", "missing/dir", "cpu", "cuda", "cuda:1", "mps", "gpu0"]) | st.text(max_size=8)


def options(command: str) -> list[str]:
    """Every option string of `command`."""
    parser = build_parser()
    for word in command.split():
        parser = next(a for a in parser._actions if a.dest in ("command", "subcommand")).choices[word]
    return sorted(parser._option_string_actions)


@pytest.mark.slow
@FEW
@given(command=st.sampled_from(sorted(BASE)), data=st.data())
def test_random_options(inputs, tmp_path, monkeypatch, capsys, command, data):
    """Options drawn from the command's own, values of every kind; outputs land in a scratch directory."""
    monkeypatch.chdir(tmp_path)  # a relative --out writes here
    drawn = data.draw(st.lists(st.sampled_from(options(command)) | VALUES, max_size=6))
    before = file_digests(*map(Path, inputs.values()))
    ends_well(capsys, [a.replace("{model}", inputs["model"]).replace("{data}", inputs["data"])
                       for a in BASE[command] + drawn])
    assert file_digests(*map(Path, inputs.values())) == before

"""Preparing on many machines: `prepare --shard I/N` then `join` gives output byte-identical to one machine's for
N = 1, 2, 3, and the join refuses parts of another run in one line each."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import make_documents, tokenizer_dir, write_doc_corpus, write_lines_corpus

from bertforge.cli import main
from bertforge.data.join import join
from bertforge.data.parts import parse_part, part_range
from bertforge.data.prepare import PrepareOptions, prepare
from bertforge.errors import BertforgeError
from bertforge.tokenizer import Tokenizer, VocabOptions

# small shards and units, so parts cut files and the join crosses shard boundaries
SMALL = PrepareOptions(max_seq_len=64, val_fraction=0.2, shard_tokens=3000, chunk_bytes=4000)
QUIET = {"workers": 1, "progress": False}


def _digests(directory) -> dict[str, str]:
    return {p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write_doc_corpus(root / "docs", make_documents(12, seed=1))
    write_lines_corpus(root / "big.txt", make_documents(40, seed=2))  # over chunk_bytes: cut into byte ranges
    texts = [" ".join(d) for d in make_documents(30, seed=3)]
    (root / "records.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    pq.write_table(pa.table({"text": texts}), root / "table.parquet", row_group_size=4)  # several row groups
    return root


@pytest.fixture(scope="module")
def whole(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "data"
    prepare([str(corpus)], tokenizer_dir(), out, SMALL, **QUIET)
    return out


def _parts(corpus, root, n: int, **kw) -> list:
    outs = []
    for i in range(1, n + 1):
        outs.append(root / f"part-{i}")
        prepare([str(corpus)], tokenizer_dir(), outs[-1], dataclasses.replace(SMALL, **kw), part=(i, n), **QUIET)
    return outs


@pytest.mark.parametrize("n", [1, 2, 3])
def test_parts_joined_are_byte_identical_to_one_machine(corpus, whole, tmp_path, n):
    parts = _parts(corpus, tmp_path, n)
    join(list(reversed(parts)), tmp_path / "joined")  # any order
    assert _digests(tmp_path / "joined") == _digests(whole)
    manifest = json.loads((whole / "manifest.json").read_text())
    assert len(manifest["splits"]["train"]["shards"]) > 2 and manifest["counts"]["val"]["documents"] > 0


def test_parts_split_the_units_by_bytes_and_cover_them_once():
    for sizes in ([5, 1, 1, 1, 10, 2], [0, 3, 0, 0, 4, 0], [0, 0]):
        for n in range(1, 9):
            ranges = [part_range(sizes, i, n) for i in range(1, n + 1)]
            assert [u for r in ranges for u in r] == list(range(len(sizes))), (sizes, n)
    sizes = [5, 1, 1, 1, 10, 2]
    assert [list(part_range(sizes, i, 2)) for i in (1, 2)] == [[0, 1, 2, 3], [4, 5]]
    assert parse_part("2/3") == (2, 3)
    for bad in ("3", "0/2", "3/2", "a/b"):
        with pytest.raises(BertforgeError, match="--shard"):
            parse_part(bad)


@pytest.mark.slow  # eleven prepares
def test_join_refuses_parts_of_another_run_in_one_line_each(corpus, tmp_path, capsys):
    parts = _parts(corpus, tmp_path, 3)
    other_n = _parts(corpus, tmp_path / "n2", 2)
    other_len = _parts(corpus, tmp_path / "len", 3, max_seq_len=48)
    other_seed = _parts(corpus, tmp_path / "seed", 3, seed=7)
    other_tok = tmp_path / "tok"
    Tokenizer.train(corpus / "docs", VocabOptions(vocab_size=300, min_frequency=1),
                    show_progress=False).save_pretrained(other_tok)
    prepare([str(corpus)], other_tok, tmp_path / "other-tok-3", SMALL, part=(3, 3), **QUIET)
    plain = tmp_path / "plain"
    prepare([str(corpus / "docs")], tokenizer_dir(), plain, SMALL, **QUIET)
    cases = {"is missing": [parts[0], parts[2]], "is given twice": [*parts, parts[1]],
             "all made with the same N": [parts[0], parts[1], other_n[1]],
             "one --max-seq-len": [parts[0], parts[1], other_len[2]],
             "another corpus or other settings": [parts[0], parts[1], other_seed[2]],
             "one --tokenizer": [parts[0], parts[1], tmp_path / "other-tok-3"],
             "is not a part": [*parts, plain]}
    for expected, given in cases.items():
        assert main(["join", *map(str, given), "--out", str(tmp_path / "joined")]) == 2, expected
        err = capsys.readouterr().err
        assert err.startswith("error: ") and expected in err and err.count("\n") == 1, err
    assert not (tmp_path / "joined").exists()
    assert main(["join", *map(str, parts), "--out", str(tmp_path / "joined")]) == 0
    assert "wrote" in capsys.readouterr().out


def test_cli_shard_and_a_part_with_no_units(tmp_path, capsys):
    corpus = write_doc_corpus(tmp_path / "corpus", make_documents(2, seed=5))  # two files: part 3 of 3 is empty
    outs = []
    for i in (1, 2, 3):
        outs.append(str(tmp_path / f"p{i}"))
        assert main(["prepare", "--corpus", str(corpus), "--tokenizer", str(tokenizer_dir()), "--out", outs[-1],
                     "--shard", f"{i}/3", "--val-fraction", "0", "--no-progress"]) == 0
        assert f"(part {i} of 3: `bertforge join` all 3)" in capsys.readouterr().out
    assert main(["join", *outs, "--out", str(tmp_path / "data")]) == 0
    assert "train: 2 documents" in capsys.readouterr().out
    assert main(["prepare", "--corpus", str(corpus), "--tokenizer", str(tokenizer_dir()), "--out", str(tmp_path / "x"),
                 "--shard", "4/3"]) == 2
    assert "--shard 4/3: the part's number must be 1 to 3" in capsys.readouterr().err

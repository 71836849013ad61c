"""`prepare`: shards hold exactly the corpus's tokens with its sentence and document boundaries; output is
byte-identical for the same inputs whatever the number of workers; validation split by document; refusals."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from support import (
    binomial_bound,
    make_documents,
    tokenizer,
    tokenizer_dir,
    write_doc_corpus,
    write_lines_corpus,
)

from bertforge.cli import main
from bertforge.data.prepare import PrepareOptions, prepare
from bertforge.data.shards import open_split, read_manifest
from bertforge.errors import BertforgeError


def shard_documents(data_dir: Path, split: str) -> list[tuple[tuple[int, ...], ...]]:
    """Documents of a split as tuples of sentence token tuples, read straight from the raw files."""
    out = []
    for shard in open_split(data_dir, split):
        for d in range(shard.n_documents):
            out.append(tuple(tuple(int(t) for t in s) for s in shard.document(d)))
    return out


def expected_documents(docs: list[list[str]]) -> list[tuple[tuple[int, ...], ...]]:
    tok = tokenizer()
    return [tuple(tuple(ids) for ids in tok.tokenize_ids(doc)) for doc in docs]


def digest(directory: Path) -> dict[str, str]:
    return {p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_shards_hold_the_corpus_tokens_sentences_and_documents(tmp_path):
    docs = make_documents(40, seed=2)
    corpus = write_doc_corpus(tmp_path / "corpus", docs)
    m = prepare([str(corpus)], str(tokenizer_dir()), tmp_path / "data",
                PrepareOptions(max_seq_len=32, val_fraction=0.2, shard_tokens=2000), workers=2, progress=False)
    got = shard_documents(tmp_path / "data", "train") + shard_documents(tmp_path / "data", "val")
    assert Counter(got) == Counter(expected_documents(docs))
    assert m["counts"]["train"]["documents"] + m["counts"]["val"]["documents"] == 40
    assert m["counts"]["train"]["sentences"] + m["counts"]["val"]["sentences"] == sum(map(len, docs))
    assert len(m["splits"]["train"]["shards"]) > 1  # shard_tokens forced several shards
    assert m["tokenizer_fingerprint"] == tokenizer().fingerprint and m["max_seq_len"] == 32
    assert m["vocab_size"] == tokenizer().vocab_size and m["dtype"] == "<u2"
    # train keeps corpus order: the train documents are the corpus minus val, in order
    train = shard_documents(tmp_path / "data", "train")
    val = set(shard_documents(tmp_path / "data", "val"))
    assert train == [d for d in expected_documents(docs) if d not in val]
    assert not list(tmp_path.glob(".data*"))  # no temporary directory left behind


def test_same_inputs_and_seed_give_byte_identical_output_for_any_worker_count(tmp_path):
    docs = make_documents(60, seed=3)
    lines = write_lines_corpus(tmp_path / "c" / "big.txt", docs)
    write_doc_corpus(tmp_path / "c" / "docs", docs[:20])
    runs = []
    for i, workers in enumerate((1, 2, 2)):
        out = tmp_path / f"out{i}"
        prepare([str(tmp_path / "c")], str(tokenizer_dir()), out,
                PrepareOptions(val_fraction=0.2, shard_tokens=3000, chunk_bytes=lines.stat().st_size // 5),
                workers=workers, progress=False)
        runs.append(digest(out))
    assert runs[0] == runs[1] == runs[2]
    assert len(runs[0]) > 10
    out = tmp_path / "other-seed"
    prepare([str(tmp_path / "c")], str(tokenizer_dir()), out,
            PrepareOptions(val_fraction=0.2, seed=7, shard_tokens=3000), workers=1, progress=False)
    assert digest(out)["manifest.json"] != runs[0]["manifest.json"]


def test_validation_split_is_by_document_at_the_requested_rate(tmp_path):
    docs = make_documents(600, seed=4, min_sents=1, max_sents=3)
    corpus = write_lines_corpus(tmp_path / "c.txt", docs)
    m = prepare([str(corpus)], str(tokenizer_dir()), tmp_path / "data", PrepareOptions(val_fraction=0.25),
                workers=1, progress=False)
    n_val = m["counts"]["val"]["documents"]
    assert n_val + m["counts"]["train"]["documents"] == 600
    assert abs(n_val / 600 - 0.25) < binomial_bound(600, 0.25)
    train, val = shard_documents(tmp_path / "data", "train"), shard_documents(tmp_path / "data", "val")
    assert not set(train) & set(val)


def test_bad_input_is_summarised_and_the_rest_prepared(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "good.txt").write_text("The treaty was signed. The navy grew.\n")
    (tmp_path / "c" / "bin.txt").write_bytes(b"\x00\x01\x02" * 100)
    (tmp_path / "c" / "latin1.txt").write_bytes("The caf\xe9 was open. It was [MASK] late.".encode("latin-1"))
    (tmp_path / "c" / "blank.txt").write_text("\n \n")
    m = prepare([str(tmp_path / "c"), str(tmp_path / "c" / "good.txt")], str(tokenizer_dir()), tmp_path / "data",
                PrepareOptions(val_fraction=0.0), workers=1, progress=False)
    reading = m["reading"]
    assert reading["skipped_files"] == {"binary file": 1, "duplicate path": 1}  # good.txt is read once
    assert reading["counts"]["invalid_utf8_bytes_replaced"] == 1
    assert reading["counts"]["empty_documents"] == 1
    assert reading["counts"]["special_tokens_in_text_dropped"] == 1
    assert m["counts"]["train"]["documents"] == 2
    mask_id = tokenizer().mask_id
    assert all(mask_id not in s for d in shard_documents(tmp_path / "data", "train") for s in d)
    # Sentence lengths shrink with the dropped token: the document reads back sentence by sentence.
    expected = [tuple(i for i in ids if i != mask_id)
                for ids in tokenizer().tokenize_ids(["The caf\ufffd was open.", "It was [MASK] late."])]
    assert tuple(expected) in {tuple(map(tuple, d)) for d in shard_documents(tmp_path / "data", "train")}


def test_refuses_to_mix_tokenizers(tmp_path):
    from bertforge.tokenizer import Tokenizer, VocabOptions

    corpus = write_doc_corpus(tmp_path / "corpus", make_documents(5, seed=5))
    out = tmp_path / "data"
    prepare([str(corpus)], str(tokenizer_dir()), out, workers=1, progress=False)
    before = digest(out)
    other = Tokenizer.train([corpus], VocabOptions(vocab_size=150, min_frequency=1), show_progress=False)
    with pytest.raises(BertforgeError, match="different tokenizer"):
        prepare([str(corpus)], other, out, workers=1, progress=False)
    assert digest(out) == before  # untouched
    # A shard copied in from data made with another tokenizer is refused when read.
    prepare([str(corpus)], other, tmp_path / "other", workers=1, progress=False)
    for ext in ("tokens", "sentences", "documents", "json"):
        (out / f"train-00000.{ext}").write_bytes((tmp_path / "other" / f"train-00000.{ext}").read_bytes())
    with pytest.raises(BertforgeError, match="another tokenizer"):
        open_split(out, "train")
    prepare([str(corpus)], other, out, workers=1, progress=False, overwrite=True)
    assert read_manifest(out)["tokenizer_fingerprint"] == other.fingerprint


def test_a_failed_prepare_leaves_the_previous_output_intact(tmp_path):
    corpus = write_doc_corpus(tmp_path / "corpus", make_documents(5, seed=6))
    out = tmp_path / "data"
    prepare([str(corpus)], str(tokenizer_dir()), out, workers=1, progress=False)
    before = digest(out)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("\n\n")
    with pytest.raises(BertforgeError, match="no documents"):
        prepare([str(tmp_path / "empty")], str(tokenizer_dir()), out, workers=1, progress=False)
    assert digest(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "data", "empty"]


def test_cli_prepare_and_inspect(tmp_path, capsys):
    corpus = write_doc_corpus(tmp_path / "corpus", make_documents(30, seed=8))
    out = tmp_path / "data"
    code = main(["prepare", "--corpus", str(corpus), "--tokenizer", str(tokenizer_dir()), "--out", str(out),
                 "--max-seq-len", "48", "--workers", "2", "--val-fraction", "0.1", "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "train:" in printed and f"wrote {out}" in printed
    assert printed.startswith("prepare: 2 worker processes, ") and " usable" in printed.splitlines()[0]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["max_seq_len"] == 48 and manifest["settings"]["val_fraction"] == 0.1
    assert main(["inspect", str(out), "--num", "4"]) == 0
    printed = capsys.readouterr().out
    rows = [ln for ln in printed.splitlines() if ln.startswith("[CLS]")]
    assert len(rows) == 4
    for row in rows:
        assert row.endswith(("IsNext", "NotNext")) and row.count("[SEP]") == 2
        assert "{" in row  # predicted positions show their labels
    assert any("[MASK]{" in row for row in rows)
    assert main(["prepare", "--corpus", str(tmp_path / "nope*.txt"), "--tokenizer", str(tokenizer_dir()),
                 "--out", str(tmp_path / "x"), "--no-progress"]) == 2
    assert "matches no file" in capsys.readouterr().err


def test_token_arrays_are_memory_mapped(tmp_path):
    corpus = write_doc_corpus(tmp_path / "corpus", make_documents(5, seed=9))
    prepare([str(corpus)], str(tokenizer_dir()), tmp_path / "data", workers=1, progress=False)
    shard = open_split(tmp_path / "data", "train")[0]
    assert isinstance(shard.tokens, np.memmap) and isinstance(shard.sentences, np.memmap)
    assert int(shard.sentences[-1]) == len(shard.tokens)
    assert int(shard.documents[-1]) == len(shard.sentences) - 1

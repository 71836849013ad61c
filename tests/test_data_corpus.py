"""Corpus reading: formats, detection, byte-range units, and bad input that must not stop a run."""

from __future__ import annotations

import gzip
import json
import random
import tracemalloc

import pytest

from bertforge.corpus import (
    ReadStats,
    Unit,
    detect_txt_format,
    expand_inputs,
    plan_units,
    read_sentences,
    read_unit,
)
from bertforge.errors import BertforgeError


def read_all(paths, fmt="auto", *, chunk_bytes=64 << 20, max_line_bytes=1 << 20):
    """(documents as lists of sentences, stats) over every unit, in order."""
    stats = ReadStats()
    docs, cur = [], []
    for unit in plan_units(list(paths), fmt, chunk_bytes=chunk_bytes, stats=stats):
        for item in read_unit(unit, stats, max_line_bytes=max_line_bytes):
            if item is None:
                docs.append(cur)
                cur = []
            else:
                cur.append(item)
    assert cur == []  # every document is closed
    return docs, stats


def test_doc_format_one_document_per_file_paragraphs_split(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("Title line\n\nMr. Smith came. He saw\nthe hall.\n\n\nThe end.\n")
    docs, stats = read_all([p])
    assert docs == [["Title line", "Mr. Smith came.", "He saw the hall.", "The end."]]
    assert stats.counts["documents"] == 1 and stats.counts["sentences"] == 4


def test_lines_format_detected_and_read(tmp_path):
    p = tmp_path / "b.txt"
    p.write_text("First sentence here.\nSecond one, Mr. X.\n\nAnother doc starts.\nAnd ends.\n\n\n"
                 "Third doc.\nWith two lines.\n")
    assert detect_txt_format(p.read_text()) == "lines"
    docs, _ = read_all([p])
    assert docs == [["First sentence here.", "Second one, Mr. X."], ["Another doc starts.", "And ends."],
                    ["Third doc.", "With two lines."]]


def test_detection_of_paragraph_files_and_hard_wrapped_prose():
    paragraphs = ("This is a paragraph. It has several sentences. Really it does.\n\n"
                  "Another paragraph. Also several. Yes.\n\nA third one here. And more.\n")
    wrapped = ("This is hard-wrapped prose that goes on and\non across lines without ending\nat the end of "
               "each line, as old books do.\n\nAnd a second paragraph\nthat is wrapped the same way.\n")
    assert detect_txt_format(paragraphs) == "doc"
    assert detect_txt_format(wrapped) == "doc"


def test_jsonl_and_gz(tmp_path):
    records = [{"text": "One doc. Two sentences."}, {"text": ""}, {"title": "no text"}, {"text": "Second doc."}]
    lines = [json.dumps(r) for r in records] + ["{not json"]
    p = tmp_path / "c.jsonl.gz"
    with gzip.open(p, "wt") as f:
        f.write("\n".join(lines) + "\n")
    t = tmp_path / "d.txt.gz"
    with gzip.open(t, "wt") as f:
        f.write("Gz text file. Is read.\n")
    docs, stats = read_all([p, t])
    assert docs == [["One doc.", "Two sentences."], ["Second doc."], ["Gz text file.", "Is read."]]
    assert stats.counts["jsonl_bad_lines"] == 1
    assert stats.counts["jsonl_records_without_text"] == 1
    assert stats.counts["empty_documents"] == 1


def test_bad_input_is_counted_and_the_rest_is_read(tmp_path):
    (tmp_path / "bad-utf8.txt").write_bytes(b"Caf\xe9 au lait. Good \xff\xfe text.\n")
    (tmp_path / "binary.txt").write_bytes(bytes(range(256)) * 10)
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blank.txt").write_text("\n\n   \n")
    (tmp_path / "good.txt").write_text("All good here.\n")
    rng = random.Random(0)
    with gzip.open(tmp_path / "truncated.txt.gz", "wt") as f:
        for i in range(3000):
            f.write(f"Some text that will be cut {i} {rng.random()}.\n\n")
    data = (tmp_path / "truncated.txt.gz").read_bytes()
    (tmp_path / "truncated.txt.gz").write_bytes(data[: len(data) // 2])
    (tmp_path / "notgzip.txt.gz").write_text("plain text pretending to be gzip\n")
    docs, stats = read_all(expand_inputs([str(tmp_path)]))
    assert ["Caf\ufffd au lait.", "Good \ufffd\ufffd text."] in docs
    assert ["All good here."] in docs
    assert stats.counts["invalid_utf8_bytes_replaced"] == 3
    reasons = dict((p.rsplit("/", 1)[-1], r) for p, r in stats.skipped)
    assert reasons["binary.txt"] == "binary file"
    assert reasons["empty.txt"] == "empty file"
    assert reasons["notgzip.txt.gz"].startswith("unreadable")
    assert reasons["truncated.txt.gz"].startswith("read error part way")
    assert any(d[0].startswith("Some text that will be cut 0 ") for d in docs)  # what was read is kept
    assert stats.counts["empty_documents"] == 1  # blank.txt


@pytest.mark.slow  # 2 MB of lines read in 16 kB pieces under tracemalloc
def test_an_enormous_line_is_read_in_bounded_pieces(tmp_path):
    """A 1.5 MB line with sentences, and a 0.5 MB line without any boundary, read with 16 kB pieces: nothing
    lost, and Python never holds more than a few pieces at once."""
    sentence = "The quick brown fox jumps over the lazy dog. "
    p = tmp_path / "huge.txt"
    with open(p, "w") as f:
        f.write(sentence * (1_500_000 // len(sentence)))
        f.write("\n\n" + "x" * 500_000 + "\n")
    tracemalloc.start()
    n_fox = other_chars = longest = 0
    stats = ReadStats()
    for unit in plan_units([p], "doc"):
        for item in read_unit(unit, stats, max_line_bytes=1 << 14):
            if item == sentence.strip():
                n_fox += 1
            elif item is not None:
                assert set(item) == {"x"}
                other_chars += len(item)
                longest = max(longest, len(item))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert n_fox == 1_500_000 // len(sentence)
    assert other_chars == 500_000 and longest <= 3 << 14  # cut into pieces of a few max_line_bytes
    assert peak < 1_000_000, peak  # below the 1.5 MB line: it was never held whole
    assert stats.counts["long_paragraph_pieces"] > 0


@pytest.mark.parametrize("fmt", ["lines", "jsonl"])
def test_byte_range_units_read_every_document_exactly_once(tmp_path, fmt):
    docs = [[f"Doc {d} sentence {s} is here." for s in range(1 + d % 5)] for d in range(300)]
    if fmt == "lines":
        p = tmp_path / "big.txt"
        p.write_text("\n\n".join("\n".join(d) for d in docs) + "\n\n\n")
    else:
        p = tmp_path / "big.jsonl"
        p.write_text("".join(json.dumps({"text": " ".join(d)}) + "\n" for d in docs))
    whole, _ = read_all([p], "lines" if fmt == "lines" else "auto")
    for chunk in (97, 1000, 4096):
        units = plan_units([p], "lines" if fmt == "lines" else "auto", chunk_bytes=chunk)
        assert len(units) > 1 and all(isinstance(u, Unit) for u in units)
        parts, _ = read_all([p], "lines" if fmt == "lines" else "auto", chunk_bytes=chunk)
        assert parts == whole == docs


def test_expand_inputs_dirs_globs_and_errors(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ("a.txt", "sub/b.jsonl", "sub/c.txt.gz", "sub/skip.csv"):
        (tmp_path / name).write_bytes(b"x")
    got = [p.relative_to(tmp_path).as_posix() for p in expand_inputs([str(tmp_path)])]
    assert got == ["a.txt", "sub/b.jsonl", "sub/c.txt.gz"]
    got = [p.name for p in expand_inputs([str(tmp_path / "sub" / "*.jsonl"), str(tmp_path / "a.txt")])]
    assert got == ["b.jsonl", "a.txt"]
    with pytest.raises(BertforgeError, match="matches no file"):
        expand_inputs([str(tmp_path / "nothing-*.txt")])


def test_a_path_met_twice_is_read_once_and_counted(tmp_path):
    (tmp_path / "a.txt").write_text("One. Two.\n")
    (tmp_path / "b.txt").write_text("Three.\n")
    stats = ReadStats()
    paths = expand_inputs([str(tmp_path), str(tmp_path / "a.txt"), str(tmp_path / "*.txt")], stats)
    assert [p.name for p in paths] == ["a.txt", "b.txt"]
    assert sorted(reason for _, reason in stats.skipped) == ["duplicate path"] * 3
    assert expand_inputs(tmp_path / "b.txt") == [tmp_path / "b.txt"]  # one path, not a list of them


def test_read_sentences_is_every_unit_without_document_ends(tmp_path):
    docs = [[f"Doc {d} sentence {s} is here." for s in range(1 + d % 3)] for d in range(50)]
    p = tmp_path / "big.txt"
    p.write_text("\n\n".join("\n".join(d) for d in docs) + "\n")
    (tmp_path / "binary.txt").write_bytes(bytes(range(256)))
    stats = ReadStats()
    progress = []
    reporter = type("Reporter", (), {"update": lambda self, n: progress.append(n)})()
    got = list(read_sentences([p, tmp_path / "binary.txt"], stats, fmt="lines", progress=reporter))
    assert got == [s for d in docs for s in d]
    assert stats.counts["documents"] == 50 and stats.skipped == [(str(tmp_path / "binary.txt"), "binary file")]
    assert sum(progress) == p.stat().st_size + 256

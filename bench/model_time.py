"""The model's time alone over a file, for A/B benches of the int8 engine (bench/int8_attention.py,
bench/int8_kernels.py): each side's model over the same length-sorted batches of 64, on the caller's threads, the
sides taking turns; every batch runs `repeats` times per side and a side's figure is the sum over batches of each
batch's fastest run. Whole-file timings on two threads moved by up to 10% from run to run on our bench machine;
the fastest run of each batch does not. Plus each side's accuracy on Rotten Tomatoes dev and test through
`predict`, as the commands run."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from inference import DATA, MAX_LENGTH, finetuned_model, uniform_texts

from bertforge.batching import length_batches
from bertforge.data.padding import pad_ids
from bertforge.infer import Predictor
from bertforge.tasks import get_task
from bertforge.train.memory import keep_freed_memory


def parser(doc: str) -> argparse.ArgumentParser:
    """The command line every model-time bench takes (`doc`: its module docstring), to add its own options to."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--workload", choices=["rt", "uniform"], default="rt")
    parser.add_argument("--repeats", type=int, default=7, help="runs of every batch per side")
    return parser


def bench_model() -> Path:
    """bench/inference.py's fine-tuned MiniLM, with the process set up as these benches measure: the allocator
    as the bertforge commands run it, one thread."""
    keep_freed_memory()
    torch.set_num_threads(1)
    return finetuned_model(DATA, 4000, 5e-5)


def compare(sides: dict[str, Predictor], workload: str, repeats: int, width: int = 30) -> None:
    """Times and accuracies of `sides`, printed, each against the first."""
    names = list(sides)
    tokenizer = sides[names[0]].task_model.tokenizer
    texts = [ex.text for ex in get_task("csv").read(DATA, "test")]
    if workload == "uniform":
        texts = uniform_texts(texts, tokenizer, len(texts))
    rows = [tokenizer.encode(t, max_length=MAX_LENGTH).ids for t in texts]
    batches = [pad_ids([rows[i] for i in idx], tokenizer.pad_id)
               for idx in length_batches([len(r) for r in rows], max_batch=64)]
    fastest = {name: [float("inf")] * len(batches) for name in names}
    with torch.no_grad():
        for r in range(repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                model = sides[name].task_model.model
                for b, (ids, mask) in enumerate(batches):
                    start = time.perf_counter()
                    model(input_ids=ids, attention_mask=mask)
                    fastest[name][b] = min(fastest[name][b], time.perf_counter() - start)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {workload}: {len(texts)} texts in "
          f"{len(batches)} batches of 64, the sum of each batch's fastest of {repeats} runs")
    base = sum(fastest[names[0]])
    for name in names:
        accuracy = []
        for split in ("dev", "test"):
            examples = get_task("csv").read(DATA, split)
            results = sides[name].predict([{"text": ex.text} for ex in examples])
            accuracy.append(100 * np.mean([r["label"] == ex.label for r, ex in zip(results, examples, strict=True)]))
        print(f"{name:<{width}} {1000 * sum(fastest[name]):8.1f} ms  {base / sum(fastest[name]):.3f}x   "
              f"accuracy dev {accuracy[0]:.2f}, test {accuracy[1]:.2f}")

"""The int8 model's attention over short sequences in fp32 (the fused kernel) against bf16 (the explicit kernel,
`bertforge.infer._bf16_attention`, on CPUs with native bf16): the model's time over a file and its accuracy.

Both sides are `Predictor(quantize="int8")` on bench/inference.py's fine-tuned MiniLM; on the fp32 side every
query/key/value product is told to write fp32 (`bf16_max_positions = 0`). Time is the model's alone (no
tokenizing), over the file's length-sorted batches of 64, on one thread: the sides alternate, every batch runs
--repeats times per side, and the figure is the sum over batches of each batch's fastest run. Whole-file timings on
two threads moved by up to 10% from run to run here, more than the difference measured; the fastest run of each
batch does not. Accuracy is on Rotten Tomatoes dev and test through `predict`, as the commands run.

    .venv/bin/python bench/int8_attention.py                      # Rotten Tomatoes test
    .venv/bin/python bench/int8_attention.py --workload uniform   # 16-128 tokens
    .venv/bin/python bench/int8_attention.py --workload uniform --up-to 128
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from inference import DATA, MAX_LENGTH, finetuned_model, uniform_texts

from bertforge import cpu
from bertforge.data.padding import pad_ids
from bertforge.infer import INT8_BF16_ATTENTION_MAX_T, Predictor, length_batches
from bertforge.model import BertSelfAttention
from bertforge.tasks import get_task
from bertforge.train.memory import keep_freed_memory


def bf16_attention_up_to(predictor: Predictor, tokens: int) -> Predictor:
    for module in predictor.task_model.model.modules():
        if isinstance(module, BertSelfAttention):
            module.qkv.bf16_max_positions = tokens
    return predictor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=["rt", "uniform"], default="rt")
    parser.add_argument("--repeats", type=int, default=7, help="runs of every batch per side")
    parser.add_argument("--up-to", type=int, default=INT8_BF16_ATTENTION_MAX_T,
                        help="the bf16 side's longest sequences in bf16 (default: the model's threshold)")
    args = parser.parse_args()
    if not cpu.has_native_bf16():
        raise SystemExit("this CPU has no native bf16: the int8 model keeps its attention in fp32 here")
    keep_freed_memory()  # as the bertforge commands run
    torch.set_num_threads(1)
    model_dir = finetuned_model(DATA, 4000, 5e-5)
    sides = {"fp32 attention": bf16_attention_up_to(Predictor(model_dir, quantize="int8"), 0),
             f"bf16 attention up to {args.up_to} tokens": bf16_attention_up_to(Predictor(model_dir, quantize="int8"),
                                                                             args.up_to)}
    names = list(sides)
    tokenizer = sides[names[0]].task_model.tokenizer
    texts = [ex.text for ex in get_task("csv").read(DATA, "test")]
    if args.workload == "uniform":
        texts = uniform_texts(texts, tokenizer, len(texts))
    rows = [tokenizer.encode(t, max_length=MAX_LENGTH).ids for t in texts]
    batches = [pad_ids([rows[i] for i in idx], tokenizer.pad_id)
               for idx in length_batches([len(r) for r in rows], max_batch=64)]
    fastest = {name: [float("inf")] * len(batches) for name in names}
    with torch.no_grad():
        for r in range(args.repeats):
            for name in names[r % 2:] + names[:r % 2]:
                model = sides[name].task_model.model
                for b, (ids, mask) in enumerate(batches):
                    start = time.perf_counter()
                    model(input_ids=ids, attention_mask=mask)
                    fastest[name][b] = min(fastest[name][b], time.perf_counter() - start)
    print(f"torch {torch.__version__}, 1 thread, {args.workload}: {len(texts)} texts in {len(batches)} batches of 64, "
          f"the sum of each batch's fastest of {args.repeats} runs")
    base = sum(fastest[names[0]])
    for name in names:
        accuracy = []
        for split in ("dev", "test"):
            examples = get_task("csv").read(DATA, split)
            results = sides[name].predict([{"text": ex.text} for ex in examples])
            accuracy.append(100 * np.mean([r["label"] == ex.label for r, ex in zip(results, examples, strict=True)]))
        print(f"{name:<34} {1000 * sum(fastest[name]):8.1f} ms  {base / sum(fastest[name]):.3f}x   "
              f"accuracy dev {accuracy[0]:.2f}, test {accuracy[1]:.2f}")


if __name__ == "__main__":
    main()

"""The int8 model's attention over short sequences in fp32 (the fused kernel) against bf16 (the explicit kernel,
`bertforge.infer.transforms._bf16_attention`, on CPUs with native bf16): the model's time over a file and its
accuracy. Both run on PyTorch's operators, as int8 does where bertforge's CPU kernels are not available (here they
are switched off: bench/int8_kernels.py compares the two engines).

Both sides are `Predictor(path, INT8)` on bench/inference.py's fine-tuned MiniLM; on the fp32 side every
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

import os

import model_time

os.environ["BERTFORGE_KERNELS"] = "0"  # the int8 model on PyTorch's operators, where this attention choice applies

from bertforge import cpu
from bertforge.encoder import BertSelfAttention
from bertforge.infer import INT8_BF16_ATTENTION_MAX_T, EngineOptions, Predictor

INT8 = EngineOptions(quantize="int8")


def bf16_attention_up_to(predictor: Predictor, tokens: int) -> Predictor:
    for module in predictor.task_model.model.modules():
        if isinstance(module, BertSelfAttention):
            module.qkv.bf16_max_positions = tokens
    return predictor


def main() -> None:
    parser = model_time.parser(__doc__)
    parser.add_argument("--up-to", type=int, default=INT8_BF16_ATTENTION_MAX_T,
                        help="the bf16 side's longest sequences in bf16 (default: the model's threshold)")
    args = parser.parse_args()
    if not cpu.has_native_bf16():
        raise SystemExit("this CPU has no native bf16: the int8 model keeps its attention in fp32 here")
    model_dir = model_time.bench_model()
    sides = {"fp32 attention": bf16_attention_up_to(Predictor(model_dir, INT8), 0),
             f"bf16 attention up to {args.up_to} tokens": bf16_attention_up_to(Predictor(model_dir, INT8),
                                                                             args.up_to)}
    model_time.compare(sides, args.workload, args.repeats, width=34)


if __name__ == "__main__":
    main()

"""The int8 model on bertforge's CPU kernels (`bertforge.kernels`: attention in one pass per sequence, residual add
+ LayerNorm in one pass per row, activation ranges handed on) against the same model on PyTorch's operators alone:
the model's time over a file and its accuracy.

Every side is `Predictor(path, INT8)` on bench/inference.py's fine-tuned MiniLM:
- "operators": built with the kernels switched off, as on a machine without them (the attention of up to 64
  tokens in bf16 on a CPU with native bf16, `bertforge.infer.transforms._bf16_attention`);
- "kernels": as `bertforge predict --quantize int8` runs where the kernels are available (query/key/value fp32);
- "kernels, bf16 query/key/value": the same, the query/key/value products writing bf16 (which the attention kernel
  also reads), the variant the kernels' default was chosen against.
Time is the model's alone (no tokenizing), over the file's length-sorted batches of 64, on one thread: the sides
take turns, every batch runs --repeats times per side, and the figure is the sum over batches of each batch's
fastest run (whole-file timings on two threads move by up to 10% between runs here). Accuracy is on Rotten
Tomatoes dev and test through `predict`, as the commands run.

    .venv/bin/python bench/int8_kernels.py                      # Rotten Tomatoes test
    .venv/bin/python bench/int8_kernels.py --workload uniform   # 16-128 tokens
"""

from __future__ import annotations

import model_time

from bertforge import kernels
from bertforge.infer import EngineOptions, FusedEncoder, Int8Linear, Predictor

INT8 = EngineOptions(quantize="int8")


def operators_only(model_dir) -> Predictor:
    available = kernels.available
    kernels.available = lambda: False
    try:
        return Predictor(model_dir, INT8)
    finally:
        kernels.available = available


def bf16_qkv(predictor: Predictor) -> Predictor:
    for module in predictor.task_model.model.modules():
        if isinstance(module, FusedEncoder):
            for layer in module.layer:
                assert isinstance(layer.attention.qkv, Int8Linear)
                layer.attention.qkv.bf16_max_positions = module.max_positions
    return predictor


def main() -> None:
    parser = model_time.parser(__doc__)
    args = parser.parse_args()
    if not kernels.available():
        raise SystemExit("bertforge's CPU kernels are not available here (they need AVX-512 or AVX2 + FMA and a "
                         "C++ compiler)")
    model_dir = model_time.bench_model()
    sides = {"operators": operators_only(model_dir), "kernels": Predictor(model_dir, INT8),
             "kernels, bf16 query/key/value": bf16_qkv(Predictor(model_dir, INT8))}
    assert not isinstance(sides["operators"].task_model.model.bert.encoder, FusedEncoder)
    assert isinstance(sides["kernels"].task_model.model.bert.encoder, FusedEncoder)
    model_time.compare(sides, args.workload, args.repeats, width=30)


if __name__ == "__main__":
    main()

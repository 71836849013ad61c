"""Which attention kernel the model should use on this CPU: PyTorch's fused kernel
(`F.scaled_dot_product_attention`, flash attention for CPU) against the explicit one bertforge's model switches
to for short sequences under bf16 training (`bertforge.encoder._explicit_attention`), per shape.

Training (the default): both sides get the same q, k, v (B, N, T, D) with B x T = 4,096 tokens; times are per
call of forward + backward (the sum of the output). The model takes the explicit kernel when training under
bf16/fp16 on a CPU with at most `_EXPLICIT_ATTENTION_MAX_T` keys; this is what that threshold was read from.
With --inference: forward only, without gradients, B x T = --tokens, q, k and v the views of one (B, T, 3, N, D)
product that the model's attention makes; in bf16 inference the model takes the explicit kernel up to
`_EXPLICIT_INFERENCE_MAX_T` keys, read from `--inference --no-mask` (predict's length-sorted batches are mostly
unpadded, and an unpadded batch has no mask); fp32 keeps the fused kernel, which this measured as fast or faster
(docs/benchmarks.md). With --int8: the choice of the int8 model (`bertforge.infer._bf16_attention`), where the
attention's inputs come from an int8 product that can write fp32 or bf16: fp32's fused kernel against bf16's
explicit one, forward only, masked; the model takes bf16 up to `INT8_BF16_ATTENTION_MAX_T` keys, read from this.
With --training-kernels: fp32 training as fine-tuning runs it (dropout 0.1 on the probabilities), the model's
attention from its query/key/value product's output (B, T, 3H) to (B, T, H) and back: bertforge's kernels
(`bertforge.training_attention.TrainingAttention`, what the model takes) against the unfused path it takes without
them (head views, `attend`, heads merged); forward + backward. Median (min-max) of --rounds rounds, the sides
interleaved.

    .venv/bin/python bench/attention.py
    .venv/bin/python bench/attention.py --lengths 64 128 256 --heads 4 12 --rounds 5
    .venv/bin/python bench/attention.py --inference --no-mask --heads 12 --head-size 32   # MiniLM's heads
    .venv/bin/python bench/attention.py --int8 --heads 12 --head-size 32 --lengths 16 32 48 64 80 96 128
    .venv/bin/python bench/attention.py --training-kernels --heads 12 --head-size 32 --lengths 28 64 128 --tokens 2048
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from measure import ratio, spread

from bertforge import kernels
from bertforge.encoder import (
    _EXPLICIT_ATTENTION_MAX_T,
    _EXPLICIT_INFERENCE_MAX_T,
    _explicit_attention,
    attend,
)
from bertforge.infer import INT8_BF16_ATTENTION_MAX_T
from bertforge.train.memory import keep_freed_memory
from bertforge.training_attention import TrainingAttention


def fused(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def explicit(q, k, v, mask):
    return _explicit_attention(q, k, v, mask, 0.0)


TRAINING_DROPOUT = 0.1


def unfused(qkv: torch.Tensor, heads: int, mask: torch.Tensor | None) -> torch.Tensor:
    """The model's attention without the kernels, from the product's output: (B, T, 3H) -> (B, T, H)."""
    B, T, three_h = qkv.shape
    q, k, v = qkv.view(B, T, 3, heads, three_h // 3 // heads).permute(2, 0, 3, 1, 4).unbind(0)
    return attend(q, k, v, mask, TRAINING_DROPOUT).transpose(1, 2).reshape(B, T, three_h // 3)


def on_kernels(qkv: torch.Tensor, heads: int, mask: torch.Tensor | None) -> torch.Tensor:
    return TrainingAttention.apply(qkv, heads, None if mask is None else mask.view(qkv.shape[0], -1), TRAINING_DROPOUT)


def time_training(fn, qkv: torch.Tensor, heads: int, mask: torch.Tensor | None, grad: torch.Tensor,
                  calls: int) -> float:
    """Milliseconds per forward + backward of `fn` (unfused or on_kernels)."""
    start = time.perf_counter()
    for _ in range(calls):
        fn(qkv, heads, mask).backward(grad)
        qkv.grad = None
    return (time.perf_counter() - start) / calls * 1000


def training_kernels(args, tokens: int) -> None:
    """--training-kernels: the unfused path against the kernels, fp32, forward + backward."""
    if not kernels.available():
        raise SystemExit("bertforge's CPU kernels are not available here (they need AVX-512 or AVX2 + FMA)")
    print(f"{'T':>5}{'N':>4}  {'unfused':>22}  {'kernels':>22}  kernels faster by")
    for T in args.lengths:
        for N in args.heads:
            g = torch.Generator().manual_seed(0)
            B = max(1, tokens // T)
            qkv = torch.randn(B, T, 3 * N * args.head_size, generator=g, requires_grad=True)
            grad = torch.randn(B, T, N * args.head_size, generator=g)
            mask = None if args.no_mask else torch.ones(B, 1, 1, T, dtype=torch.bool)
            if mask is not None:
                mask[::2, ..., T - T // 4:] = False
            times = {"unfused": [], "on_kernels": []}
            for fn in (unfused, on_kernels):
                time_training(fn, qkv, N, mask, grad, 2)  # warm-up
            for _ in range(args.rounds):
                for fn in (unfused, on_kernels):
                    times[fn.__name__].append(time_training(fn, qkv, N, mask, grad, args.calls))
            print(f"{T:>5}{N:>4}  {spread(times['unfused'], '.2f'):>22}  {spread(times['on_kernels'], '.2f'):>22}  "
                  f"{ratio(times['on_kernels'], times['unfused'], False):.2f}x")


def time_calls(fn, q, k, v, mask, calls: int) -> float:
    """Milliseconds per forward + backward (forward only where q takes no gradient)."""
    start = time.perf_counter()
    for _ in range(calls):
        if q.requires_grad:
            fn(q, k, v, mask).float().sum().backward()
        else:
            with torch.inference_mode():
                fn(q, k, v, mask)
    return (time.perf_counter() - start) / calls * 1000


def inputs(T: int, N: int, D: int, tokens: int, dtype: torch.dtype, inference: bool, masked: bool = True):
    """q, k, v (B, N, T, D) and a mask with half the sequences padded by a quarter (None unless `masked`);
    B = tokens // T."""
    g = torch.Generator().manual_seed(0)
    B = max(1, tokens // T)
    if inference:  # views of one projection, laid out as BertSelfAttention makes them
        q, k, v = torch.randn(B, T, 3, N, D, generator=g, dtype=dtype).permute(2, 0, 3, 1, 4).unbind(0)
    else:
        q, k, v = (torch.randn(B, N, T, D, generator=g, dtype=dtype).requires_grad_() for _ in range(3))
    if not masked:
        return q, k, v, None
    mask = torch.ones(B, 1, 1, T, dtype=torch.bool)
    mask[::2, ..., T - T // 4:] = False
    return q, k, v, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128, 192, 256, 384])
    parser.add_argument("--heads", type=int, nargs="+", default=[4, 12])
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=10, help="timed calls per round")
    parser.add_argument("--inference", action="store_true", help="forward only, without gradients")
    parser.add_argument("--no-mask", action="store_true", help="no padding mask (an unpadded batch)")
    parser.add_argument("--int8", action="store_true", help="fused fp32 against explicit bf16, forward only: the "
                        "int8 model's choice (--dtypes does not apply)")
    parser.add_argument("--training-kernels", action="store_true", help="fp32 training with dropout: bertforge's "
                        "attention kernels against the unfused path")
    parser.add_argument("--tokens", type=int, help="B x T (default: 4,096 training, 1,792 = 64 x 28 inference)")
    args = parser.parse_args()
    args.inference = args.inference or args.int8
    kept = keep_freed_memory()  # as the bertforge commands run: without it each call maps its (B, N, T, T) scores anew
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    tokens = args.tokens or (1792 if args.inference else 4096)
    what = ("fp32 forward + backward with dropout, the model's attention on the kernels against unfused"
            if args.training_kernels else
            f"forward, fused fp32 against explicit bf16 (the int8 model's threshold: {INT8_BF16_ATTENTION_MAX_T} keys)"
            if args.int8 else
            f"forward (the model's threshold in bf16 inference: {_EXPLICIT_INFERENCE_MAX_T} keys)" if args.inference
            else f"forward + backward (the model's threshold under bf16: {_EXPLICIT_ATTENTION_MAX_T} keys)")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {what}, {tokens} tokens, allocator: "
          f"{'freed memory kept' if kept else 'the system default'}, ms per call, "
          f"median (min-max) over {args.rounds} rounds")
    if args.training_kernels:
        return training_kernels(args, tokens)
    print(f"{'dtype':<6}{'T':>5}{'N':>4}  {'fused':>22}  {'explicit':>22}  explicit faster by")
    # (label, fused side's dtype, explicit side's dtype)
    rows = [("int8", torch.float32, torch.bfloat16)] if args.int8 else [(n, dtypes[n], dtypes[n]) for n in args.dtypes]
    for name, fused_dtype, explicit_dtype in rows:
        for T in args.lengths:
            for N in args.heads:
                side = {fn: inputs(T, N, args.head_size, tokens, dtype, args.inference, not args.no_mask)
                        for fn, dtype in ((fused, fused_dtype), (explicit, explicit_dtype))}
                times = {"fused": [], "explicit": []}
                for fn in (fused, explicit):
                    time_calls(fn, *side[fn], 2)  # warm-up
                for _ in range(args.rounds):
                    for fn in (fused, explicit):
                        times[fn.__name__].append(time_calls(fn, *side[fn], args.calls))
                print(f"{name:<6}{T:>5}{N:>4}  {spread(times['fused'], '.2f'):>22}  "
                      f"{spread(times['explicit'], '.2f'):>22}  {ratio(times['explicit'], times['fused'], False):.2f}x")


if __name__ == "__main__":
    main()

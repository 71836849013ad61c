"""Which attention kernel a training step should use on this CPU: PyTorch's fused kernel
(`F.scaled_dot_product_attention`, flash attention for CPU) against the explicit one bertforge's model switches
to for short sequences under bf16 (`bertforge.model._explicit_attention`), forward and backward, per shape.

Both sides get the same q, k, v (B, N, T, D) with B x T = 4,096 tokens; times are per call of forward +
backward (the sum of the output), median (min-max) of --rounds rounds, interleaved. The model takes the
explicit kernel when training under bf16/fp16 on a CPU with at most `_EXPLICIT_ATTENTION_MAX_T` keys; this
bench is what that threshold was read from. It also prints fp32, where the fused kernel stays.

    .venv/bin/python bench/attention.py
    .venv/bin/python bench/attention.py --lengths 64 128 256 --heads 4 12 --rounds 5
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from measure import ratio, spread

from bertforge.model import _EXPLICIT_ATTENTION_MAX_T, _explicit_attention


def fused(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def explicit(q, k, v, mask):
    return _explicit_attention(q, k, v, mask, 0.0)


def time_calls(fn, q, k, v, mask, calls: int) -> float:
    """Milliseconds per forward + backward."""
    start = time.perf_counter()
    for _ in range(calls):
        fn(q, k, v, mask).float().sum().backward()
    return (time.perf_counter() - start) / calls * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128, 192, 256, 384])
    parser.add_argument("--heads", type=int, nargs="+", default=[4, 12])
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=10, help="timed calls per round")
    args = parser.parse_args()
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, forward + backward, ms per call, "
          f"median (min-max) over {args.rounds} rounds; the model's threshold: {_EXPLICIT_ATTENTION_MAX_T} keys")
    print(f"{'dtype':<6}{'T':>5}{'N':>4}  {'fused':>22}  {'explicit':>22}  explicit faster by")
    for name in args.dtypes:
        for T in args.lengths:
            for N in args.heads:
                g = torch.Generator().manual_seed(0)
                q, k, v = (torch.randn(4096 // T, N, T, args.head_size, generator=g, dtype=dtypes[name])
                           .requires_grad_() for _ in range(3))
                mask = torch.ones(4096 // T, 1, 1, T, dtype=torch.bool)
                mask[::2, ..., T - T // 4:] = False  # half the sequences padded by a quarter
                times = {"fused": [], "explicit": []}
                for fn in (fused, explicit):
                    time_calls(fn, q, k, v, mask, 2)  # warm-up
                for _ in range(args.rounds):
                    for fn in (fused, explicit):
                        times[fn.__name__].append(time_calls(fn, q, k, v, mask, args.calls))
                print(f"{name:<6}{T:>5}{N:>4}  {spread(times['fused'], '.2f'):>22}  "
                      f"{spread(times['explicit'], '.2f'):>22}  {ratio(times['explicit'], times['fused'], False):.2f}x")


if __name__ == "__main__":
    main()

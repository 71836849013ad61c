"""Which library should run the encoder's fp32 training products on this CPU: torch's default (MKL, through
`F.linear` and `@`) against oneDNN (`torch.ops.mkldnn._linear_pointwise`, the path `bertforge.linear` takes on AMD
CPUs with AVX-512), for the three products of a Linear layer's training step: forward (y = x W^T + b), the
input's gradient (dx = dy W) and the weight's (dW = dy^T x), each on the operands as the layer has them (W as
stored, no reordering; the transposes as views).

The shapes are a fine-tuning batch's: --tokens rows (default 864: 32 snippets of 27 tokens, a Rotten Tomatoes
batch) through the layers of --model (minilm: hidden 384, intermediate 1536; base: 768 and 3072), one row per
distinct layer shape (the query-key-value product, the attention's output, the feed-forward pair). Each product
runs --calls times per round, the two libraries alternating over --rounds rounds; the table shows GFLOP/s,
median (min-max) over rounds, and oneDNN's ratio to MKL, with the choice `bertforge.linear.fp32_on_onednn` makes
here.

    .venv/bin/python bench/fp32_products.py
    .venv/bin/python bench/fp32_products.py --model base --tokens 4096 --rounds 7
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from measure import ratio, spread

from bertforge import cpu
from bertforge.linear import fp32_on_onednn

MODELS = {"minilm": (384, 1536), "base": (768, 3072)}


def onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def products(tokens: int, n_in: int, n_out: int) -> dict[str, tuple]:
    """{product: (MKL call, oneDNN call, FLOPs)} for a layer n_in -> n_out over `tokens` rows."""
    x, w, b, g = torch.randn(tokens, n_in), torch.randn(n_out, n_in), torch.randn(n_out), torch.randn(tokens, n_out)
    flops = 2 * tokens * n_in * n_out
    return {"forward": (lambda: F.linear(x, w, b), lambda: onednn(x, w, b), flops),
            "input grad": (lambda: g @ w, lambda: onednn(g, w.t(), None), flops),
            "weight grad": (lambda: g.t() @ x, lambda: onednn(g.t(), x.t(), None), flops)}


def rate(fn, flops: int, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return flops * calls / (time.perf_counter() - start) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=list(MODELS), default="minilm")
    p.add_argument("--tokens", type=int, default=864)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=10)
    args = p.parse_args()
    hidden, inner = MODELS[args.model]
    print(f"{args.model}, {args.tokens} rows, torch {torch.__version__}, {torch.get_num_threads()} threads, CPU "
          f"{cpu.vendor() or 'unknown'}{' with AVX-512' if 'avx512f' in cpu.cpu_flags() else ''}; "
          f"bertforge.linear takes oneDNN here: {fp32_on_onednn()}")
    print(f"{'layer':<14} {'product':<12} {'MKL GFLOP/s':>22} {'oneDNN GFLOP/s':>22} {'oneDNN/MKL':>10}")
    for layer, (n_in, n_out) in {"qkv": (hidden, 3 * hidden), "attention out": (hidden, hidden),
                                 "intermediate": (hidden, inner), "output": (inner, hidden)}.items():
        for name, (mkl_call, onednn_call, flops) in products(args.tokens, n_in, n_out).items():
            mkl, one = [], []
            for r in range(args.rounds):
                sides = [(mkl_call, mkl), (onednn_call, one)]
                for fn, out in sides if r % 2 == 0 else sides[::-1]:
                    out.append(rate(fn, flops, args.calls))
            print(f"{layer:<14} {name:<12} {spread(mkl):>22} {spread(one):>22} {ratio(one, mkl):>9.2f}x")


if __name__ == "__main__":
    main()

"""What a fine-tuning epoch asks of the CPU's products, for bench/finetune.py's share-of-the-matmul-rate line.

Model FLOPs of a classification step on a batch of B sequences padded to T: 6 x (the encoder's products, 4H^2 + 2HI
multiply-adds a position and layer, plus attention's scores and weighted sum, 2TH) x B x T x L, plus the pooler and
the classifier on B positions: forward 2 FLOPs a multiply-add, backward twice that. The share is of the work the real
tokens need (each sequence at its own length n: n positions, attention 2nH): work on padding is not the model's, and
bertforge's layers skip most of it (`bertforge.training_attention.TrainingPacking`) where the reference computes it;
the padded batches' work is printed beside it. The embeddings, LayerNorm, softmax, GELU and the optimizer count
nothing: they are the overhead the share shows.

The matmul rate is measured, not quoted: a training Linear's three products (y = x W^T, dx = dy W, dW = dy^T x) at
the encoder's four shapes with a batch's rows, on MKL (`torch.mm`) and on oneDNN (`torch.ops.mkldnn._linear_pointwise`,
what `bertforge.linear` calls on AMD CPUs with AVX-512) into preallocated outputs, the faster library's rate: what the
step's own products can reach on this CPU, at its own shapes (the best of five rounds, as a peak is read;
bench/finetune.py reads it before and after its runs and takes the higher).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from cpu_peak import layer_shapes

from bertforge.linear import has_onednn_linear


def classifier_flops(hidden: int, intermediate: int, layers: int, labels: int, batches: list[list[int]],
                     padded: bool = False) -> float:
    """Training FLOPs (forward and backward) of `batches`, each its sequences' lengths: each sequence at its own
    length, or (`padded`) at its batch's longest, as a padded batch computes it."""
    total = 0.0
    for lengths in batches:
        for n in lengths:
            T = max(lengths) if padded else n
            total += T * layers * (4 * hidden * hidden + 2 * hidden * intermediate + 2 * T * hidden)
            total += hidden * hidden + hidden * labels
    return 6 * total


def _seconds(call, budget: float) -> float:
    call()
    reps, start = 0, time.perf_counter()
    while reps < 3 or time.perf_counter() - start < budget:
        call()
        reps += 1
    return (time.perf_counter() - start) / reps


def _products(rows: int, k: int, n: int) -> dict[str, list]:
    """A Linear (k -> n)'s three training products over `rows` rows, per library, as calls."""
    x, w, dy = torch.randn(rows, k), torch.randn(n, k), torch.randn(rows, n)
    dy_t = dy.t().contiguous()
    y, dx, dw = torch.empty(rows, n), torch.empty(rows, k), torch.empty(n, k)
    found = {"MKL": [lambda: torch.mm(x, w.t(), out=y), lambda: torch.mm(dy, w, out=dx),
                     lambda: torch.mm(dy_t, x, out=dw)]}
    if has_onednn_linear():
        def product(a, b):
            return lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")

        found["oneDNN"] = [product(x, w), product(dy, w.t()), product(dy_t, x.t())]
    return found


def product_rate(hidden: int, intermediate: int, rows: int, rounds: int = 5) -> tuple[float, str]:
    """GFLOP/s of the encoder's training products at `rows` rows on the faster library, and that library's name:
    the best of `rounds` rounds, as a peak is read (a busy machine only lowers it; the median of three read 169
    GFLOP/s at BERT-base's shapes while the step's own products ran faster)."""
    shapes = layer_shapes(hidden, intermediate)
    flops = sum(3 * 2 * rows * k * n for k, n in shapes)
    calls: dict[str, list] = {}
    for k, n in shapes:
        for library, found in _products(rows, k, n).items():
            calls.setdefault(library, []).extend(found)
    rates: dict[str, list[float]] = {library: [] for library in calls}
    for _ in range(rounds):
        for library, library_calls in calls.items():
            rates[library].append(flops / sum(_seconds(c, 0.05) for c in library_calls) / 1e9)
    best = max(rates, key=lambda library: max(rates[library]))
    return max(rates[best]), best


def _step_shapes(init: Path, batches: list[list[int]]) -> tuple[dict, int]:
    """The config of the model in `init`, and the rows of the median padded batch of `batches`."""
    config = json.loads((init / "config.json").read_text())
    return config, int(statistics.median(len(b) * max(b) for b in batches))


def step_rate(init: Path, batches: list[list[int]]) -> tuple[float, str]:
    """`product_rate` at the shapes of the model in `init` and the median padded batch of `batches`."""
    config, rows = _step_shapes(init, batches)
    return product_rate(config["hidden_size"], config["intermediate_size"], rows)


def matmul_share(init: Path, batches: list[list[int]], results: dict[str, list[dict]],
                 earlier: tuple[float, str] | None = None) -> None:
    """Prints each side's model FLOPs a second over the rate this CPU's products reach at the step's shapes
    (`step_rate`, read now and, where given, `earlier`, before the runs: the higher of the two, as a peak is read;
    a VM's speed moves between minutes, and one reading taken in a slow minute put BERT-base's step at 132%):
    `batches` an epoch's sequence lengths, batch by batch; `results` {side: [{"epoch_s": ...}, ...]}, `init` the model
    directory both sides start from."""
    config, rows = _step_shapes(init, batches)
    H, inner = config["hidden_size"], config["intermediate_size"]
    rate, library = max(product_rate(H, inner, rows), earlier or (0.0, ""))
    flops = {padded: classifier_flops(H, inner, config["num_hidden_layers"], 2, batches, padded)
             for padded in (False, True)}
    percent = {padded: {side: 100 * work / statistics.median(r["epoch_s"] for r in rs) / 1e9 / rate
                        for side, rs in results.items()} for padded, work in flops.items()}

    def shares(padded: bool) -> str:
        return ", ".join(f"{side} {value:.0f}%" for side, value in percent[padded].items())

    print(f"share of the matmul rate: {shares(False)} (an epoch's real tokens' {flops[False] / 1e12:.2f} model "
          f"TFLOP at the median s/epoch, over {rate:.0f} GFLOP/s, the training products at the step's shapes, {rows} "
          f"rows, on {library}; goal >= 75%); counting the padded batches' {flops[True] / 1e12:.2f} TFLOP: "
          f"{shares(True)}")
    if max(percent[False].values()) > 100:
        print("the matmul rate read low: a side ran its products faster than the rate measured before and after the "
              "runs (this machine's speed moved); rerun on a quieter machine before reading the shares")

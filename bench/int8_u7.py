"""bertforge's u7 int8 products (CPUs without VNNI) against its oneDNN ones: speed at an encoder's shapes, and, with
--model, what each activation scheme does to a classifier's accuracy. With --kernel vnni, the same speed comparison
for the VNNI products (8-bit weights; AVX-512 CPUs with avx512_vnni and without AMX, kernels/int8_vnni.h).

    .venv/bin/python bench/int8_u7.py                                      # MiniLM-L6's shapes, 1,920 / 256 / 32 rows
    .venv/bin/python bench/int8_u7.py --kernel vnni --hidden 128 --intermediate 512   # BERT-tiny's shapes
    .venv/bin/python bench/int8_u7.py --model .cache/bench-inference/rt-minilm-4000-lr5e-05 --data DIR

The scheme (bertforge/kernels/int8_u7.h, what `Int8Linear` runs with 7-bit weights where the kernels load):
activations quantized per row (each token its own range, holding 0) to 7 bits, weights per output channel to 7
bits, so that two `vpmaddubsw` results add in int16 before one `vpmaddwd`: 3 multiplying instructions per 64
multiply-adds, where 8-bit activations need 4; bench/cpu_peak.py's loops put the two sequences at about 195-200 and
140-153 giga multiply-adds a second on a 2-core Zen 3. The kernel: a 4 x 16 micro-tile (each row's broadcast codes
serve 16 columns; a 6 x 8 tile ran 5-15% slower), weights packed once into 16-column panels, rows quantized in one
vectorized pass, the dequantizing epilogue in vectors, tiles shared over torch's threads.

Speed: y = x W^T + b at the encoder's four Linear shapes for each --rows, giga multiply-adds a second, the median of
--rounds rounds with the two sides alternating: the u7 path against the same `Int8Linear` on oneDNN (8-bit
activations per tensor; its few-row fbgemm path off), each side's activation quantizing included. Exactness: the u7
output against its scheme computed in float64 (largest difference over the largest output; ~1e-3 where a value
falls on a rounding boundary and the kernel's float32 division puts it one code away).

Accuracy (--model, a fine-tuned classifier; --data, a directory with dev.csv and test.csv of text,label): every
Linear layer replaced by the scheme computed exactly in float64 (fake quantization: codes, then integer sums), for
8 and 7 activation bits, per tensor (a batch's range) and per row, 7-bit weights; accuracy on each split next to
fp32's and the int8 engine's.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from cpu_peak import layer_shapes, seconds_per_call  # noqa: E402
from measure import ratio, spread  # noqa: E402

from bertforge import (
    cpu,  # noqa: E402
    kernels,  # noqa: E402
)
from bertforge.infer import transforms  # noqa: E402
from bertforge.infer.engines import Predictor  # noqa: E402
from bertforge.infer.transforms import Int8Linear, vnni_products  # noqa: E402
from bertforge.options import EngineOptions  # noqa: E402
from bertforge.tasks.runner import load_task_model  # noqa: E402


def exact(x: torch.Tensor, codes: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor, bits: int,
          per_row: bool) -> torch.Tensor:
    """The scheme in float64: activation codes of `bits` bits (per row or per tensor, the range holding 0), weight
    codes as given, integer sums, dequantized."""
    x = x.double().reshape(-1, x.shape[-1])
    lo = (x.amin(1, keepdim=True) if per_row else x.min()).clamp(max=0)
    hi = (x.amax(1, keepdim=True) if per_row else x.max()).clamp(min=0)
    top = 2 ** bits - 1
    scale = ((hi - lo) / top).clamp(min=1e-12)
    zero = (-lo / scale).round()
    q = (x / scale + zero).round().clamp(0, top)
    return ((q - zero) @ codes.double().T) * scale * weight_scale.double() + bias.double()


def speed(rows_list: list[int], hidden: int, intermediate: int, rounds: int, kernel: str = "u7") -> None:
    print(f"giga multiply-adds a second, median (min-max); Int8Linear's {kernel} path against its oneDNN one")
    bits = 7 if kernel == "u7" else 8
    top = 2 ** (bits - 1) - 1
    for rows in rows_list:
        for k, n in layer_shapes(hidden, intermediate):
            torch.manual_seed(k + n)
            linear, x = nn.Linear(k, n), torch.randn(rows, k)
            candidate = Int8Linear(linear, weight_bits=bits)
            with transforms.on_onednn():
                current = Int8Linear(linear, weight_bits=bits)
            current.few_rows = current.u7 = None
            codes = (linear.weight.detach() / candidate.weight_scale[:, None]).round().clamp(-top, top)
            reference = exact(x, codes, candidate.weight_scale, linear.bias.detach(), bits, True)
            difference = float((candidate(x).double() - reference).abs().max() / reference.abs().max())
            ours, theirs = [], []
            with torch.inference_mode():
                for _ in range(rounds):  # the sides alternate
                    ours.append(rows * k * n / seconds_per_call(lambda f=candidate, x=x: f(x), 5) / 1e9)
                    theirs.append(rows * k * n / seconds_per_call(lambda f=current, x=x: f(x), 5) / 1e9)
            print(f"  {rows:5d} x {k:4d} -> {n:4d}: {kernel} {spread(ours)}  oneDNN {spread(theirs)}  "
                  f"{ratio(ours, theirs):.2f}x  exactness {difference:.1e}")


class FakeLinear(nn.Module):
    def __init__(self, linear: nn.Linear, bits: int, per_row: bool):
        super().__init__()
        w = linear.weight.detach().double()
        self.weight_scale = w.abs().amax(1).clamp(min=1e-12) / 63
        self.codes = (w / self.weight_scale[:, None]).round().clamp(-63, 63)
        self.bias = linear.bias.detach().double()
        self.bits, self.per_row = bits, per_row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = exact(x, self.codes, self.weight_scale, self.bias, self.bits, self.per_row)
        return y.float().reshape(*x.shape[:-1], -1)


def _swap(model: nn.Module, make) -> None:
    for name, child in model.named_children():
        if isinstance(child, nn.Linear):
            setattr(model, name, make(child))
        else:
            _swap(child, make)


def accuracy(model: str, data: Path) -> None:
    splits = {}
    for split in ("dev", "test"):
        with open(data / f"{split}.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        splits[split] = ([{"text": r["text"]} for r in rows], [r["label"] for r in rows])

    def score(predictor: Predictor) -> str:
        parts = []
        for split, (records, labels) in splits.items():
            got = [o["label"] for o in predictor.predict(records)]
            parts.append(f"{split} {100 * np.mean([a == b for a, b in zip(got, labels, strict=True)]):.2f}")
        return "  ".join(parts)

    print(f"accuracy (%), {model}")
    print(f"  {'fp32':34s}{score(Predictor(model))}")
    print(f"  {'int8 engine (Int8Linear)':34s}{score(Predictor(model, EngineOptions(quantize='int8')))}")
    for bits, per_row in ((8, False), (7, False), (8, True), (7, True)):
        predictor = Predictor(model)
        task_model = load_task_model(model, device="cpu")
        task_model.model.eval()
        _swap(task_model.model, lambda linear, b=bits, r=per_row: FakeLinear(linear, b, r))
        predictor.task_model = task_model
        name = f"u{bits} {'per row' if per_row else 'per tensor'} x s7 (exact)"
        print(f"  {name:34s}{score(predictor)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1920, 256, 32])
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kernel", choices=["u7", "vnni"], default="u7", help="whose products to time")
    parser.add_argument("--model", help="a fine-tuned classifier directory: also score the schemes' accuracy")
    parser.add_argument("--data", type=Path, help="a directory with dev.csv and test.csv (text,label), for --model")
    args = parser.parse_args(argv)
    if not kernels.available():
        parser.error("bertforge's CPU kernels do not load here (they need AVX2 and FMA, a C++ compiler and ninja)")
    if args.model and not args.data:
        parser.error("--model needs --data")
    print(f"CPU: {cpu.cpuinfo_field('model name')}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.kernel == "vnni" and not vnni_products():
        parser.error("the VNNI kernels run only on AVX-512 CPUs with avx512_vnni and without AMX")
    speed(args.rows, args.hidden, args.intermediate, args.rounds, args.kernel)
    if args.model:
        accuracy(args.model, args.data)


if __name__ == "__main__":
    main()

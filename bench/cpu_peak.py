"""How close the products run to what this CPU can do: its multiply-add peaks measured, and the rate of each
library's products at an encoder's shapes against them.

    .venv/bin/python bench/cpu_peak.py                              # MiniLM-L6's shapes (H 384, I 1536)
    .venv/bin/python bench/cpu_peak.py --hidden 768 --intermediate 3072 --rows 4096 32 --rounds 7

Peaks: a small C++ loop (built here with torch's extension builder, like bertforge's kernels), every one of torch's
threads running independent chains of one instruction with nothing else to wait on, so the figure is what the core's
pipes retire: fp32 FMA (`vfmadd231ps`, 8 multiply-adds an AVX2 register, 16 on AVX-512) and, for int8 without VNNI,
`vpmaddubsw` (u8 x s8, pairs summed in int16) then `vpmaddwd` with ones and `vpaddd` (what an AVX2 int8 product
runs per 32 multiply-adds; with VNNI one `vpdpbusd` does the same). The loops are AVX2's: on a CPU with AVX-512 or
VNNI the libraries run wider instructions than these peaks count, so the shares printed there would pass 100%; the
bench says so and is meant for AVX2-only CPUs (issue 67's AVX2 goals).

Products: y = x W^T + b at the encoder's four Linear shapes (query/key/value H -> 3H, attention output H -> H,
feed-forward H -> I and I -> H) for each --rows (a batch's tokens: 1,920 is 64 snippets of 30; 32 one text), the
rate summed over the four, in multiply-adds a second: fp32 on MKL (`F.linear`, what torch and `transformers` run)
and on oneDNN with the weight packed once (`bertforge.infer.packed_linear.PackedLinear`, bertforge's fp32 inference),
and int8 (`Int8Linear`, bertforge's int8 inference: oneDNN, or fbgemm for few rows on CPUs without VNNI; its fp32
input's quantizing included). A product's figure is the median of --rounds rounds (min-max beside it), the sides
alternating within a round; a peak's is its best round (a busy machine only lowers it), and each share is of that.
Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from measure import spread  # noqa: E402

from bertforge import cpu  # noqa: E402
from bertforge.files import cache_dir  # noqa: E402
from bertforge.infer.packed_linear import PackedLinear  # noqa: E402
from bertforge.infer.transforms import Int8Linear, on_onednn  # noqa: E402

PEAK_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <cstdint>

namespace {
double seconds() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Each thread runs `iterations` of `body`; multiply-adds a second over all threads.
template <class Body> double rate(int64_t iterations, double per_iteration, Body body) {
  int threads = 1;
  const double start = seconds();
#pragma omp parallel
  {
#pragma omp single
    threads = omp_get_num_threads();
    body(iterations);
  }
  return per_iteration * iterations * threads / (seconds() - start);
}

// 10 independent FMA chains of 8 floats: more than the pipes' latency x width, so the pipes are the limit.
__attribute__((noinline)) float fma_chains(int64_t n) {
  __m256 acc[10];
  __m256 x = _mm256_set1_ps(1.0001f), y = _mm256_set1_ps(0.9999f);
  for (int i = 0; i < 10; ++i) acc[i] = _mm256_set1_ps(float(i));
  for (int64_t k = 0; k < n; ++k) {
#pragma GCC unroll 10
    for (int i = 0; i < 10; ++i) acc[i] = _mm256_fmadd_ps(x, y, acc[i]);
    __asm__ volatile("" : "+x"(x));
  }
  __m256 s = acc[0];
  for (int i = 1; i < 10; ++i) s = _mm256_add_ps(s, acc[i]);
  return _mm256_cvtss_f32(s);
}

// 8 independent chains of u8 x s8 (32 multiply-adds each): vpmaddubsw, vpmaddwd by ones, vpaddd. The asm keeps the
// compiler from computing one chain's product once for all eight.
__attribute__((noinline)) int u8_chains(int64_t n) {
  __m256i acc[8];
  __m256i x = _mm256_set1_epi8(3), y = _mm256_set1_epi8(5);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_set1_epi32(i);
  for (int64_t k = 0; k < n; ++k) {
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), ones));
      __asm__ volatile("" : "+x"(y));
    }
  }
  __m256i s = acc[0];
  for (int i = 1; i < 8; ++i) s = _mm256_add_epi32(s, acc[i]);
  return _mm256_extract_epi32(s, 0);
}
}  // namespace

double fma_peak(int64_t n) { return rate(n, 80, [](int64_t m) { volatile float r = fma_chains(m); (void)r; }); }
double u8_peak(int64_t n) { return rate(n, 256, [](int64_t m) { volatile int r = u8_chains(m); (void)r; }); }
"""


def build_peaks():
    """The peak loops, built once into bertforge's cache (AVX2 + FMA: every CPU the AVX2 kernels run on has them)."""
    from torch.utils.cpp_extension import load_inline

    where = cache_dir() / "bench-cpu-peak"
    where.mkdir(parents=True, exist_ok=True)
    return load_inline("bertforge_cpu_peak", cpp_sources=PEAK_SOURCE, functions=["fma_peak", "u8_peak"],
                       extra_cflags=["-O2", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"],
                       build_directory=str(where), verbose=False)


def peaks(module, rounds: int) -> dict[str, list[float]]:
    """Giga multiply-adds a second on torch's threads, one figure a round for each instruction."""
    import os

    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    found: dict[str, list[float]] = {"fp32 FMA": [], "u8 x s8 (vpmaddubsw)": []}
    for _ in range(rounds):
        found["fp32 FMA"].append(module.fma_peak(20_000_000) / 1e9)
        found["u8 x s8 (vpmaddubsw)"].append(module.u8_peak(10_000_000) / 1e9)
    return found


def layer_shapes(hidden: int, intermediate: int) -> list[tuple[int, int]]:
    """(in, out) of an encoder layer's four Linear layers."""
    return [(hidden, 3 * hidden), (hidden, hidden), (hidden, intermediate), (intermediate, hidden)]


def seconds_per_call(call, repeats: int) -> float:
    call()
    call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats


def _plain(linear: nn.Linear):
    return lambda x: nn.functional.linear(x, linear.weight, linear.bias)


def product_rates(shapes: list[tuple[int, int]], rows: int, rounds: int) -> dict[str, list[float]]:
    """Giga multiply-adds a second over the four shapes, per library, one figure a round."""
    torch.manual_seed(0)
    linears = [nn.Linear(k, n) for k, n in shapes]
    inputs = [torch.randn(rows, k) for k, _ in shapes]
    with on_onednn():  # oneDNN's product at every size (PackedLinear takes few rows to bertforge's kernel)
        packed = [PackedLinear(lin, torch.float32) for lin in linears]
    sides = {
        "fp32 MKL (F.linear)": [_plain(lin) for lin in linears],
        "fp32 oneDNN packed": packed,
        "int8 (Int8Linear)": [Int8Linear(lin, cpu.int8_weight_bits() or 8) for lin in linears],
    }
    macs = sum(rows * k * n for k, n in shapes) / 1e9
    repeats = max(3, int(2e9 / max(1.0, macs * 1e9)))
    found: dict[str, list[float]] = {name: [] for name in sides}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, layers in sides.items():
                total = sum(seconds_per_call(lambda f=f, x=x: f(x), repeats) for f, x in zip(layers, inputs,
                                                                                            strict=True))
                found[name].append(macs / total)
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--rows", type=int, nargs="+", default=[1920, 32], help="tokens a product's input holds")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if not {"avx2", "fma"} <= cpu.cpu_flags():
        parser.error("the peak loops need AVX2 and FMA")
    from bertforge.train.memory import keep_freed_memory

    keep_freed_memory()  # as the bertforge commands run
    if {"avx512f", "avx512_vnni", "avx_vnni"} & cpu.cpu_flags():
        print("note: this CPU has AVX-512 or VNNI, which the libraries use and these AVX2 peaks do not count")
    print(f"CPU: {cpu.cpuinfo_field('model name')}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"int8 weights of {cpu.int8_weight_bits()} bits")
    top = peaks(build_peaks(), args.rounds)
    print("\npeak, giga multiply-adds a second: the best round (min-max)")
    for name, values in top.items():
        print(f"  {name:28s}{max(values):7.1f} ({min(values):.1f}-{max(values):.1f})")
    shapes = layer_shapes(args.hidden, args.intermediate)
    for rows in args.rows:
        print(f"\nproducts of a layer's four Linear shapes (H {args.hidden}, I {args.intermediate}) on {rows} rows")
        for name, values in product_rates(shapes, rows, args.rounds).items():
            peak = max(top["u8 x s8 (vpmaddubsw)" if name.startswith("int8") else "fp32 FMA"])
            print(f"  {name:28s}{spread(values)}  {100 * statistics.median(values) / peak:5.1f}% of its peak")


if __name__ == "__main__":
    main()

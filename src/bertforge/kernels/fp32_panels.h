// Few-row fp32 products (bertforge/kernels/cpu_kernels.cpp registers f32_pack and f32_linear; both builds carry them,
// `packed_linear.PackedLinear` sends them any layer's products of a few rows): y = x W^T + b, the exact GELU applied as
// a tile is written where asked, over a weight packed once into panels of 16 columns. The AVX2 build's tiles are up to
// 6 rows x 16 columns in 12 accumulators (one 256-bit FMA a cycle on a Zen 1 core: 12 a k-step, against 2 panel loads
// and 6 broadcasts), a short last tile computing only its rows; the AVX-512 build's up to 14 rows x 32 columns
// (`wide_tile`). K is taken 256 at a time so that a panel's block and a tile's rows stay in L1. On a 2-core Zen 1 EPYC,
// MiniLM-L6's four products of 27 rows (one snippet) ran 1.22-1.25x oneDNN's packed fp32 products (torch's
// `_linear_pointwise`), of 54 rows 1.10-1.12x; from 128 rows on oneDNN's were 1.05-1.12x faster. On a 2-core Xeon
// with two 512-bit FMA units the wide tiles ran MiniLM-L6's and BERT-base's products of 1-27 rows 1.1-2.8x oneDNN's,
// of 64 rows 0.92-1.12x (docs/benchmarks.md).
//
//   panels[p][k][j] = W[16 p + j, k];   y[i, n] = b[n] + sum_k x[i, k] W[n, k]   (k in order, one FMA each)
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include "vec.h"

namespace bertforge::f32 {

constexpr int64_t MR = 6, NR = 16;
// Rows of x a task reads (its block stays in a core's L2 while every panel passes): about 192 KB of it.
constexpr int64_t kBlockFloats = 48 * 1024;
// The most of K a tile's pass takes (a panel's 256 x 16 floats, 16 KB, and 6 rows of x, 6 KB, within L1).
constexpr int64_t kDepth = 256;

// W (N, K) fp32, N a multiple of NR -> panels (N / NR, K, NR)
inline at::Tensor pack(const at::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1);
  return w.reshape({N / NR, NR, K}).transpose(1, 2).contiguous();
}

// y rows (ROWS of N) at columns n0 .. n0 + NR += x rows (ROWS, K apart) times a panel's rows k0 .. k0 + kc: the
// first of a row's k-blocks starts from the bias, its last applies the GELU where asked. Stored and reloaded between
// blocks in fp32, the sums are those of one pass over K, bit for bit.
template <int ROWS>
inline void tile(const float* x, int64_t K, int64_t kc, const float* panel, const float* bias, float* y, int64_t N,
                 bool first, bool gelu) {
  __m256 c[ROWS][2];
#pragma GCC unroll 6
  for (int i = 0; i < ROWS; ++i) {
    c[i][0] = _mm256_loadu_ps(first ? bias : y + i * N);
    c[i][1] = _mm256_loadu_ps(first ? bias + 8 : y + i * N + 8);
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * NR), w1 = _mm256_loadu_ps(panel + k * NR + 8);
#pragma GCC unroll 6
    for (int i = 0; i < ROWS; ++i) {
      const __m256 a = _mm256_broadcast_ss(x + i * K + k);
      c[i][0] = _mm256_fmadd_ps(a, w0, c[i][0]);
      c[i][1] = _mm256_fmadd_ps(a, w1, c[i][1]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < ROWS; ++i) {
    _mm256_storeu_ps(y + i * N, c[i][0]);
    _mm256_storeu_ps(y + i * N + 8, c[i][1]);
  }
  if (gelu)
    for (int i = 0; i < ROWS; ++i) gelu_in_place(y + i * N, NR);
}

// The k-blocks' depth: K in the fewest blocks of at most kDepth, of even sizes. Both builds' tiles take the same
// blocks, so each output is stored and reloaded at the same points of its sum: the same bits.
inline int64_t k_depth(int64_t K) {
  const int64_t blocks = (K + kDepth - 1) / kDepth;
  return (K + blocks - 1) / std::max<int64_t>(blocks, 1);
}

// rows [r0, r1) of x times panel p (its K rows from `panel`) into y, a k-block at a time: a block of the panel
// (kc x 16 floats) and a tile's rows of x stay in the core's 32 KB L1 while the block's tiles pass
inline void block(const float* x, int64_t K, const float* panel, const float* bias, float* y, int64_t N, int64_t r0,
                  int64_t r1, bool gelu) {
  const int64_t depth = k_depth(K);
  for (int64_t k0 = 0; k0 < K; k0 += depth) {
    const int64_t kc = std::min(depth, K - k0);
    const bool first = k0 == 0, act = gelu && k0 + kc == K;
    for (int64_t r = r0; r < r1; r += MR) {
      const float* a = x + r * K + k0;
      const float* w = panel + k0 * NR;
      float* out = y + r * N;
      switch (std::min(MR, r1 - r)) {
        case 6: tile<6>(a, K, kc, w, bias, out, N, first, act); break;
        case 5: tile<5>(a, K, kc, w, bias, out, N, first, act); break;
        case 4: tile<4>(a, K, kc, w, bias, out, N, first, act); break;
        case 3: tile<3>(a, K, kc, w, bias, out, N, first, act); break;
        case 2: tile<2>(a, K, kc, w, bias, out, N, first, act); break;
        default: tile<1>(a, K, kc, w, bias, out, N, first, act);
      }
    }
  }
}

#ifdef __AVX512F__
// The AVX-512 build's tiles: up to kWideRows rows x two panels (32 columns) in 2 x 14 zmm accumulators, a k-step's
// two panel loads and up to 14 broadcasts feeding up to 28 FMAs (a Xeon core issues two 512-bit FMAs a cycle). Each
// output is the same sum as `tile`'s (from the bias, k in order, one FMA each), so the same bits.
constexpr int kWideRows = 14;

template <int ROWS, int PANELS>
inline void wide_tile(const float* x, int64_t K, int64_t kc, const float* panel, const float* bias, float* y,
                      int64_t N, bool first, bool gelu) {
  __m512 c[ROWS][PANELS];
#pragma GCC unroll 14
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < PANELS; ++j) c[i][j] = _mm512_loadu_ps(first ? bias + j * NR : y + i * N + j * NR);
  for (int64_t k = 0; k < kc; ++k) {
    __m512 w[PANELS];
    for (int j = 0; j < PANELS; ++j) w[j] = _mm512_loadu_ps(panel + j * K * NR + k * NR);
#pragma GCC unroll 14
    for (int i = 0; i < ROWS; ++i) {
      const __m512 a = _mm512_set1_ps(x[i * K + k]);
      for (int j = 0; j < PANELS; ++j) c[i][j] = _mm512_fmadd_ps(a, w[j], c[i][j]);
    }
  }
#pragma GCC unroll 14
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < PANELS; ++j) _mm512_storeu_ps(y + i * N + j * NR, c[i][j]);
  if (gelu)
    for (int i = 0; i < ROWS; ++i) gelu_in_place(y + i * N, PANELS * NR);
}

using WideTile = void (*)(const float*, int64_t, int64_t, const float*, const float*, float*, int64_t, bool, bool);

template <int PANELS, int... R>
constexpr std::array<WideTile, sizeof...(R)> wide_tiles(std::integer_sequence<int, R...>) {
  return {&wide_tile<R + 1, PANELS>...};
}

// `block` for one or two panels (`count`) in the wide tiles, the rows in tiles of even sizes (27: 14, 13)
inline void wide_block(const float* x, int64_t K, const float* panel, int64_t count, const float* bias, float* y,
                       int64_t N, int64_t r0, int64_t r1, bool gelu) {
  static constexpr auto one = wide_tiles<1>(std::make_integer_sequence<int, kWideRows>{});
  static constexpr auto two = wide_tiles<2>(std::make_integer_sequence<int, kWideRows>{});
  const auto& tiles = count == 2 ? two : one;
  const int64_t tiles_down = (r1 - r0 + kWideRows - 1) / kWideRows;
  const int64_t rows = (r1 - r0 + tiles_down - 1) / std::max<int64_t>(tiles_down, 1);
  const int64_t depth = k_depth(K);
  for (int64_t k0 = 0; k0 < K; k0 += depth) {
    const int64_t kc = std::min(depth, K - k0);
    const bool first = k0 == 0, act = gelu && k0 + kc == K;
    for (int64_t r = r0; r < r1; r += rows)
      tiles[std::min(rows, r1 - r) - 1](x + r * K + k0, K, kc, panel + k0 * NR, bias, y + r * N, N, first, act);
  }
}
constexpr int64_t kPanelsATask = 2;
// The fewest rows of a row block: a few texts' rows in one block, whatever K, so that each weight is read once (a
// 768 x 3072 weight's 27 rows in three blocks ran 0.63x oneDNN's packed product on a 2-core Xeon; in one, 1.08x)
constexpr int64_t kLeastBlockRows = 64;
#else
constexpr int64_t kPanelsATask = 1;
constexpr int64_t kLeastBlockRows = MR;
#endif

// rows [r0, r1) of x times panels p0 .. p1 of `panels` (each K x NR) into y's columns NR p0 .. NR p1: the AVX-512
// build's wide tiles two panels at a time, else `block` a panel at a time (the same bits either way)
inline void panel_range(const float* x, int64_t K, const float* panels, const float* bias, float* y, int64_t N,
                        int64_t r0, int64_t r1, int64_t p0, int64_t p1, bool gelu) {
  for (int64_t p = p0; p < p1; p += kPanelsATask) {
#ifdef __AVX512F__
    wide_block(x, K, panels + p * K * NR, std::min<int64_t>(2, p1 - p), bias + p * NR, y + p * NR, N, r0, r1, gelu);
#else
    block(x, K, panels + p * K * NR, bias + p * NR, y + p * NR, N, r0, r1, gelu);
#endif
  }
}

// x (M, K) contiguous fp32 times the panels' N columns plus bias (N): (M, N). Tasks are (row block, kPanelsATask
// panels) pairs, row blocks outermost, shared out over torch's threads: one text's few rows split by panels, a batch
// by blocks.
inline at::Tensor linear(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& bias, bool gelu) {
  const int64_t K = x.size(-1), M = x.numel() / K, P = panels.size(0), N = P * NR;
  // the fewest row blocks within the budget, of even sizes (so that two blocks give two threads even work)
  const int64_t most = std::max(kLeastBlockRows, kBlockFloats / std::max<int64_t>(K, 1) / MR * MR);
  const int64_t blocks = (M + most - 1) / most;
  const int64_t mc = ((M + blocks - 1) / std::max<int64_t>(blocks, 1) + MR - 1) / MR * MR;
  const int64_t groups = (P + kPanelsATask - 1) / kPanelsATask;
  at::Tensor y = at::empty({M, N}, x.options());
  const float *xs = x.data_ptr<float>(), *ws = panels.data_ptr<float>(), *bs = bias.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  at::parallel_for(0, blocks * groups, task_grain(mc, K, kPanelsATask * NR), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / groups, p = t % groups * kPanelsATask;
      panel_range(xs, K, ws, bs, ys, N, b * mc, std::min(M, (b + 1) * mc), p, std::min(P, p + kPanelsATask), gelu);
    }
  });
  return y;
}

}  // namespace bertforge::f32

// int8 products for AVX2 CPUs without VNNI (bertforge/kernels/cpu_kernels.cpp registers them as u7_pack and
// u7_linear; both builds carry them, AVX-512 CPUs run them only when asked). Activations are quantized per row (a
// token's own range, holding 0) to 7 bits (codes 0-127) and weights per output channel to 7 bits (+-63), so four
// u7 x s7 products sum within int16 (4 x 127 x 63 = 32,004): two vpmaddubsw are added in int16 before one vpmaddwd
// widens them, 3 multiplying instructions per 64 multiply-adds where 8-bit activations need 4. On a 2-core Zen 3 the
// two sequences peak at about 195-200 and 140-153 giga multiply-adds a second (bench/cpu_peak.py); this kernel ran
// 1.13-1.24x oneDNN's u8 product at 1,920 rows and 2.6-6.4x at 32 (bench/int8_u7.py). Per row, 7 bits kept three
// fine-tuned classifiers within 0.45 points of fp32 where 7 bits per tensor lost up to 2.25.
//
//   y[i, n] = (sum_k q[i, k] w[n, k] - zero[i] * colsum[n]) * scale[i] * wscale[n] + bias[n]
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "int8_args.h"
#include "vec.h"

namespace bertforge::u7 {  // bertforge's Vec, Range and kLanes (vec.h) are in scope

constexpr int64_t MR = 4, NR = 16, MC = 96;

// Weight codes (N, K) int8 within +-63 -> panels of NR columns: [panel][k/8][2 halves of 4 k][NR cols][4 bytes];
// K padded to 8 with zeros. Also column sums of the codes (for the activations' zero points).
inline std::tuple<at::Tensor, at::Tensor> pack_weight(const at::Tensor& codes) {
  return pack_panels(codes, NR, 8, [](int64_t k, int64_t j) { return k / 8 * 128 + k % 8 / 4 * 64 + j * 4 + k % 4; });
}

// x (M, K) fp32 -> u7 codes (M, Kp) with per-row scale and zero point (range always holding 0).
inline void quantize_rows(const float* x, int64_t M, int64_t K, int64_t Kp, uint8_t* q, float* scale, int32_t* zero) {
  quantize_each_row(x, M, K, 127.f, scale, zero, [&](int64_t r, const float* row, float s, int32_t z) {
    const __m256 inv = _mm256_set1_ps(1.f / s), zf = _mm256_set1_ps(float(z)), top = _mm256_set1_ps(127.f),
                 zero8 = _mm256_setzero_ps();
    uint8_t* out = q + r * Kp;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(row + k), inv),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v = _mm256_min_ps(top, _mm256_max_ps(zero8, _mm256_add_ps(v, zf)));
      const __m256i i32 = _mm256_cvtps_epi32(v);
      const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + k), _mm_packus_epi16(i16, i16));
    }
    for (; k < K; ++k) {
      const float v = std::nearbyint(row[k] / s) + z;
      out[k] = static_cast<uint8_t>(std::min(127.f, std::max(0.f, v)));
    }
    for (k = K; k < Kp; ++k) out[k] = 0;
  });
}

inline __m256i step(__m256i acc, __m256i a0, __m256i a1, __m256i b0, __m256i b1, __m256i ones) {
  const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(a0, b0), _mm256_maddubs_epi16(a1, b1));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(t, ones));
}

// acc (ROWS x NR int32) over Kp for ROWS rows of q (rows Kp apart), panel p: only the rows asked for are computed
template <int ROWS>
inline void micro_rows(const uint8_t* q, int64_t Kp, const int8_t* panel, int32_t* out /* ROWS x NR */) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i c[ROWS][2];
  for (int i = 0; i < ROWS; ++i) c[i][0] = c[i][1] = _mm256_setzero_si256();
  for (int64_t k = 0; k < Kp; k += 8) {
    const __m256i b00 = _mm256_load_si256(reinterpret_cast<const __m256i*>(panel));       // k..k+3, cols 0-7
    const __m256i b01 = _mm256_load_si256(reinterpret_cast<const __m256i*>(panel + 32));  // k..k+3, cols 8-15
    const __m256i b10 = _mm256_load_si256(reinterpret_cast<const __m256i*>(panel + 64));  // k+4..k+7, cols 0-7
    const __m256i b11 = _mm256_load_si256(reinterpret_cast<const __m256i*>(panel + 96));
    panel += 128;
#pragma GCC unroll 4
    for (int i = 0; i < ROWS; ++i) {
      const uint8_t* row = q + i * Kp + k;
      const __m256i a0 = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(row));
      const __m256i a1 = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(row + 4));
      c[i][0] = step(c[i][0], a0, a1, b00, b10, ones);
      c[i][1] = step(c[i][1], a0, a1, b01, b11, ones);
    }
  }
  for (int i = 0; i < ROWS; ++i) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * NR), c[i][0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * NR + 8), c[i][1]);
  }
}

// acc (rows x NR int32, rows 1..MR) over Kp for `rows` rows of q (Kp apart), panel p. A sequence's last tile is
// often short (13 rows: 4 + 4 + 4 + 1): its missing rows are not computed (a 4-row tile for them cost the AVX2 EPYC
// of Zen 1 up to a fifth of such a product).
inline void micro(const uint8_t* q, int64_t Kp, const int8_t* panel, int64_t rows, int32_t* out /* MR x NR */) {
  switch (rows) {
    case 4: return micro_rows<4>(q, Kp, panel, out);
    case 3: return micro_rows<3>(q, Kp, panel, out);
    case 2: return micro_rows<2>(q, Kp, panel, out);
    default: return micro_rows<1>(q, Kp, panel, out);
  }
}

// rows r .. r + rows of one micro tile's sums (rows x NR) for columns n0 .. n0 + NR, written through `o`
inline void write_tile(const int32_t* tile, int64_t rows, int64_t r, int64_t n0, const Epilogue& o) {
  const int64_t N = o.N;
  if (n0 + NR <= N) {
    for (int64_t h = 0; h < NR; h += 8) {
      const __m256 colsum = _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o.sums + n0 + h)));
      const __m256 wsv = _mm256_loadu_ps(o.wscale + n0 + h), bv = _mm256_loadu_ps(o.bias + n0 + h);
      for (int64_t i = 0; i < rows; ++i) {
        const __m256 acc = _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(tile + i * NR + h)));
        const __m256 centred = _mm256_fnmadd_ps(_mm256_set1_ps(float(o.xzero[r + i])), colsum, acc);
        _mm256_storeu_ps(o.y + (r + i) * N + n0 + h,
                         _mm256_fmadd_ps(centred, _mm256_mul_ps(_mm256_set1_ps(o.xscale[r + i]), wsv), bv));
      }
    }
  } else {
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < NR && n0 + j < N; ++j) {
        const int64_t n = n0 + j;
        o.y[(r + i) * N + n] =
            (tile[i * NR + j] - o.xzero[r + i] * o.sums[n]) * o.xscale[r + i] * o.wscale[n] + o.bias[n];
      }
  }
  if (o.gelu)
    for (int64_t i = 0; i < rows; ++i) gelu_in_place(o.y + (r + i) * N + n0, std::min(NR, N - n0));
}

// rows [r0, r1) of the codes q (rows of Kp) times one panel (columns n0 ..), written through `o`
inline void block(const uint8_t* q, int64_t Kp, const int8_t* panel, int64_t r0, int64_t r1, int64_t n0,
                  const Epilogue& o) {
  alignas(32) int32_t tile[MR * NR];
  for (int64_t r = r0; r < r1; r += MR) {
    const int64_t rows = std::min(MR, r1 - r);
    micro(q + r * Kp, Kp, panel, rows, tile);
    write_tile(tile, rows, r, n0, o);
  }
}

inline at::Tensor linear(const at::Tensor& x /* contiguous */, const at::Tensor& packed, const at::Tensor& sums,
                         const at::Tensor& wscale, const at::Tensor& bias, int64_t N, bool gelu) {
  const int64_t K = x.size(-1), M = x.numel() / K, Kp = (K + 7) / 8 * 8, panels = (N + NR - 1) / NR;
  // every code is written by quantize_rows (the padding too), so the buffer starts uninitialized
  const at::Tensor codes = at::empty({M * Kp}, at::kByte);
  uint8_t* q = codes.data_ptr<uint8_t>();
  std::vector<float> xs(M);
  std::vector<int32_t> xz(M);
  quantize_rows(x.data_ptr<float>(), M, K, Kp, q, xs.data(), xz.data());
  at::Tensor y = at::empty({M, N}, x.options());
  const Epilogue o{sums.data_ptr<int32_t>(), wscale.data_ptr<float>(), bias.data_ptr<float>(), xs.data(), xz.data(),
              y.data_ptr<float>(), N, gelu};
  const int8_t* wp = packed.data_ptr<int8_t>();
  const int64_t mblocks = (M + MC - 1) / MC;
  at::parallel_for(0, mblocks * panels, task_grain(std::min(M, MC), Kp, NR), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t mb = t / panels, p = t % panels;
      block(q, Kp, wp + p * Kp * NR, mb * MC, std::min(M, (mb + 1) * MC), p * NR, o);
    }
  });
  return y;
}

}  // namespace bertforge::u7

// int8 products for AVX-512 CPUs with VNNI, vpdpbusd (with AMX the small ones; kernels/cpu_kernels.cpp registers
// them as vnni_pack and vnni_linear; only the AVX-512 build of a CPU with avx512_vnni carries them). Activations are
// quantized per row (a token's own range, holding 0) to 8 bits (codes 0-255), weights per output channel to 8 bits
// (+-127); vpdpbusd sums four u8 x s8 products into each int32 lane. On torch's own path (oneDNN's
// qlinear_pointwise, a batch's one range) each product came with work around it: the batch's range read back to
// Python, a pass for the codes, rows padded to a rounded count. In the demo's BERT-tiny that path took 66% of the
// time at about 130 giga multiply-adds a second. Here the activations are quantized in one pass over the rows, the
// product is an 8 x 32 register tile over weights packed once, and the epilogue (the zero points' share, both scales,
// the bias and, when asked, the exact GELU) is applied as the tile is written: the same speed as oneDNN's product
// at full batches, the work around it gone (docs/benchmarks.md).
//
//   y[i, n] = act((sum_k q[i, k] w[n, k] - zero[i] * colsum[n]) * scale[i] * wscale[n] + bias[n])
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "int8_args.h"
#include "vec.h"

namespace bertforge::vnni {

// whether this build carries the kernels (has_vnni)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define BERTFORGE_VNNI 1
#else
#define BERTFORGE_VNNI 0
#endif
constexpr bool kBuilt = BERTFORGE_VNNI;

constexpr int64_t MR = 8, NR = 32, MC = 128;

// Weight codes (N, K) int8 -> panels of NR columns: [panel][k/4][NR cols][4 bytes], K padded to 4 with zeros; and
// the codes' column sums (for the activations' zero points), padded to whole panels.
inline std::tuple<at::Tensor, at::Tensor> pack_weight(const at::Tensor& codes) {
  return pack_panels(codes, NR, 4, [](int64_t k, int64_t j) { return k / 4 * NR * 4 + j * 4 + k % 4; });
}

#if BERTFORGE_VNNI

// x (M, K) fp32 -> u8 codes (M, Kp) with a scale and zero point per row (its range, always holding 0); the codes
// round half to even, as torch.round does.
inline void quantize_rows(const float* x, int64_t M, int64_t K, int64_t Kp, uint8_t* q, float* scale, int32_t* zero) {
  quantize_each_row(x, M, K, 255.f, scale, zero, [&](int64_t r, const float* row, float s, int32_t z) {
    const U8Codes codes(1.f / s, z);
    uint8_t* out = q + r * Kp;
    int64_t k = 0;
    for (; k + kLanes <= K; k += kLanes) codes.store(out + k, Vec::load(row + k));
    if (k < K) codes.store_first(out + k, Vec::load_first(row + k, K - k, 0.f), K - k);
    for (k = K; k < Kp; ++k) out[k] = 0;
  });
}

// Up to 16 output columns from n: what the epilogue needs of them, and each row's sums written through it.
struct Columns {
  int64_t n;
  __mmask16 m;
  __m512 colsum, ws, bv;
  Columns(const Epilogue& e, int64_t n)
      : n(n), m(e.N - n >= 16 ? __mmask16(0xFFFF) : Vec::first(e.N - n)),
        colsum(_mm512_cvtepi32_ps(_mm512_loadu_si512(e.sums + n))), ws(_mm512_maskz_loadu_ps(m, e.wscale + n)),
        bv(_mm512_maskz_loadu_ps(m, e.bias + n)) {}

  // row's int32 sums of code products (16 columns) -> its outputs
  void write(const Epilogue& e, int64_t row, __m512i sums) const {
    const __m512 centred = _mm512_fnmadd_ps(_mm512_set1_ps(float(e.xzero[row])), colsum, _mm512_cvtepi32_ps(sums));
    __m512 v = _mm512_fmadd_ps(centred, _mm512_mul_ps(_mm512_set1_ps(e.xscale[row]), ws), bv);
    if (e.gelu) v = gelu_erf(Vec{v}).v;  // vec.h
    _mm512_mask_storeu_ps(e.y + row * e.N + n, m, v);
  }
};

// R rows of q (from row r) times one panel (columns n0..n0+NR), written through the epilogue.
template <int R>
inline void tile(const uint8_t* q, int64_t Kp, const int8_t* panel, int64_t r, int64_t n0, const Epilogue& e) {
  __m512i c[R][2];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) c[i][0] = c[i][1] = _mm512_setzero_si512();
  for (int64_t k = 0; k < Kp; k += 4) {
    const __m512i b0 = _mm512_loadu_si512(panel), b1 = _mm512_loadu_si512(panel + 64);
    panel += 128;
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      int32_t four;
      std::memcpy(&four, q + i * Kp + k, 4);
      const __m512i a = _mm512_set1_epi32(four);
      c[i][0] = _mm512_dpbusd_epi32(c[i][0], a, b0);
      c[i][1] = _mm512_dpbusd_epi32(c[i][1], a, b1);
    }
  }
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    const int64_t n = n0 + 16 * h;
    if (n >= e.N) break;
    const Columns cols(e, n);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) cols.write(e, r + i, c[i][h]);
  }
}

inline void rows_tile(int64_t rows, const uint8_t* q, int64_t Kp, const int8_t* panel, int64_t r, int64_t n0,
                      const Epilogue& e) {
  switch (rows) {
    case 8: return tile<8>(q, Kp, panel, r, n0, e);
    case 7: return tile<7>(q, Kp, panel, r, n0, e);
    case 6: return tile<6>(q, Kp, panel, r, n0, e);
    case 5: return tile<5>(q, Kp, panel, r, n0, e);
    case 4: return tile<4>(q, Kp, panel, r, n0, e);
    case 3: return tile<3>(q, Kp, panel, r, n0, e);
    case 2: return tile<2>(q, Kp, panel, r, n0, e);
    default: return tile<1>(q, Kp, panel, r, n0, e);
  }
}

inline at::Tensor linear(const at::Tensor& x /* contiguous fp32 */, const at::Tensor& packed, const at::Tensor& sums,
                         const at::Tensor& wscale, const at::Tensor& bias, int64_t N, bool gelu) {
  const int64_t K = x.size(-1), M = x.numel() / K, Kp = (K + 3) / 4 * 4, panels = (N + NR - 1) / NR;
  const at::Tensor codes = at::empty({M * Kp}, at::kByte);  // every code written by quantize_rows, padding too
  uint8_t* q = codes.data_ptr<uint8_t>();
  std::vector<float> xs(M);
  std::vector<int32_t> xz(M);
  quantize_rows(x.data_ptr<float>(), M, K, Kp, q, xs.data(), xz.data());
  at::Tensor y = at::empty({M, N}, x.options());
  const Epilogue e{sums.data_ptr<int32_t>(), wscale.data_ptr<float>(), bias.data_ptr<float>(), xs.data(), xz.data(),
                   y.data_ptr<float>(), N, gelu};
  const int8_t* wp = packed.data_ptr<int8_t>();
  const int64_t mblocks = (M + MC - 1) / MC;
  at::parallel_for(0, mblocks * panels, task_grain(std::min(M, MC), Kp, NR), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t mb = t / panels, p = t % panels;
      for (int64_t r = mb * MC; r < std::min(M, (mb + 1) * MC); r += MR)
        rows_tile(std::min(MR, M - r), q + r * Kp, Kp, wp + p * Kp * NR, r, p * NR, e);
    }
  });
  return y;
}

#else

inline at::Tensor linear(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         int64_t, bool) {
  TORCH_CHECK(false, "vnni_linear: this build of bertforge's kernels has no AVX-512 VNNI (the CPU lacks avx512_vnni)");
}

#endif

// The operators (cpu_kernels.cpp registers them): a weight's 8-bit codes (N, K) int8 packed, (panels, their column
// sums); x (..., K) fp32 times the packed weight's N columns, the exact GELU applied where `gelu`.
inline std::tuple<at::Tensor, at::Tensor> checked_pack(const at::Tensor& codes) {
  check_int8_codes(codes);
  return pack_weight(codes.contiguous());
}

inline at::Tensor checked_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& column_sums,
                                 const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias,
                                 int64_t out_features, bool gelu) {
  const Int8Operands o =
      check_int8_operands("vnni_pack", x, packed, column_sums, weight_scale, bias, out_features, NR, 4);
  return linear(x.contiguous(), packed, column_sums, weight_scale.contiguous(), o.bias, out_features, gelu)
      .view(o.shape);
}

// Whether this build carries the kernels (the AVX-512 build, compiled on a CPU with avx512_vnni).
inline bool has_vnni() { return kBuilt; }

}  // namespace bertforge::vnni

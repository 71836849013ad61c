// What both per-row int8 products (u7_linear, int8_u7.h; vnni_linear, int8_vnni.h) share: packing a weight's codes
// into panels, a row's scale and zero point, and the checks they make of their operands.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "vec.h"

namespace bertforge {

// A weight's codes as the pack operators take them: an (out, in) int8 matrix.
inline void check_int8_codes(const at::Tensor& codes) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.size(1) > 0,
              "codes must be a (out, in) int8 matrix");
}

// Weight codes (N, K) int8 -> panels of `columns` output columns, each K rounded up to `k_multiple` (zeros) times
// `columns` bytes, code k of the panel's column j at `offset(k, j)`; and the codes' column sums (for the
// activations' zero points), padded to whole panels.
template <typename Offset>
inline std::tuple<at::Tensor, at::Tensor> pack_panels(const at::Tensor& codes, int64_t columns, int64_t k_multiple,
                                                      Offset offset) {
  const int64_t N = codes.size(0), K = codes.size(1), Kp = (K + k_multiple - 1) / k_multiple * k_multiple;
  const int64_t panels = (N + columns - 1) / columns;
  at::Tensor out = at::zeros({panels * Kp * columns}, at::kChar);
  at::Tensor sums = at::zeros({panels * columns}, at::kInt);
  const int8_t* w = codes.data_ptr<int8_t>();
  int8_t* o = out.data_ptr<int8_t>();
  int32_t* s = sums.data_ptr<int32_t>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      o[(n / columns) * Kp * columns + offset(k, n % columns)] = w[n * K + k];
      s[n] += w[n * K + k];
    }
  return {out, sums};
}

// A row's scale and zero point for codes 0..top: its range, always holding 0, in `top` steps.
inline void row_scale(const float* row, int64_t K, float top, float* scale, int32_t* zero) {
  Range range;
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) range.add(Vec::load(row + k));
  if (k < K) range.add_first(row + k, K - k);
  const float lo = std::min(range.min(), 0.f), hi = std::max(range.max(), 0.f);
  float s = (hi - lo) / top;
  if (s == 0.f) s = 1.f;
  *scale = s;
  *zero = static_cast<int32_t>(std::nearbyint(-lo / s));
}

// Each row of x (M, K) with its scale and zero point for codes 0..top (row_scale, kept in scale[r] and zero[r]),
// shared over torch's threads in chunks of at least 32K values (one text's rows stay on the calling thread): write(r,
// row, s, z) writes the row's codes.
template <typename Write>
inline void quantize_each_row(const float* x, int64_t M, int64_t K, float top, float* scale, int32_t* zero,
                              Write write) {
  at::parallel_for(0, M, std::max<int64_t>(16, (1 << 15) / std::max<int64_t>(K, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      row_scale(x + r * K, K, top, &scale[r], &zero[r]);
      write(r, x + r * K, scale[r], zero[r]);
    }
  });
}

// Where a per-row int8 product's int32 sums go (vnni and u7 alike): y[i, n] = act((sum - xzero[i] colsum[n]) xscale[i]
// wscale[n] + bias[n]), act the exact GELU where `gelu`.
struct Epilogue {
  const int32_t* sums;  // (panels x NR) column sums
  const float* wscale;  // (N)
  const float* bias;    // (N)
  const float* xscale;  // (M)
  const int32_t* xzero;  // (M)
  float* y;             // (M, N)
  int64_t N;
  bool gelu;
};

struct Int8Operands {
  at::Tensor bias;             // (N) fp32, zeros where there was none
  std::vector<int64_t> shape;  // the output's: x's with its last size N
};

// x (..., K) fp32 against weights packed by `pack` in panels of `columns` (NR) over K rounded up to `k_multiple`.
inline Int8Operands check_int8_operands(const char* pack, const at::Tensor& x, const at::Tensor& packed,
                                        const at::Tensor& column_sums, const at::Tensor& weight_scale,
                                        const std::optional<at::Tensor>& bias, int64_t N, int64_t columns,
                                        int64_t k_multiple) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) > 0, "x must be fp32 (..., in)");
  const int64_t K = x.size(-1), panels = (N + columns - 1) / columns;
  const int64_t Kp = (K + k_multiple - 1) / k_multiple * k_multiple;
  TORCH_CHECK(N > 0 && packed.scalar_type() == at::kChar && packed.numel() == panels * Kp * columns, "packed must be ",
              pack, "'s panels for a weight of x's input size");
  TORCH_CHECK(column_sums.scalar_type() == at::kInt && column_sums.numel() == panels * columns, "column sums mismatch");
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat && weight_scale.numel() == N, "weight_scale must be (out,)");
  at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::zeros({N}, at::kFloat);
  TORCH_CHECK(b.numel() == N, "bias must be (out,)");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return {b, shape};
}

}  // namespace bertforge

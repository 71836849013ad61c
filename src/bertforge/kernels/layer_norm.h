// LayerNorm of one row, with the residual add before it: the add_layer_norm and residual_layer_norm operators'
// (cpu_kernels.cpp) and the int8 encoder's layers (int8_encoder.h).
#pragma once

#include <cmath>
#include <cstdint>

#include "attention.h"
#include "vec.h"

namespace bertforge {

// Row x (H long) + residual (null: x alone) into y, the sum into s too (null: not kept); then y normalized in place:
// (y - mean) / sqrt(var + eps) * weight + bias, its values added to `range`. H is whole vectors; y holds the sum
// until it is overwritten by the normalized values.
inline void normalize_row(const float* x, const float* residual, const float* weight, const float* bias, float eps,
                          int64_t H, float* y, float* s, Range& range) {
  Vec total = Vec::zero();
  for (int64_t h = 0; h < H; h += kLanes) {
    Vec a = Vec::load(x + h);
    if (residual != nullptr) a = a + Vec::load(residual + h);
    if (s != nullptr) a.store(s + h);
    a.store(y + h);
    total = total + a;
  }
  const Vec mean = Vec::all(bertforge::reduce_add(total) / H);
  Vec sq = Vec::zero();
  for (int64_t h = 0; h < H; h += kLanes) {
    const Vec c = Vec::load(y + h) - mean;
    sq = bertforge::fma(c, c, sq);
  }
  const Vec rstd = Vec::all(1.0f / std::sqrt(bertforge::reduce_add(sq) / H + eps));
  for (int64_t h = 0; h < H; h += kLanes) {
    const Vec out = bertforge::fma((Vec::load(y + h) - mean) * rstd, Vec::load(weight + h), Vec::load(bias + h));
    out.store(y + h);
    range.add(out);
  }
}

}  // namespace bertforge

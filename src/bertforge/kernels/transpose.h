// A matrix transposed, with its column sums, in one pass: for the backward of a Linear layer whose fp32 products run
// on oneDNN (bertforge/linear.py). Its weight's gradient dW = dy^T x needs dy^T as a row-major matrix (oneDNN's
// operator takes its input only so, and made the copy itself with a strided copy: 6-7% of a MiniLM-L6 fine-tuning
// step on a 2-core Zen 4), and its bias's gradient is dy's column sums, another pass over dy.
//
// The work is cut by columns: a block of kLanes columns is read row after row, kLanes rows at a time, transposed in
// registers and written as kLanes rows of the result. A column's sum adds each block of kLanes rows, then the blocks
// in order (M / kLanes rounding steps on the running sum instead of M), the rows after the last block one by one: the
// sums depend on the ISA (kLanes), not on the threads.

#pragma once

#include <cstdint>

#include "vec.h"

namespace bertforge {

// Columns [c0, c1) of g (M, N, row-major): gt[c][r] = g[r][c] for every row r (gt is (N, M), row-major) and
// sums[c] the sum of column c over the rows. c0 is a multiple of kLanes.
inline void transpose_columns(const float* g, float* gt, float* sums, int64_t M, int64_t N, int64_t c0, int64_t c1) {
  constexpr int64_t L = Vec::kLanes;
  int64_t c = c0;
  for (; c + L <= c1; c += L) {
    Vec sum = Vec::zero();
    int64_t r = 0;
    for (; r + L <= M; r += L) {
      Vec block[L];
      for (int64_t i = 0; i < L; ++i) block[i] = Vec::load(g + (r + i) * N + c);
      Vec part = block[0];
      for (int64_t i = 1; i < L; ++i) part = part + block[i];
      sum = sum + part;
      transpose(block);
      for (int64_t i = 0; i < L; ++i) block[i].store(gt + (c + i) * M + r);
    }
    alignas(64) float lane[L];
    sum.store(lane);
    for (; r < M; ++r) {  // the rows after the last whole block
      for (int64_t i = 0; i < L; ++i) {
        const float v = g[r * N + c + i];
        gt[(c + i) * M + r] = v;
        lane[i] += v;
      }
    }
    for (int64_t i = 0; i < L; ++i) sums[c + i] = lane[i];
  }
  for (; c < c1; ++c) {  // the columns after the last whole block
    float sum = 0.0f;
    for (int64_t r = 0; r < M; ++r) {
      const float v = g[r * N + c];
      gt[c * M + r] = v;
      sum += v;
    }
    sums[c] = sum;
  }
}

}  // namespace bertforge

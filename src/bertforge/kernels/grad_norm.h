// The 2-norm of many tensors taken together, in one pass over them on every thread: gradient clipping's norm
// (bertforge/train/optim.py `clipped_step`). torch's clip_grad_norm_ takes a norm per tensor, a norm of those, and
// then multiplies every gradient by the clipping factor, another pass; on a CPU that was 6% of a MiniLM-L6
// fine-tuning step (a 47 MB word-embedding gradient among 105 tensors).
//
// The tensors are cut into blocks of kNormBlock floats (a tensor's last block shorter). A block's squares are summed
// in four vectors of fp32 lanes, the lanes added, and that sum kept in double; the blocks' sums are then added in
// order. So the result depends on the ISA (the lanes), not on the threads; each fp32 lane adds at most
// kNormBlock / (4 kLanes) squares.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace bertforge {

constexpr int64_t kNormBlock = 4096;

inline double sum_of_squares(const float* x, int64_t n) {
  constexpr int64_t L = Vec::kLanes;
  Vec acc[4] = {Vec::zero(), Vec::zero(), Vec::zero(), Vec::zero()};
  int64_t i = 0;
  for (; i + 4 * L <= n; i += 4 * L) {
    for (int k = 0; k < 4; ++k) {
      const Vec v = Vec::load(x + i + k * L);
      acc[k] = fma(v, v, acc[k]);
    }
  }
  for (; i + L <= n; i += L) {
    const Vec v = Vec::load(x + i);
    acc[0] = fma(v, v, acc[0]);
  }
  if (i < n) {
    const Vec v = Vec::load_first(x + i, n - i, 0.0f);
    acc[1] = fma(v, v, acc[1]);
  }
  return static_cast<double>(reduce_add((acc[0] + acc[1]) + (acc[2] + acc[3])));
}

// The blocks of `t` that hold any of `rows` (sorted row indices of a 2-D tensor): its other blocks are all zeros.
inline std::vector<bool> blocks_of_rows(const at::Tensor& t, const at::Tensor& rows) {
  const int64_t width = t.dim() > 0 && t.size(0) > 0 ? t.numel() / t.size(0) : 1;
  std::vector<bool> marked((t.numel() + kNormBlock - 1) / kNormBlock, false);
  const at::Tensor r = rows.to(at::kLong).contiguous();
  const int64_t* row = r.data_ptr<int64_t>();
  for (int64_t i = 0; i < r.numel(); ++i) {
    TORCH_CHECK(row[i] >= 0 && row[i] < t.size(0), "grad_norm: a row index outside its tensor");
    for (int64_t b = row[i] * width / kNormBlock; b <= ((row[i] + 1) * width - 1) / kNormBlock; ++b) marked[b] = true;
  }
  return marked;
}

// sqrt of the sum of every element's square over `tensors` (each fp32, contiguous, on the CPU). Where `rows` gives a
// tensor its rows (a gradient that is zero elsewhere, bertforge/train/rows.py), only the blocks holding them are
// read: the others' sums are +0.0, and the blocks' sums are added in the same order, so the result is the same bits.
inline double grad_norm(at::TensorList tensors, const c10::List<std::optional<at::Tensor>>& rows) {
  TORCH_CHECK(rows.size() == tensors.size(), "grad_norm: one entry of rows a tensor");
  std::vector<const float*> starts;  // one entry a block
  std::vector<int64_t> sizes;
  for (size_t k = 0; k < tensors.size(); ++k) {
    const at::Tensor& t = tensors[k];
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
                "grad_norm takes contiguous fp32 CPU tensors");
    const std::optional<at::Tensor> only = rows.get(k);
    const std::vector<bool> marked = only.has_value() ? blocks_of_rows(t, *only) : std::vector<bool>();
    const float* p = t.data_ptr<float>();
    for (int64_t i = 0; i < t.numel(); i += kNormBlock) {
      if (!marked.empty() && !marked[i / kNormBlock]) continue;
      starts.push_back(p + i);
      sizes.push_back(std::min(kNormBlock, t.numel() - i));
    }
  }
  std::vector<double> sums(starts.size());
  at::parallel_for(0, static_cast<int64_t>(starts.size()), 8, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) sums[b] = sum_of_squares(starts[b], sizes[b]);
  });
  double total = 0.0;
  for (double s : sums) total += s;
  return std::sqrt(total);
}

}  // namespace bertforge

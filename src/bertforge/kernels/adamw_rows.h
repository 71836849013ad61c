// AdamW over a word embedding's rows (bertforge/train/rows.py): a task's batches look up a few hundred of its 30,522
// rows a step, and a row never looked up since training began has a zero gradient and zero moments, so AdamW's whole
// update of it is the weight decay, p - (lr wd) p. Such rows get only that (a read and a write of the row); the rows
// ever looked up (`live`) get the whole update. Every element is computed by one formula either way (the decay is the
// first line of the update, and the rest leaves p unchanged when m, v and g are 0), so which rows are marked live
// changes no bit of the result as long as every row outside `live` has zero moments and gradient.
//
// The update is torch's AdamW (decoupled weight decay, bias-corrected moments, eps outside the square root), in fp32
// with explicit fused multiply-adds: the same bits in the AVX-512 and AVX2 builds, within rounding of torch's fused
// kernel. `grad_scale`, where given, divides every gradient as it is read (gradient clipping's factor, as torch's
// fused step takes it).

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace bertforge {

struct AdamWStep {
  float lr_decay;        // lr x weight decay
  float beta1, beta2;
  float step_size;       // lr / (1 - beta1^step)
  float correction2;     // sqrt(1 - beta2^step)
  float eps;
  float scale;           // grad_scale, or 1
  bool scaled;
};

inline void adamw_row(float* p, const float* g, float* m, float* v, int64_t n, const AdamWStep& s) {
  for (int64_t i = 0; i < n; ++i) {
    const float grad = s.scaled ? g[i] / s.scale : g[i];
    const float decayed = std::fma(-p[i], s.lr_decay, p[i]);
    const float mi = std::fma(s.beta1, m[i], (1.0f - s.beta1) * grad);
    const float vi = std::fma(s.beta2, v[i], (1.0f - s.beta2) * grad * grad);
    const float denom = std::sqrt(vi) / s.correction2 + s.eps;
    m[i] = mi;
    v[i] = vi;
    p[i] = std::fma(-s.step_size, mi / denom, decayed);
  }
}

inline void decay_row(float* p, int64_t n, const AdamWStep& s) {
  for (int64_t i = 0; i < n; ++i) p[i] = std::fma(-p[i], s.lr_decay, p[i]);
}

// hyper: lr, beta1, beta2, weight decay, eps, step (the step's number, from 1). param, grad, exp_avg, exp_avg_sq:
// contiguous fp32 (rows, width) on the CPU; live: (rows,) bool.
inline void adamw_rows(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                       const at::Tensor& exp_avg_sq, const at::Tensor& live, at::ArrayRef<double> hyper,
                       const std::optional<at::Tensor>& scale) {
  for (const at::Tensor* t : {&param, &grad, &exp_avg, &exp_avg_sq}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                    t->sizes() == param.sizes(),
                "adamw_rows takes contiguous fp32 CPU tensors of the parameter's shape");
  }
  TORCH_CHECK(live.scalar_type() == at::kBool && live.is_contiguous() && live.numel() == param.size(0),
              "adamw_rows: live is one bool a row");
  TORCH_CHECK(hyper.size() == 6, "adamw_rows: hyper is lr, beta1, beta2, weight decay, eps, step");
  const double lr = hyper[0], beta1 = hyper[1], beta2 = hyper[2], step = hyper[5];
  AdamWStep s{};
  s.lr_decay = static_cast<float>(lr * hyper[3]);
  s.beta1 = static_cast<float>(beta1);
  s.beta2 = static_cast<float>(beta2);
  s.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, step)));
  s.correction2 = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, step)));
  s.eps = static_cast<float>(hyper[4]);
  s.scaled = scale.has_value();
  s.scale = s.scaled ? scale->item<float>() : 1.0f;
  const int64_t rows = param.size(0), width = param.size(1);
  float* p = param.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  const bool* is_live = live.data_ptr<bool>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t at = r * width;
      if (is_live[r]) {
        adamw_row(p + at, g + at, m + at, v + at, width, s);
      } else {
        decay_row(p + at, width, s);
      }
    }
  });
}

}  // namespace bertforge

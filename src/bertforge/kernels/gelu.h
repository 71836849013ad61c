// The exact GELU for training, fp32 or bf16 (computed in fp32, rounded once): y = x Phi(x) forward, dx = dy (Phi(x) +
// x phi(x)) backward, Phi the standard normal's distribution function and phi its density. erf is vec.h's (Abramowitz
// and Stegun's 7.1.26, as the int8 products' GELU), and the density's e^(-x^2 / 2) is the exponential that erf computes
// anyway, so the gradient costs about what the forward does: one pass over x (and dy), where torch's gelu_backward
// evaluates erf and exp apart.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>

#include "vec.h"

namespace bertforge {

// Phi(x) = (1 + erf(x / sqrt 2)) / 2, erf by IEEE operations only (vec.h's erf_signed<true>) so that training gives the
// same bits on every x86 CPU that runs the same build; `gauss` gets e^(-x^2 / 2).
inline Vec normal_cdf(Vec x, Vec& gauss) {
  return Vec::all(0.5f) * (Vec::all(1.f) + erf_signed<true>(x * Vec::all(0.70710678118654752f), gauss));
}

inline Vec gelu_value(Vec x, Vec /*dy*/) {
  Vec gauss;
  return x * normal_cdf(x, gauss);
}

inline Vec gelu_gradient(Vec x, Vec dy) {
  Vec gauss;
  const Vec cdf = normal_cdf(x, gauss);
  return dy * fma(x * Vec::all(0.39894228040143268f), gauss, cdf);  // 1 / sqrt(2 pi)
}

// out[i] = f(x[i], dy[i]) over the tensors' elements, shared over the threads; dy may be x (the forward reads none).
// fp32 or bf16 (computed in fp32, rounded once as torch's bf16 GELU rounds).
template <Vec (*f)(Vec, Vec), typename T>
void elementwise_range(const T* xs, const T* gs, T* ys, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + Vec::kLanes <= end; i += Vec::kLanes) f(Vec::load(xs + i), Vec::load(gs + i)).store(ys + i);
  if (i < end) {
    T x[Vec::kLanes] = {}, g[Vec::kLanes] = {}, y[Vec::kLanes];
    std::copy_n(xs + i, end - i, x);
    std::copy_n(gs + i, end - i, g);
    f(Vec::load(x), Vec::load(g)).store(y);
    std::copy_n(y, end - i, ys + i);
  }
}

template <Vec (*f)(Vec, Vec)>
at::Tensor elementwise(const at::Tensor& x, const at::Tensor& dy) {
  TORCH_CHECK(x.scalar_type() == dy.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "gelu: fp32 or bf16 tensors, both of one type");
  TORCH_CHECK(x.sizes() == dy.sizes(), "gelu_backward: the gradient's shape must be the input's");
  const at::Tensor a = x.contiguous(), g = dy.contiguous();
  at::Tensor out = at::empty_like(a);
  at::parallel_for(0, a.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
    if (a.scalar_type() == at::kFloat) {
      elementwise_range<f>(a.data_ptr<float>(), g.data_ptr<float>(), out.data_ptr<float>(), begin, end);
    } else {
      elementwise_range<f>(a.data_ptr<at::BFloat16>(), g.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(),
                           begin, end);
    }
  });
  return out;
}

inline at::Tensor gelu(const at::Tensor& x) { return elementwise<gelu_value>(x, x); }

inline at::Tensor gelu_backward(const at::Tensor& dy, const at::Tensor& x) { return elementwise<gelu_gradient>(x, dy); }

}  // namespace bertforge

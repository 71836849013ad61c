// The exact GELU for training, fp32 or bf16 (computed in fp32, rounded once): y = x Phi(x) forward, dx = dy (Phi(x) +
// x phi(x)) backward, Phi the standard normal's distribution function and phi its density. erf is vec.h's (Abramowitz
// and Stegun's 7.1.26, as the int8 products' GELU), and the density's e^(-x^2 / 2) is the exponential that erf computes
// anyway, so the gradient costs about what the forward does: one pass over x (and dy), where torch's gelu_backward
// evaluates erf and exp apart.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <tuple>

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

// With the bias of the product before it (fp32, rows of I, I whole vectors): gelu(x + bias), the bias added here
// rather than copied into the product's output first (MKL's addmm), and the gradient (dx, dbias), dbias the column
// sums of dx over fixed chunks of kBiasChunk rows, then the chunks in order (bits by the build, not the threads).
constexpr int64_t kBiasChunk = 32;

inline void check_bias(const at::Tensor& x, const at::Tensor& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) % Vec::kLanes == 0,
              "gelu_bias: x must be fp32, its last dimension whole vectors");
  TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == x.size(-1),
              "gelu_bias: bias must be a contiguous fp32 vector of x's last dimension");
}

inline at::Tensor gelu_bias(const at::Tensor& x, const at::Tensor& bias) {
  check_bias(x, bias);
  const at::Tensor a = x.contiguous();
  at::Tensor out = at::empty_like(a);
  const int64_t I = a.size(-1), rows = a.numel() / std::max<int64_t>(I, 1);
  const float *xs = a.data_ptr<float>(), *b = bias.data_ptr<float>();
  float* ys = out.data_ptr<float>();
  at::parallel_for(0, rows, kBiasChunk, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t h = 0; h < I; h += Vec::kLanes) {
        const Vec v = Vec::load(xs + r * I + h) + Vec::load(b + h);
        gelu_value(v, v).store(ys + r * I + h);
      }
    }
  });
  return out;
}

inline std::tuple<at::Tensor, at::Tensor> gelu_bias_backward(const at::Tensor& dy, const at::Tensor& x,
                                                             const at::Tensor& bias) {
  check_bias(x, bias);
  TORCH_CHECK(dy.scalar_type() == at::kFloat && dy.sizes() == x.sizes(),
              "gelu_bias_backward: the gradient must be fp32, shaped as x");
  const at::Tensor a = x.contiguous(), g = dy.contiguous();
  at::Tensor dx = at::empty_like(a);
  const int64_t I = a.size(-1), rows = a.numel() / std::max<int64_t>(I, 1);
  const int64_t chunks = (rows + kBiasChunk - 1) / kBiasChunk;
  at::Tensor parts = at::zeros({std::max<int64_t>(chunks, 1), I}, a.options());
  const float *xs = a.data_ptr<float>(), *gs = g.data_ptr<float>(), *b = bias.data_ptr<float>();
  float *ds = dx.data_ptr<float>(), *pp = parts.data_ptr<float>();
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      float* part = pp + c * I;
      for (int64_t r = c * kBiasChunk; r < std::min(rows, (c + 1) * kBiasChunk); ++r) {
        for (int64_t h = 0; h < I; h += Vec::kLanes) {
          const Vec d = gelu_gradient(Vec::load(xs + r * I + h) + Vec::load(b + h), Vec::load(gs + r * I + h));
          d.store(ds + r * I + h);
          (Vec::load(part + h) + d).store(part + h);
        }
      }
    }
  });
  at::Tensor dbias = at::empty({I}, a.options());
  sum_in_order(pp, std::max<int64_t>(chunks, 1), I, dbias.data_ptr<float>());
  return {dx, dbias};
}

inline at::Tensor gelu_backward(const at::Tensor& dy, const at::Tensor& x) { return elementwise<gelu_gradient>(x, dy); }

}  // namespace bertforge

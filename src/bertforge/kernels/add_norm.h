// Training's post-LN residual block, out = LayerNorm(residual + dropout(z + bias)), in one pass forward and one back
// (bertforge/add_norm.py): z is a Linear layer's product without its bias (the attention's output projection, the
// feed-forward's second). Unfused, the block is five operators each way (the bias copied into the product's output,
// dropout, the add, LayerNorm; back: LayerNorm's gradient, dropout's, the bias's column sums, the residual's add),
// each a pass over a (rows, H) tensor with its own fixed cost.
//
// Dropout's mask is dropout.h's, over the (rows, H) tensor's element indices, so a key drops what `bertforge.dropout`
// drops there; the kept values are scaled as apply_mask_range scales them. The forward keeps the sum residual +
// dropout(z + bias) and each row's mean and 1 / sqrt(variance + eps), as torch's LayerNorm keeps its input and
// statistics; the backward recomputes the mask. The column sums (the bias's, LayerNorm's weight's and bias's
// gradients) add the rows of fixed chunks of kChunk rows, then the chunks in order: the bits depend on the build (its
// vector width), not on the threads. Under bf16 autocast z is the bf16 product: read as fp32, everything else fp32 as
// autocast's LayerNorm computes it, z's gradient rounded to bf16 once.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

#include "attention.h"
#include "dropout.h"
#include "vec.h"

namespace bertforge::add_norm {

constexpr int64_t kChunk = 32;  // rows a task, and a partial column sum's

template <typename Z>  // z's type: fp32, or bf16 (a product under bf16 autocast)
struct Forward {
  const Z* z;
  const float *bias, *residual, *weight, *beta;
  float *sum, *out, *stats;  // stats: (mean, rstd) a row
  int64_t H;
  float eps, scale;
  bool drop;
  MaskKey key;

  void row(int64_t i) const {
    const Z* zi = z + i * H;
    const float* ri = residual + i * H;
    float *si = sum + i * H, *oi = out + i * H;
    const uint32_t first = static_cast<uint32_t>(i * H);
    Vec total = Vec::zero();
    for (int64_t h = 0; h < H; h += kLanes) {
      Vec t = Vec::load(zi + h) + Vec::load(bias + h);
      if (drop) t = t * keep_factor(key.kept_lanes(first + static_cast<uint32_t>(h)), scale);
      const Vec a = Vec::load(ri + h) + t;
      a.store(si + h);
      total = total + a;
    }
    const float mean = bertforge::reduce_add(total) / static_cast<float>(H);
    Vec sq = Vec::zero();
    for (int64_t h = 0; h < H; h += kLanes) {
      const Vec c = Vec::load(si + h) - Vec::all(mean);
      sq = bertforge::fma(c, c, sq);
    }
    const float rstd = 1.0f / std::sqrt(bertforge::reduce_add(sq) / static_cast<float>(H) + eps);
    for (int64_t h = 0; h < H; h += kLanes) {
      const Vec xhat = (Vec::load(si + h) - Vec::all(mean)) * Vec::all(rstd);
      bertforge::fma(xhat, Vec::load(weight + h), Vec::load(beta + h)).store(oi + h);
    }
    stats[2 * i] = mean;
    stats[2 * i + 1] = rstd;
  }
};

template <typename Z>  // dz's type, z's
struct Backward {
  const float *grad, *sum, *stats, *weight;
  float* dsum;  // the residual's gradient (LayerNorm's input's)
  Z* dz;        // z's (the bias's before its sums; rounded once where bf16)
  int64_t H;
  float scale;
  bool drop;
  MaskKey key;

  // row i's gradients; its terms added to part: [dbias | dweight | dbeta], 3H
  void row(int64_t i, float* part) const {
    const float *gi = grad + i * H, *si = sum + i * H;
    float* di = dsum + i * H;
    Z* zi = dz + i * H;
    const Vec mean = Vec::all(stats[2 * i]), rstd = Vec::all(stats[2 * i + 1]);
    Vec sg = Vec::zero(), sgx = Vec::zero();
    for (int64_t h = 0; h < H; h += kLanes) {
      const Vec dy = Vec::load(gi + h), xhat = (Vec::load(si + h) - mean) * rstd, g = dy * Vec::load(weight + h);
      sg = sg + g;
      sgx = bertforge::fma(g, xhat, sgx);
      bertforge::fma(dy, xhat, Vec::load(part + H + h)).store(part + H + h);
      (Vec::load(part + 2 * H + h) + dy).store(part + 2 * H + h);
    }
    const float n = static_cast<float>(H);
    const Vec a = Vec::all(bertforge::reduce_add(sg) / n), c = Vec::all(bertforge::reduce_add(sgx) / n);
    const uint32_t first = static_cast<uint32_t>(i * H);
    for (int64_t h = 0; h < H; h += kLanes) {
      const Vec xhat = (Vec::load(si + h) - mean) * rstd, g = Vec::load(gi + h) * Vec::load(weight + h);
      const Vec ds = bertforge::fnma(xhat, c, g - a) * rstd;
      ds.store(di + h);
      const Vec d = drop ? ds * keep_factor(key.kept_lanes(first + static_cast<uint32_t>(h)), scale) : ds;
      d.store(zi + h);
      (Vec::load(part + h) + d).store(part + h);
    }
  }
};

inline void check(const at::Tensor& x, int64_t H, const char* what) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.numel() == H && x.is_contiguous(), what,
              " must be a contiguous fp32 vector of the last dimension's size");
}

template <typename Z>
void run_forward(const Forward<Z>& f, int64_t rows) {
  at::parallel_for(0, rows, kChunk, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) f.row(i);
  });
}

// out = LayerNorm(residual + dropout(z + bias)) over the last dimension, dropout at p with `key` (none at p = 0):
// (out, the sum, stats (rows, 2)), all fp32. z is fp32 or bf16 (read as fp32); everything else fp32.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const at::Tensor& z, const at::Tensor& bias,
                                                              const at::Tensor& residual, const at::Tensor& weight,
                                                              const at::Tensor& beta, double eps, double p,
                                                              int64_t key) {
  const bool bf16 = z.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || z.scalar_type() == at::kFloat) && residual.scalar_type() == at::kFloat &&
                  z.sizes() == residual.sizes(),
              "add_norm_train: z (fp32 or bf16) and residual (fp32) must be of one shape");
  const int64_t H = z.size(-1);
  TORCH_CHECK(H > 0 && H % kMultiple == 0, "add_norm_train: the last dimension must be a multiple of 16");
  TORCH_CHECK(z.numel() <= (int64_t{1} << 32), "add_norm_train: at most 2^32 elements");
  TORCH_CHECK(p >= 0 && p < 1, "add_norm_train: p must be in [0, 1)");
  check(bias, H, "bias");
  check(weight, H, "weight");
  check(beta, H, "beta");
  const at::Tensor a = z.contiguous(), r = residual.contiguous();
  at::Tensor sum = at::empty_like(r), out = at::empty_like(r);
  const int64_t rows = a.numel() / H;
  at::Tensor stats = at::empty({rows, 2}, r.options());
  const float *b = bias.data_ptr<float>(), *rs = r.data_ptr<float>(), *w = weight.data_ptr<float>();
  const float* be = beta.data_ptr<float>();
  float *ss = sum.data_ptr<float>(), *os = out.data_ptr<float>(), *st = stats.data_ptr<float>();
  const float e = static_cast<float>(eps), scale = static_cast<float>(1.0 / (1.0 - p));
  if (bf16) {
    run_forward(Forward<c10::BFloat16>{a.data_ptr<c10::BFloat16>(), b, rs, w, be, ss, os, st, H, e, scale, p > 0,
                                       MaskKey(p, key)}, rows);
  } else {
    run_forward(Forward<float>{a.data_ptr<float>(), b, rs, w, be, ss, os, st, H, e, scale, p > 0, MaskKey(p, key)},
                rows);
  }
  return {out, sum, stats};
}

template <typename Z>
void run_backward(const Backward<Z>& b, int64_t rows, int64_t chunks, float* parts) {
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      for (int64_t i = c * kChunk; i < std::min(rows, (c + 1) * kChunk); ++i) b.row(i, parts + c * 3 * b.H);
    }
  });
}

// The gradients from out's: (the sum's, which is the residual's; z's, of type `z_type` (fp32 or bf16); bias's;
// LayerNorm weight's; its bias's).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& grad, const at::Tensor& sum, const at::Tensor& stats, const at::Tensor& weight, double p,
    int64_t key, at::ScalarType z_type) {
  TORCH_CHECK(grad.scalar_type() == at::kFloat && grad.sizes() == sum.sizes() && sum.is_contiguous(),
              "add_norm_train_backward: the gradient must be fp32, shaped as the kept sum");
  TORCH_CHECK(z_type == at::kFloat || z_type == at::kBFloat16, "add_norm_train_backward: z is fp32 or bf16");
  const int64_t H = sum.size(-1), rows = sum.numel() / H;
  TORCH_CHECK(stats.scalar_type() == at::kFloat && stats.numel() == 2 * rows && stats.is_contiguous(),
              "add_norm_train_backward: stats must be the forward's");
  check(weight, H, "weight");
  const at::Tensor g = grad.contiguous();
  at::Tensor dsum = at::empty_like(sum), dz = at::empty_like(sum, sum.options().dtype(z_type));
  const int64_t chunks = (rows + kChunk - 1) / kChunk;
  at::Tensor parts = at::zeros({std::max<int64_t>(chunks, 1), 3 * H}, sum.options());
  const float *gs = g.data_ptr<float>(), *ss = sum.data_ptr<float>(), *st = stats.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float *ds = dsum.data_ptr<float>(), *pp = parts.data_ptr<float>();
  const float scale = static_cast<float>(1.0 / (1.0 - p));
  if (z_type == at::kBFloat16) {
    run_backward(Backward<c10::BFloat16>{gs, ss, st, w, ds, dz.data_ptr<c10::BFloat16>(), H, scale, p > 0,
                                         MaskKey(p, key)}, rows, chunks, pp);
  } else {
    run_backward(Backward<float>{gs, ss, st, w, ds, dz.data_ptr<float>(), H, scale, p > 0, MaskKey(p, key)}, rows,
                 chunks, pp);
  }
  at::Tensor sums = at::empty({3, H}, sum.options());  // [dbias | dweight | dbeta], as the parts hold them
  sum_in_order(pp, std::max<int64_t>(chunks, 1), 3 * H, sums.data_ptr<float>());
  at::Tensor dbias = sums[0].clone(), dweight = sums[1].clone(), dbeta = sums[2].clone();  // each its own storage
  return {dsum, dz, dbias, dweight, dbeta};
}

}  // namespace bertforge::add_norm

// The ops of training's attention (cpu_kernels.cpp registers them): their arguments checked and the kernels of
// attention_train.h called on them.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "attention_train.h"

namespace bertforge {
namespace train {

// Training's attention (attention_train.h): qkv (B, T, 3H) -> (out (B, T, H), probabilities (B, N, T, Tp), fp32,
// those dropout dropped with their sign bit set), dropout at p with `key`; and the backward, out's gradient -> qkv's.
// qkv, out and both gradients fp32, or all bf16 (under bf16 autocast).
// Packed: qkv (rows, 3H) holds B sequences of real tokens, sequence b rows offsets[b] .. offsets[b + 1] (int64, B + 1),
// each at most `length` long (the padded batch's T, which dropout's indices count in), then spare rows (from
// offsets[B]: the products' rows rounded up), whose output and gradient are zeros; out (rows, H), the probabilities
// flat.
struct TrainCall {
  Shape shape;
  Layout layout;
  at::Tensor offsets;
  std::vector<int64_t> probs_first;
  int64_t probs = 0;  // floats
  int64_t spare_from = 0, spare = 0;  // packed: the spare rows after the sequences'
  TrainCall(const at::Tensor& qkv, int64_t heads, const std::optional<at::Tensor>& packed, int64_t length) {
    const int64_t dims = packed.has_value() ? 2 : 3;  // packed: `packed` holds the offsets
    TORCH_CHECK(heads > 0 && qkv.dim() == dims && qkv.size(dims - 1) % (3 * heads * kMultiple) == 0,
                "qkv must be (B, T, 3H), or (rows, 3H) packed, H heads x a multiple of 16");
    TORCH_CHECK(qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16, "qkv must be fp32 or bf16");
    const int64_t D = qkv.size(dims - 1) / 3 / heads;
    if (!packed.has_value()) {
      shape = {qkv.size(0), qkv.size(1), heads, D};
      probs = shape.B * heads * shape.T * padded_length(shape.T);
      return;
    }
    offsets = packed->to(at::kLong).contiguous();
    const int64_t* o = offsets.data_ptr<int64_t>();
    const int64_t B = offsets.numel() - 1;
    TORCH_CHECK(offsets.dim() == 1 && B >= 0 && o[0] == 0 && o[B] <= qkv.size(0), "offsets must be 0 .. rows");
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(o[b + 1] >= o[b] && o[b + 1] - o[b] <= length, "offsets must rise by at most length a sequence");
    shape = {B, length, heads, D};
    probs_first.resize(B);
    probs = packed_probs(o, B, heads, probs_first.data());
    layout = {o, probs_first.data()};
    spare_from = o[B], spare = qkv.size(0) - o[B];
  }
  void zero_spare(const at::Tensor& rows) const {
    if (spare > 0) rows.narrow(0, spare_from, spare).zero_();
  }
};

inline std::tuple<at::Tensor, at::Tensor> attention_train(const at::Tensor& qkv, int64_t heads,
                                                          const std::optional<at::Tensor>& mask, double p,
                                                          int64_t key, const std::optional<at::Tensor>& offsets,
                                                          int64_t length) {
  const TrainCall call(qkv, heads, offsets, length);
  const Shape& s = call.shape;
  TORCH_CHECK(p >= 0 && p < 1, "p must be in [0, 1)");
  TORCH_CHECK(p == 0 || s.B * s.N * s.T * s.T <= (int64_t{1} << 32), "dropout masks of at most 2^32 elements");
  const at::Tensor x = qkv.contiguous();
  TORCH_CHECK(!mask.has_value() || !offsets.has_value(), "a packed call has no mask");
  const Queries keys(mask, std::nullopt, s.B, s.T);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = s.N * s.D;
  at::Tensor out = at::empty(out_shape, x.options());
  const auto fp32 = x.options().dtype(at::kFloat);
  at::Tensor probs = offsets.has_value() ? at::empty({call.probs}, fp32)
                                         : at::empty({s.B, s.N, s.T, padded_length(s.T)}, fp32);
  const Dropper drop(p, key);
  if (x.scalar_type() == at::kBFloat16) {
    attention_forward(x.data_ptr<c10::BFloat16>(), keys.mask_data(), s, call.layout, drop,
                      out.data_ptr<c10::BFloat16>(), probs.data_ptr<float>());
  } else {
    attention_forward(x.data_ptr<float>(), keys.mask_data(), s, call.layout, drop, out.data_ptr<float>(),
                      probs.data_ptr<float>());
  }
  call.zero_spare(out);
  return {out, probs};
}

inline at::Tensor attention_train_backward(const at::Tensor& grad, const at::Tensor& qkv, const at::Tensor& probs,
                                           int64_t heads, double p, int64_t key,
                                           const std::optional<at::Tensor>& offsets, int64_t length) {
  const TrainCall call(qkv, heads, offsets, length);
  const Shape& s = call.shape;
  const at::Tensor x = qkv.contiguous(), g = grad.contiguous(), pr = probs.contiguous();
  std::vector<int64_t> grad_shape(x.sizes().begin(), x.sizes().end());
  grad_shape.back() = s.N * s.D;
  TORCH_CHECK(g.scalar_type() == x.scalar_type() && g.sizes() == at::IntArrayRef(grad_shape),
              "grad must be of qkv's type, (B, T, H), or (rows, H) packed");
  TORCH_CHECK(pr.scalar_type() == at::kFloat && pr.numel() == call.probs && pr.dim() == (offsets ? 1 : 4),
              "probs must be attention_train's");
  TORCH_CHECK(p >= 0 && p < 1, "p must be in [0, 1)");
  at::Tensor dqkv = at::empty_like(x);
  const Dropper drop(p, key);
  if (x.scalar_type() == at::kBFloat16) {
    attention_backward(g.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), pr.data_ptr<float>(), s,
                       call.layout, drop, dqkv.data_ptr<c10::BFloat16>());
  } else {
    attention_backward(g.data_ptr<float>(), x.data_ptr<float>(), pr.data_ptr<float>(), s, call.layout, drop,
                       dqkv.data_ptr<float>());
  }
  call.zero_spare(dqkv);
  return dqkv;
}

}  // namespace train
}  // namespace bertforge

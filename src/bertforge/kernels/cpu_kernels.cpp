// CPU kernels for bertforge's int8 inference (bertforge/kernels/__init__.py builds this file once per machine, for
// AVX-512 or for AVX2 + FMA: vec.h holds the two vector layers, every kernel here and in attention.h is written once
// over them).
//
// Between its int8 products, an encoder layer spends most of its time in many small operators: on Rotten Tomatoes
// snippets (27 tokens on average) attention alone is about 8 of them per layer (head split copies, two batched
// products, scale, mask, softmax, casts), each a pass over memory with its own fixed cost. These kernels do the same
// work in one pass each:
//   attention      scores, mask, softmax and the weighted sum of values, one sequence (every head) at a time, or a
//                  share of its heads where sequences are fewer than threads (one text), from the query/key/value
//                  product's output as it is, into the (B, P, H) layout the next product reads;
//   add_layer_norm the residual add and LayerNorm of one row at a time (residual_layer_norm: keeping the sum, for
//                  pre-LN layers).
// Both also return the range (min, max) of what they wrote, which the following int8 product quantizes by, so it
// needs no pass of its own to find it. Before them, embeddings: the input embeddings' three rows and LayerNorm.
// For the products' other inputs:
//   value_range    the range of a tensor, and
//   quantize_u8    its u8 codes for a scale and zero point.
// And for training on oneDNN's fp32 products (bertforge/linear.py):
//   transpose_sum  a Linear layer's output gradient transposed, with its column sums (transpose.h);
//   grad_norm      the 2-norm of many tensors together, gradient clipping's (grad_norm.h);
//   adamw_rows     AdamW over a word embedding, the rows never looked up only decayed (adamw_rows.h);
//   gelu           the exact GELU and its gradient, one pass each (gelu.h; gelu_bias: the bias added on the way);
//   add_norm_train post-LN's LayerNorm(residual + dropout(z + bias)) and its gradients, one pass each (add_norm.h);
//   attention_train (and its backward) attention with dropout, from and to the products' layouts, padded or packed
//                  (attention_train.h; the ops in attention_train_ops.h).
// fp32 inference's few-row products: f32_linear over weights f32_pack made (fp32_panels.h); f32_encoder
// (fp32_encoder.h) runs a whole encoder of them a sequence at a time, as int8_encoder does.
// The int8 products themselves: u7_linear (int8_u7.h, CPUs without int8 dot products) and vnni_linear (int8_vnni.h,
// AVX-512 VNNI without AMX), each quantizing its activations per row; int8_encoder (int8_encoder.h) runs a whole
// encoder of either's products a sequence at a time (int8_encoder_shares: whether it shares a lone sequence's work out
// over the threads).
// (lanes() says which build this is: 16 floats a vector on AVX-512, 8 on AVX2.)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "adamw_rows.h"
#include "add_norm.h"
#include "attention.h"
#include "attention_train.h"
#include "attention_train_ops.h"
#include "dropout.h"
#include "fp32_encoder.h"
#include "gelu.h"
#include "grad_norm.h"
#include "int8_u7.h"
#include "int8_amx.h"
#include "int8_encoder.h"
#include "int8_vnni.h"
#include "layer_norm.h"
#include "transpose.h"
#include "vec.h"

namespace {

using bertforge::kInf;
using bertforge::kLanes;
using bertforge::kMultiple;
using bertforge::normalize_row;
using bertforge::Range;
using bertforge::Vec;

at::Tensor range_tensor(const std::vector<Range>& parts) {
  float lo = kInf, hi = -kInf;
  for (const Range& r : parts) {
    lo = std::min(lo, r.min());
    hi = std::max(hi, r.max());
  }
  at::Tensor out = at::empty({2}, at::kFloat);
  out.data_ptr<float>()[0] = lo;
  out.data_ptr<float>()[1] = hi;
  return out;
}

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& qkv, int64_t heads,
                                             const std::optional<at::Tensor>& mask,
                                             const std::optional<at::Tensor>& positions) {
  TORCH_CHECK(heads > 0 && qkv.dim() == 3 && qkv.size(2) % (3 * heads * kMultiple) == 0,
              "qkv must be (B, T, 3H), H heads x a multiple of 16");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16, "qkv must be fp32 or bf16");
  const at::Tensor x = qkv.contiguous();
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2) / 3, D = H / heads;
  const bertforge::Queries queries(mask, positions, B, T);
  const int64_t P = queries.P;
  at::Tensor out = at::empty({B, P, H}, x.options().dtype(at::kFloat));
  const bool* mp = queries.mask_data();
  const int64_t* pp = queries.positions_data();
  float* op = out.data_ptr<float>();
  const std::vector<Range> ranges =
      x.scalar_type() == at::kFloat
          ? bertforge::attention_kernel(x.data_ptr<float>(), mp, pp, op, B, T, P, heads, D)
          : bertforge::attention_kernel(x.data_ptr<at::BFloat16>(), mp, pp, op, B, T, P, heads, D);
  return {out, range_tensor(ranges)};
}

// LayerNorm over the last dimension (fp32) of x + residual, or of x alone (residual null); with `sum` not null the sum
// x + residual is written there too (the residual stream of a pre-LN layer). Returns the range of the output.
at::Tensor layer_norm_into(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
                           const at::Tensor& bias, double eps, at::Tensor& out, at::Tensor* sum) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be fp32");
  TORCH_CHECK(residual == nullptr || (x.sizes() == residual->sizes() && residual->scalar_type() == at::kFloat),
              "x and residual must have the same shape, fp32");
  const int64_t H = x.size(-1);
  TORCH_CHECK(H % kMultiple == 0, "the last dimension must be a multiple of 16");
  TORCH_CHECK(weight.numel() == H && bias.numel() == H, "weight and bias must have the last dimension's size");
  const at::Tensor a = x.contiguous(), r = residual == nullptr ? at::Tensor() : residual->contiguous();
  const at::Tensor w = weight.to(at::kFloat).contiguous(), c = bias.to(at::kFloat).contiguous();
  out = at::empty_like(a);
  if (sum != nullptr) *sum = residual == nullptr ? a : at::empty_like(a);
  const int64_t rows = H == 0 ? 0 : a.numel() / H;
  const int64_t grain = std::max<int64_t>(16, 8192 / std::max<int64_t>(H, 1));  // rows a task: >= 8K values
  std::vector<Range> ranges((rows + grain - 1) / grain);
  const float *ap = a.data_ptr<float>(), *rp = residual == nullptr ? nullptr : r.data_ptr<float>(),
              *wp = w.data_ptr<float>(), *cp = c.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* sp = sum != nullptr && residual != nullptr ? sum->data_ptr<float>() : nullptr;
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, static_cast<int64_t>(ranges.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      Range range;
      for (int64_t i = chunk * grain; i < std::min(rows, (chunk + 1) * grain); ++i)
        normalize_row(ap + i * H, rp == nullptr ? nullptr : rp + i * H, wp, cp, feps, H, op + i * H,
                      sp == nullptr ? nullptr : sp + i * H, range);
      ranges[chunk] = range;
    }
  });
  return range_tensor(ranges);
}

// LayerNorm(x + residual): (output, its range). The post-LN layer's two norms.
std::tuple<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor& x, const at::Tensor& residual,
                                                  const at::Tensor& weight, const at::Tensor& bias, double eps) {
  at::Tensor out;
  at::Tensor range = layer_norm_into(x, &residual, weight, bias, eps, out, nullptr);
  return {out, range};
}

// x + residual (x alone without a residual) and its LayerNorm: (sum, output, the output's range). A pre-LN layer's
// residual stream and the normalized input of its next product.
std::tuple<at::Tensor, at::Tensor, at::Tensor> residual_layer_norm(const at::Tensor& x,
                                                                   const std::optional<at::Tensor>& residual,
                                                                   const at::Tensor& weight, const at::Tensor& bias,
                                                                   double eps) {
  at::Tensor out, sum;
  at::Tensor range = layer_norm_into(x, residual.has_value() ? &*residual : nullptr, weight, bias, eps, out, &sum);
  return {sum, out, range};
}

// BERT's input embeddings for inference, a row at a time: LayerNorm((word[id] + position[t]) + type[type id]) (type
// row 0 without type ids), the sums in torch's order. ids (B, T); the tables and LayerNorm fp32.
at::Tensor embeddings(const at::Tensor& ids, const std::optional<at::Tensor>& types, const at::Tensor& word,
                      const at::Tensor& position, const at::Tensor& type, const at::Tensor& weight,
                      const at::Tensor& bias, double eps) {
  TORCH_CHECK(ids.dim() == 2, "ids must be (B, T)");
  const int64_t B = ids.size(0), T = ids.size(1), H = word.size(-1);
  for (const at::Tensor* t : {&word, &position, &type, &weight, &bias})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->size(-1) == H,
                "the embedding tables and LayerNorm must be contiguous fp32 of one width");
  TORCH_CHECK(H % kMultiple == 0 && word.dim() == 2 && position.dim() == 2 && type.dim() == 2 && type.size(0) > 0,
              "the embedding tables must be (rows, H), H a multiple of 16");
  TORCH_CHECK(T <= position.size(0), "the sequence is longer than the position embeddings");
  // the ids checked in one pass (four torch reductions took about a third of the operator's time for one text)
  const auto within = [](const at::Tensor& t, int64_t rows) {
    const int64_t* v = t.data_ptr<int64_t>();
    return std::all_of(v, v + t.numel(), [rows](int64_t i) { return i >= 0 && i < rows; });
  };
  const at::Tensor id = ids.to(at::kLong).contiguous();
  TORCH_CHECK(within(id, word.size(0)), "ids must lie within the vocabulary");
  at::Tensor kind;
  if (types.has_value()) {
    kind = types->to(at::kLong).contiguous();
    TORCH_CHECK(kind.sizes() == id.sizes(), "type ids must have the ids' shape");
    TORCH_CHECK(within(kind, type.size(0)), "type ids must lie within the type embeddings");
  }
  at::Tensor out = at::empty({B, T, H}, word.options());
  const int64_t *ip = id.data_ptr<int64_t>(), *kp = kind.defined() ? kind.data_ptr<int64_t>() : nullptr;
  const float *wp = word.data_ptr<float>(), *pp = position.data_ptr<float>(), *tp = type.data_ptr<float>();
  const float *gp = weight.data_ptr<float>(), *bp = bias.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * T, 64, [&](int64_t begin, int64_t end) {  // a text's rows on one thread
    Range unused;
    for (int64_t r = begin; r < end; ++r) {
      const float *w = wp + ip[r] * H, *p = pp + (r % T) * H, *t = tp + (kp == nullptr ? 0 : kp[r]) * H;
      float* y = op + r * H;
      for (int64_t h = 0; h < H; h += kLanes) ((Vec::load(w + h) + Vec::load(p + h)) + Vec::load(t + h)).store(y + h);
      normalize_row(y, nullptr, gp, bp, static_cast<float>(eps), H, y, nullptr, unused);
    }
  });
  return out;
}

// (min, max) of an fp32 tensor's values.
at::Tensor value_range(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be fp32");
  const at::Tensor a = x.contiguous();
  const int64_t n = a.numel(), grain = 1 << 16;
  const float* xp = a.data_ptr<float>();
  std::vector<Range> ranges((n + grain - 1) / grain);
  at::parallel_for(0, static_cast<int64_t>(ranges.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      Range range;
      const int64_t stop = std::min(n, (chunk + 1) * grain);
      int64_t i = chunk * grain;
      for (; i + kLanes <= stop; i += kLanes) range.add(Vec::load(xp + i));
      if (i < stop) range.add_first(xp + i, stop - i);
      ranges[chunk] = range;
    }
  });
  return range_tensor(ranges);
}

// round(x / scale) + zero within [0, 255], as uint8 (rounding half to even), from fp32.
at::Tensor quantize_u8(const at::Tensor& x, double scale, int64_t zero) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be fp32");
  TORCH_CHECK(scale > 0 && zero >= 0 && zero <= 255, "scale must be positive and zero within [0, 255]");
  const at::Tensor a = x.contiguous();
  at::Tensor out = at::empty(a.sizes(), a.options().dtype(at::kByte));
  const int64_t n = a.numel(), grain = 1 << 16;
  const float* xp = a.data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  const bertforge::U8Codes codes(static_cast<float>(1.0 / scale), static_cast<int32_t>(zero));
  at::parallel_for(0, (n + grain - 1) / grain, 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t stop = std::min(n, (chunk + 1) * grain);
      int64_t i = chunk * grain;
      for (; i + kLanes <= stop; i += kLanes) codes.store(op + i, Vec::load(xp + i));
      if (i < stop) codes.store_first(op + i, Vec::load_first(xp + i, stop - i, 0.0f), stop - i);
    }
  });
  return out;
}

// Dropout's keep mask of n elements (bool, 1 = kept) for drop probability p and a 64-bit key (dropout.h).
at::Tensor keep_mask(int64_t n, double p, int64_t key) {
  TORCH_CHECK(n >= 0 && n <= (int64_t{1} << 32), "a mask of 0 to 2^32 elements");
  TORCH_CHECK(p >= 0 && p < 1, "p must be in [0, 1)");
  at::Tensor keep = at::empty({n}, at::TensorOptions().dtype(at::kBool));
  uint8_t* kp = reinterpret_cast<uint8_t*>(keep.data_ptr<bool>());
  const bertforge::MaskKey mask_key(p, key);
  at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
    bertforge::keep_mask_range(kp, begin, end, mask_key);
  });
  return keep;
}

// x * keep * 1 / (1 - p) (fp32 or bf16, as x), keep the mask keep_mask(x.numel(), p, key) would give, computed on the
// way and never stored: dropout's forward, and with the same key its backward (on the gradient).
at::Tensor apply_keep_mask(const at::Tensor& x, double p, int64_t key) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be fp32 or bf16");
  TORCH_CHECK(x.numel() <= (int64_t{1} << 32), "at most 2^32 elements");
  TORCH_CHECK(p >= 0 && p < 1, "p must be in [0, 1)");
  const at::Tensor a = x.contiguous();
  at::Tensor out = at::empty_like(a);
  const bertforge::MaskKey mask_key(p, key);
  const float scale = static_cast<float>(1.0 / (1.0 - p));  // the scalar as torch's fp32 and bf16 products take it
  at::parallel_for(0, a.numel(), 1 << 15, [&](int64_t begin, int64_t end) {
    if (a.scalar_type() == at::kFloat) {
      bertforge::apply_mask_range(a.data_ptr<float>(), out.data_ptr<float>(), begin, end, mask_key, scale, begin);
    } else {
      bertforge::apply_mask_range(a.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), begin, end, mask_key,
                                  scale, begin);
    }
  });
  return out;
}

// A weight's 7-bit codes (N, K) int8, packed for u7_linear: (panels, their column sums).
std::tuple<at::Tensor, at::Tensor> u7_pack(const at::Tensor& codes) {
  bertforge::check_int8_codes(codes);
  TORCH_CHECK(codes.numel() == 0 || (codes.min().item<int>() >= -63 && codes.max().item<int>() <= 63),
              "codes must lie within +-63 (7 bits)");
  return bertforge::u7::pack_weight(codes.contiguous());
}

// x (..., K) fp32 times the packed weight's N columns, activations quantized per row to 7 bits (int8_u7.h), the exact
// GELU applied where `gelu`.
at::Tensor u7_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& column_sums,
                     const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias, int64_t out_features,
                     bool gelu) {
  const bertforge::Int8Operands o = bertforge::check_int8_operands(
      "u7_pack", x, packed, column_sums, weight_scale, bias, out_features, bertforge::u7::NR, 8);
  return bertforge::u7::linear(x.contiguous(), packed, column_sums, weight_scale.contiguous(), o.bias, out_features,
                               gelu)
      .view(o.shape);
}

// g (M, N) fp32 transposed to (N, M), and its column sums (N): a Linear layer's dy^T and bias gradient (transpose.h).
std::tuple<at::Tensor, at::Tensor> transpose_sum(const at::Tensor& g) {
  TORCH_CHECK(g.dim() == 2 && g.scalar_type() == at::kFloat, "g must be an fp32 (rows, columns) matrix");
  const at::Tensor a = g.contiguous();
  const int64_t M = a.size(0), N = a.size(1), blocks = (N + kLanes - 1) / kLanes;
  at::Tensor gt = at::empty({N, M}, at::kFloat), sums = at::empty({N}, at::kFloat);
  const float* src = a.data_ptr<float>();
  float *dst = gt.data_ptr<float>(), *sum = sums.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    bertforge::transpose_columns(src, dst, sum, M, N, begin * kLanes, std::min(end * kLanes, N));
  });
  return {gt, sums};
}

// Floats in one vector of this build: 16 (AVX-512) or 8 (AVX2).
int64_t lanes() { return kLanes; }

// How many threads the kernels' parallel loops run on now: torch's intra-op threads where the build has OpenMP (a
// build without it runs every at::parallel_for on the calling thread alone).
int64_t parallel_threads() {
  std::vector<int> used(std::max(1, at::get_num_threads()), 0);
  at::parallel_for(0, static_cast<int64_t>(used.size()), 1, [&](int64_t, int64_t) {
    used[std::min<int64_t>(at::get_thread_num(), static_cast<int64_t>(used.size()) - 1)] = 1;
  });
  int64_t n = 0;
  for (int u : used) n += u;
  return n;
}

}  // namespace

TORCH_LIBRARY(bertforge, m) {
  m.def("attention(Tensor qkv, int heads, Tensor? mask, Tensor? positions) -> (Tensor, Tensor)");
  m.def("add_layer_norm(Tensor x, Tensor residual, Tensor weight, Tensor bias, float eps) -> (Tensor, Tensor)");
  m.def("residual_layer_norm(Tensor x, Tensor? residual, Tensor weight, Tensor bias, float eps) -> "
        "(Tensor, Tensor, Tensor)");
  m.def("embeddings(Tensor ids, Tensor? types, Tensor word, Tensor position, Tensor type, Tensor weight, "
        "Tensor bias, float eps) -> Tensor");
  m.def("value_range(Tensor x) -> Tensor");
  m.def("quantize_u8(Tensor x, float scale, int zero) -> Tensor");
  m.def("keep_mask(int n, float p, int key) -> Tensor", &keep_mask);
  m.def("apply_keep_mask(Tensor x, float p, int key) -> Tensor");
  m.def("transpose_sum(Tensor g) -> (Tensor, Tensor)");
  m.def("gelu(Tensor x) -> Tensor");
  m.def("gelu_backward(Tensor grad, Tensor x) -> Tensor");
  m.def("gelu_bias(Tensor x, Tensor bias) -> Tensor");
  m.def("gelu_bias_backward(Tensor grad, Tensor x, Tensor bias) -> (Tensor, Tensor)");
  m.def("add_norm_train(Tensor z, Tensor bias, Tensor residual, Tensor weight, Tensor beta, float eps, float p, "
        "int key) -> (Tensor, Tensor, Tensor)");
  m.def("add_norm_train_backward(Tensor grad, Tensor sum, Tensor stats, Tensor weight, float p, int key, "
        "ScalarType z_type) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("grad_norm(Tensor[] tensors, Tensor?[] rows) -> float", &bertforge::grad_norm);
  m.def("adamw_rows(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor live, "
        "float[] hyper, Tensor? grad_scale) -> ()", &bertforge::adamw_rows);
  m.def("attention_train(Tensor qkv, int heads, Tensor? mask, float p, int key, Tensor? offsets=None, int length=0)"
        " -> (Tensor, Tensor)");
  m.def("attention_train_backward(Tensor grad, Tensor qkv, Tensor probs, int heads, float p, int key, "
        "Tensor? offsets=None, int length=0) -> Tensor");
  m.def("lanes() -> int", &lanes);
  m.def("parallel_threads() -> int", &parallel_threads);
  m.def("f32_pack(Tensor weight) -> Tensor");
  m.def("f32_linear(Tensor x, Tensor panels, Tensor? bias, bool gelu) -> Tensor");
  m.def("u7_pack(Tensor codes) -> (Tensor, Tensor)");
  m.def("u7_linear(Tensor x, Tensor packed, Tensor column_sums, Tensor weight_scale, Tensor? bias, int out_features, "
        "bool gelu=False) -> Tensor");
  m.def("vnni_pack(Tensor codes) -> (Tensor, Tensor)");
  m.def("vnni_linear(Tensor x, Tensor packed, Tensor column_sums, Tensor weight_scale, Tensor? bias, "
        "int out_features, bool gelu) -> Tensor");
  m.def("has_vnni() -> bool", &bertforge::vnni::has_vnni);
  m.def("amx_tiles() -> bool", &bertforge::amx::usable);
  m.def("int8_encoder(Tensor x, Tensor? mask, Tensor? positions, Tensor[] weights, int heads, float[] eps, "
        "bool pre_ln, bool u7=False) -> Tensor");
  m.def("f32_encoder(Tensor x, Tensor? mask, Tensor? positions, Tensor[] weights, int heads, float[] eps, bool pre_ln)"
        " -> Tensor");
  m.def("int8_encoder_shares(int B, int T, int H, int I, bool u7=False) -> bool",
        &bertforge::encoder::int8_encoder_shares);
}

TORCH_LIBRARY_IMPL(bertforge, CPU, m) {
  m.impl("attention", attention);
  m.impl("add_layer_norm", add_layer_norm);
  m.impl("residual_layer_norm", residual_layer_norm);
  m.impl("embeddings", embeddings);
  m.impl("value_range", value_range);
  m.impl("quantize_u8", quantize_u8);
  m.impl("apply_keep_mask", apply_keep_mask);
  m.impl("f32_pack", bertforge::f32::checked_pack);
  m.impl("f32_linear", bertforge::f32::checked_linear);
  m.impl("f32_encoder", bertforge::encoder::f32_encoder);
  m.impl("u7_pack", u7_pack);
  m.impl("u7_linear", u7_linear);
  m.impl("vnni_pack", bertforge::vnni::checked_pack);
  m.impl("vnni_linear", bertforge::vnni::checked_linear);
  m.impl("int8_encoder", bertforge::encoder::int8_encoder);
  m.impl("transpose_sum", transpose_sum);
  m.impl("gelu", bertforge::gelu);
  m.impl("gelu_backward", bertforge::gelu_backward);
  m.impl("gelu_bias", bertforge::gelu_bias);
  m.impl("gelu_bias_backward", bertforge::gelu_bias_backward);
  m.impl("add_norm_train", bertforge::add_norm::forward);
  m.impl("add_norm_train_backward", bertforge::add_norm::backward);
  m.impl("attention_train", bertforge::train::attention_train);
  m.impl("attention_train_backward", bertforge::train::attention_train_backward);
}

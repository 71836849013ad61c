// An encoder of fp32 layers run a sequence at a time (the f32_encoder operator): int8_encoder.h's loop (every layer
// of one sequence before the next, or a lone sequence's products and attention shared out over the threads) over
// fp32 products on the few-row kernel of fp32_panels.h (`F32Products`). Each piece is an operator's own (f32_linear's
// tiles, attention's Sequence, add_layer_norm's rows), so the results are those of the operators run one after
// another on the same products, bit for bit; what goes is the work between them: a dispatch, an allocation and a
// pass over the batch's memory for each of a layer's seven operators, and, where only some positions are answered (a
// classifier's [CLS]), the padding after each sequence's keys. Also the checked f32_pack and f32_linear operators.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "fp32_panels.h"
#include "int8_encoder.h"

namespace bertforge::f32 {

// A weight (N, K) fp32, N a multiple of 16, packed for `checked_linear`: panels of 16 columns.
inline at::Tensor checked_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "weight must be an fp32 (out, in) matrix");
  TORCH_CHECK(weight.size(0) % NR == 0, "the weight's rows (out features) must be a multiple of 16");
  return pack(weight.contiguous());
}

// x (..., K) fp32 times the packed weight plus bias (zeros where none): (..., N), the exact GELU applied where `gelu`.
inline at::Tensor checked_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                                 bool gelu) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) > 0, "x must be fp32 (..., in)");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.size(2) == NR &&
                  panels.size(1) == x.size(-1) && panels.is_contiguous(),
              "panels must be f32_pack's, of the weight x is multiplied by");
  const int64_t N = panels.size(0) * NR;
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::zeros({N}, at::kFloat);
  TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == N, "bias must be fp32 with a value a column");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return linear(x.contiguous(), panels, b, gelu).view(shape);
}

}  // namespace bertforge::f32

namespace bertforge::encoder {

// A shared-out fp32 product's chunks (`EncoderWork::team`; kChunkMacs for int8) hold at least this many multiply-adds:
// fp32 multiplies several times slower than int8, so a lone text's work pays to share out from smaller products. One
// text through the encoder on a 2-core Zen 4, two threads against one: BERT-tiny (products of 0.4-1.8M at 27 tokens)
// 1.12x sooner at 27 tokens, 1.27x at 64; 256 wide 1.71x and 1.81x; MiniLM-L6 1.79x and 1.82x.
constexpr int64_t kF32ChunkMacs = 1 << 19;

// A sequence's fp32 products for `EncoderWork`: nothing to quantize (the rows are read as they are), then any range
// of a weight's panels, as f32_linear computes them (`f32::panel_range`: the same tiles and k-blocks, so the same
// bits).
struct F32Products {
  static constexpr int64_t kPanel = f32::NR, kChunk = kF32ChunkMacs;
  static constexpr bool on_tiles = false;
  static bool uses_tiles() { return false; }
  static constexpr int64_t depth(int64_t K) { return K; }
  const float* rows = nullptr;
  F32Products(int64_t, int64_t) {}

  // the rows the next `multiply` reads (kept by address: they must stay as they are until it has run)
  void quantize(const float* in, int64_t, int64_t) { rows = in; }

  // y's columns of panels p0 .. p1 of the M rows' product: reads this object only, so threads may each take panels
  void multiply(int64_t M, const Product& w, bool gelu, float* y, int64_t p0, int64_t p1) const {
    f32::panel_range(rows, w.K, w.f32, w.bias, y, w.N, 0, M, p0, p1, gelu);
  }
};

// The operator: x (B, T, H) fp32; mask (B, T) (True: a key to attend) or None; positions (B, P) or None (the last
// layer's answers at every position); weights, 12 a layer: for each of qkv, attention output, intermediate (GELU
// inside) and output its f32_pack panels and bias, then LN1's and LN2's weight and bias; pre-LN layers add the final
// LayerNorm's weight and bias at the end. eps: two a layer (and the final LayerNorm's). Returns (B, P, H), or (B, T,
// H) without positions: post-LN, the last layer's output; pre-LN, its output's final LayerNorm.
inline at::Tensor f32_encoder(const at::Tensor& x, const std::optional<at::Tensor>& mask,
                              const std::optional<at::Tensor>& positions, at::TensorList weights, int64_t heads,
                              at::ArrayRef<double> eps, bool pre_ln) {
  // a product's panels and bias (its outputs: N, or the panels' where N is given as -1)
  auto product = [&](size_t at, int64_t K, int64_t N) {
    const at::Tensor &panels = weights[at], &bias = weights[at + 1];
    N = N < 0 && panels.dim() == 3 ? panels.size(0) * f32::NR : N;
    TORCH_CHECK(panels.scalar_type() == at::kFloat && panels.is_contiguous() && panels.dim() == 3 &&
                    panels.size(0) * f32::NR == N && panels.size(1) == K && panels.size(2) == f32::NR,
                "a layer's product is not f32_pack's panels for its shape");
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == N,
                "a layer's product needs an fp32 bias of its output size");
    Product p{nullptr, nullptr, nullptr, bias.data_ptr<float>(), K, N};
    p.f32 = panels.data_ptr<float>();
    return p;
  };
  return Stack(x, mask, positions, weights, 12, heads, eps, pre_ln, product).run<F32Products>(heads);
}

}  // namespace bertforge::encoder

// An encoder of int8 layers run a sequence at a time (the int8_encoder operator), post-LN or pre-LN: every layer of
// one sequence, one after the other, on one thread, before the next sequence; with fewer sequences than threads (a
// text served alone) each sequence's products and attention shared out over the threads instead (`shares_out`).
// Each piece is the operators' own (the per-row products' quantization, tiles and epilogue, int8_vnni.h or int8_u7.h;
// attention's Sequence, attention.h; add_layer_norm's rows, layer_norm.h), so the results are theirs bit for bit;
// what goes is the work between them.
// Run operator by operator over a batch, a small model's layer writes each activation of the whole batch out and
// reads it back (BERT-tiny's feed-forward: 3.6 MB for 64 snippets, past the core's L2), each of about ten operators
// finds its rows again, and the products of a batch are tall and thin (K = 128). A sequence's activations (tens of
// rows) stay in L1 and L2 from its first product to its last. Where the CPU has AMX and Linux grants the tiles, the
// VNNI products run on them (int8_amx.h: the same int32 sums, so the same bits). Each sequence reads every layer's
// weights: narrow encoders only (`transforms.SEQUENCE_MAX_HIDDEN`). Where only some positions are answered (a
// classifier's [CLS]), a sequence's padding after its keys is left out of every layer (`real_rows`), and the last
// layer computes its queries at those positions alone (`query_key_value`).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "attention.h"
#include "int8_amx.h"
#include "int8_products.h"
#include "layer_norm.h"
#include "vec.h"

namespace bertforge::encoder {

// A layer's products and LayerNorms. Post-LN: x1 = LN1(out(attention(qkv(x))) + x), then LN2(output(gelu(
// intermediate(x1))) + x1). Pre-LN: LN1 is taken before the attention (the previous layer computed it), LN2 before
// the feed-forward, and the next layer's LN1 (or the encoder's final LayerNorm) after it.
struct Layer {
  Product qkv, out, intermediate, output;
  const float *norm1_weight, *norm1_bias, *norm2_weight, *norm2_bias;
  float eps1, eps2;
};

// A LayerNorm's weight, bias and eps.
struct Norm {
  const float *weight, *bias;
  float eps;
};

// One thread's working memory, sized once for the call's longest sequence and widest product, and its products.
// `team`: the calling thread runs the sequences one after another and shares each one's products (by panels) and
// attention (by groups of heads, as `attention_kernel` shares a lone text's) out over every thread (fewer sequences
// than threads, as for a text served alone); else each thread runs its own sequences.
template <typename Products>
struct EncoderWork {
  Sequence seq;
  Products products;
  bool team = false;
  std::vector<float> qkv, queries, context, attended, normed, middle, normed_in, hidden, output, gathered, x[2];
  EncoderWork(int64_t heads, int64_t T, int64_t H, int64_t I)
      : seq(heads, T, H / heads), products(T, std::max(H, I)), qkv(T * 3 * H), queries(T * 3 * H), context(T * H),
        attended(T * H), normed(T * H), middle(T * H), normed_in(T * H), hidden(T * I), output(T * H),
        gathered(T * H) {
    x[0].resize(T * H);
    x[1].resize(T * H);
  }

  // One post-LN layer over the sequence in `in` (T rows of H), its answer at P rows (`positions`, or every row
  // when null) into `out`.
  void post_ln_layer(const Layer& L, const float* in, const bool* mask, const int64_t* positions, int64_t P,
                     float* out) {
    const int64_t H = seq.N * seq.D;
    Range unused;
    const float* residual = attend(L, in, in, mask, positions, P);
    for (int64_t i = 0; i < P; ++i)
      normalize_row(attended.data() + i * H, residual + i * H, L.norm1_weight, L.norm1_bias, L.eps1, H,
                    normed.data() + i * H, nullptr, unused);
    feed_forward(L, normed.data(), P);
    for (int64_t i = 0; i < P; ++i)
      normalize_row(output.data() + i * H, normed.data() + i * H, L.norm2_weight, L.norm2_bias, L.eps2, H,
                    out + i * H, nullptr, unused);
  }

  // One pre-LN layer: `stream` the residual stream (T rows of H), `normed` its LN1 (the rows the layer reads). Its
  // answer at P rows: the stream into `stream_out` (null: not kept) and its LayerNorm by `next` into `normed_out`.
  void pre_ln_layer(const Layer& L, const float* stream, const float* reads, const bool* mask,
                    const int64_t* positions, int64_t P, const Norm& next, float* stream_out, float* normed_out) {
    const int64_t H = seq.N * seq.D;
    Range unused;
    const float* residual = attend(L, reads, stream, mask, positions, P);
    for (int64_t i = 0; i < P; ++i)
      normalize_row(attended.data() + i * H, residual + i * H, L.norm2_weight, L.norm2_bias, L.eps2, H,
                    normed.data() + i * H, middle.data() + i * H, unused);
    feed_forward(L, normed.data(), P);
    for (int64_t i = 0; i < P; ++i)
      normalize_row(output.data() + i * H, middle.data() + i * H, next.weight, next.bias, next.eps, H,
                    normed_out + i * H, stream_out == nullptr ? nullptr : stream_out + i * H, unused);
  }

 private:
  // attended (P rows) = out(attention(qkv(in))) at P rows; returns the residual's rows at those positions.
  const float* attend(const Layer& L, const float* in, const float* residual, const bool* mask,
                      const int64_t* positions, int64_t P) {
    Range unused;
    query_key_value(L.qkv, in, positions, P);
    if (team && seq.T * seq.T * seq.N * seq.D >= Products::kChunk) {
      attention_kernel(qkv.data(), mask, positions, context.data(), 1, seq.T, P, seq.N, seq.D);
    } else {
      seq.read(qkv.data(), mask);
      seq.transpose_keys();
      seq.answer_all(positions, P, context.data(), unused);
    }
    product(context.data(), P, L.out, false, attended.data());
    return positions == nullptr ? residual : gather(residual, positions, P);
  }

  // y's columns c0 .. c1 (whole panels; c1 past N stops at N) of the M rows' product: the rows quantized once, then
  // the panels on this thread, or in the team's chunks of at least kChunkMacs (the same tiles a panel: the same bits)
  void product(const float* in, int64_t M, const Product& w, bool gelu, float* y, int64_t c0 = 0,
               int64_t c1 = kWhole) {
    constexpr int64_t kPanel = Products::kPanel;
    const int64_t p0 = c0 / kPanel, p1 = (std::min(c1, w.N) + kPanel - 1) / kPanel;
    products.quantize(in, M, w.K);
    const int64_t grain = task_grain(M, Products::depth(w.K), kPanel, Products::kChunk);
    if (!team || p1 - p0 < 2 * grain) return products.multiply(M, w, gelu, y, p0, p1);
    at::parallel_for(p0, p1, grain, [&](int64_t begin, int64_t end) { products.multiply(M, w, gelu, y, begin, end); });
  }

  // the P rows (H wide) of `rows` at positions, in their order, into `gathered`
  const float* gather(const float* rows, const int64_t* positions, int64_t P) {
    const int64_t H = seq.N * seq.D;
    for (int64_t i = 0; i < P; ++i) std::copy_n(rows + positions[i] * H, H, gathered.data() + i * H);
    return gathered.data();
  }

  // qkv (T rows of 3H) = qkv(in), its queries only at the P positions where they are given (the other rows' are
  // left as they were: attention copies them along but answers at the P positions alone). A classifier's last layer
  // then skips a third of its first product over all but [CLS] (about a fifteenth of BERT-tiny's products, a
  // sixtieth of MiniLM-L6's). Each row's outputs are the same bits either way (per-row codes and sums). Where the
  // queries' columns are not whole panels (H not a multiple of the panels' width), every row's are computed.
  void query_key_value(const Product& w, const float* in, const int64_t* positions, int64_t P) {
    const int64_t T = seq.T, H = seq.N * seq.D;
    if (positions == nullptr || H % Products::kPanel != 0) return product(in, T, w, false, qkv.data());
    product(in, T, w, false, qkv.data(), H);
    product(gather(in, positions, P), P, w, false, queries.data(), 0, H);
    for (int64_t i = 0; i < P; ++i) std::copy_n(queries.data() + i * 3 * H, H, qkv.data() + positions[i] * 3 * H);
  }

  // output (P rows) = output(gelu(intermediate(in)))
  void feed_forward(const Layer& L, const float* in, int64_t P) {
    product(in, P, L.intermediate, true, hidden.data());
    product(hidden.data(), P, L.output, false, output.data());
  }
};

// The rows of a sequence its layers must run: where only some positions are answered and its mask is a run of
// keys then padding holding them all, the keys' (padding attends to nothing a key reads, and no one reads its
// answers); else all T.
inline int64_t real_rows(const bool* keys, const int64_t* positions, int64_t T, int64_t P) {
  if (keys == nullptr || positions == nullptr) return T;
  int64_t n = 0;
  while (n < T && keys[n]) ++n;
  for (int64_t t = n; t < T; ++t)
    if (keys[t]) return T;
  for (int64_t i = 0; i < P; ++i)
    if (positions[i] >= n) return T;
  return n > 0 ? n : T;
}

// One call's inputs: x (B, T, H); mask (B, T) or null; positions (B, P) or null; out (B, P, H). Pre-LN when `final`
// (the encoder's last LayerNorm) is given, else post-LN.
struct Encoding {
  const float* x;
  const bool* mask;
  const int64_t* positions;
  const std::vector<Layer>& layers;
  const std::optional<Norm>& final;
  int64_t T, P, H;
  float* out;
};

// Sequence b of the call through every layer, on `work`.
template <typename Products>
void encode_sequence(EncoderWork<Products>& work, const Encoding& job, int64_t b) {
  const int64_t T = job.T, P = job.P, H = job.H, last = static_cast<int64_t>(job.layers.size()) - 1;
  const std::vector<Layer>& layers = job.layers;
  const float* in = job.x + b * T * H;
  const bool* keys = job.mask == nullptr ? nullptr : job.mask + b * T;
  float* answer = job.out + b * P * H;
  const int64_t* at = job.positions == nullptr ? nullptr : job.positions + b * P;
  const int64_t rows = real_rows(keys, at, T, P);
  work.seq.fit(rows);
  if (!job.final.has_value()) {
    for (int64_t l = 0; l <= last; ++l) {
      float* dst = l == last ? answer : work.x[l % 2].data();
      work.post_ln_layer(layers[l], in, keys, l == last ? at : nullptr, l == last ? P : rows, dst);
      in = dst;
    }
    return;
  }
  Range unused;
  const Layer& first = layers.front();
  for (int64_t t = 0; t < rows; ++t)
    normalize_row(in + t * H, nullptr, first.norm1_weight, first.norm1_bias, first.eps1, H,
                  work.normed_in.data() + t * H, nullptr, unused);
  for (int64_t l = 0; l <= last; ++l) {
    const Norm next = l == last ? *job.final : Norm{layers[l + 1].norm1_weight, layers[l + 1].norm1_bias,
                                                    layers[l + 1].eps1};
    float* stream = l == last ? nullptr : work.x[l % 2].data();
    work.pre_ln_layer(layers[l], in, work.normed_in.data(), keys, l == last ? at : nullptr, l == last ? P : rows,
                      next, stream, l == last ? answer : work.normed_in.data());
    in = stream;
  }
}

// Whether B sequences of T rows (H wide, feed-forward I) run one after another with each one's work shared out over
// the threads (`EncoderWork::team`): where they are fewer than the threads and a sequence's widest product makes
// two chunks, not on AMX tiles (each thread's own state: there a thread runs its sequences alone).
inline bool shares_out(int64_t B, int64_t T, int64_t H, int64_t I, bool tiles, int64_t chunk = kChunkMacs) {
  return B < at::get_num_threads() && T * H * I >= 2 * chunk && !tiles;
}

// Every sequence through every layer, the last answering at positions when given: a sequence a task, or one after
// another with their work shared out (`shares_out`).
template <typename Products>
void encode(const Encoding& job, int64_t heads, int64_t B) {
  const int64_t T = job.T, H = job.H, I = job.layers.front().intermediate.N;
  if (shares_out(B, T, H, I, Products::uses_tiles(), Products::kChunk)) {
    EncoderWork<Products> work(heads, T, H, I);
    work.team = true;
    for (int64_t b = 0; b < B; ++b) encode_sequence(work, job, b);
    return;
  }
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    EncoderWork<Products> work(heads, T, H, I);
#if BERTFORGE_AMX
    std::optional<amx::Tiles> tiles;  // configured for this thread while it works, released after
    if (work.products.on_tiles) tiles.emplace();
#endif
    for (int64_t b = begin; b < end; ++b) encode_sequence(work, job, b);
  });
}


// An encoder operator's operands: x's checks and the layers read from its weights, `per` tensors a layer (its four
// products', each read by `product(at, K, N)` from its first tensor's index, then LN1's and LN2's weight and bias)
// and, pre-LN, the final LayerNorm's weight and bias after the last layer; eps two a layer (and the final one's).
struct Stack {
  at::Tensor x;
  Queries queries;
  std::vector<Layer> layers;
  std::optional<Norm> final;

  template <typename ReadProduct>
  Stack(const at::Tensor& input, const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& positions,
        at::TensorList weights, size_t per, int64_t heads, at::ArrayRef<double> eps, bool pre_ln, ReadProduct product)
      : x(checked(input, heads)), queries(mask, positions, x.size(0), x.size(1)) {
    const int64_t H = x.size(2);
    const size_t extra = pre_ln ? 2 : 0, count = weights.size() / per, each = (per - 4) / 4;
    TORCH_CHECK(count > 0 && weights.size() == per * count + extra && eps.size() == 2 * count + extra / 2,
                "weights must be ", per, " tensors a layer (and the final LayerNorm's two, pre-LN), eps two a layer "
                "(and one)");
    TORCH_CHECK(queries.P <= x.size(1), "positions must be (B, P), P at most T");
    auto vector = [&](size_t at) {
      TORCH_CHECK(weights[at].scalar_type() == at::kFloat && weights[at].is_contiguous() && weights[at].numel() == H,
                  "a LayerNorm's weight and bias must be fp32 of the hidden size");
      return weights[at].data_ptr<float>();
    };
    for (size_t l = 0; l < count; ++l) {
      const size_t at = l * per, norms = at + 4 * each;
      const Product qkv = product(at, H, 3 * H), out = product(at + each, H, H);
      const Product intermediate = product(at + 2 * each, H, -1);  // -1: its outputs, from the weights
      layers.push_back(Layer{qkv, out, intermediate, product(at + 3 * each, intermediate.N, H), vector(norms),
                             vector(norms + 1), vector(norms + 2), vector(norms + 3),
                             static_cast<float>(eps[2 * l]), static_cast<float>(eps[2 * l + 1])});
    }
    if (pre_ln) final = Norm{vector(per * count), vector(per * count + 1), static_cast<float>(eps[2 * count])};
  }

  // every sequence through every layer on `Products` (`encode`): (B, P, H)
  template <typename Products>
  at::Tensor run(int64_t heads) const {
    const int64_t B = x.size(0), T = x.size(1), H = x.size(2), P = queries.P;
    at::Tensor out = at::empty({B, P, H}, x.options());
    const Encoding job{x.data_ptr<float>(), queries.mask_data(), queries.positions_data(), layers, final, T, P, H,
                       out.data_ptr<float>()};
    encode<Products>(job, heads, B);
    return out;
  }

 private:
  static at::Tensor checked(const at::Tensor& x, int64_t heads) {
    TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat, "x must be fp32 (B, T, H)");
    TORCH_CHECK(heads > 0 && x.size(2) % (heads * kMultiple) == 0, "H must be heads x a multiple of 16");
    return x.contiguous();
  }
};

// The operator: x (B, T, H) fp32; mask (B, T) (True: a key to attend) or None; positions (B, P) or None (the last
// layer's answers at every position); weights, 20 a layer: for each of qkv, attention output, intermediate (GELU
// inside) and output its vnni_pack panels (u7_pack's where `u7`), column sums, weight scales and bias, then LN1's and
// LN2's weight and bias (`Layer`); pre-LN layers add the final LayerNorm's weight and bias at the end. eps: two a
// layer (and the final LayerNorm's). Returns (B, P, H), or (B, T, H) without positions: post-LN, the last layer's
// output; pre-LN, its output's final LayerNorm.
inline at::Tensor int8_encoder(const at::Tensor& x, const std::optional<at::Tensor>& mask,
                               const std::optional<at::Tensor>& positions, at::TensorList weights, int64_t heads,
                               at::ArrayRef<double> eps, bool pre_ln, bool u7) {
  TORCH_CHECK(u7 || vnni::kBuilt, "int8_encoder: this build of bertforge's kernels has no AVX-512 VNNI (the CPU "
                                  "lacks avx512_vnni); its products run on the u7 kernels");
  // a product's panels, column sums, weight scales (one an output: N where it is given as -1) and bias
  auto product = [&](size_t at, int64_t K, int64_t N) {
    const at::Tensor &panels = weights[at], &sums = weights[at + 1], &wscale = weights[at + 2], &bias = weights[at + 3];
    N = N < 0 ? wscale.numel() : N;
    const int64_t NR = u7 ? u7::NR : vnni::NR, depth = u7 ? 8 : 4;
    const int64_t Kp = (K + depth - 1) / depth * depth, count = (N + NR - 1) / NR;
    TORCH_CHECK(panels.scalar_type() == at::kChar && panels.is_contiguous() && panels.numel() == count * Kp * NR &&
                    sums.scalar_type() == at::kInt && sums.is_contiguous() && sums.numel() == count * NR,
                u7 ? "a layer's product is not u7_pack's panels for its shape"
                   : "a layer's product is not vnni_pack's panels for its shape");
    TORCH_CHECK(wscale.scalar_type() == at::kFloat && wscale.is_contiguous() && wscale.numel() == N &&
                    bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == N,
                "a layer's product needs fp32 weight scales and bias of its output size");
    return Product{panels.data_ptr<int8_t>(), sums.data_ptr<int32_t>(), wscale.data_ptr<float>(),
                   bias.data_ptr<float>(), K, N};
  };
  const Stack stack(x, mask, positions, weights, 20, heads, eps, pre_ln, product);
#if BERTFORGE_VNNI
  if (!u7) return stack.run<VnniProducts>(heads);
#endif
  return stack.run<U7Products>(heads);
}

// Whether the operator shares B sequences' work out over the threads (`shares_out`), on the u7 or the VNNI products.
inline bool int8_encoder_shares(int64_t B, int64_t T, int64_t H, int64_t I, bool u7) {
  return shares_out(B, T, H, I, !u7 && amx::usable());
}

}  // namespace bertforge::encoder

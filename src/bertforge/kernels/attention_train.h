// Attention for training in fp32 (cpu_kernels.cpp registers attention_train and attention_train_backward;
// bertforge/encoder.py's TrainingAttention uses them): scores, mask, softmax, dropout and the weighted values, and the
// gradients of all of it, one head of one sequence a task.
//
// The unfused path is about ten operators a layer (the heads split out of the query/key/value product's output and
// copied for two batched products, the scale, the mask, the softmax, dropout, the heads merged back; in the backward
// the same again and the three gradients stacked into one), each a pass over memory: on a 2-core Zen 4 a MiniLM-L6
// layer's attention took 7 ms forward and backward at 32 x 28 tokens, where its multiply-adds need about 1. Here the
// forward reads the product's output (B, T, 3H) as it is and writes its result in the (B, T, H) layout the next
// product reads; the backward writes the (B, T, 3H) gradient that product's backward reads.
//
// The forward keeps the softmax's probabilities (B, N, T, Tp), Tp = T rounded up to whole vectors (the extra columns
// zeros), for the backward; dropout's mask is not kept: it is dropout.h's hash of each probability's index in the
// (B, N, T, T) tensor the unfused path drops from, recomputed in the backward, so both paths drop the same
// probabilities for the same key. A query with no key to attend gets zeros (the unfused path gives NaN).

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention.h"
#include "dropout.h"
#include "vec.h"

namespace bertforge {
namespace train {

// A left-hand matrix whose element (i, k) is at p[i * row + k * step] (step 1: rows; row 1: a matrix transposed).
struct Lhs {
  const float* p;
  int64_t row, step;
};

// An output matrix, rows `row` floats apart.
struct Out {
  float* p;
  int64_t row;
};

template <int QN, int NB>
inline void product_block(Lhs a, const float* b, int64_t ldb, int64_t K, float alpha, Out c) {
  Vec acc[QN][NB];
#pragma GCC unroll 8
  for (int i = 0; i < QN; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[i][j] = Vec::zero();
  accumulate<QN, NB>(a.p, a.row, a.step, b, ldb, K, acc);
  const Vec s = Vec::all(alpha);
#pragma GCC unroll 8
  for (int i = 0; i < QN; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) (acc[i][j] * s).store(c.p + i * c.row + kLanes * j);
}

template <int QN>
inline void product_strip(Lhs a, const float* b, int64_t ldb, int64_t K, int64_t cols, float alpha, Out c) {
  int64_t j0 = 0;
  for (; j0 + 2 * kLanes <= cols; j0 += 2 * kLanes) product_block<QN, 2>(a, b + j0, ldb, K, alpha, {c.p + j0, c.row});
  if (j0 < cols) product_block<QN, 1>(a, b + j0, ldb, K, alpha, {c.p + j0, c.row});
}

// Rows of A a product's block takes: as many accumulators as the ISA has registers to spare (32 vector registers
// on AVX-512, 16 on AVX2).
constexpr int kRows = kLanes == 16 ? 8 : 4;

// C (M rows of `cols`, whole vectors) = alpha A (M x K) B (K rows, ldb apart), kRows rows at a time.
inline void product(Lhs a, const float* b, int64_t ldb, int64_t M, int64_t K, int64_t cols, float alpha, Out c) {
  int64_t i0 = 0;
  for (; i0 + kRows <= M; i0 += kRows) product_strip<kRows>({a.p + i0 * a.row, a.row, a.step}, b, ldb, K, cols, alpha,
                                                             {c.p + i0 * c.row, c.row});
  for (; i0 < M; i0 += 4) {
    const Lhs ai{a.p + i0 * a.row, a.row, a.step};
    const Out ci{c.p + i0 * c.row, c.row};
    switch (std::min<int64_t>(4, M - i0)) {
      case 4: product_strip<4>(ai, b, ldb, K, cols, alpha, ci); break;
      case 3: product_strip<3>(ai, b, ldb, K, cols, alpha, ci); break;
      case 2: product_strip<2>(ai, b, ldb, K, cols, alpha, ci); break;
      default: product_strip<1>(ai, b, ldb, K, cols, alpha, ci);
    }
  }
}

// Dropout's keep test of dropout.h for a key and drop probability: element `index` survives when keep(index).
struct Dropper {
  uint32_t k0, k1, threshold;
  float scale;
  bool active;
  Dropper(double p, int64_t key)
      : k0(static_cast<uint32_t>(static_cast<uint64_t>(key))),
        k1(static_cast<uint32_t>(static_cast<uint64_t>(key) >> 32)),
        threshold(static_cast<uint32_t>(std::min(std::llround(p * 4294967296.0), 4294967295LL))),
        scale(static_cast<float>(1.0 / (1.0 - p))),
        active(p > 0) {}
  // out[j] = x[j] * keep * scale for j < n, element j's index base + j (as apply_mask_range computes it); n whole
  // vectors, so that the loop vectorizes without a scalar tail (the rows' padding, zeros, stays zeros)
  void apply(const float* x, float* out, int64_t n, int64_t base) const {
    const uint32_t a = k0, c = k1, t = threshold, start = static_cast<uint32_t>(base);
    const float s = scale;
    for (int64_t j = 0; j < n; ++j) {
      const uint32_t u = mix32(mix32((start + static_cast<uint32_t>(j)) ^ a) + c);
      out[j] = x[j] * (u >= t ? 1.0f : 0.0f) * s;
    }
  }
};

// Prefetches lines [from, to) of the `count` 64-byte lines at p into L2 (null p: none).
inline void prefetch_lines(const void* p, int64_t count, int64_t from, int64_t to) {
  if (p == nullptr) return;
  const char* c = static_cast<const char*>(p);
  for (int64_t line = from; line < std::min(to, count); ++line) _mm_prefetch(c + line * 64, _MM_HINT_T1);
}

// One head's working set: its queries (scaled by 1 / sqrt(D)), keys and values (T rows of D; the keys and values
// padded with zero rows to Tp), keys or values transposed (D x Tp), which keys may be attended (keep 1 / 0, bias
// 0 / -inf), a (T x Tp) matrix of scores or their gradients, the dropped probabilities and the output's gradient.
struct Head {
  int64_t T, D, Tp;
  std::vector<float> q, k, v, transposed, keep, bias, S, dropped, grad;
  Head(int64_t T, int64_t D)
      : T(T), D(D), Tp((T + kLanes - 1) / kLanes * kLanes), q(T * D), k(Tp * D, 0.0f), v(Tp * D, 0.0f),
        transposed(D * Tp), keep(Tp, 0.0f), bias(Tp, -kInf), S(T * Tp), dropped(T * Tp, 0.0f), grad(T * D) {}

  // The head's columns [n D, n D + D) of the query, key and value thirds of `rows` (T rows of 3H); the mask row
  // (null: every key) into keep and bias.
  void read(const float* rows, int64_t H, int64_t n, const bool* mask) {
    const Vec scale = Vec::all(1.0f / std::sqrt(static_cast<float>(D)));
    for (int64_t t = 0; t < T; ++t) {
      const float* r = rows + t * 3 * H + n * D;
      for (int64_t d = 0; d < D; d += kLanes) {
        (Vec::load(r + d) * scale).store(q.data() + t * D + d);
        Vec::load(r + H + d).store(k.data() + t * D + d);
        Vec::load(r + 2 * H + d).store(v.data() + t * D + d);
      }
      const bool allowed = mask == nullptr || mask[t];
      keep[t] = allowed ? 1.0f : 0.0f;
      bias[t] = allowed ? 0.0f : -kInf;
    }
  }

  // transposed = m (Tp x D) transposed, kLanes x kLanes blocks at a time
  void transpose_from(const std::vector<float>& m) {
    for (int64_t t0 = 0; t0 < Tp; t0 += kLanes)
      for (int64_t d0 = 0; d0 < D; d0 += kLanes) {
        Vec block[kLanes];
        for (int64_t i = 0; i < kLanes; ++i) block[i] = Vec::load(m.data() + (t0 + i) * D + d0);
        transpose(block);
        for (int64_t i = 0; i < kLanes; ++i) block[i].store(transposed.data() + (d0 + i) * Tp + t0);
      }
  }

  // QN query rows from i0: scores, softmax, the probabilities into probs (rows of Tp)
  template <int QN>
  void probabilities(int64_t i0, float* probs) {
    float inv[QN];
    scores<QN>(q.data() + i0 * D, D, transposed.data(), Tp, bias.data(), S.data() + i0 * Tp);
    softmax<QN>(S.data() + i0 * Tp, Tp, keep.data(), inv);
    for (int i = 0; i < QN; ++i)
      for (int64_t j = 0; j < Tp; j += kLanes)
        (Vec::load(S.data() + (i0 + i) * Tp + j) * Vec::all(inv[i])).store(probs + (i0 + i) * Tp + j);
  }

  // The forward: probabilities into probs (T x Tp), the output into out (T rows, `stride` apart). `base` is the
  // index of the head's first probability in the (B, N, T, T) tensor dropout's mask is drawn over.
  void forward(float* probs, float* out, int64_t stride, const Dropper& drop, int64_t base) {
    transpose_from(k);
    for (int64_t i0 = 0; i0 < T; i0 += kQueries) {
      switch (std::min<int64_t>(kQueries, T - i0)) {
        case 4: probabilities<4>(i0, probs); break;
        case 3: probabilities<3>(i0, probs); break;
        case 2: probabilities<2>(i0, probs); break;
        default: probabilities<1>(i0, probs);
      }
    }
    const float* p = probs;
    if (drop.active) {
      for (int64_t i = 0; i < T; ++i) drop.apply(probs + i * Tp, dropped.data() + i * Tp, Tp, base + i * T);
      p = dropped.data();
    }
    product({p, Tp, 1}, v.data(), D, T, T, D, 1.0f, {out, stride});
  }

  // The backward from the output's gradient (in `grad`) and the forward's probabilities: the gradients of the
  // queries, keys and values into dq, dk and dv (T rows each, `stride` apart).
  void backward(const float* probs, float* dq, float* dk, float* dv, int64_t stride, const Dropper& drop,
                int64_t base) {
    transpose_from(v);
    product({grad.data(), D, 1}, transposed.data(), Tp, T, D, Tp, 1.0f, {S.data(), Tp});  // of the dropped probs
    const float* p = probs;
    for (int64_t i = 0; i < T; ++i) {
      const float* pi = probs + i * Tp;
      float* si = S.data() + i * Tp;
      if (drop.active) {
        drop.apply(pi, dropped.data() + i * Tp, Tp, base + i * T);
        drop.apply(si, si, Tp, base + i * T);  // of the probabilities
      }
      Vec dot = Vec::zero();
      for (int64_t j = 0; j < Tp; j += kLanes) dot = fma(Vec::load(pi + j), Vec::load(si + j), dot);
      const Vec r = Vec::all(reduce_add(dot));
      for (int64_t j = 0; j < Tp; j += kLanes) (Vec::load(pi + j) * (Vec::load(si + j) - r)).store(si + j);
    }
    if (drop.active) p = dropped.data();
    product({p, 1, Tp}, grad.data(), D, T, T, D, 1.0f, {dv, stride});
    product({S.data(), Tp, 1}, k.data(), D, T, T, D, 1.0f / std::sqrt(static_cast<float>(D)), {dq, stride});
    product({S.data(), 1, Tp}, q.data(), D, T, T, D, 1.0f, {dk, stride});
  }
};

// Shapes of a call: B sequences of T tokens, N heads of D.
struct Shape {
  int64_t B, T, N, D;
};

// qkv (B, T, 3H) -> out (B, T, H) and probs (B, N, T, Tp); mask (B, T) true where a key may be attended, or null.
// A task is a sequence, its heads in turn; while a head is worked, a share of the next sequence's rows is prefetched,
// so that the heads find them in cache (the rows hold every head's columns; read head by head from memory they came
// at a fraction of the bandwidth).
inline void attention_forward(const float* qkv, const bool* mask, Shape s, const Dropper& drop, float* out,
                              float* probs) {
  const int64_t H = s.N * s.D, lines = s.T * 3 * H * 4 / 64;
  at::parallel_for(0, s.B, 1, [&](int64_t begin, int64_t end) {
    Head head(s.T, s.D);
    for (int64_t b = begin; b < end; ++b) {
      const float* rows = qkv + b * s.T * 3 * H;
      for (int64_t n = 0; n < s.N; ++n) {
        const int64_t task = b * s.N + n;
        prefetch_lines(b + 1 < end ? rows + s.T * 3 * H : nullptr, lines, lines * n / s.N, lines * (n + 1) / s.N);
        head.read(rows, H, n, mask == nullptr ? nullptr : mask + b * s.T);
        head.forward(probs + task * s.T * head.Tp, out + b * s.T * H + n * s.D, H, drop, task * s.T * s.T);
      }
    }
  });
}

// grad (B, T, H), the output's gradient -> dqkv (B, T, 3H), from the forward's qkv and probs.
inline void attention_backward(const float* grad, const float* qkv, const float* probs, Shape s, const Dropper& drop,
                               float* dqkv) {
  const int64_t H = s.N * s.D, Tp = (s.T + kLanes - 1) / kLanes * kLanes;
  const int64_t lines = s.T * 3 * H * 4 / 64, grad_lines = s.T * H * 4 / 64, prob_lines = s.N * s.T * Tp * 4 / 64;
  at::parallel_for(0, s.B, 1, [&](int64_t begin, int64_t end) {
    Head head(s.T, s.D);
    for (int64_t b = begin; b < end; ++b) {
      const float* rows = qkv + b * s.T * 3 * H;
      const bool more = b + 1 < end;
      for (int64_t n = 0; n < s.N; ++n) {
        const int64_t task = b * s.N + n;
        prefetch_lines(more ? rows + s.T * 3 * H : nullptr, lines, lines * n / s.N, lines * (n + 1) / s.N);
        prefetch_lines(more ? grad + (b + 1) * s.T * H : nullptr, grad_lines, grad_lines * n / s.N,
                       grad_lines * (n + 1) / s.N);
        prefetch_lines(more ? probs + (b + 1) * s.N * s.T * Tp : nullptr, prob_lines, prob_lines * n / s.N,
                       prob_lines * (n + 1) / s.N);
        head.read(rows, H, n, nullptr);
        for (int64_t t = 0; t < s.T; ++t)
          std::copy_n(grad + (b * s.T + t) * H + n * s.D, s.D, head.grad.data() + t * s.D);
        float* dq = dqkv + b * s.T * 3 * H + n * s.D;
        head.backward(probs + task * s.T * Tp, dq, dq + H, dq + 2 * H, 3 * H, drop, task * s.T * s.T);
      }
    }
  });
}

}  // namespace train
}  // namespace bertforge

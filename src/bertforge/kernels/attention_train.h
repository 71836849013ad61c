// Attention for training in fp32 (cpu_kernels.cpp registers attention_train and attention_train_backward;
// bertforge/encoder.py's TrainingAttention uses them): scores, mask, softmax, dropout and the weighted values, and the
// gradients of all of it, one head of one sequence a task. Under bf16 autocast the product's output, the result and
// the gradients are bf16 (the element type E), read into and written from the head's fp32 working set: the arithmetic
// is fp32's either way, and each bf16 result is rounded once.
//
// The unfused path is about ten operators a layer (the heads split out of the query/key/value product's output and
// copied for two batched products, the scale, the mask, the softmax, dropout, the heads merged back; in the backward
// the same again and the three gradients stacked into one), each a pass over memory: on a 2-core Zen 4 a MiniLM-L6
// layer's attention took 4.1 ms forward and backward at 32 x 28 tokens, 1.9 here (bench/attention.py
// --training-kernels; docs/benchmarks.md). Here the forward reads the product's output (B, T, 3H) as it is and
// writes its result in the (B, T, H) layout the next product reads; the backward writes the (B, T, 3H) gradient that
// product's backward reads.
//
// The forward keeps the softmax's probabilities (B, N, T, Tp), Tp = T rounded up to whole vectors (the extra columns
// zeros), for the backward, with dropout's mask in their sign bits (Dropper): the mask is dropout.h's hash of each
// probability's index in the (B, N, T, T) tensor the unfused path drops from, so both paths drop the same
// probabilities for the same key. A query with no key to attend gets zeros (the unfused path gives NaN).

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
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

// Dropout on the probabilities: dropout.h's mask for p and a key over the (B, N, T, T) tensor's indices, a vector at a
// time. The forward marks each probability it drops by setting its sign bit in the probabilities it keeps for the
// backward (they are >= 0: the magnitudes are the probabilities, the signs the mask), so that the backward reads the
// mask instead of hashing every index again, twice.
struct Dropper {
  MaskKey key;
  float scale;
  bool active;
  Dropper(double p, int64_t key) : key(p, key), scale(static_cast<float>(1.0 / (1.0 - p))), active(p > 0) {}

  // A row of probabilities (n floats, whole vectors; element 0 at index `base`): dropped into `out`, marked in x.
  void drop_and_mark(float* x, float* out, int64_t n, int64_t base) const {
    for (int64_t j = 0; j < n; j += kLanes) {
      const Vec keep = key.kept_lanes(static_cast<uint32_t>(base + j)), p = Vec::load(x + j);
      (p * keep_factor(keep, scale)).store(out + j);
      bits_xor(p, bits_andnot(keep, Vec::all(-0.0f))).store(x + j);
    }
  }

  // The factor of each of the kLanes marked probabilities at x (their sign bits: set where dropped).
  Vec marked_factor(Vec x) const { return bits_andnot(sign_lanes(x), Vec::all(scale)); }
};

// A marked probability's magnitude (the probability; with no dropout the value itself).
inline Vec magnitude(Vec x) { return bits_andnot(Vec::all(-0.0f), x); }

// Prefetches share `part` of `parts` of the 64-byte lines of n elements at p into L2.
template <typename E>
inline void prefetch_share(const E* p, int64_t n, int64_t part, int64_t parts) {
  const int64_t lines = n * static_cast<int64_t>(sizeof(E)) / 64;
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t line = lines * part / parts; line < lines * (part + 1) / parts; ++line)
    _mm_prefetch(c + line * 64, _MM_HINT_T1);
}

// n elements (whole vectors) from `from` to `to`, each converted between fp32 and bf16 where their types differ.
template <typename A, typename B>
inline void convert(const A* from, int64_t n, B* to) {
  for (int64_t i = 0; i < n; i += kLanes) Vec::load(from + i).store(to + i);
}

// One head's working set: its queries (scaled by 1 / sqrt(D)), keys and values (T rows of D; the keys and values
// padded with zero rows to Tp), keys or values transposed (D x Tp), which keys may be attended (keep 1 / 0, bias
// 0 / -inf), a (T x Tp) matrix of scores or their gradients, the dropped probabilities and the output's gradient;
// for bf16 results, the fp32 result or the three gradients (3 T x D) before they are rounded.
// Made once a thread for the call's length `row` (the padded batch's T, which dropout's indices count in), and fitted
// to each packed sequence's own length.
struct Head {
  int64_t T, D, Tp, row;
  std::vector<float> q, k, v, transposed, keep, bias, S, dropped, grad, result;
  Head(int64_t D, int64_t row, bool rounds)
      : T(row), D(D), Tp(padded_length(row)), row(row), q(T * D), k(Tp * D, 0.0f), v(Tp * D, 0.0f),
        transposed(D * Tp), keep(Tp, 0.0f), bias(Tp, -kInf), S(T * Tp), dropped(T * Tp, 0.0f), grad(T * D),
        result(rounds ? 3 * T * D : 0) {}

  // A sequence of `length` (<= row) tokens next: the rows from `length` up to whole vectors are padding again
  // (zero keys and values, keep 0, bias -inf), as the constructor leaves them.
  void fit(int64_t length) {
    if (length == T) return;
    T = length, Tp = padded_length(length);
    std::fill(k.begin() + T * D, k.begin() + Tp * D, 0.0f);
    std::fill(v.begin() + T * D, v.begin() + Tp * D, 0.0f);
    std::fill(keep.begin() + T, keep.begin() + Tp, 0.0f);
    std::fill(bias.begin() + T, bias.begin() + Tp, -kInf);
  }

  // The head's columns [n D, n D + D) of the query, key and value thirds of `rows` (T rows of 3H); the mask row
  // (null: every key) into keep and bias.
  template <typename E>
  void read(const E* rows, int64_t H, int64_t n, const bool* mask) {
    const Vec scale = Vec::all(1.0f / std::sqrt(static_cast<float>(D)));
    for (int64_t t = 0; t < T; ++t) {
      const E* r = rows + t * 3 * H + n * D;
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
    transpose_matrix(k.data(), Tp, D, transposed.data());
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
      for (int64_t i = 0; i < T; ++i) drop.drop_and_mark(probs + i * Tp, dropped.data() + i * Tp, Tp, base + i * row);
      p = dropped.data();
    }
    product({p, Tp, 1}, v.data(), D, T, T, D, 1.0f, {out, stride});
  }

  // The backward from the output's gradient (in `grad`) and the forward's probabilities: the gradients of the
  // queries, keys and values into dq, dk and dv (T rows each, `stride` apart).
  void backward(const float* probs, float* dq, float* dk, float* dv, int64_t stride, const Dropper& drop) {
    transpose_matrix(v.data(), Tp, D, transposed.data());
    product({grad.data(), D, 1}, transposed.data(), Tp, T, D, Tp, 1.0f, {S.data(), Tp});  // of the dropped probs
    for (int64_t i = 0; i < T; ++i) {
      const float* pi = probs + i * Tp;
      float* si = S.data() + i * Tp;
      Vec dot = Vec::zero();
      if (drop.active) {  // the dropped probabilities again, and the gradient of the probabilities from theirs
        float* di = dropped.data() + i * Tp;
        for (int64_t j = 0; j < Tp; j += kLanes) {
          const Vec x = Vec::load(pi + j), f = drop.marked_factor(x), prob = magnitude(x);
          (prob * f).store(di + j);
          const Vec g = Vec::load(si + j) * f;
          g.store(si + j);
          dot = fma(prob, g, dot);
        }
      } else {
        for (int64_t j = 0; j < Tp; j += kLanes) dot = fma(Vec::load(pi + j), Vec::load(si + j), dot);
      }
      const Vec r = Vec::all(reduce_add(dot));
      for (int64_t j = 0; j < Tp; j += kLanes) (magnitude(Vec::load(pi + j)) * (Vec::load(si + j) - r)).store(si + j);
    }
    const float* p = drop.active ? dropped.data() : probs;
    product({p, 1, Tp}, grad.data(), D, T, T, D, 1.0f, {dv, stride});
    product({S.data(), Tp, 1}, k.data(), D, T, T, D, 1.0f / std::sqrt(static_cast<float>(D)), {dq, stride});
    product({S.data(), 1, Tp}, q.data(), D, T, T, D, 1.0f, {dk, stride});
  }
};

// Shapes of a call: B sequences of at most T tokens, N heads of D.
struct Shape {
  int64_t B, T, N, D;
};

// Where each sequence of a call lies. Padded (offsets null): sequence b is rows b T .. b T + T, its padding masked.
// Packed: rows offsets[b] .. offsets[b + 1], real tokens only (at most T), its probabilities from probs_first[b].
// Either way dropout's index of head n's probability (i, j) is ((b N + n) T + i) T + j, as in the padded batch's
// (B, N, T, T) probabilities, so a right-padded batch drops the same probabilities packed or not.
struct Layout {
  const int64_t* offsets = nullptr;  // B + 1
  const int64_t* probs_first = nullptr;  // B
  int64_t first(int64_t b, const Shape& s) const { return offsets == nullptr ? b * s.T : offsets[b]; }
  int64_t length(int64_t b, const Shape& s) const { return offsets == nullptr ? s.T : offsets[b + 1] - offsets[b]; }
  int64_t probs_at(int64_t b, const Shape& s) const {
    return offsets == nullptr ? b * s.N * s.T * padded_length(s.T) : probs_first[b];
  }
};

// Where a packed call's probabilities begin, sequence by sequence (N T_b Tp_b floats each), and their total.
inline int64_t packed_probs(const int64_t* offsets, int64_t B, int64_t N, int64_t* first) {
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    first[b] = total;
    const int64_t T = offsets[b + 1] - offsets[b];
    total += N * T * padded_length(T);
  }
  return total;
}

// qkv (rows, 3H) -> out (rows, H) and the probabilities; mask (B, T) true where a key may be attended, or null (and
// null when packed). A task is a sequence, its heads in turn; while a head is worked, a share of the next sequence's
// rows is prefetched, so that the heads find them in cache (the rows hold every head's columns; with one head of any
// sequence a task, the loads of qkv's rows took a third of the backward's time under perf). E: fp32 or bf16.
template <typename E>
inline void attention_forward(const E* qkv, const bool* mask, Shape s, Layout where, const Dropper& drop, E* out,
                              float* probs) {
  constexpr bool rounds = !std::is_same_v<E, float>;
  const int64_t H = s.N * s.D;
  at::parallel_for(0, s.B, 1, [&](int64_t begin, int64_t end) {
    Head head(s.D, s.T, rounds);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t T = where.length(b, s);
      if (T == 0) continue;
      head.fit(T);
      const E* rows = qkv + where.first(b, s) * 3 * H;
      for (int64_t n = 0; n < s.N; ++n) {
        const int64_t task = b * s.N + n;
        if (b + 1 < end)  // share n of the next sequence's rows
          prefetch_share(qkv + where.first(b + 1, s) * 3 * H, where.length(b + 1, s) * 3 * H, n, s.N);
        head.read(rows, H, n, mask == nullptr ? nullptr : mask + b * s.T);
        float* const probs_n = probs + where.probs_at(b, s) + n * T * head.Tp;
        E* const o = out + where.first(b, s) * H + n * s.D;
        if constexpr (rounds) {  // into the fp32 result, then rounded into out's rows
          head.forward(probs_n, head.result.data(), s.D, drop, task * s.T * s.T);
          for (int64_t t = 0; t < T; ++t) convert(head.result.data() + t * s.D, s.D, o + t * H);
        } else {
          head.forward(probs_n, o, H, drop, task * s.T * s.T);
        }
      }
    }
  });
}

// grad (rows, H), the output's gradient -> dqkv (rows, 3H), from the forward's qkv and probabilities.
template <typename E>
inline void attention_backward(const E* grad, const E* qkv, const float* probs, Shape s, Layout where,
                               const Dropper& drop, E* dqkv) {
  constexpr bool rounds = !std::is_same_v<E, float>;
  const int64_t H = s.N * s.D;
  at::parallel_for(0, s.B, 1, [&](int64_t begin, int64_t end) {
    Head head(s.D, s.T, rounds);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t T = where.length(b, s), first = where.first(b, s);
      if (T == 0) continue;
      head.fit(T);
      const E* rows = qkv + first * 3 * H;
      for (int64_t n = 0; n < s.N; ++n) {
        if (b + 1 < end) {  // share n of sequence b + 1's rows of qkv, its output's gradient and its probabilities
          const int64_t next = where.first(b + 1, s), length = where.length(b + 1, s);
          prefetch_share(qkv + next * 3 * H, length * 3 * H, n, s.N);
          prefetch_share(grad + next * H, length * H, n, s.N);
          prefetch_share(probs + where.probs_at(b + 1, s), s.N * length * padded_length(length), n, s.N);
        }
        head.read(rows, H, n, nullptr);
        for (int64_t t = 0; t < T; ++t) convert(grad + (first + t) * H + n * s.D, s.D, head.grad.data() + t * s.D);
        const float* probs_n = probs + where.probs_at(b, s) + n * T * head.Tp;
        E* const dq = dqkv + first * 3 * H + n * s.D;
        if constexpr (rounds) {  // into the fp32 gradients (dq, dk, dv: T x D each), then rounded into dqkv's rows
          float* const r = head.result.data();
          head.backward(probs_n, r, r + T * s.D, r + 2 * T * s.D, s.D, drop);
          for (int64_t t = 0; t < T; ++t)
            for (int64_t part = 0; part < 3; ++part)
              convert(r + (part * T + t) * s.D, s.D, dq + t * 3 * H + part * H);
        } else {
          head.backward(probs_n, dq, dq + H, dq + 2 * H, 3 * H, drop);
        }
      }
    }
  });
}

}  // namespace train
}  // namespace bertforge

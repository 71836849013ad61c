// The attention kernel of cpu_kernels.cpp: scores, mask, softmax and the weighted sum of values, one sequence (every
// head) at a time, from the query/key/value product's output as it is, into the (B, P, H) layout the next product
// reads; over vec.h's vectors (kLanes floats: 16 on AVX-512, 8 on AVX2).

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "vec.h"

namespace bertforge {

constexpr int64_t kLanes = Vec::kLanes;
// What the operators ask of a head's and a row's size: whole vectors on either ISA (AVX-512's 16 floats), so that
// both builds take the same shapes.
constexpr int64_t kMultiple = 16;
static_assert(kMultiple % kLanes == 0, "a head is whole vectors");

// acc[i][c] += sum over k < K of a[i * lda + k * ka] * b[k * ldb + kLanes c ..]: QN rows of A (ka = 1; lda = 1 reads
// A transposed) against kLanes NB columns of B, the register-blocked product attention's scores (queries x transposed
// keys) and its weighted values (probabilities x values) are made of, and its gradients (attention_train.h). QN x NB
// independent accumulators keep the FMA units busy.
template <int QN, int NB>
inline void accumulate(const float* a, int64_t lda, int64_t ka, const float* b, int64_t ldb, int64_t K,
                       Vec (&acc)[QN][NB]) {
  for (int64_t k = 0; k < K; ++k) {
    Vec bk[NB];
#pragma GCC unroll 8
    for (int c = 0; c < NB; ++c) bk[c] = Vec::load(b + k * ldb + kLanes * c);
#pragma GCC unroll 8
    for (int i = 0; i < QN; ++i) {
      const Vec aik = Vec::all(a[i * lda + k * ka]);
#pragma GCC unroll 8
      for (int c = 0; c < NB; ++c) acc[i][c] = fma(aik, bk[c], acc[i][c]);
    }
  }
}

// S (QN rows of Tp) = the mask's 0 / -inf + q (QN rows of D) x kt (the keys transposed, D rows of Tp), kLanes NB
// keys from j0.
template <int QN, int NB>
inline void score_block(const float* q, int64_t D, const float* kt, int64_t Tp, int64_t j0, const float* bias,
                        float* S) {
  Vec acc[QN][NB];
#pragma GCC unroll 8
  for (int c = 0; c < NB; ++c) {
    const Vec start = Vec::load(bias + j0 + kLanes * c);
#pragma GCC unroll 8
    for (int i = 0; i < QN; ++i) acc[i][c] = start;
  }
  accumulate<QN, NB>(q, D, 1, kt + j0, Tp, D, acc);
#pragma GCC unroll 8
  for (int i = 0; i < QN; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < NB; ++c) acc[i][c].store(S + i * Tp + j0 + kLanes * c);
}

template <int QN>
inline void scores(const float* q, int64_t D, const float* kt, int64_t Tp, const float* bias, float* S) {
  int64_t j0 = 0;
  for (; j0 + 2 * kLanes <= Tp; j0 += 2 * kLanes) score_block<QN, 2>(q, D, kt, Tp, j0, bias, S);
  if (j0 < Tp) score_block<QN, 1>(q, D, kt, Tp, j0, bias, S);
}

// out rows (QN of them, `stride` apart) = P (QN rows of Tp) x v (T rows of D) x inv (per row), kLanes NB of the D
// columns from d0.
template <int QN, int NB>
inline void value_block(const float* P, const float* inv, int64_t Tp, const float* v, int64_t T, int64_t D,
                        int64_t d0, float* out, int64_t stride, Range& range) {
  Vec acc[QN][NB];
#pragma GCC unroll 8
  for (int i = 0; i < QN; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < NB; ++c) acc[i][c] = Vec::zero();
  accumulate<QN, NB>(P, Tp, 1, v + d0, D, T, acc);
#pragma GCC unroll 8
  for (int i = 0; i < QN; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < NB; ++c) {
      const Vec y = acc[i][c] * Vec::all(inv[i]);
      y.store(out + i * stride + d0 + kLanes * c);
      range.add(y);
    }
}

template <int QN>
inline void values(const float* P, const float* inv, int64_t Tp, const float* v, int64_t T, int64_t D, float* out,
                   int64_t stride, Range& range) {
  int64_t d0 = 0;
  for (; d0 + 2 * kLanes <= D; d0 += 2 * kLanes) value_block<QN, 2>(P, inv, Tp, v, T, D, d0, out, stride, range);
  if (d0 < D) value_block<QN, 1>(P, inv, Tp, v, T, D, d0, out, stride, range);
}

// Rows i < QN of S (Tp long each) become exp(row - its max) at the keys to attend and 0 elsewhere, and inv[i] one
// over their sum (0 for a row with no key to attend, whose output is then zeros, where SDPA gives NaN). The rows
// are worked in step, so that their horizontal reductions, each a chain of dependent shuffles, overlap.
template <int QN>
inline void softmax(float* S, int64_t Tp, const float* keep, float* inv) {
  Vec top[QN], shift[QN], total[QN];
#pragma GCC unroll 8
  for (int i = 0; i < QN; ++i) top[i] = Vec::all(-kInf);
  for (int64_t j = 0; j < Tp; j += kLanes)
#pragma GCC unroll 8
    for (int i = 0; i < QN; ++i) top[i] = max(top[i], Vec::load(S + i * Tp + j));
#pragma GCC unroll 8
  for (int i = 0; i < QN; ++i) {
    const float m = reduce_max(top[i]);
    shift[i] = Vec::all(m == -kInf ? 0.0f : m);
    total[i] = Vec::zero();
  }
  for (int64_t j = 0; j < Tp; j += kLanes) {
    const Vec allowed = Vec::load(keep + j);
#pragma GCC unroll 8
    for (int i = 0; i < QN; ++i) {
      float* at = S + i * Tp + j;
      const Vec e = exp_nonpositive(Vec::load(at) - shift[i]) * allowed;
      e.store(at);
      total[i] = total[i] + e;
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < QN; ++i) {
    const float sum = reduce_add(total[i]);
    inv[i] = sum > 0.0f ? 1.0f / sum : 0.0f;
  }
}

// QN queries' attention: scores, softmax, weighted values into out (QN rows `stride` apart).
template <int QN>
inline void answer(const float* q, int64_t D, const float* kt, int64_t Tp, const float* bias, const float* keep,
                   float* S, const float* v, int64_t T, float* out, int64_t stride, Range& range) {
  float inv[QN];
  scores<QN>(q, D, kt, Tp, bias, S);
  softmax<QN>(S, Tp, keep, inv);
  values<QN>(S, inv, Tp, v, T, D, out, stride, range);
}

// T rounded up to whole vectors: the length of a row of scores.
inline int64_t padded_length(int64_t T) { return (T + kLanes - 1) / kLanes * kLanes; }

// dst (cols x rows) = src (rows x cols, both whole vectors) transposed, kLanes x kLanes blocks at a time.
inline void transpose_matrix(const float* src, int64_t rows, int64_t cols, float* dst) {
  for (int64_t r0 = 0; r0 < rows; r0 += kLanes)
    for (int64_t c0 = 0; c0 < cols; c0 += kLanes) {
      Vec block[kLanes];
      for (int64_t i = 0; i < kLanes; ++i) block[i] = Vec::load(src + (r0 + i) * cols + c0);
      transpose(block);
      for (int64_t i = 0; i < kLanes; ++i) block[i].store(dst + (c0 + i) * rows + r0);
    }
}

// The operators' mask (B, T), True where a key may be attended, and query positions (B, P), each optional: checked,
// made contiguous, and P (T without positions).
struct Queries {
  at::Tensor mask, positions;
  int64_t P;
  Queries(const std::optional<at::Tensor>& m, const std::optional<at::Tensor>& p, int64_t B, int64_t T) : P(T) {
    if (m.has_value()) {
      mask = m->to(at::kBool).contiguous();
      TORCH_CHECK(mask.dim() == 2 && mask.size(0) == B && mask.size(1) == T, "mask must be (B, T)");
    }
    if (p.has_value()) {
      positions = p->to(at::kLong).contiguous();
      TORCH_CHECK(positions.dim() == 2 && positions.size(0) == B, "positions must be (B, P)");
      P = positions.size(1);
      TORCH_CHECK(P == 0 || (positions.min().item<int64_t>() >= 0 && positions.max().item<int64_t>() < T),
                  "positions must lie within the sequence");
    }
  }
  const bool* mask_data() const { return mask.defined() ? mask.data_ptr<bool>() : nullptr; }
  const int64_t* positions_data() const { return positions.defined() ? positions.data_ptr<int64_t>() : nullptr; }
};

// Queries handled together: enough independent accumulators to hide the FMA latency, few enough to stay in registers.
constexpr int kQueries = 4;
// Rows of qkv prefetched ahead of the one being read.
constexpr int64_t kAhead = 4;

// One sequence's working set, in fp32: every head's queries (scaled), keys and values (N, T, D), the keys transposed
// (N, D, Tp), Tp = T padded to whole vectors; which keys may be attended (keep 1 / 0, bias 0 / -inf); the scores of
// kQueries queries and those queries gathered (when only some positions are asked for).
struct Sequence {
  // W: the width of a row's query (and key, and value) part and of an output row, N * D unless the sequence's heads
  // are shared out (`attention_kernel`): then this one works N of them, its rows and outputs offset to the first
  int64_t N, T, D, Tp, W;
  // rows T .. Tp of k stay zeros, so the padded key columns of kt are zeros; their keep 0, bias -inf
  std::vector<float> qs, k, kt, v, keep, bias, S, gathered;
  Sequence(int64_t N, int64_t T, int64_t D, int64_t W = 0)
      : N(N), T(T), D(D), Tp(padded_length(T)), W(W > 0 ? W : N * D), qs(N * T * D), k(N * Tp * D, 0.0f),
        kt(N * D * Tp), v(N * T * D), keep(Tp, 0.0f), bias(Tp, -kInf), S(kQueries * Tp), gathered(kQueries * D) {}

  // A sequence of `length` (<= the T it was made for, its buffers' size) rows next: the rows from `length` up to
  // whole vectors are padding again (zero keys, keep 0, bias -inf), as the constructor leaves them. attention_train.h's
  // Head::fit does the same for one head.
  void fit(int64_t length) {
    if (length == T) return;
    T = length;
    Tp = padded_length(length);
    for (int64_t n = 0; n < N; ++n) std::fill(k.begin() + (n * Tp + T) * D, k.begin() + (n + 1) * Tp * D, 0.0f);
    std::fill(keep.begin() + T, keep.begin() + Tp, 0.0f);
    std::fill(bias.begin() + T, bias.begin() + Tp, -kInf);
  }

  // Sequence b's rows of qkv (T, 3H) read once, in order, prefetched a few rows ahead, into qs, k and v; its mask
  // row (null: every key) into keep and bias.
  template <typename scalar_t>
  void read(const scalar_t* rows, const bool* mask) {
    const int64_t H = W, row = 3 * H;
    const Vec scale = Vec::all(1.0f / std::sqrt(static_cast<float>(D)));
    for (int64_t t = 0; t < T; ++t) {
      if (t + kAhead < T) {
        const char* next = reinterpret_cast<const char*>(rows + (t + kAhead) * row);
        for (int64_t byte = 0; byte < row * static_cast<int64_t>(sizeof(scalar_t)); byte += 64)
          _mm_prefetch(next + byte, _MM_HINT_T0);
      }
      const scalar_t* r = rows + t * row;
      for (int64_t n = 0; n < N; ++n) {
        for (int64_t d = 0; d < D; d += kLanes) {
          (Vec::load(r + n * D + d) * scale).store(qs.data() + (n * T + t) * D + d);
          Vec::load(r + H + n * D + d).store(k.data() + (n * Tp + t) * D + d);
          Vec::load(r + 2 * H + n * D + d).store(v.data() + (n * T + t) * D + d);
        }
      }
      const bool allowed = mask == nullptr || mask[t];
      keep[t] = allowed ? 1.0f : 0.0f;
      bias[t] = allowed ? 0.0f : -kInf;
    }
  }

  // kt = each head's keys transposed, kLanes x kLanes blocks at a time
  void transpose_keys() {
    for (int64_t n = 0; n < N; ++n) transpose_matrix(k.data() + n * Tp * D, Tp, D, kt.data() + n * D * Tp);
  }

  // The answers of P queries (at `positions`, or the first P when null) of every head into out (P rows of H),
  // kQueries at a time.
  void answer_all(const int64_t* positions, int64_t P, float* out, Range& range) {
    const int64_t H = W;
    for (int64_t n = 0; n < N; ++n) {
      const float* ktn = kt.data() + n * D * Tp;
      const float* vn = v.data() + n * T * D;
      for (int64_t i0 = 0; i0 < P; i0 += kQueries) {
        const int64_t qn = std::min<int64_t>(kQueries, P - i0);
        const float* q = qs.data() + (n * T + i0) * D;
        if (positions != nullptr) {
          for (int64_t i = 0; i < qn; ++i)
            std::copy_n(qs.data() + (n * T + positions[i0 + i]) * D, D, gathered.data() + i * D);
          q = gathered.data();
        }
        float* dst = out + i0 * H + n * D;
        const float *b = bias.data(), *kp = keep.data();
        switch (qn) {
          case 4: answer<4>(q, D, ktn, Tp, b, kp, S.data(), vn, T, dst, H, range); break;
          case 3: answer<3>(q, D, ktn, Tp, b, kp, S.data(), vn, T, dst, H, range); break;
          case 2: answer<2>(q, D, ktn, Tp, b, kp, S.data(), vn, T, dst, H, range); break;
          default: answer<1>(q, D, ktn, Tp, b, kp, S.data(), vn, T, dst, H, range);
        }
      }
    }
  }
};

// qkv (B, T, 3H): each row query, key, value, each of N heads of D (a multiple of kLanes); mask (B, T) True where a
// key may be attended, or null; positions (B, P) the query positions, or null for all T. out (B, P, H). Returns the
// ranges of the output's parts, one a task (the caller joins them). A task is one sequence, or with fewer sequences
// than threads (a text served alone) a group of its heads: up to threads / B groups of whole heads, each Sequence
// reading and writing only its heads' columns, with the same arithmetic per head, so the same output bits (one text
// of MiniLM-L6, 12 heads, ran its attention on one of two cores before).
template <typename scalar_t>
std::vector<Range> attention_kernel(const scalar_t* qkv, const bool* mask, const int64_t* positions, float* out,
                                    int64_t B, int64_t T, int64_t P, int64_t N, int64_t D) {
  const int64_t H = N * D, threads = at::get_num_threads();
  const int64_t groups = B < threads ? std::min<int64_t>(N, threads / B) : 1;
  std::vector<Range> ranges(B * groups);
  at::parallel_for(0, B * groups, 1, [&](int64_t begin, int64_t end) {
    std::optional<Sequence> seq;  // reused over the task's sequences while their head count stays the same
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / groups, g = task % groups;
      const int64_t n0 = g * N / groups, n1 = (g + 1) * N / groups;
      if (!seq || seq->N != n1 - n0) seq.emplace(n1 - n0, T, D, H);
      seq->read(qkv + b * T * 3 * H + n0 * D, mask == nullptr ? nullptr : mask + b * T);
      seq->transpose_keys();
      seq->answer_all(positions == nullptr ? nullptr : positions + b * P, P, out + b * P * H + n0 * D, ranges[task]);
    }
  });
  return ranges;
}

}  // namespace bertforge

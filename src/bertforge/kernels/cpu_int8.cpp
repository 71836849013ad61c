// CPU kernels for bertforge's int8 inference (bertforge/kernels/__init__.py builds this file once per machine).
//
// Between its int8 products, an encoder layer spends most of its time in many small operators: on Rotten Tomatoes
// snippets (27 tokens on average) attention alone is about 8 of them per layer (head split copies, two batched
// products, scale, mask, softmax, casts), each a pass over memory with its own fixed cost. These kernels do the same
// work in one pass each:
//   attention      scores, mask, softmax and the weighted sum of values, one sequence (every head) at a time, from
//                  the query/key/value product's output as it is, into the (B, P, H) layout the next product reads;
//   add_layer_norm the residual add and LayerNorm of one row at a time (residual_layer_norm: keeping the sum, for
//                  pre-LN layers).
// Both also return the range (min, max) of what they wrote, which the following int8 product quantizes by, so it
// needs no pass of its own to find it. For the products' other inputs:
//   value_range    the range of a tensor, and
//   quantize_u8    its u8 codes for a scale and zero point.

#include <immintrin.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int64_t kLanes = 16;  // floats in one AVX512 register (two AVX2 ones)

// e^x for x <= 0, 16 at a time: x = n ln2 + r with |r| <= ln2 / 2, e^r by the degree-7 polynomial of Cephes' expf
// (relative error about 1e-7), times 2^n by vscalefps. Below -87 it gives about e^-87 instead of smaller values.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

struct Range {
  __m512 lo = _mm512_set1_ps(kInf), hi = _mm512_set1_ps(-kInf);
  void add(__m512 x) {
    lo = _mm512_min_ps(lo, x);
    hi = _mm512_max_ps(hi, x);
  }
  float min() const { return _mm512_reduce_min_ps(lo); }
  float max() const { return _mm512_reduce_max_ps(hi); }
};

// 16 values as fp32
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const at::BFloat16* x) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

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

// A 16 x 16 block transposed in registers: r[i] holds row i on the way in, column i on the way out.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

// acc[i][c] += sum over k < K of a[i * lda + k] * b[k * ldb + 16 c .. + 16]: QN rows of A against 16 NB columns of
// B, the register-blocked product both attention's scores (queries x transposed keys) and its weighted values
// (probabilities x values) are made of. QN x NB independent accumulators keep the FMA units busy.
template <int QN, int NB>
inline void accumulate(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t K, __m512 (&acc)[QN][NB]) {
  for (int64_t k = 0; k < K; ++k) {
    __m512 bk[NB];
#pragma GCC unroll 8
    for (int c = 0; c < NB; ++c) bk[c] = _mm512_loadu_ps(b + k * ldb + kLanes * c);
#pragma GCC unroll 8
    for (int i = 0; i < QN; ++i) {
      const __m512 aik = _mm512_set1_ps(a[i * lda + k]);
#pragma GCC unroll 8
      for (int c = 0; c < NB; ++c) acc[i][c] = _mm512_fmadd_ps(aik, bk[c], acc[i][c]);
    }
  }
}

// S (QN rows of Tp) = the mask's 0 / -inf + q (QN rows of D) x kt (the keys transposed, D rows of Tp), 16 NB keys
// from j0.
template <int QN, int NB>
inline void score_block(const float* q, int64_t D, const float* kt, int64_t Tp, int64_t j0, const float* bias,
                        float* S) {
  __m512 acc[QN][NB];
#pragma GCC unroll 8
  for (int c = 0; c < NB; ++c) {
    const __m512 start = _mm512_loadu_ps(bias + j0 + kLanes * c);
#pragma GCC unroll 8
    for (int i = 0; i < QN; ++i) acc[i][c] = start;
  }
  accumulate<QN, NB>(q, D, kt + j0, Tp, D, acc);
#pragma GCC unroll 8
  for (int i = 0; i < QN; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < NB; ++c) _mm512_storeu_ps(S + i * Tp + j0 + kLanes * c, acc[i][c]);
}

template <int QN>
inline void scores(const float* q, int64_t D, const float* kt, int64_t Tp, const float* bias, float* S) {
  int64_t j0 = 0;
  for (; j0 + 2 * kLanes <= Tp; j0 += 2 * kLanes) score_block<QN, 2>(q, D, kt, Tp, j0, bias, S);
  if (j0 < Tp) score_block<QN, 1>(q, D, kt, Tp, j0, bias, S);
}

// out rows (QN of them, `stride` apart) = P (QN rows of Tp) x v (T rows of D) x inv (per row), 16 NB of the D
// columns from d0.
template <int QN, int NB>
inline void value_block(const float* P, const float* inv, int64_t Tp, const float* v, int64_t T, int64_t D,
                        int64_t d0, float* out, int64_t stride, Range& range) {
  __m512 acc[QN][NB];
#pragma GCC unroll 8
  for (int i = 0; i < QN; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < NB; ++c) acc[i][c] = _mm512_setzero_ps();
  accumulate<QN, NB>(P, Tp, v + d0, D, T, acc);
#pragma GCC unroll 8
  for (int i = 0; i < QN; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < NB; ++c) {
      const __m512 y = _mm512_mul_ps(acc[i][c], _mm512_set1_ps(inv[i]));
      _mm512_storeu_ps(out + i * stride + d0 + kLanes * c, y);
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
  __m512 top[QN], shift[QN], total[QN];
#pragma GCC unroll 8
  for (int i = 0; i < QN; ++i) top[i] = _mm512_set1_ps(-kInf);
  for (int64_t j = 0; j < Tp; j += kLanes)
#pragma GCC unroll 8
    for (int i = 0; i < QN; ++i) top[i] = _mm512_max_ps(top[i], _mm512_loadu_ps(S + i * Tp + j));
#pragma GCC unroll 8
  for (int i = 0; i < QN; ++i) {
    const float m = _mm512_reduce_max_ps(top[i]);
    shift[i] = _mm512_set1_ps(m == -kInf ? 0.0f : m);
    total[i] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < Tp; j += kLanes) {
    const __m512 allowed = _mm512_loadu_ps(keep + j);
#pragma GCC unroll 8
    for (int i = 0; i < QN; ++i) {
      float* at = S + i * Tp + j;
      const __m512 e = _mm512_mul_ps(exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(at), shift[i])), allowed);
      _mm512_storeu_ps(at, e);
      total[i] = _mm512_add_ps(total[i], e);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < QN; ++i) {
    const float sum = _mm512_reduce_add_ps(total[i]);
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

// Queries handled together: enough independent accumulators to hide the FMA latency, few enough to stay in registers.
constexpr int kQueries = 4;
// Rows of qkv prefetched ahead of the one being read.
constexpr int64_t kAhead = 4;

// qkv (B, T, 3H): each row query, key, value, each of N heads of D (a multiple of 16); mask (B, T) True where a key
// may be attended, or null; positions (B, P) the query positions, or null for all T. out (B, P, H).
template <typename scalar_t>
void attention_kernel(const scalar_t* qkv, const bool* mask, const int64_t* positions, float* out, int64_t B,
                      int64_t T, int64_t P, int64_t N, int64_t D, std::vector<Range>& ranges) {
  const int64_t H = N * D, row = 3 * H;
  const int64_t Tp = (T + kLanes - 1) / kLanes * kLanes;  // keys padded to whole vectors: keep 0, bias -inf
  const __m512 scale16 = _mm512_set1_ps(1.0f / std::sqrt(static_cast<float>(D)));
  // One sequence a task: its rows of qkv are read once, in order, prefetched a few rows ahead, into every head's
  // queries (scaled), keys and values (T, D) in fp32; each head's keys are then transposed, 16 x 16 blocks at a
  // time, to (D, Tp), and its queries answered 4 at a time.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    // rows T .. Tp of k stay zeros, so the padded key columns of kt are zeros
    std::vector<float> qs(N * T * D), k(N * Tp * D, 0.0f), kt(N * D * Tp), v(N * T * D), gathered(kQueries * D),
        S(kQueries * Tp), keep(Tp, 0.0f), bias(Tp, -kInf);
    for (int64_t b = begin; b < end; ++b) {
      const scalar_t* base = qkv + b * T * row;
      for (int64_t t = 0; t < T; ++t) {
        if (t + kAhead < T) {
          const char* next = reinterpret_cast<const char*>(base + (t + kAhead) * row);
          for (int64_t byte = 0; byte < row * static_cast<int64_t>(sizeof(scalar_t)); byte += 64)
            _mm_prefetch(next + byte, _MM_HINT_T0);
        }
        const scalar_t* r = base + t * row;
        for (int64_t n = 0; n < N; ++n) {
          for (int64_t d = 0; d < D; d += kLanes) {
            _mm512_storeu_ps(qs.data() + (n * T + t) * D + d, _mm512_mul_ps(load16(r + n * D + d), scale16));
            _mm512_storeu_ps(k.data() + (n * Tp + t) * D + d, load16(r + H + n * D + d));
            _mm512_storeu_ps(v.data() + (n * T + t) * D + d, load16(r + 2 * H + n * D + d));
          }
        }
        const bool allowed = mask == nullptr || mask[b * T + t];
        keep[t] = allowed ? 1.0f : 0.0f;
        bias[t] = allowed ? 0.0f : -kInf;
      }
      for (int64_t n = 0; n < N; ++n) {
        for (int64_t t0 = 0; t0 < Tp; t0 += kLanes) {
          for (int64_t d0 = 0; d0 < D; d0 += kLanes) {
            __m512 block[kLanes];
            for (int64_t i = 0; i < kLanes; ++i) block[i] = _mm512_loadu_ps(k.data() + (n * Tp + t0 + i) * D + d0);
            transpose16(block);
            for (int64_t i = 0; i < kLanes; ++i) _mm512_storeu_ps(kt.data() + (n * D + d0 + i) * Tp + t0, block[i]);
          }
        }
      }
      Range range;
      for (int64_t n = 0; n < N; ++n) {
        const float* ktn = kt.data() + n * D * Tp;
        const float* vn = v.data() + n * T * D;
        for (int64_t i0 = 0; i0 < P; i0 += kQueries) {
          const int64_t qn = std::min<int64_t>(kQueries, P - i0);
          const float* q = qs.data() + (n * T + i0) * D;
          if (positions != nullptr) {  // the queries at these positions, gathered
            for (int64_t i = 0; i < qn; ++i)
              std::copy_n(qs.data() + (n * T + positions[b * P + i0 + i]) * D, D, gathered.data() + i * D);
            q = gathered.data();
          }
          float* dst = out + (b * P + i0) * H + n * D;
          switch (qn) {
            case 4: answer<4>(q, D, ktn, Tp, bias.data(), keep.data(), S.data(), vn, T, dst, H, range); break;
            case 3: answer<3>(q, D, ktn, Tp, bias.data(), keep.data(), S.data(), vn, T, dst, H, range); break;
            case 2: answer<2>(q, D, ktn, Tp, bias.data(), keep.data(), S.data(), vn, T, dst, H, range); break;
            default: answer<1>(q, D, ktn, Tp, bias.data(), keep.data(), S.data(), vn, T, dst, H, range);
          }
        }
      }
      ranges[b] = range;
    }
  });
}

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& qkv, int64_t heads,
                                             const std::optional<at::Tensor>& mask,
                                             const std::optional<at::Tensor>& positions) {
  TORCH_CHECK(heads > 0 && qkv.dim() == 3 && qkv.size(2) % (3 * heads * kLanes) == 0,
              "qkv must be (B, T, 3H), H heads x a multiple of 16");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16, "qkv must be fp32 or bf16");
  const at::Tensor x = qkv.contiguous();
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2) / 3, D = H / heads;
  at::Tensor m, pos;
  if (mask.has_value()) {
    m = mask->to(at::kBool).contiguous();
    TORCH_CHECK(m.dim() == 2 && m.size(0) == B && m.size(1) == T, "mask must be (B, T)");
  }
  int64_t P = T;
  if (positions.has_value()) {
    pos = positions->to(at::kLong).contiguous();
    TORCH_CHECK(pos.dim() == 2 && pos.size(0) == B, "positions must be (B, P)");
    P = pos.size(1);
    TORCH_CHECK(P == 0 || (pos.min().item<int64_t>() >= 0 && pos.max().item<int64_t>() < T),
                "positions must lie within the sequence");
  }
  at::Tensor out = at::empty({B, P, H}, x.options().dtype(at::kFloat));
  std::vector<Range> ranges(B);
  const bool* mp = mask.has_value() ? m.data_ptr<bool>() : nullptr;
  const int64_t* pp = positions.has_value() ? pos.data_ptr<int64_t>() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    attention_kernel(x.data_ptr<float>(), mp, pp, out.data_ptr<float>(), B, T, P, heads, D, ranges);
  } else {
    attention_kernel(x.data_ptr<at::BFloat16>(), mp, pp, out.data_ptr<float>(), B, T, P, heads, D, ranges);
  }
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
  TORCH_CHECK(H % kLanes == 0, "the last dimension must be a multiple of 16");
  TORCH_CHECK(weight.numel() == H && bias.numel() == H, "weight and bias must have the last dimension's size");
  const at::Tensor a = x.contiguous(), r = residual == nullptr ? at::Tensor() : residual->contiguous();
  const at::Tensor w = weight.to(at::kFloat).contiguous(), c = bias.to(at::kFloat).contiguous();
  out = at::empty_like(a);
  if (sum != nullptr) *sum = residual == nullptr ? a : at::empty_like(a);
  const int64_t rows = H == 0 ? 0 : a.numel() / H;
  const int64_t grain = 16;
  std::vector<Range> ranges((rows + grain - 1) / grain);
  const float *ap = a.data_ptr<float>(), *rp = residual == nullptr ? nullptr : r.data_ptr<float>(),
              *wp = w.data_ptr<float>(), *cp = c.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* sp = sum != nullptr && residual != nullptr ? sum->data_ptr<float>() : nullptr;
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, static_cast<int64_t>(ranges.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      Range range;
      for (int64_t i = chunk * grain; i < std::min(rows, (chunk + 1) * grain); ++i) {
        const float *xi = ap + i * H, *ri = rp == nullptr ? nullptr : rp + i * H;
        float* yi = op + i * H;
        float* si = sp == nullptr ? nullptr : sp + i * H;
        // H a multiple of 16 (checked): the sum, the sum of squared deviations, then the output, 16 at a time;
        // the row's x + residual is kept in the output until it is overwritten by the normalized values
        __m512 total = _mm512_setzero_ps();
        for (int64_t h = 0; h < H; h += kLanes) {
          __m512 y = _mm512_loadu_ps(xi + h);
          if (ri != nullptr) y = _mm512_add_ps(y, _mm512_loadu_ps(ri + h));
          if (si != nullptr) _mm512_storeu_ps(si + h, y);
          _mm512_storeu_ps(yi + h, y);
          total = _mm512_add_ps(total, y);
        }
        const __m512 mean = _mm512_set1_ps(_mm512_reduce_add_ps(total) / H);
        __m512 sq = _mm512_setzero_ps();
        for (int64_t h = 0; h < H; h += kLanes) {
          const __m512 c = _mm512_sub_ps(_mm512_loadu_ps(yi + h), mean);
          sq = _mm512_fmadd_ps(c, c, sq);
        }
        const __m512 rstd = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(sq) / H + feps));
        for (int64_t h = 0; h < H; h += kLanes) {
          const __m512 c = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(yi + h), mean), rstd);
          const __m512 y = _mm512_fmadd_ps(c, _mm512_loadu_ps(wp + h), _mm512_loadu_ps(cp + h));
          _mm512_storeu_ps(yi + h, y);
          range.add(y);
        }
      }
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
      for (; i + kLanes <= stop; i += kLanes) range.add(_mm512_loadu_ps(xp + i));
      if (i < stop) {
        const __mmask16 m = static_cast<__mmask16>((1u << (stop - i)) - 1);
        range.lo = _mm512_mask_min_ps(range.lo, m, range.lo, _mm512_maskz_loadu_ps(m, xp + i));
        range.hi = _mm512_mask_max_ps(range.hi, m, range.hi, _mm512_maskz_loadu_ps(m, xp + i));
      }
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
  const __m512 inv = _mm512_set1_ps(static_cast<float>(1.0 / scale));
  const __m512i z = _mm512_set1_epi32(static_cast<int32_t>(zero)), lo = _mm512_setzero_si512(),
                hi = _mm512_set1_epi32(255);
  at::parallel_for(0, (n + grain - 1) / grain, 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t stop = std::min(n, (chunk + 1) * grain);
      const auto codes = [&](__m512 values) {
        const __m512i q = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(values, inv)), z);
        return _mm512_cvtepi32_epi8(_mm512_min_epi32(_mm512_max_epi32(q, lo), hi));
      };
      int64_t i = chunk * grain;
      for (; i + kLanes <= stop; i += kLanes)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(op + i), codes(_mm512_loadu_ps(xp + i)));
      if (i < stop) {
        const __mmask16 m = static_cast<__mmask16>((1u << (stop - i)) - 1);
        _mm_mask_storeu_epi8(op + i, m, codes(_mm512_maskz_loadu_ps(m, xp + i)));
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(bertforge, m) {
  m.def("attention(Tensor qkv, int heads, Tensor? mask, Tensor? positions) -> (Tensor, Tensor)");
  m.def("add_layer_norm(Tensor x, Tensor residual, Tensor weight, Tensor bias, float eps) -> (Tensor, Tensor)");
  m.def("residual_layer_norm(Tensor x, Tensor? residual, Tensor weight, Tensor bias, float eps) -> "
        "(Tensor, Tensor, Tensor)");
  m.def("value_range(Tensor x) -> Tensor");
  m.def("quantize_u8(Tensor x, float scale, int zero) -> Tensor");
}

TORCH_LIBRARY_IMPL(bertforge, CPU, m) {
  m.impl("attention", attention);
  m.impl("add_layer_norm", add_layer_norm);
  m.impl("residual_layer_norm", residual_layer_norm);
  m.impl("value_range", value_range);
  m.impl("quantize_u8", quantize_u8);
}

// The vector layer bertforge's int8 kernels (cpu_kernels.cpp, attention.h) are written over: `Vec`, fp32 lanes in one
// register, and the few operations the kernels use, for the ISA the file is compiled for:
//   AVX-512 (__AVX512F__, -march=native on a CPU with avx512f)  16 lanes, partial vectors by masked loads/stores;
//   AVX2 + FMA (__AVX2__ and __FMA__, -mavx2 -mfma)             8 lanes, partial vectors by _mm256_maskload_ps and,
//                                                                for the u8 codes, a store through a small buffer.
// The kernels name no intrinsic but _mm_prefetch (SSE, on both): everything ISA-specific is here, and everything here
// has the same meaning on both (up to rounding: the reductions add the lanes in another order). Neither needs
// AVX512-BF16: bf16 values are read as fp32's upper half, by integer shifts.

#pragma once

#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace bertforge {

constexpr float kInf = std::numeric_limits<float>::infinity();

#if defined(__AVX512F__)

constexpr const char* kIsa = "avx512";

struct Vec {
  static constexpr int64_t kLanes = 16;
  __m512 v;

  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec all(float x) { return {_mm512_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const c10::BFloat16* p) {  // bf16 is fp32's upper half
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16))};
  }
  // p's first n (< kLanes) values, `fill` in the other lanes; reads only those n
  static Vec load_first(const float* p, int64_t n, float fill) {
    return {_mm512_mask_loadu_ps(_mm512_set1_ps(fill), first(n), p)};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  // as bf16, rounded to nearest even as c10::BFloat16 rounds (a NaN as 0x7FC0)
  void store(c10::BFloat16* p) const {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static __mmask16 first(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }
};

inline Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec operator/(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }  // IEEE's, unlike reciprocal
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }     // a b + c
inline Vec fnma(Vec a, Vec b, Vec c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }   // c - a b
inline Vec min(Vec a, Vec b) { return {_mm512_min_ps(a.v, b.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }  // b where either is NaN
inline float reduce_add(Vec a) { return _mm512_reduce_add_ps(a.v); }
inline float reduce_min(Vec a) { return _mm512_reduce_min_ps(a.v); }
inline float reduce_max(Vec a) { return _mm512_reduce_max_ps(a.v); }
inline Vec round_even(Vec a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// p 2^n, n whole
inline Vec times_pow2(Vec p, Vec n) { return {_mm512_scalef_ps(p.v, n.v)}; }
// 1 / d, d >= 1: rcp14's 14 bits, then a Newton step (about 2^-28)
inline Vec reciprocal(Vec d) {
  const __m512 t = _mm512_rcp14_ps(d.v);
  return {_mm512_mul_ps(t, _mm512_fnmadd_ps(d.v, t, _mm512_set1_ps(2.f)))};
}

// 32-bit unsigned integers in as many lanes as Vec has floats: dropout's hash (dropout.h) a vector at a time.
struct UVec {
  __m512i v;
  static UVec all(uint32_t x) { return {_mm512_set1_epi32(static_cast<int32_t>(x))}; }
  static UVec index(uint32_t first) {  // first, first + 1, ..., modulo 2^32
    return {_mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(first)),
                             _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15))};
  }
};
inline UVec operator^(UVec a, UVec b) { return {_mm512_xor_si512(a.v, b.v)}; }
inline UVec operator+(UVec a, UVec b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline UVec operator*(UVec a, uint32_t b) { return {_mm512_mullo_epi32(a.v, UVec::all(b).v)}; }  // modulo 2^32
inline UVec operator>>(UVec a, int n) { return {_mm512_srli_epi32(a.v, static_cast<unsigned>(n))}; }
// all bits set in the lanes where a >= t (unsigned), none elsewhere, as a Vec's bits
inline Vec at_least(UVec a, uint32_t t) {
  const __mmask16 m = _mm512_cmpge_epu32_mask(a.v, UVec::all(t).v);
  return {_mm512_castsi512_ps(_mm512_maskz_set1_epi32(m, -1))};
}
// Bitwise operations on the lanes' bits
inline __m512i ints(Vec a) { return _mm512_castps_si512(a.v); }
inline Vec floats(__m512i a) { return {_mm512_castsi512_ps(a)}; }
inline Vec bits_and(Vec a, Vec b) { return floats(_mm512_and_si512(ints(a), ints(b))); }
inline Vec bits_andnot(Vec a, Vec b) { return floats(_mm512_andnot_si512(ints(a), ints(b))); }  // ~a & b
inline Vec bits_xor(Vec a, Vec b) { return floats(_mm512_xor_si512(ints(a), ints(b))); }
// all bits set in the lanes whose sign bit is set, none elsewhere
inline Vec sign_lanes(Vec a) { return floats(_mm512_srai_epi32(ints(a), 31)); }

// A kLanes x kLanes block transposed in registers: r[i] holds row i on the way in, column i on the way out.
inline void transpose(Vec (&r)[Vec::kLanes]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i].v, r[2 * i + 1].v);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i].v, r[2 * i + 1].v);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i].v = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1].v = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2].v = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3].v = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i].v, r[i + 4].v, 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i].v, r[i + 4].v, 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8].v, r[i + 12].v, 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8].v, r[i + 12].v, 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i].v = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 4].v = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 8].v = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    r[i + 12].v = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

// u8 codes round(x inv) + zero within [0, 255], rounding half to even (the CPU's default rounding mode).
class U8Codes {
 public:
  U8Codes(float inv, int32_t zero) : inv_(_mm512_set1_ps(inv)), zero_(_mm512_set1_epi32(zero)) {}
  void store(uint8_t* out, Vec x) const { _mm_storeu_si128(reinterpret_cast<__m128i*>(out), narrow(codes(x))); }
  void store_first(uint8_t* out, Vec x, int64_t n) const {  // the first n (< kLanes) codes only
    _mm512_mask_cvtepi32_storeu_epi8(out, Vec::first(n), codes(x));
  }

 private:
  __m512i codes(Vec x) const {
    const __m512i q = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(x.v, inv_)), zero_);
    return _mm512_min_epi32(_mm512_max_epi32(q, _mm512_setzero_si512()), _mm512_set1_epi32(255));
  }
  static __m128i narrow(__m512i q) { return _mm512_cvtepi32_epi8(q); }
  __m512 inv_;
  __m512i zero_;
};

#elif defined(__AVX2__) && defined(__FMA__)

constexpr const char* kIsa = "avx2";

struct Vec {
  static constexpr int64_t kLanes = 8;
  __m256 v;

  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec all(float x) { return {_mm256_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec load(const c10::BFloat16* p) {  // bf16 is fp32's upper half
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16))};
  }
  // p's first n (< kLanes) values, `fill` in the other lanes; reads only those n
  static Vec load_first(const float* p, int64_t n, float fill) {
    const __m256i m = first(n);
    return {_mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m))};
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  // as bf16, rounded to nearest even as c10::BFloat16 rounds (a NaN as 0x7FC0)
  void store(c10::BFloat16* p) const {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);  // 8 words in the low half
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(words));
  }
  static __m256i first(int64_t n) {  // all ones in lanes i < n
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
};

inline Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec operator/(Vec a, Vec b) { return {_mm256_div_ps(a.v, b.v)}; }  // IEEE's, unlike reciprocal
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }     // a b + c
inline Vec fnma(Vec a, Vec b, Vec c) { return {_mm256_fnmadd_ps(a.v, b.v, c.v)}; }   // c - a b
inline Vec min(Vec a, Vec b) { return {_mm256_min_ps(a.v, b.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }  // b where either is NaN

// the 8 lanes folded to one by `op`: halves, then quarters, then pairs
template <typename Op>
inline float reduce(Vec a, Op op) {
  __m128 x = op(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  x = op(x, _mm_movehl_ps(x, x));
  x = op(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
inline float reduce_add(Vec a) { return reduce(a, [](__m128 x, __m128 y) { return _mm_add_ps(x, y); }); }
inline float reduce_min(Vec a) { return reduce(a, [](__m128 x, __m128 y) { return _mm_min_ps(x, y); }); }
inline float reduce_max(Vec a) { return reduce(a, [](__m128 x, __m128 y) { return _mm_max_ps(x, y); }); }
inline Vec round_even(Vec a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// 1 / d, d >= 1: rcp's 12 bits, then two Newton steps (about 2^-23)
inline Vec reciprocal(Vec d) {
  __m256 t = _mm256_rcp_ps(d.v);
  t = _mm256_mul_ps(t, _mm256_fnmadd_ps(d.v, t, _mm256_set1_ps(2.f)));
  return {_mm256_mul_ps(t, _mm256_fnmadd_ps(d.v, t, _mm256_set1_ps(2.f)))};
}
// p 2^n, n whole within [-126, 127] (AVX2 has no vscalefps): 2^n built in the exponent bits, n + 127, of an fp32.
// exp_nonpositive clamps its argument at -87, so n >= round(-87 / ln 2) = -126, the least normal exponent.
inline Vec times_pow2(Vec p, Vec n) {
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23);
  return {_mm256_mul_ps(p.v, _mm256_castsi256_ps(bits))};
}

// 32-bit unsigned integers in as many lanes as Vec has floats: dropout's hash (dropout.h) a vector at a time.
struct UVec {
  __m256i v;
  static UVec all(uint32_t x) { return {_mm256_set1_epi32(static_cast<int32_t>(x))}; }
  static UVec index(uint32_t first) {  // first, first + 1, ..., modulo 2^32
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return {_mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(first)), lanes)};
  }
};
inline UVec operator^(UVec a, UVec b) { return {_mm256_xor_si256(a.v, b.v)}; }
inline UVec operator+(UVec a, UVec b) { return {_mm256_add_epi32(a.v, b.v)}; }
inline UVec operator*(UVec a, uint32_t b) { return {_mm256_mullo_epi32(a.v, UVec::all(b).v)}; }  // modulo 2^32
inline UVec operator>>(UVec a, int n) { return {_mm256_srli_epi32(a.v, n)}; }
// all bits set in the lanes where a >= t (unsigned: max(a, t) == a), none elsewhere, as a Vec's bits
inline Vec at_least(UVec a, uint32_t t) {
  return {_mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_max_epu32(a.v, UVec::all(t).v), a.v))};
}
// Bitwise operations on the lanes' bits
inline Vec bits_and(Vec a, Vec b) { return {_mm256_and_ps(a.v, b.v)}; }
inline Vec bits_andnot(Vec a, Vec b) { return {_mm256_andnot_ps(a.v, b.v)}; }  // ~a & b
inline Vec bits_xor(Vec a, Vec b) { return {_mm256_xor_ps(a.v, b.v)}; }
// all bits set in the lanes whose sign bit is set, none elsewhere
inline Vec sign_lanes(Vec a) { return {_mm256_castsi256_ps(_mm256_srai_epi32(_mm256_castps_si256(a.v), 31))}; }

// A kLanes x kLanes block transposed in registers: r[i] holds row i on the way in, column i on the way out.
inline void transpose(Vec (&r)[Vec::kLanes]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 4; ++i) {  // pairs of rows interleaved, within each 128-bit half
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i].v, r[2 * i + 1].v);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i].v, r[2 * i + 1].v);
  }
  for (int i = 0; i < 2; ++i) {  // 4 rows' columns, 4 values each, within each half
    s[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    s[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    s[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    s[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {  // rows 0-3 and 4-7 joined: low halves columns 0-3, high halves columns 4-7
    r[i].v = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
    r[i + 4].v = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
  }
}

// u8 codes round(x inv) + zero within [0, 255], rounding half to even (the CPU's default rounding mode).
class U8Codes {
 public:
  U8Codes(float inv, int32_t zero) : inv_(_mm256_set1_ps(inv)), zero_(_mm256_set1_epi32(zero)) {}
  void store(uint8_t* out, Vec x) const { _mm_storel_epi64(reinterpret_cast<__m128i*>(out), narrow(x)); }
  void store_first(uint8_t* out, Vec x, int64_t n) const {  // the first n (< kLanes) codes only
    alignas(16) uint8_t codes[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(codes), narrow(x));
    std::memcpy(out, codes, static_cast<size_t>(n));
  }

 private:
  // the 8 codes in the low 8 bytes; the saturating packs keep them within [0, 255]
  __m128i narrow(Vec x) const {
    const __m256i q = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(x.v, inv_)), zero_);
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    return _mm_packus_epi16(words, words);
  }
  __m256 inv_;
  __m256i zero_;
};

#else
#error "bertforge's int8 kernels are written for AVX-512 or AVX2 with FMA"
#endif

// e^x for x <= 0, kLanes at a time: x = n ln2 + r with |r| <= ln2 / 2, e^r by the degree-7 polynomial of Cephes'
// expf (relative error about 1e-7), times 2^n. Below -87 it gives about e^-87 instead of smaller values.
inline Vec exp_nonpositive(Vec x) {
  x = max(x, Vec::all(-87.0f));
  const Vec n = round_even(x * Vec::all(1.44269504088896341f));
  Vec r = fnma(n, Vec::all(0.693359375f), x);
  r = fnma(n, Vec::all(-2.12194440e-4f), r);
  Vec p = Vec::all(1.9875691500e-4f);
  p = fma(p, r, Vec::all(1.3981999507e-3f));
  p = fma(p, r, Vec::all(8.3334519073e-3f));
  p = fma(p, r, Vec::all(4.1665795894e-2f));
  p = fma(p, r, Vec::all(1.6666665459e-1f));
  p = fma(p, r, Vec::all(5.0000001201e-1f));
  p = fma(p, r * r, r + Vec::all(1.0f));
  return times_pow2(p, n);
}

// erf(u) by Abramowitz and Stegun's 7.1.26 (absolute error under 1.5e-7), on |u| with u's sign put back; `gauss` gets
// e^(-u^2) on the way. kExact: t = 1 / (1 + 0.3275911 |u|) by IEEE division, the same bits on every x86 CPU (training's
// GELU, gelu.h); else by `reciprocal`, whose rcp estimate Intel and AMD CPUs round differently (the int8 products').
template <bool kExact>
inline Vec erf_signed(Vec u, Vec& gauss) {
  const Vec sign = bits_and(u, Vec::all(-0.0f));
  const Vec a = bits_xor(u, sign);  // |u|
  const Vec d = fma(a, Vec::all(0.3275911f), Vec::all(1.f));
  Vec t;
  if constexpr (kExact) {
    t = Vec::all(1.f) / d;
  } else {
    t = reciprocal(d);
  }
  Vec p = Vec::all(1.061405429f);
  p = fma(p, t, Vec::all(-1.453152027f));
  p = fma(p, t, Vec::all(1.421413741f));
  p = fma(p, t, Vec::all(-0.284496736f));
  p = fma(p, t, Vec::all(0.254829592f));
  gauss = exp_nonpositive(Vec::zero() - a * a);
  return bits_xor(fnma(p * t, gauss, Vec::all(1.f)), sign);
}

// The exact GELU, x Phi(x) = x (1 + erf(x / sqrt 2)) / 2, erf as above: inside the u7 and VNNI products (int8_u7.h,
// int8_vnni.h); training's GELU is gelu.h.
inline Vec gelu_erf(Vec x) {
  Vec gauss;
  const Vec erf = erf_signed<false>(x * Vec::all(0.70710678118654752f), gauss);
  return (Vec::all(0.5f) * x) * (Vec::all(1.f) + erf);
}

// y[0..n) = gelu_erf(y) in place.
inline void gelu_in_place(float* y, int64_t n) {
  int64_t i = 0;
  for (; i + Vec::kLanes <= n; i += Vec::kLanes) gelu_erf(Vec::load(y + i)).store(y + i);
  if (i < n) {
    float last[Vec::kLanes];
    gelu_erf(Vec::load_first(y + i, n - i, 0.f)).store(last);
    std::copy_n(last, n - i, y + i);
  }
}

// The running (min, max) of what a kernel wrote, kLanes wide until it is read.
struct Range {
  Vec lo = Vec::all(kInf), hi = Vec::all(-kInf);
  void add(Vec x) {
    lo = bertforge::min(lo, x);
    hi = bertforge::max(hi, x);
  }
  void add_first(const float* p, int64_t n) {  // p's first n (< kLanes) values
    lo = bertforge::min(lo, Vec::load_first(p, n, kInf));
    hi = bertforge::max(hi, Vec::load_first(p, n, -kInf));
  }
  float min() const { return reduce_min(lo); }
  float max() const { return reduce_max(hi); }
};

// The fewest (row block, panel) tasks of a product a thread takes for `macs` multiply-adds a chunk (by default 256K,
// so a product of a row or a few, a classifier's pooler and head over one text, runs on the calling thread, not waking
// others).
inline int64_t task_grain(int64_t block_rows, int64_t depth, int64_t columns, int64_t macs = int64_t{1} << 18) {
  return std::max<int64_t>(1, macs / std::max<int64_t>(1, block_rows * depth * columns));
}

// out[j] = parts[0][j] + parts[1][j] + ... + parts[count - 1][j] in that order, for j < width (whole vectors; count >=
// 1, parts `count` rows of `width`): training's column sums, added over fixed chunks of rows and then the chunks in
// order, so that their bits depend on the build, not on the threads (gelu.h's bias gradient, add_norm.h's).
inline void sum_in_order(const float* parts, int64_t count, int64_t width, float* out) {
  for (int64_t j = 0; j < width; j += Vec::kLanes) {
    Vec total = Vec::load(parts + j);
    for (int64_t c = 1; c < count; ++c) total = total + Vec::load(parts + c * width + j);
    total.store(out + j);
  }
}

}  // namespace bertforge

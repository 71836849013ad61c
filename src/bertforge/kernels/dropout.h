// Dropout's keep masks from a counter-based hash (cpu_kernels.cpp registers keep_mask; bertforge/dropout.py uses it).
//
// PyTorch draws a dropout mask on the CPU from a Mersenne Twister one number at a time (bernoulli_): about 10 ns an
// element, so the 20 masks of a fine-tuning step of MiniLM-L6 at batch 32 on short texts cost 12% of the step.
// Here element i of a mask is a pure function of i and a 64-bit key drawn from torch's generator once a call:
//   u = mix(mix(i ^ k0) + k1)    (k0, k1 the key's low and high 32 bits; mix Wellons' "lowbias32" bijection)
//   keep = u >= t,               t = round(p 2^32), so P(drop) = t / 2^32, p to within 2^-33.
// Each element needs only 32-bit integer multiplies, xors and shifts, which vectorize on any x86 ISA (fp32 takes
// vec.h's full-width vectors, kept_lanes; the compiler's own are half as wide on AVX-512), and no element depends on
// another, so the bits do not depend on the ISA, the threads or the blocking:
// bertforge/dropout.py computes the same bits with torch's integer operators where this file cannot be built.
// Masks of up to 2^32 elements (the index is 32 bits wide).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "vec.h"

namespace bertforge {

// lowbias32 on one uint32_t, or on vec.h's UVec, a vector's lanes at a time
template <typename U>
inline U mix32(U x) {
  x = x ^ (x >> 16);
  x = x * 0x7feb352dU;
  x = x ^ (x >> 15);
  x = x * 0x846ca68bU;
  return x ^ (x >> 16);
}

// A mask's key (its low and high 32 bits) and threshold, from dropout's drop probability p (0 <= p < 1) and a
// 64-bit key; kept(i): whether element i survives.
struct MaskKey {
  uint32_t k0, k1, threshold;
  MaskKey(double p, int64_t key)
      : k0(static_cast<uint32_t>(static_cast<uint64_t>(key))),
        k1(static_cast<uint32_t>(static_cast<uint64_t>(key) >> 32)),
        threshold(static_cast<uint32_t>(std::min(std::llround(p * 4294967296.0), 4294967295LL))) {}
  bool kept(uint32_t i) const { return mix32(mix32(i ^ k0) + k1) >= threshold; }
  // kept(first), ..., kept(first + kLanes - 1), a vector at a time: all bits set in a kept element's lane, none in a
  // dropped one's
  Vec kept_lanes(uint32_t first) const {
    return at_least(mix32(mix32(UVec::index(first) ^ UVec::all(k0)) + UVec::all(k1)), threshold);
  }
};

// What dropout multiplies an element by, from kept_lanes' bits: scale where kept, +0 where dropped. x times it is
// x keep scale to the bit (x keep is x, or a zero of x's sign, exactly).
inline Vec keep_factor(Vec kept_bits, float scale) { return bits_and(kept_bits, Vec::all(scale)); }

// keep[i] for i in [begin, end): 1 where element i survives, 0 where it is dropped
inline void keep_mask_range(uint8_t* keep, int64_t begin, int64_t end, MaskKey key) {
  for (int64_t i = begin; i < end; ++i) keep[i] = key.kept(static_cast<uint32_t>(i));
}

// out[i] = x[i] * keep[i] * scale for i in [begin, end), keep[i] (1 or 0) computed as keep_mask_range computes it:
// dropout applied without a mask in memory, and its backward, which recomputes the mask from the same key. The two
// products are done in this order, in fp32, and rounded once to T, as torch computes `x * keep * scale` (x times 0 or
// 1 is exact, -0 and infinities included), so the result is the same to the bit; a NaN stays a NaN (in bf16 its
// payload may differ). `first` is element begin's index in the mask (begin, unless x is part of a larger tensor).
template <typename T>
inline void apply_mask_range(const T* x, T* out, int64_t begin, int64_t end, MaskKey key, float scale,
                             int64_t first) {
  const uint32_t start = static_cast<uint32_t>(first);
  int64_t i = begin;
  if constexpr (std::is_same_v<T, float>) {  // fp32 a vector at a time (the compiler's vectors are half as wide)
    for (; i + Vec::kLanes <= end; i += Vec::kLanes) {
      const Vec f = keep_factor(key.kept_lanes(start + static_cast<uint32_t>(i - begin)), scale);
      (Vec::load(x + i) * f).store(out + i);
    }
  }
  for (; i < end; ++i) {
    const float kept = key.kept(start + static_cast<uint32_t>(i - begin)) ? 1.0f : 0.0f;
    out[i] = static_cast<T>(static_cast<float>(x[i]) * kept * scale);
  }
}

}  // namespace bertforge

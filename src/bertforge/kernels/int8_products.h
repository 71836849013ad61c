// A sequence's int8 products for the int8_encoder operator (int8_encoder.h): one product's packed weights
// (`Product`), and the per-row products on the VNNI kernels (`VnniProducts`, AMX tiles where granted) or on the u7
// kernels (`U7Products`), each quantizing a sequence's rows once and then multiplying any range of the weight's
// panels, so a sequence's product can be run on one thread or shared out over several by panels.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "int8_amx.h"
#include "int8_u7.h"
#include "int8_vnni.h"

namespace bertforge::encoder {

// A chunk of a shared-out product's panels (`EncoderWork::team`) holds at least this many multiply-adds, and its
// attention is shared out from this many (T x T x H): BERT-tiny's products at 27 rows (1.3-1.8M each) took twice as
// long split in two with chunks of a quarter of this as on one thread (a 2-core Zen 4); MiniLM-L6's ran alike.
constexpr int64_t kChunkMacs = 1 << 21;

// A column range's end past every product's last column: the whole product.
constexpr int64_t kWhole = INT64_MAX;

// One int8 product's weights, as vnni_pack or u7_pack made them (panels of columns over K rounded up); or an fp32
// one's (`f32`: f32_pack's panels, the int8 fields null; fp32_encoder.h).
struct Product {
  const int8_t* panels;
  const int32_t* sums;
  const float* wscale;
  const float* bias;
  int64_t K, N;
  const float* f32 = nullptr;
};

// A sequence's rows quantized for a product by `Quantize` (vnni's or u7's quantize_rows): u8 codes, K rounded up to
// kMultiple a row, and a row's scale and zero point.
using QuantizeRows = void (*)(const float*, int64_t, int64_t, int64_t, uint8_t*, float*, int32_t*);
template <int64_t kMultiple, QuantizeRows Quantize>
struct RowCodes {
  std::vector<uint8_t> codes;
  std::vector<float> scale;
  std::vector<int32_t> zero;
  RowCodes(int64_t rows, int64_t T, int64_t width) : codes(rows * depth(width)), scale(T), zero(T) {}

  static constexpr int64_t depth(int64_t K) { return (K + kMultiple - 1) / kMultiple * kMultiple; }

  // the M rows' codes, for the product's `multiply`
  void quantize(const float* in, int64_t M, int64_t K) {
    Quantize(in, M, K, depth(K), codes.data(), scale.data(), zero.data());
  }

  // where the product of these rows by w writes y (M rows of w.N)
  Epilogue epilogue(const Product& w, bool gelu, float* y) const {
    return Epilogue{w.sums, w.wscale, w.bias, scale.data(), zero.data(), y, w.N, gelu};
  }
};

// A sequence's products on the VNNI kernels (8-bit activations per row; AMX tiles where granted and K is whole tile
// depths), as vnni_linear computes them: every output element by the same int32 sums and epilogue.
#if BERTFORGE_VNNI
struct VnniProducts : RowCodes<4, vnni::quantize_rows> {
  static constexpr int64_t kPanel = vnni::NR, kChunk = kChunkMacs;
  static bool uses_tiles() { return amx::usable(); }
  bool on_tiles = uses_tiles();
  // codes for rows up to a whole AMX tile's, which reads them
  VnniProducts(int64_t T, int64_t width) : RowCodes((T + amx::kRows - 1) / amx::kRows * amx::kRows, T, width) {}

  // y's columns of panels p0 .. p1 of the M quantized rows' product: reads this object only, so threads may each
  // take panels of one product
  void multiply(int64_t M, const Product& w, bool gelu, float* y, int64_t p0, int64_t p1) const {
    const int64_t Kp = depth(w.K);
    const Epilogue e = epilogue(w, gelu, y);
    if (on_tiles && Kp % amx::kDepth == 0) return amx::product(codes.data(), M, Kp, w.panels, e, p0, p1);
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t r = 0; r < M; r += vnni::MR)
        vnni::rows_tile(std::min(vnni::MR, M - r), codes.data() + r * Kp, Kp, w.panels + p * Kp * vnni::NR, r,
                        p * vnni::NR, e);
  }
};
#endif

// A sequence's products on the u7 kernels (7-bit activations per row, CPUs without int8 dot products), as
// u7_linear computes them.
struct U7Products : RowCodes<8, u7::quantize_rows> {
  static constexpr int64_t kPanel = u7::NR, kChunk = kChunkMacs;
  static constexpr bool on_tiles = false;
  static bool uses_tiles() { return false; }
  U7Products(int64_t T, int64_t width) : RowCodes(T, T, width) {}

  // as VnniProducts::multiply
  void multiply(int64_t M, const Product& w, bool gelu, float* y, int64_t p0, int64_t p1) const {
    const int64_t Kp = depth(w.K);
    const Epilogue o = epilogue(w, gelu, y);
    for (int64_t p = p0; p < p1; ++p) u7::block(codes.data(), Kp, w.panels + p * Kp * kPanel, 0, M, p * kPanel, o);
  }
};

}  // namespace bertforge::encoder

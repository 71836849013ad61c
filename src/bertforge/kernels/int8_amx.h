// int8 products on AMX tiles, for the encoder a sequence at a time (int8_encoder.h): built where the build's CPU has
// AMX (the AVX-512 build is -march=native), run where Linux lets the process use the tiles. The weights are the VNNI
// kernels' panels as they are: a panel's rows of four k-bytes for its 32 columns are two AMX B tiles (16 columns
// each, rows 128 bytes apart). The sums are the same int32 sums (exact), written through the VNNI kernels' epilogue
// (`Columns`), so the outputs are vnni_linear's bit for bit. A 16 x 64 by 64 x 16 tile product (tdpbusd) does 16,384
// multiply-adds where vpdpbusd does 64.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "int8_vnni.h"

#if BERTFORGE_VNNI && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define BERTFORGE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define BERTFORGE_AMX 0
#endif

namespace bertforge::amx {

// Rows of activations a tile holds, and the k-bytes a tile product takes at a time (K must be a multiple of it).
constexpr int64_t kRows = 16, kDepth = 64;

#if BERTFORGE_AMX

// Whether this process may use the tiles: Linux grants them on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA), once per process; a kernel that will not leaves the VNNI kernels in their place.
inline bool usable() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

// Every tile 16 rows of 64 bytes: A (activations: 16 rows x 64 k-bytes), B (64 k x 16 columns, four k-bytes a
// column) and C (16 rows x 16 int32 sums). Tiles are a thread's state: each thread configures its own.
struct Tiles {
  Tiles() {
    alignas(64) uint8_t config[64] = {};
    config[0] = 1;  // palette 1
    for (int t = 0; t < 8; ++t) {
      config[16 + 2 * t] = 64;  // bytes a row
      config[48 + t] = kRows;   // rows
    }
    _tile_loadconfig(config);
  }
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};

// y (M rows) = codes (M rows of Kp bytes, readable up to M rounded up to 16 rows) times the packed weight's panels
// p0 .. p1, written through the epilogue: two row tiles by a panel's two column tiles at a time, into 4 KB of sums.
inline void product(const uint8_t* codes, int64_t M, int64_t Kp, const int8_t* panels, const Epilogue& e, int64_t p0,
                    int64_t p1) {
  using vnni::NR;
  alignas(64) int32_t sums[2 * kRows][NR];
  for (int64_t p = p0; p < p1; ++p) {
    const int8_t* panel = panels + p * Kp * NR;
    const bool wide = p * NR + 16 < e.N;  // the panel's second 16 columns hold outputs
    const vnni::Columns left(e, p * NR), right(e, wide ? p * NR + 16 : p * NR);
    for (int64_t r = 0; r < M; r += 2 * kRows) {
      const bool two = r + kRows < M;
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
      for (int64_t k = 0; k < Kp; k += kDepth) {
        const int8_t* b = panel + k / 4 * NR * 4;
        _tile_loadd(2, b, NR * 4);
        _tile_loadd(3, b + 64, NR * 4);
        _tile_loadd(0, codes + r * Kp + k, Kp);
        _tile_dpbusd(4, 0, 2);
        _tile_dpbusd(5, 0, 3);
        if (two) {
          _tile_loadd(1, codes + (r + kRows) * Kp + k, Kp);
          _tile_dpbusd(6, 1, 2);
          _tile_dpbusd(7, 1, 3);
        }
      }
      _tile_stored(4, &sums[0][0], NR * 4);
      _tile_stored(5, &sums[0][16], NR * 4);
      _tile_stored(6, &sums[kRows][0], NR * 4);
      _tile_stored(7, &sums[kRows][16], NR * 4);
      for (int64_t i = 0; i < std::min(2 * kRows, M - r); ++i) {
        left.write(e, r + i, _mm512_load_si512(&sums[i][0]));
        if (wide) right.write(e, r + i, _mm512_load_si512(&sums[i][16]));
      }
    }
  }
}

#else  // no tiles: the VNNI kernels run every product (where the build has them)

inline bool usable() { return false; }
#if BERTFORGE_VNNI
struct Tiles {};
inline void product(const uint8_t*, int64_t, int64_t, const int8_t*, const Epilogue&, int64_t, int64_t) {}
#endif

#endif

}  // namespace bertforge::amx

// What every AMX kernel needs before its first tile instruction (the packed GEMM, ops/csrc/packed_gemm_amx.h; the
// flash tiles of prompt attention, attention/csrc/flash_amx.h): the kernel's grant of the tile data state, and a
// tile configuration. ops/build.py puts this folder on every kernel's include path.
#pragma once

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace pagellm_amx {

// The process may use tile data only once the kernel grants it (Linux arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); asked once.
inline bool permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-5 (C and A operands) of `rows` rows, tiles 6-7 (B operands) of 16, every row 64 bytes.
inline void configure(int rows) {
  Config cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = static_cast<uint8_t>(t >= 6 ? 16 : rows);
  }
  // GCC's _tile_loadconfig tells the compiler it reads only the first 8 bytes, which lets the stores above sink
  // past it: a memory barrier keeps them before.
  asm volatile("" ::: "memory");
  _tile_loadconfig(&cfg);
}

// C tiles 0-3 set to zero: R row tiles x P panels (tiles 0-1: the first row tile's panels, 2-3: the second's).
template <int R, int P>
inline void zero_c_tiles() {
  _tile_zero(0);
  if (P > 1) _tile_zero(1);
  if (R > 1) _tile_zero(2);
  if (R > 1 && P > 1) _tile_zero(3);
}

}  // namespace pagellm_amx
#endif

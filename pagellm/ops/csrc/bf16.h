// bfloat16 <-> float32 for scalar code, rounding as torch rounds (to nearest even; a NaN stays a quiet NaN).
#pragma once

#include <cstdint>

namespace {

inline float f32(uint16_t h) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(h) << 16);
}

inline uint16_t bf16(float f) {
  uint32_t u = __builtin_bit_cast(uint32_t, f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace

// The int8 packed layout of packed_gemm_w8a8.cpp (described at its top): its constants, and the work on either side
// of the kernel's tiles: a weight's column quantized into its panel once at load time (quantize_column), and each
// call's rows of x made the tiles' unsigned operand (quantize_rows). Built into that library only (with its
// -ffp-contract=off).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "int8_rows.h"  // row_scale, col_mask, widen_bf16

namespace pagellm_w8a8 {

using pagellm_int8::col_mask;
using pagellm_int8::widen_bf16;

constexpr int kPanel = 16;     // output columns per panel (one zmm of int32)
constexpr int64_t kQuad = 64;  // bytes per k-quad of a panel (16 columns x 4 int8)

// Rows [r0, r1) of bfloat16 x [., k] (row stride ldx) quantized: out[r] = q(x[r]) + 128 over 4 * quads bytes (the
// padding 128, i.e. q = 0), sx[r] their scale. q = round-to-nearest-even(x · (127 / max|x|)) clamped to ±127.
inline void quantize_rows(const uint16_t* x, int64_t ldx, int64_t k, int64_t quads, uint8_t* out, float* sx, int64_t r0,
                          int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* row = x + r * ldx;
    const __m512 vinv = _mm512_set1_ps(pagellm_int8::row_scale(row, k, &sx[r]));
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), zero = _mm512_set1_epi32(128);
    uint8_t* dst = out + r * 4 * quads;
    for (int64_t c = 0; c < k; c += kPanel) {
      const __mmask16 m = col_mask(static_cast<int>(k - c));
      const __m512 v = _mm512_mul_ps(widen_bf16(_mm256_maskz_loadu_epi16(m, row + c)), vinv);
      const __m512i q = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(v), lo), hi);
      _mm512_mask_cvtepi32_storeu_epi8(dst + c, m, _mm512_add_epi32(q, zero));
    }
    std::memset(dst + k, 128, static_cast<size_t>(4 * quads - k));
  }
}

// One output column's weights (bfloat16 [k]) quantized as gemm_w8a8.quantize does, op for op: s = max|w| / 127,
// q = round(w / (s > 0 ? s : 1)) clamped to ±127 (to nearest even), into column c of its panel (stride 16 * 4 bytes
// per quad); returns Σ q. False for a NaN or infinite weight.
inline bool quantize_column(const uint16_t* w, int64_t k, int8_t* panel, int c, float* scale, int64_t* sum) {
  constexpr int kNotFinite = 0x01 | 0x08 | 0x10 | 0x80;  // quiet NaN, +inf, -inf, signalling NaN
  __m512 mx = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += kPanel) {
    const __m512 v = widen_bf16(_mm256_maskz_loadu_epi16(col_mask(static_cast<int>(k - i)), w + i));
    if (_mm512_fpclass_ps_mask(v, kNotFinite)) return false;
    mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
  }
  *scale = _mm512_reduce_max_ps(mx) / 127.0f;
  const __m512 step = _mm512_set1_ps(*scale > 0.0f ? *scale : 1.0f);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  __m512i total = _mm512_setzero_si512();
  alignas(64) int32_t q[kPanel];
  for (int64_t i = 0; i < k; i += kPanel) {
    const __mmask16 m = col_mask(static_cast<int>(k - i));
    const __m512 v = _mm512_div_ps(widen_bf16(_mm256_maskz_loadu_epi16(m, w + i)), step);
    const __m512i r = _mm512_maskz_mov_epi32(m, _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(v), lo), hi));
    total = _mm512_add_epi32(total, r);
    _mm512_store_si512(q, r);
    for (int j = 0; j < kPanel && i + j < k; ++j)
      panel[((i + j) / 4) * kQuad + 4 * c + (i + j) % 4] = static_cast<int8_t>(q[j]);
  }
  *sum = _mm512_reduce_add_epi32(total);
  return true;
}

}  // namespace pagellm_w8a8

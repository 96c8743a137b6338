// What the int8 kernels' operands share (w8a8_layout.h, w4a8_layout.h): lane masks, bfloat16 widened to float32, and
// a row's scale: a bfloat16 row's max|x| gives its scale s_x = max|x| / 127, and q(x) multiplies x by 127 / max|x|
// (0 for a row of zeros, or where that factor overflows).
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace pagellm_int8 {

// The first `cols` of 16 lanes (all 16 from 16 on).
inline __mmask16 col_mask(int64_t cols) {
  return cols >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << cols) - 1);
}

// 16 bfloat16 values widened to float32.
inline __m512 widen_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// 127 / max|x| over the row's k values (0 where that is 0 or not finite); *sx = max|x| / 127.
inline float row_scale(const uint16_t* row, int64_t k, float* sx) {
  __m512 mx = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += 16) {
    mx = _mm512_max_ps(mx, _mm512_abs_ps(widen_bf16(_mm256_maskz_loadu_epi16(col_mask(k - c), row + c))));
  }
  const float amax = _mm512_reduce_max_ps(mx);
  float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  if (!std::isfinite(inv)) inv = 0.0f;
  *sx = amax / 127.0f;
  return inv;
}

}  // namespace pagellm_int8

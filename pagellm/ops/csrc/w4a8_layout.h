// The 4-bit packed layout of packed_gemm_w4a8.cpp (described at its top): its constants, and the work on either side
// of the kernel's tiles: a weight packed once at load time (quantize_group or take_group per column's group,
// write_block per panel's group, pack_panels over the panels), and each call's rows of x made the tiles' operands
// (quantize_rows for W4A8, copy_rows for W4A16). Built into that library only (with its -ffp-contract=off).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "int8_rows.h"  // row_scale, col_mask, widen_bf16

namespace pagellm_w4a8 {

constexpr int kPanel = 16;                // output columns per panel (one zmm)
constexpr int kGroup = 32;                // inputs per group (one d and one m per column)
constexpr int64_t kLine = 64;             // bytes per line
constexpr int kNibbleLines = 4;           // lines of nibbles per group, 8 inputs each
constexpr int64_t kGroupBytes = 5 * kLine;  // a group of a panel: its nibble lines and its scale line

using pagellm_int8::col_mask;
using pagellm_int8::widen_bf16;

// Rows [r0, r1) of bfloat16 x [., k] (row stride ldx) quantized: out[r] = q(x[r]) over groups * 32 bytes (zero
// padding), sums[r][g] = Σ q(x[r]) over group g, sx[r] the row's scale. q is the int8 kernel's.
inline void quantize_rows(const uint16_t* x, int64_t ldx, int64_t k, int64_t groups, int8_t* out, float* sums,
                          float* sx, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* row = x + r * ldx;
    const __m512 vinv = _mm512_set1_ps(pagellm_int8::row_scale(row, k, &sx[r]));
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    int8_t* dst = out + r * kGroup * groups;
    for (int64_t g = 0; g < groups; ++g) {
      __m512i sum = _mm512_setzero_si512();
      for (int64_t c = g * kGroup; c < (g + 1) * kGroup; c += kPanel) {
        const __mmask16 m = c < k ? col_mask(static_cast<int>(k - c)) : 0;
        const __m512 v = _mm512_mul_ps(widen_bf16(_mm256_maskz_loadu_epi16(m, row + c)), vinv);
        const __m512i q = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(v), lo), hi);
        _mm512_mask_cvtepi32_storeu_epi8(dst + c, 0xffff, q);
        sum = _mm512_add_epi32(sum, q);
      }
      sums[r * groups + g] = static_cast<float>(_mm512_reduce_add_epi32(sum));
    }
  }
}

// W4A16: rows [r0, r1) of bfloat16 x [., k] copied zero-padded to groups * 32 (out[r]), each 8 inputs in the pair
// order of group_step_bf16's operands (0, 2, 1, 3, 4, 6, 5, 7), with each group's sum of x in float32 (sums[r][g],
// over 16-lane halves then across the lanes).
inline void copy_rows(const uint16_t* x, int64_t ldx, int64_t k, int64_t groups, uint16_t* out, float* sums,
                      int64_t r0, int64_t r1) {
  const __m256i order = _mm256_setr_epi16(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* row = x + r * ldx;
    uint16_t* dst = out + r * kGroup * groups;
    for (int64_t g = 0; g < groups; ++g) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t c = g * kGroup; c < (g + 1) * kGroup; c += kPanel) {
        const __mmask16 m = c < k ? col_mask(static_cast<int>(k - c)) : 0;
        const __m256i v = _mm256_maskz_loadu_epi16(m, row + c);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c), _mm256_permutexvar_epi16(order, v));
        sum = _mm512_add_ps(sum, widen_bf16(v));
      }
      sums[r * groups + g] = _mm512_reduce_add_ps(sum);
    }
  }
}

// One row's group of 32 weights (bfloat16, `valid` of them real, the rest zero padding) quantized as
// gemm_w4a8.quantize does, op for op: lo, hi = min, max; d = half((hi - lo) / 15), m = half(lo); q = round((w - m) /
// (d > 0 ? d : 1)) clamped to [0, 15] (to nearest even; this source has no fused multiply-adds).
// Returns false for a NaN or infinite weight.
inline bool quantize_group(const uint16_t* w, int valid, uint8_t* q, uint16_t* d, uint16_t* m) {
  const __m512 a = widen_bf16(_mm256_maskz_loadu_epi16(col_mask(valid), w));
  const __m512 b = widen_bf16(_mm256_maskz_loadu_epi16(col_mask(valid - kPanel > 0 ? valid - kPanel : 0), w + 16));
  constexpr int kNotFinite = 0x01 | 0x08 | 0x10 | 0x80;  // quiet NaN, +inf, -inf, signalling NaN
  if (_mm512_fpclass_ps_mask(a, kNotFinite) | _mm512_fpclass_ps_mask(b, kNotFinite)) return false;
  const float lo = _mm512_reduce_min_ps(_mm512_min_ps(a, b)), hi = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
  *d = _cvtss_sh((hi - lo) / 15.0f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  *m = _cvtss_sh(lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const float df = _cvtsh_ss(*d);
  const __m512 step = _mm512_set1_ps(df > 0.0f ? df : 1.0f), low = _mm512_set1_ps(_cvtsh_ss(*m));
  const __m512 top = _mm512_set1_ps(15.0f), zero = _mm512_setzero_ps();
  for (int h = 0; h < 2; ++h) {
    const __m512 v = _mm512_div_ps(_mm512_sub_ps(h ? b : a, low), step);
    const __m512 r = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT), zero), top);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r)));
  }
  return true;
}

// The integers of a group given as bfloat16 values (a 4-bit checkpoint's, held by the weight): false unless each of
// the `valid` values is a whole number in [0, 15]; q is zero beyond them.
inline bool take_group(const uint16_t* w, int valid, uint8_t* q) {
  const __m512 top = _mm512_set1_ps(15.0f), zero = _mm512_setzero_ps();
  __mmask16 bad = 0;
  for (int h = 0; h < 2; ++h) {
    const __mmask16 lanes = col_mask(valid - kPanel * h > 0 ? valid - kPanel * h : 0);
    const __m512 v = widen_bf16(_mm256_maskz_loadu_epi16(lanes, w + kPanel * h));
    const __mmask16 whole = _mm512_cmp_ps_mask(v, _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO), _CMP_EQ_OQ) &
                            _mm512_cmp_ps_mask(v, zero, _CMP_GE_OQ) & _mm512_cmp_ps_mask(v, top, _CMP_LE_OQ);
    bad |= lanes & static_cast<__mmask16>(~whole);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + kPanel * h), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(v)));
  }
  return bad == 0;
}

// One panel's group of the packed layout from its columns' integers q and their d and m (scales[0], scales[1]).
inline void write_block(uint8_t* block, const uint8_t (&q)[kPanel][kGroup], const uint16_t (&scales)[2][kPanel]) {
  for (int l = 0; l < kNibbleLines; ++l)
    for (int c = 0; c < kPanel; ++c)
      for (int i = 0; i < 4; ++i)
        block[l * kLine + 4 * c + i] = static_cast<uint8_t>(q[c][8 * l + i] | (q[c][8 * l + 4 + i] << 4));
  std::memcpy(block + kNibbleLines * kLine, scales, sizeof(scales));
}

// Each panel's groups of a [n, k] weight laid out in one pass, the panels over torch's OpenMP threads: `group(row,
// g, valid, q, d, m)` fills one column's group and says whether it could; returns 0, or -1 where one could not.
template <typename Group>
int pack_panels(int64_t n, int64_t k, uint8_t* out, Group group) {
  const int64_t panels = (n + kPanel - 1) / kPanel, groups = (k + kGroup - 1) / kGroup;
  int failed = 0;
#pragma omp parallel for schedule(static) reduction(| : failed)
  for (int64_t p = 0; p < panels; ++p) {
    for (int64_t g = 0; g < groups; ++g) {
      uint16_t scales[2][kPanel] = {};
      uint8_t q[kPanel][kGroup] = {};
      const int valid = static_cast<int>(k - g * kGroup < kGroup ? k - g * kGroup : kGroup);
      for (int c = 0; c < kPanel && p * kPanel + c < n; ++c)
        failed |= !group(p * kPanel + c, g, valid, q[c], &scales[0][c], &scales[1][c]);
      write_block(out + (p * groups + g) * kGroupBytes, q, scales);
    }
  }
  return failed ? -1 : 0;
}

// What a nibble means to the W4A16 entries: the integer q (bfloat16(q): w = d · q + m), or MXFP4's E2M1 value
// (0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6 by its code, the sign the top bit: w = d · e2m1(q), m = 0). vpermw reads 32.
alignas(64) constexpr uint16_t kIntegers[32] = {
    0, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160,
    0x4170, 0, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150,
    0x4160, 0x4170};
alignas(64) constexpr uint16_t kE2M1[32] = {
    0, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0, 0x8000, 0xbf00, 0xbf80, 0xbfc0, 0xc000, 0xc040, 0xc080,
    0xc0c0, 0, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0, 0x8000, 0xbf00, 0xbf80, 0xbfc0, 0xc000, 0xc040,
    0xc080, 0xc0c0};

}  // namespace pagellm_w4a8

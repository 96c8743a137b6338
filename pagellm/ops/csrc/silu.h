// SiLU(gate) * up for 16 floats (AVX-512) or 8 (AVX2 + FMA) and torch's bfloat16 rounding (and gpt-oss's clamped
// SwiGLU and Gemma's GeGLU, the fused kernels'), shared by the SiLU·mul
// kernel (ops/csrc/fused.cpp) and the packed GEMMs (their gate/up epilogues: packed_gemm_amx.h,
// packed_gemm_avx512.h, packed_gemm_w8a8.cpp; the AVX2 stores, packed_gemm_avx2.h), so the fused and the two-call
// paths give the same bits. ops/build.py
// compiles every kernel with this folder on the include path.
#pragma once

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "simd_exp.h"  // exp16

// Round 16 floats to bfloat16 (nearest even; inputs here are never NaN), kept as float32: the value a bf16 store
// and reload would give.
static inline __m512 round_bf16x16(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u))));
}

// round_bf16x16 of v stored as bfloat16 into the lanes of m.
static inline void store_bf16x16(uint16_t* p, __m512 v, __mmask16 m) {
  const __m512i u = _mm512_castps_si512(round_bf16x16(v));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

// silu(g) * u = g / (1 + e^-g) * u, in float32 (g and u already bfloat16 values).
static inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  return _mm512_mul_ps(silu, u);
}

// gpt-oss's clamped SwiGLU, (clamp(u, -limit, limit) + 1) * (g' * sigmoid(alpha * g')) with g' = min(g, limit),
// each operation rounded to bfloat16 where torch's sequence of bfloat16 ops rounds it but the last (the caller's
// store rounds it); g and u already bfloat16 values.
static inline __m512 clamped_swiglu16(__m512 g, __m512 u, float limit, float alpha) {
  const __m512 one = _mm512_set1_ps(1.f), cap = _mm512_set1_ps(limit);
  g = round_bf16x16(_mm512_min_ps(g, cap));
  u = round_bf16x16(_mm512_max_ps(_mm512_min_ps(u, cap), _mm512_sub_ps(_mm512_setzero_ps(), cap)));
  const __m512 up1 = round_bf16x16(_mm512_add_ps(u, one));
  const __m512 ga = round_bf16x16(_mm512_mul_ps(g, _mm512_set1_ps(alpha)));
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), ga));
  const __m512 sig = round_bf16x16(_mm512_div_ps(one, _mm512_add_ps(one, e)));
  return _mm512_mul_ps(up1, round_bf16x16(_mm512_mul_ps(g, sig)));
}

// Gemma's GeGLU, gelu_tanh(g) * u, with gelu_tanh(g) = 0.5 g (1 + tanh(c (g + 0.044715 g^3))), c = sqrt(2 / pi),
// computed as g / (1 + e^(-2 c (g + 0.044715 g^3))) (the same function; no cancellation near 0) and rounded to
// bfloat16 before the product, as torch's bfloat16 gelu and mul round; g and u already bfloat16 values.
static inline __m512 gelu_tanh_mul16(__m512 g, __m512 u) {
  const __m512 inner = _mm512_mul_ps(g, _mm512_fmadd_ps(_mm512_mul_ps(g, g), _mm512_set1_ps(0.044715f),
                                                       _mm512_set1_ps(1.f)));
  const __m512 e = exp16(_mm512_mul_ps(inner, _mm512_set1_ps(-1.5957691216057308f)));
  return _mm512_mul_ps(round_bf16x16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e))), u);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "simd_exp.h"  // exp8

// Eight bfloat16 values (16 bytes at p) as float32.
static inline __m256 widen_bf16x8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Eight float32 lanes rounded to bfloat16 as torch rounds (nearest, ties to even; NaN stays a quiet NaN).
static inline __m128i round_bf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  const __m256i magnitude = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i words = _mm256_blendv_epi8(rounded, quiet, nan);
  const __m256i packed = _mm256_packus_epi32(words, words);  // per 128-bit lane: w0..3 w0..3 | w4..7 w4..7
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

// silu(g) * u = g / (1 + e^-g) * u on 8 lanes, in float32 (g and u already bfloat16 values).
static inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
  return _mm256_mul_ps(silu, u);
}

// gelu_tanh_mul16's steps on 8 lanes, but for the rounding before the product (the caller rounds gelu's 8 lanes).
static inline __m256 gelu_tanh8(__m256 g) {
  const __m256 inner = _mm256_mul_ps(g, _mm256_fmadd_ps(_mm256_mul_ps(g, g), _mm256_set1_ps(0.044715f),
                                                        _mm256_set1_ps(1.f)));
  const __m256 e = exp8(_mm256_mul_ps(inner, _mm256_set1_ps(-1.5957691216057308f)));
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e));
}
#endif

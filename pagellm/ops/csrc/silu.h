// SiLU(gate) * up for 16 floats and torch's bfloat16 rounding, shared by the SiLU·mul kernel (ops/csrc/fused.cpp)
// and the packed GEMM's gate/up epilogue (ops/csrc/packed_gemm_amx.h), so the fused and the two-call paths give
// the same bits. ops/build.py compiles every kernel with this folder on the include path.
#pragma once

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

// silu(g) * u = g / (1 + e^-g) * u, in float32 (g and u already bfloat16 values).
static inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  return _mm512_mul_ps(silu, u);
}
#endif

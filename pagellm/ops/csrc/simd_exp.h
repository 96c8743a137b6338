// e^x for 16 floats (AVX-512) or 8 (AVX2 + FMA), shared by the C++ kernels (attention/csrc/paged_attention.cpp,
// ops/csrc/fused.cpp).
// x is clamped to [-87, 88]; x = n ln2 + r, e^r by a degree-6 polynomial, times 2^n (relative error ~1e-7).
// ops/build.py compiles every kernel with this folder on the include path and keys builds by these headers too.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.0f / 720);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 120));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 24));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 6));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(0.5f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

// 2^x for 16 floats, for softmax exponents (x <= 0 but for rounding): x = n + r with r in [-0.5, 0.5], 2^r by a
// degree-5 polynomial fitted for relative error (~2e-7 in float32, as exp16), times 2^n. Ten operations to
// exp16's thirteen, where an attention tile's softmax spends most of its time. Below -126 the result is 2^-126's
// (no denormals, whose arithmetic is slow); NaN goes in as -126.
static inline __m512 exp2_16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 y = _mm512_set1_ps(1.326472708e-03f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(9.671512862e-03f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.550733746e-02f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(2.402224208e-01f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(6.931469776e-01f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// exp16's steps on 8 lanes; 2^n is built in the exponent field (n is in [-126, 127] after the clamp).
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.f)), _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.0f / 720);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 120));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 24));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 6));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(0.5f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2));
}
#endif

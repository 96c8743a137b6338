// 8-bit floating-point K/V cache elements (``--kv-cache-dtype fp8_e4m3 | fp8_e5m2``): their bits, conversion to
// float32 and to bfloat16 vectors on load, and rounding into them on store.
//
// Stored values are the K/V rows themselves (scale 1.0), rounded to nearest even and saturated at the format's
// largest finite value (e4m3: 448, the OCP "fn" format without infinities; e5m2: 57344), as
// attention/torch_ref.py quantize_kv does with torch's float8 dtypes: the two write the same bits (tests/kernels).
// Both formats widen exactly to bfloat16 and float32, so a kernel reading them computes on the stored values.
//
// Widening without a table: put the 7 magnitude bits where a float32's exponent and mantissa start (e4m3: bits 20
// to 26, e5m2: 21 to 27) and multiply by 2^(127 - bias); a normal number gets its exponent rebased, and a subnormal
// one (exponent field 0) becomes a float32 subnormal whose product is the right small value. Zero stays zero.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagellm {

struct Fp8E4M3 {  // 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, 0x7f/0xff NaN
  uint8_t x;
  static constexpr int kMantissa = 3, kBias = 7;
  static constexpr float kMax = 448.f;
  static constexpr float kMinNormal = 0x1p-6f;
  static constexpr float kWiden = 0x1p120f;    // 2^(127 - bias): rebases the shifted exponent field
  static constexpr float kSubnormal = 0x1p9f;  // 1 / the subnormal step, 2^(bias - 1 + mantissa)
};

struct Fp8E5M2 {  // 1 sign, 5 exponent (bias 15), 2 mantissa bits
  uint8_t x;
  static constexpr int kMantissa = 2, kBias = 15;
  static constexpr float kMax = 57344.f;
  static constexpr float kMinNormal = 0x1p-14f;
  static constexpr float kWiden = 0x1p112f;
  static constexpr float kSubnormal = 0x1p16f;
};

template <typename F>
inline float fp8_to_float(F v) {
  const uint32_t mag = static_cast<uint32_t>(v.x & 0x7f) << (23 - F::kMantissa);
  float f;
  std::memcpy(&f, &mag, sizeof(f));
  f *= F::kWiden;
  return (v.x & 0x80) ? -f : f;
}

inline float to_float(Fp8E4M3 v) { return fp8_to_float(v); }
inline float to_float(Fp8E5M2 v) { return fp8_to_float(v); }

// Round to nearest even, saturating at F::kMax; a NaN becomes 0xff (as torch writes every NaN).
template <typename F>
inline F fp8_from_float(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const float a = std::fabs(f);
  if (std::isnan(a)) return F{0xff};
  uint32_t mag;
  if (a < F::kMinNormal) {  // whole subnormal steps; rounds up into the first normal number at most
    mag = static_cast<uint32_t>(std::nearbyint(a * F::kSubnormal));
  } else {
    uint32_t b;
    const float c = a < F::kMax ? a : F::kMax;
    std::memcpy(&b, &c, sizeof(b));
    const int drop = 23 - F::kMantissa;
    b += (1u << (drop - 1)) - 1 + ((b >> drop) & 1u);
    mag = (b >> drop) - ((127u - F::kBias) << F::kMantissa);
  }
  return F{static_cast<uint8_t>(sign | mag)};
}

#if defined(__AVX2__)
// 8 elements widened to float32 (the AVX2 walk's load).
template <typename F>
inline __m256 fp8_load8(const F* p) {
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7f)), 23 - F::kMantissa);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
  const __m256 f = _mm256_mul_ps(_mm256_castsi256_ps(mag), _mm256_set1_ps(F::kWiden));
  return _mm256_or_ps(f, _mm256_castsi256_ps(sign));
}
#endif

#if defined(__AVX512F__)
// 16 elements widened to float32.
template <typename F>
inline __m512 fp8_load16(const F* p) {
  const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i mag = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x7f)), 23 - F::kMantissa);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
  const __m512 f = _mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(F::kWiden));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign));
}

inline __m512 load16(const Fp8E4M3* p) { return fp8_load16(p); }
inline __m512 load16(const Fp8E5M2* p) { return fp8_load16(p); }

// 16 float32 values rounded into F (as fp8_from_float) and stored.
template <typename F>
inline void fp8_store16(F* p, __m512 f) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
  const __m512 a = _mm512_abs_ps(f);
  const __mmask16 nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
  const __mmask16 sub = _mm512_cmp_ps_mask(a, _mm512_set1_ps(F::kMinNormal), _CMP_LT_OQ);
  const __m512i b = _mm512_castps_si512(_mm512_min_ps(a, _mm512_set1_ps(F::kMax)));
  constexpr int drop = 23 - F::kMantissa;
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, drop), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32((1 << (drop - 1)) - 1), odd));
  __m512i mag = _mm512_sub_epi32(_mm512_srli_epi32(rounded, drop),
                                 _mm512_set1_epi32((127 - F::kBias) << F::kMantissa));
  const __m512 scaled = _mm512_mul_ps(a, _mm512_set1_ps(F::kSubnormal));
  const __m512i steps = _mm512_cvt_roundps_epi32(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  mag = _mm512_mask_mov_epi32(mag, sub, steps);
  const __m512i bits = _mm512_mask_mov_epi32(_mm512_or_si512(mag, sign), nan, _mm512_set1_epi32(0xff));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(bits));
}
#endif

// The bfloat16 bits of magnitude code m (0..127) of F, computed without floats (a compile-time table's entries).
template <typename F>
constexpr uint16_t fp8_bf16_bits(int m) {
  const int exp = m >> F::kMantissa, mant = m & ((1 << F::kMantissa) - 1);
  if (exp > 0) return static_cast<uint16_t>(((exp + 127 - F::kBias) << 7) | (mant << (7 - F::kMantissa)));
  if (mant == 0) return 0;
  int lead = 0;  // a subnormal mant * 2^(1 - bias - mantissa): normalise on its leading bit
  while ((mant >> (lead + 1)) != 0) ++lead;
  const int e = lead + 1 - F::kBias - F::kMantissa + 127;
  return static_cast<uint16_t>((e << 7) | ((mant - (1 << lead)) << (7 - lead)));
}

// The low and the high bytes of the 128 magnitudes' bfloat16 bits: the two-register tables of vpermi2b.
template <typename F>
struct Fp8Bf16Table {
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi[128];
  constexpr Fp8Bf16Table() : lo(), hi() {
    for (int m = 0; m < 128; ++m) {
      lo[m] = static_cast<uint8_t>(fp8_bf16_bits<F>(m) & 0xff);
      hi[m] = static_cast<uint8_t>(fp8_bf16_bits<F>(m) >> 8);
    }
  }
};
template <typename F>
inline constexpr Fp8Bf16Table<F> kFp8Bf16Table{};

#if defined(__AVX512BF16__)
// 32 elements widened to bfloat16 (exact), in order: the operand the bf16 dot-product kernels load from a cache.
// With AVX-512 VBMI, two byte lookups (vpermi2b over the 128 magnitudes) give each element's two bytes, and the sign
// bit is ORed in: 7 instructions for 32 elements, about 2.5x fewer than widening through float32, which made the
// decode walk slower over an 8-bit cache than over bfloat16 (docs/performance.md, Round 20).
template <typename F>
inline __m512i fp8_load32_bf16(const F* p) {
#if defined(__AVX512VBMI__)
  const Fp8Bf16Table<F>& t = kFp8Bf16Table<F>;
  const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i high = _mm512_slli_epi16(x, 8);                // the code in each element's high byte
  const __m512i idx = _mm512_or_si512(x, high);                // ... and in its low byte (bit 7 is not an index bit)
  const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(t.lo), idx, _mm512_load_si512(t.lo + 64));
  const __m512i hi = _mm512_permutex2var_epi8(_mm512_load_si512(t.hi), idx, _mm512_load_si512(t.hi + 64));
  const __m512i bits = _mm512_mask_blend_epi8(0xAAAAAAAAAAAAAAAAull, lo, hi);
  return _mm512_ternarylogic_epi32(bits, high, _mm512_set1_epi16(static_cast<int16_t>(0x8000)), 0xF8);  // | sign
#else
  return (__m512i)_mm512_cvtne2ps_pbh(fp8_load16(p + 16), fp8_load16(p));
#endif
}
#endif

}  // namespace pagellm

// A GGUF's quantized blocks decoded to float32, each value computed as gguf's own numpy `dequantize` computes it
// (the same products in the same order, so the same roundings), for fused.cpp's dequantize_gguf. Block types, in the
// order of kBlockTypes (pagellm/ops/fused.py's GGUF_BLOCKS lists the same):
//   Q4_0, Q4_1, Q4_K: w = d * q + m per 32 inputs, q in [0, 15] (Q4_0: w = d * (q - 8); Q4_K: d * sc and
//                     -(dmin * mn) from its super-block's float16 d and dmin and eight packed 6-bit scales and minima)
//   Q8_0:             w = d * q, q a signed byte
//   Q5_0, Q5_1:       Q4_0 and Q4_1 with a fifth bit per input in a 32-bit mask (Q5_0: w = d * (q - 16))
//   Q5_K:             Q4_K with a fifth bit per input: w = d * sc * q - dmin * mn
//   Q6_K:             w = (d * sc) * (q - 32) per 16 inputs, sc a signed byte, q's low 4 bits and high 2 apart
//   Q2_K, Q3_K:       2 and 3 bits per input under 4-bit (Q2_K, with 4-bit minima) or 6-bit signed scales per 16
//   IQ4_NL, IQ4_XS:   w = d * kIq4Values[q] (IQ4_XS: d * sc with a 6-bit signed sc per 32 inputs)
//   F16, BF16:        two bytes a value, read kMaxValues at a time
// Every product of a float16 and small integers is exact in float32, so the one rounding is the last operation's,
// with or without a fused multiply-add; Q6_K's and IQ4_XS's two products round once each, in numpy's order.
#pragma once

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

namespace gguf_blocks {

struct BlockType {
  int64_t values, bytes;  // inputs and bytes per block
};
enum Kind : int64_t {
  kQ4_0, kQ4_1, kQ4_K, kQ8_0, kQ5_0, kQ5_1, kQ5_K, kQ6_K, kQ2_K, kQ3_K, kIQ4_NL, kIQ4_XS, kF16, kBF16
};
constexpr BlockType kBlockTypes[] = {{32, 18},  {32, 20},  {256, 144}, {32, 34},  {32, 22}, {32, 24}, {256, 176},
                                     {256, 210}, {256, 84}, {256, 110}, {32, 18}, {256, 136}, {1, 2},  {1, 2}};
constexpr int64_t kMaxValues = 256;
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// The float16 in two little-endian bytes, exactly (subnormals, infinities and NaNs included).
inline float half_at(const uint8_t* p) {
  const uint32_t h = p[0] | (p[1] << 8), sign = (h & 0x8000u) << 16, exp = (h >> 10) & 31, man = h & 1023;
  if (exp == 31) return __builtin_bit_cast(float, sign | 0x7f800000u | (man << 13));
  if (exp == 0) return (sign ? -1.f : 1.f) * static_cast<float>(man) * 0x1p-24f;
  return __builtin_bit_cast(float, sign | ((exp + 112) << 23) | (man << 13));
}

// Q4_K's and Q5_K's eight (d * sc, -(dmin * mn)): float16 d and dmin, then twelve bytes of 6-bit scales and minima
// (the first four of each in the low 6 bits of bytes 0-3 and 4-7; the last four in bytes 8-11's nibbles, their top
// two bits in the top bits of bytes 0-3 and 4-7).
inline void k_groups(const uint8_t* block, float* d, float* m) {
  const float scale = half_at(block), dmin = half_at(block + 2);
  const uint8_t* s = block + 4;
  for (int j = 0; j < 8; ++j) {
    const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    d[j] = scale * static_cast<float>(sc), m[j] = -(dmin * static_cast<float>(mn));
  }
}

// 32 inputs from 16 bytes of nibbles (low nibbles the first 16, high the next) and, with `fifth`, a fifth bit each
// (bit j of `high` for input j): d * q + m, or with an `offset` (Q4_0's 8, Q5_0's 16) d * (q - offset), as numpy
// computes it (a zero keeps d's sign).
inline void nibbles32(const uint8_t* q, uint32_t high, bool fifth, float d, float m, int offset, float* v) {
  const auto value = [&](int x) { return offset ? d * static_cast<float>(x - offset) : d * static_cast<float>(x) + m; };
  for (int j = 0; j < 16; ++j) {
    v[j] = value((q[j] & 15) | (fifth ? ((high >> j) & 1) << 4 : 0));
    v[j + 16] = value((q[j] >> 4) | (fifth ? ((high >> (j + 16)) & 1) << 4 : 0));
  }
}

inline uint32_t u32_at(const uint8_t* p) {
  return p[0] | (p[1] << 8) | (p[2] << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

// Q4_K (five_bits false) and Q5_K: eight groups of 32; each 32 bytes of nibbles hold two groups (low nibbles, then
// high); Q5_K's fifth bit of input i of group g is bit g of its 32-byte mask's byte i.
inline void k_quant(const uint8_t* block, bool five_bits, float* v) {
  float d[8], m[8];
  k_groups(block, d, m);
  const uint8_t* high = block + 16;
  const uint8_t* q = block + (five_bits ? 48 : 16);
  for (int g = 0; g < 8; ++g) {
    const uint8_t* run = q + 32 * (g / 2);
    for (int i = 0; i < 32; ++i) {
      const int nibble = g % 2 ? run[i] >> 4 : run[i] & 15;
      const int value = nibble | (five_bits ? ((high[i] >> g) & 1) << 4 : 0);
      v[32 * g + i] = d[g] * static_cast<float>(value) + m[g];
    }
  }
}

// Q6_K, Q2_K and Q3_K order their 256 inputs as two halves of four runs of 32: input 128 h + 32 t + i, whose scale
// is the sixteenth 8 h + 2 t + i / 16. `each(h, t, i, p)` visits them a run of 16 at a time (one scale), so the
// compiler vectorizes the innermost loop.
template <typename Each>
inline void k_runs(Each each) {
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 4; ++t)
      for (int i0 = 0; i0 < 32; i0 += 16)
#pragma omp simd
        for (int i = i0; i < i0 + 16; ++i) each(h, t, i, 128 * h + 32 * t + i);
}

// Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, sixteen signed scales, then d. Input 128 h + 32 t + i takes
// the low nibble of byte 64 h + 32 (t % 2) + i (the high nibble for t >= 2) and bits 2 t of byte 32 h + i.
inline void q6_k(const uint8_t* block, float* v) {
  const uint8_t *ql = block, *qh = block + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
  const float d = half_at(block + 208);
  float scale[16];
  for (int g = 0; g < 16; ++g) scale[g] = d * static_cast<float>(sc[g]);
  k_runs([&](int h, int t, int i, int p) {
    const int lo = (ql[64 * h + 32 * (t % 2) + i] >> (4 * (t / 2))) & 15, hi = (qh[32 * h + i] >> (2 * t)) & 3;
    v[p] = scale[p / 16] * static_cast<float>((lo | (hi << 4)) - 32);
  });
}

// Q2_K: sixteen bytes of 4-bit scales (low) and minima (high), 64 bytes of 2-bit values, then d and dmin. Input
// 128 h + 32 t + i takes bits 2 t of byte 32 h + i.
inline void q2_k(const uint8_t* block, float* v) {
  const uint8_t *sc = block, *q = block + 16;
  const float d = half_at(block + 80), dmin = half_at(block + 82);
  float dl[16], ml[16];
  for (int g = 0; g < 16; ++g)
    dl[g] = d * static_cast<float>(sc[g] & 15), ml[g] = dmin * static_cast<float>(sc[g] >> 4);
  k_runs([&](int h, int t, int i, int p) {
    v[p] = dl[p / 16] * static_cast<float>((q[32 * h + i] >> (2 * t)) & 3) - ml[p / 16];
  });
}

// Q3_K: a 32-byte mask of high bits, 64 bytes of 2-bit values, twelve bytes of sixteen 6-bit signed scales, then d.
// Input p takes the low bits as Q2_K's and bit p / 32 of mask byte p % 32; q = low - 4 where that bit is clear.
inline void q3_k(const uint8_t* block, float* v) {
  const uint8_t *mask = block, *q = block + 32, *s = block + 96;
  const float d = half_at(block + 108);
  float dl[16];
  for (int k = 0; k < 16; ++k) {
    const int lo = (s[k % 8] >> (4 * (k / 8))) & 15, hi = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
    dl[k] = d * static_cast<float>((lo | (hi << 4)) - 32);
  }
  k_runs([&](int h, int t, int i, int p) {
    const int low = (q[32 * h + i] >> (2 * t)) & 3, clear = ((mask[i] >> (4 * h + t)) & 1) ^ 1;
    v[p] = dl[p / 16] * static_cast<float>(low - (clear << 2));
  });
}

// IQ4_XS: d, a 16-bit word of the eight scales' top two bits, four bytes of their low nibbles, then each 32
// inputs' 16 bytes of nibbles (low nibbles first) indexing kIq4Values.
inline void iq4_xs(const uint8_t* block, float* v) {
  const float d = half_at(block);
  const int top = block[2] | (block[3] << 8);
  for (int g = 0; g < 8; ++g) {
    const int sc = (((block[4 + g / 2] >> (4 * (g % 2))) & 15) | (((top >> (2 * g)) & 3) << 4)) - 32;
    const float dl = d * static_cast<float>(sc);
    const uint8_t* q = block + 8 + 16 * g;
    for (int j = 0; j < 16; ++j) {
      v[32 * g + j] = dl * static_cast<float>(kIq4Values[q[j] & 15]);
      v[32 * g + 16 + j] = dl * static_cast<float>(kIq4Values[q[j] >> 4]);
    }
  }
}

// One block of `kind` into v (kBlockTypes[kind].values floats).
inline void decode(const uint8_t* block, int64_t kind, float* v) {
  switch (kind) {  // the K-quants and IQ4_XS read their own scales
    case kQ4_0: return nibbles32(block + 2, 0, false, half_at(block), 0.f, 8, v);
    case kQ4_1: return nibbles32(block + 4, 0, false, half_at(block), half_at(block + 2), 0, v);
    case kQ4_K: return k_quant(block, false, v);
    case kQ8_0: {
      const float d = half_at(block);
      for (int j = 0; j < 32; ++j) v[j] = d * static_cast<float>(static_cast<int8_t>(block[2 + j]));
      return;
    }
    case kQ5_0: return nibbles32(block + 6, u32_at(block + 2), true, half_at(block), 0.f, 16, v);
    case kQ5_1: return nibbles32(block + 8, u32_at(block + 4), true, half_at(block), half_at(block + 2), 0, v);
    case kQ5_K: return k_quant(block, true, v);
    case kQ6_K: return q6_k(block, v);
    case kQ2_K: return q2_k(block, v);
    case kQ3_K: return q3_k(block, v);
    case kIQ4_NL: {
      const float d = half_at(block);
      for (int j = 0; j < 16; ++j) {
        v[j] = d * static_cast<float>(kIq4Values[block[2 + j] & 15]);
        v[j + 16] = d * static_cast<float>(kIq4Values[block[2 + j] >> 4]);
      }
      return;
    }
    default: return iq4_xs(block, v);
  }
}

// `len` float16 or (`brain`) bfloat16 values from two little-endian bytes each, exactly.
inline void halves(const uint8_t* p, int64_t len, bool brain, float* v) {
  int64_t j = 0;
  if (brain) {
#pragma omp simd
    for (j = 0; j < len; ++j)
      v[j] = __builtin_bit_cast(float, static_cast<uint32_t>(p[2 * j] | (p[2 * j + 1] << 8)) << 16);
    return;
  }
#if defined(__F16C__)
  for (; j + 8 <= len; j += 8)
    _mm256_storeu_ps(v + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * j))));
#endif
  for (; j < len; ++j) v[j] = half_at(p + 2 * j);
}

// The values of a row of `inputs` from input `at` on into v, up to kMaxValues (whole blocks: a row's inputs and
// kMaxValues are multiples of every block's). Returns how many.
inline int64_t decode_run(const uint8_t* row, int64_t kind, int64_t at, int64_t inputs, float* v) {
  const int64_t len = std::min(kMaxValues, inputs - at);
  if (kind == kF16 || kind == kBF16) {
    halves(row + 2 * at, len, kind == kBF16, v);
    return len;
  }
  const BlockType type = kBlockTypes[kind];
  for (int64_t b = 0; b < len; b += type.values) decode(row + (at + b) / type.values * type.bytes, kind, v + b);
  return len;
}

}  // namespace gguf_blocks

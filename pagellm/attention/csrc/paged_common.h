// What the paged attention kernels share: the bfloat16 bits type, conversions, 16-lane loads, and which keys a
// query token may see (Visibility). Included by paged_attention.cpp and flash_bf16.h; ops/build.py keys builds by
// the headers next to a source too.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagellm {

constexpr int kTileQueries = 48;  // query vectors (tokens x grouped heads) per flash tile

struct BFloat16 {  // the bits of a bfloat16; arithmetic happens in float32
  uint16_t x;
};

inline float to_float(float x) { return x; }
inline float to_float(BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename T>
inline T from_float(float f);
template <>
inline float from_float<float>(float f) { return f; }
template <>
inline BFloat16 from_float<BFloat16>(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return BFloat16{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return BFloat16{static_cast<uint16_t>(u >> 16)};
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
#endif

// The keys one query token attends to: every key before ``ctx_end`` (causal rows: its own position + 1), plus, for
// draft-tree rows, the keys whose bit is set in ``bits``: ``words`` 64-bit words over the keys from ``win`` on (the
// row's own query tokens). The walk covers keys [0, kend).
struct Visibility {
  int64_t ctx_end = 0;
  int64_t kend = 0;
  const uint64_t* bits = nullptr;
  int64_t win = 0;
  int64_t words = 0;

  // Bits [offset, offset + 32) of the tree mask (0 outside it); offset may be negative.
  uint32_t tree_bits(int64_t offset) const {
    if (bits == nullptr || offset >= words * 64 || offset <= -32) return 0;
    if (offset < 0) return static_cast<uint32_t>(bits[0] << -offset);
    const int64_t word = offset / 64, shift = offset % 64;
    uint64_t value = bits[word] >> shift;
    if (shift && word + 1 < words) value |= bits[word + 1] << (64 - shift);
    return static_cast<uint32_t>(value);
  }

  // Which of the keys [start, start + n) (n <= 32) are visible, as lane bits.
  uint32_t mask(int64_t start, int64_t n) const {
    const uint32_t lanes = n >= 32 ? ~0u : (1u << n) - 1;
    const int64_t before = ctx_end - start;
    uint32_t m = before >= n ? ~0u : before <= 0 ? 0u : (1u << before) - 1;
    if (bits != nullptr) m |= tree_bits(start - win);
    return m & lanes;
  }

  bool visible(int64_t key) const {
    if (key < ctx_end) return true;
    const int64_t offset = key - win;
    return bits != nullptr && offset >= 0 && offset < words * 64 && ((bits[offset / 64] >> (offset % 64)) & 1u);
  }
};

// The visibility of token ``token`` of a row whose query tokens start at key ``win``; ``bits`` is the step's
// [T, words] tree-mask array (null when the step has no draft tree).
inline Visibility token_visibility(const int64_t* ctx_end, const uint64_t* bits, int64_t words, int64_t token,
                                   int64_t win) {
  Visibility vis;
  vis.ctx_end = vis.kend = ctx_end[token];
  if (bits == nullptr) return vis;
  const uint64_t* row = bits + token * words;
  for (int64_t w = words - 1; w >= 0; --w) {
    if (row[w]) {
      vis.bits = row;
      vis.win = win;
      vis.words = words;
      const int64_t last = win + w * 64 + 63 - __builtin_clzll(row[w]);
      if (last + 1 > vis.kend) vis.kend = last + 1;
      break;
    }
  }
  return vis;
}

}  // namespace pagellm

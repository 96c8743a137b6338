// What the paged attention kernels share: the bfloat16 bits type, conversions, 16-lane loads, which keys a query
// token may see (Visibility), and the token walks' key tiles and block prefetch. Included by paged_attention.cpp,
// flash_bf16.h, walk_bf16.h and walk_avx2.h; ops/build.py keys builds by the headers next to a source too.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "fp8.h"       // ops/csrc: the 8-bit cache elements
#include "simd_exp.h"  // ops/csrc: exp16

#if defined(__AVX512F__) || defined(__AVX2__)
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

// The keys one query token attends to: every key in [kstart, ctx_end) (causal rows: up to its own position; kstart
// is 0, or under a sliding window the first key inside the window), plus, for draft-tree rows, the keys from kstart
// on whose bit is set in ``bits``: ``words`` 64-bit words over the keys from ``win`` on (the row's own query
// tokens). The walk covers keys [begin(align), kend): kstart rounded down to a multiple of ``align`` (a block, so a
// walk's tiles are the ones a walk from key 0 takes).
struct Visibility {
  int64_t ctx_end = 0;
  int64_t kend = 0;
  int64_t kstart = 0;
  const uint64_t* bits = nullptr;
  int64_t win = 0;
  int64_t words = 0;
  const float* sinks = nullptr;  // [heads] gpt-oss's attention sinks (one logit per query head), or null
  float softcap = 0.f;           // Gemma 2's attention logit soft cap, in natural units (scores scaled), or 0

  // The sink's share of query head ``head``'s softmax denominator, e^(sink - max) with ``max`` the running maximum
  // of its scores in natural units (a logit with no value: it only scales the output down); 0 without sinks.
  float sink_term(int64_t head, float max) const { return sinks == nullptr ? 0.f : std::exp(sinks[head] - max); }

  // Bits [offset, offset + 32) of the tree mask (0 outside it); offset may be negative.
  uint32_t tree_bits(int64_t offset) const {
    if (bits == nullptr || offset >= words * 64 || offset <= -32) return 0;
    if (offset < 0) return static_cast<uint32_t>(bits[0] << -offset);
    const int64_t word = offset / 64, shift = offset % 64;
    uint64_t value = bits[word] >> shift;
    if (shift && word + 1 < words) value |= bits[word + 1] << (64 - shift);
    return static_cast<uint32_t>(value);
  }

  int64_t begin(int64_t align) const { return kstart - kstart % align; }

  // Which of the keys [start, start + n) (n <= 32) are visible, as lane bits.
  uint32_t mask(int64_t start, int64_t n) const {
    const uint32_t lanes = n >= 32 ? ~0u : (1u << n) - 1;
    const int64_t before = ctx_end - start, outside = kstart - start;
    uint32_t m = before >= n ? ~0u : before <= 0 ? 0u : (1u << before) - 1;
    if (bits != nullptr) m |= tree_bits(start - win);
    if (outside > 0) m &= outside >= 32 ? 0u : ~((1u << outside) - 1);
    return m & lanes;
  }

  bool visible(int64_t key) const {
    if (key < kstart) return false;
    if (key < ctx_end) return true;
    const int64_t offset = key - win;
    return bits != nullptr && offset >= 0 && offset < words * 64 && ((bits[offset / 64] >> (offset % 64)) & 1u);
  }
};

// Gemma 2's soft cap of one score, c * tanh(s / c), in any units (c in the same ones: the cap is scale-equivariant);
// -inf (an invisible key) stays -inf.
inline float soft_cap(float s, float c) {
  return s == -std::numeric_limits<float>::infinity() ? s : c * std::tanh(s / c);
}

#if defined(__AVX512F__)
// soft_cap of 16 scores (c > 0), tanh as 1 - 2 / (e^(2x) + 1) with simd_exp.h's exp16 (which clamps its argument, so
// large scores give c exactly); callers keep an invisible lane's -inf by masking.
inline __m512 soft_cap16(__m512 s, float c) {
  const __m512 e = exp16(_mm512_mul_ps(s, _mm512_set1_ps(2.f / c)));
  const __m512 twice = _mm512_set1_ps(2.f * c);
  return _mm512_sub_ps(_mm512_set1_ps(c), _mm512_div_ps(twice, _mm512_add_ps(e, _mm512_set1_ps(1.f))));
}
#endif

// Where key ``pos``'s row for ``kv_head`` starts in a [num_blocks, block_size, kv_heads, head_dim] cache.
inline int64_t key_offset(const int64_t* blocks, int64_t pos, int64_t block_size, int64_t token_stride,
                          int64_t kv_head, int64_t head_dim) {
  return (blocks[pos / block_size] * block_size + pos % block_size) * token_stride + kv_head * head_dim;
}

// The visibility of token ``token`` of a row whose query tokens start at key ``win``; ``ctx_start`` is the step's
// [T] first keys inside a sliding window (null: no window), ``bits`` its [T, words] tree-mask array (null when the
// step has no draft tree).
inline Visibility token_visibility(const int64_t* ctx_end, const int64_t* ctx_start, const uint64_t* bits,
                                   int64_t words, int64_t token, int64_t win) {
  Visibility vis;
  vis.ctx_end = vis.kend = ctx_end[token];
  if (ctx_start != nullptr) vis.kstart = ctx_start[token];
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

#if defined(__AVX512F__) || defined(__AVX2__)
// The tile of keys the walk takes next from ``start``: up to 16 keys inside one block. Tiles depend only on the
// absolute position, so a token's tiles are the same in any row (paged_attention.cpp: float32 reproducibility).
inline int64_t tile_length(int64_t start, int64_t kend, int64_t block_size) {
  return std::min({int64_t(16), kend - start, block_size - start % block_size});
}

inline uint16_t tile_mask(const Visibility& vis, int64_t start, int64_t n) {  // lane bits (an AVX-512 mask)
  if (start >= vis.kstart && start + n <= vis.ctx_end) return static_cast<uint16_t>((1u << n) - 1);
  return static_cast<uint16_t>(vis.mask(start, n));
}

// Ask for a later block's rows of this head while the current one is processed: a request's blocks sit anywhere
// in the pool, so the hardware prefetcher cannot guess the jump. The walk asks kPrefetchBlocks blocks ahead, into
// L2 (the T1 hint): on Zen 4 that keeps more lines in flight than T0 prefetches into L1 one block ahead, whose
// misses queue behind the walk's own loads (DRAM-bound microbenchmark, 30 layer caches, random block placement:
// 0.44-0.46 -> 0.35-0.37 ms per layer at batch 32, 4.0-4.5 -> 2.7-3.0 ms at batch 256; docs/performance.md).
// (Inlined for sure: a call inside the walk would spill the G x NV query and accumulator registers around it.)
constexpr int64_t kPrefetchBlocks = 2;

// Block b of the walk's blocks: this head's K and V rows of the keys before kend.
template <typename T>
__attribute__((always_inline)) inline void prefetch_block(const T* k_cache, const T* v_cache, const int64_t* blocks,
                                                          int64_t b, int64_t kend, int64_t block_size,
                                                          int64_t token_stride, int64_t kv_head, int64_t head_dim) {
  const int64_t first = b * block_size, rows = std::min(block_size, kend - first);
  const int64_t base = blocks[b] * block_size * token_stride + kv_head * head_dim;
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t byte = 0; byte < head_dim * int64_t(sizeof(T)); byte += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(k_cache + base + t * token_stride) + byte, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(v_cache + base + t * token_stride) + byte, _MM_HINT_T1);
    }
  }
}

// A walk's first asks: its blocks 1 .. kPrefetchBlocks - 1 from ``begin`` (a block's first key; its block 0 is
// asked for by the walk before, or not at all).
template <typename T>
__attribute__((always_inline)) inline void prefetch_first(const T* k_cache, const T* v_cache, const int64_t* blocks,
                                                          int64_t begin, int64_t kend, int64_t block_size,
                                                          int64_t token_stride, int64_t kv_head, int64_t head_dim) {
  for (int64_t b = begin / block_size + 1; b < begin / block_size + kPrefetchBlocks && b * block_size < kend; ++b)
    prefetch_block(k_cache, v_cache, blocks, b, kend, block_size, token_stride, kv_head, head_dim);
}

// The float32 walks' asks for one tile [start, start + n) of a walk from ``begin``: at the first tile,
// prefetch_first; at the tile that ends a block, the block kPrefetchBlocks ahead (only blocks holding keys before
// kend).
template <typename T>
__attribute__((always_inline)) inline void prefetch_ahead(const T* k_cache, const T* v_cache, const int64_t* blocks,
                                                          int64_t begin, int64_t kend, int64_t start, int64_t n,
                                                          int64_t block_size, int64_t token_stride, int64_t kv_head,
                                                          int64_t head_dim) {
  if (start == begin)
    prefetch_first(k_cache, v_cache, blocks, begin, kend, block_size, token_stride, kv_head, head_dim);
  const int64_t ahead = start / block_size + kPrefetchBlocks;
  if ((start + n) % block_size == 0 && ahead * block_size < kend)
    prefetch_block(k_cache, v_cache, blocks, ahead, kend, block_size, token_stride, kv_head, head_dim);
}
#endif

}  // namespace pagellm

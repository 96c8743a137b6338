// The bfloat16 token walk with AVX-512 BF16 dot products: one query token of one kv head, its G grouped query
// heads, over the keys in tiles of up to 16 that never cross a block (decode rows, and every token of a row when
// flash tiles are off).
//
// The float32 walk (walk_f32.h, walk_fixed) widens every K and V element to float32 and sums each key's
// score horizontally, and its std::exp calls spill the accumulators; here a tile's K rows are transposed into bf16
// pairs (kt[pair] over its 16 keys, transpose16 from flash_bf16.h), so the G score vectors of 16 keys are D/2
// `vdpbf16ps` each against broadcast query pairs, and V rows are interleaved in key pairs, so P·V is a `vdpbf16ps`
// of a broadcast probability pair against 16 head dimensions. Scores, the online softmax and the output stay in
// float32 and in registers; the probabilities are rounded to bfloat16 for P·V, as the flash tiles do. The output's
// head dimensions come out in the flash tiles' permuted order, undone by write_row. With K/V hot in the caches a
// batch-32 step's layer (SmolLM2 shapes, 192 keys) went 213 -> 128 us; from DRAM see docs/performance.md (Round 8).
// An 8-bit cache's rows (KV = Fp8E4M3 / Fp8E5M2, ops/csrc/fp8.h) are widened exactly to bf16 as they are loaded,
// half the bytes from memory for the same dot products. Oracle: attention/torch_ref.py.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "flash_bf16.h"
#include "paged_common.h"
#include "simd_exp.h"  // ops/csrc: exp16

#if defined(__AVX512BF16__)
namespace pagellm {

// s[g] += the scores of the tile's keys against query head g, for head dimensions [32 c, 32 c + 32).
template <int G, typename KV>
__attribute__((always_inline)) inline void tile_scores(const KV* const* krow, int64_t n, int c,
                                                       const int32_t (*qp)[64], __m512 s[G]) {
  __m512i rows[16];
  for (int t = 0; t < 16; ++t)
    rows[t] = t < n ? load32_bf16(krow[t] + 32 * c) : _mm512_setzero_si512();
  transpose16(rows);  // rows[j]: pair j of this chunk, one key per lane
  for (int j = 0; j < 16; ++j)
    for (int g = 0; g < G; ++g)
      s[g] = _mm512_dpbf16_ps(s[g], as_bh(_mm512_set1_epi32(qp[g][16 * c + j])), as_bh(rows[j]));
}

// Online-softmax update of one query head for a tile whose (unscaled) scores are s: rescales its running sum and
// output when the maximum grows, and leaves the tile's probabilities in p2 as bf16 key pairs.
template <int NV>
__attribute__((always_inline)) inline void tile_softmax(__m512 s, __mmask16 valid, __m512 scale, float& running_max,
                                                        __m512& sum, __m512 (&acc)[NV], int32_t* p2, float cap) {
  __m512 x = _mm512_mask_mul_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid, s, scale);
  if (cap != 0.f) x = _mm512_mask_mov_ps(x, valid, soft_cap16(x, cap));  // Gemma 2's, on the scaled scores
  const float tile_max = _mm512_reduce_max_ps(x);
  if (tile_max > running_max) {  // exp16 inline, not std::exp: a call would spill every accumulator around it
    const __m512 corr = exp16(_mm512_set1_ps(running_max - tile_max));
    running_max = tile_max;
    sum = _mm512_mul_ps(sum, corr);
    for (int v = 0; v < NV; ++v) acc[v] = _mm512_mul_ps(acc[v], corr);
  }
  const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(x, _mm512_set1_ps(running_max))));
  sum = _mm512_add_ps(sum, p);
  _mm256_store_si256(reinterpret_cast<__m256i*>(p2), (__m256i)_mm512_cvtneps_pbh(p));
}

// acc[g] += P · V over the tile's n keys (V rows from ``v``, ``stride`` apart), key pairs interleaved for dpbf16.
// Each pair also asks for the K and V rows of the same keys kPrefetchBlocks blocks ahead (the first ``ahead`` keys
// at k_ahead, v_ahead): one request a key spreads the next blocks' misses over the walk, where asking for a whole
// block at its boundary queued them in a burst behind the walk's own loads.
template <int D, int G, typename KV>
__attribute__((always_inline)) inline void tile_values(const KV* v, int64_t n, int64_t stride,
                                                       const int32_t (*p2)[8], __m512 (&acc)[G][D / 16],
                                                       const KV* k_ahead, const KV* v_ahead, int64_t ahead) {
  for (int64_t kp = 0; 2 * kp < n; ++kp) {
    const KV* a = v + 2 * kp * stride;
    const bool second = 2 * kp + 1 < n;  // a missing second key gets zeros (its slot may hold anything)
    __m512bh w[G];
    for (int g = 0; g < G; ++g) w[g] = as_bh(_mm512_set1_epi32(p2[g][kp]));
    for (int64_t t = 2 * kp; t < 2 * kp + 2 && t < ahead; ++t)
      for (int byte = 0; byte < D * int(sizeof(KV)); byte += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(k_ahead + t * stride) + byte, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(v_ahead + t * stride) + byte, _MM_HINT_T1);
      }
    for (int c = 0; c < D / 32; ++c) {
      const __m512i x = load32_bf16(a + 32 * c);
      const __m512i y = second ? load32_bf16(a + stride + 32 * c) : _mm512_setzero_si512();
      const __m512bh lo = as_bh(_mm512_unpacklo_epi16(x, y)), hi = as_bh(_mm512_unpackhi_epi16(x, y));
      for (int g = 0; g < G; ++g) {
        acc[g][2 * c] = _mm512_dpbf16_ps(acc[g][2 * c], w[g], lo);
        acc[g][2 * c + 1] = _mm512_dpbf16_ps(acc[g][2 * c + 1], w[g], hi);
      }
    }
  }
}

template <int D, int G, typename KV>
void walk_bf16(const BFloat16* q, const KV* k_cache, const KV* v_cache, const int64_t* blocks,
               const Visibility& vis, int64_t block_size, int64_t kv_heads, int64_t kv_head, float scale,
               BFloat16* out) {
  static_assert(D / 2 <= 64, "query pairs are held in int32[64]");
  alignas(64) int32_t qp[G][64];  // the query heads as bf16 pairs
  alignas(64) int32_t p2[G][8];   // a tile's probabilities as bf16 key pairs
  __m512 acc[G][D / 16], sum[G];  // sum: the running softmax denominators, per lane until the end
  float running_max[G];
  for (int g = 0; g < G; ++g) {
    std::memcpy(qp[g], q + g * D, D * sizeof(BFloat16));
    running_max[g] = -std::numeric_limits<float>::infinity();
    sum[g] = _mm512_setzero_ps();
    for (int v = 0; v < D / 16; ++v) acc[g][v] = _mm512_setzero_ps();
  }
  const __m512 sc = _mm512_set1_ps(scale);
  const int64_t stride = kv_heads * D;
  auto offset = [&](int64_t pos) { return (blocks[pos / block_size] * block_size + pos % block_size) * stride; };
  const int64_t begin = vis.begin(block_size);
  prefetch_first(k_cache, v_cache, blocks, begin, vis.kend, block_size, stride, kv_head, D);  // later: key by key
  int64_t n = 0;
  for (int64_t start = begin; start < vis.kend; start += n) {
    n = tile_length(start, vis.kend, block_size);
    const __mmask16 valid = tile_mask(vis, start, n);
    if (!valid) continue;
    const int64_t base = offset(start) + kv_head * D;
    const KV* krow[16];
    for (int t = 0; t < n; ++t) krow[t] = k_cache + base + t * stride;
    __m512 s[G];
    for (int g = 0; g < G; ++g) s[g] = _mm512_setzero_ps();
    for (int c = 0; c < D / 32; ++c) tile_scores<G>(krow, n, c, qp, s);
    for (int g = 0; g < G; ++g)
      tile_softmax<D / 16>(s[g], valid, sc, running_max[g], sum[g], acc[g], p2[g], vis.softcap);
    const int64_t ahead = start + kPrefetchBlocks * block_size, ahead_n = std::min(n, vis.kend - ahead);
    const int64_t ahead_base = ahead_n > 0 ? offset(ahead) + kv_head * D : 0;
    tile_values<D, G>(v_cache + base, n, stride, p2, acc, k_cache + ahead_base, v_cache + ahead_base, ahead_n);
  }
  for (int g = 0; g < G; ++g) {
    alignas(64) float o[D];
    for (int v = 0; v < D / 16; ++v) _mm512_store_ps(o + 16 * v, acc[g][v]);
    write_row<D>(o, _mm512_reduce_add_ps(sum[g]) + vis.sink_term(kv_head * G + g, running_max[g]), out + g * D);
  }
}

}  // namespace pagellm
#endif

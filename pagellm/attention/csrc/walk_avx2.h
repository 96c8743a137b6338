// The token walk in AVX2 + FMA, for CPUs without AVX-512 (AMD Zen 2/3, older Intel): the same work as walk_vec in
// walk_f32.h (one query token, one kv head, its grouped query heads walking the keys once with an online
// softmax), in 8-lane vectors. Keys come in the same 16-key tiles (tile_length), so a float32 token takes the same
// instructions whatever row it is in. q (scaled) and the running weighted V live in stack arrays; K/V rows are
// widened to float32 on load. Included by paged_attention.cpp.
#pragma once

#include <cmath>
#include <limits>

#include "paged_common.h"
#include "simd_exp.h"  // ops/csrc: exp8

#if defined(__AVX2__) && defined(__FMA__)
namespace pagellm {

constexpr int64_t kWalkMaxDim = 256;
constexpr int64_t kWalkMaxGroup = 16;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const BFloat16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

inline __m256 load8(const Fp8E4M3* p) { return fp8_load8(p); }
inline __m256 load8(const Fp8E5M2* p) { return fp8_load8(p); }

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// Lanes [8 * half, 8 * half + 8) of a 16-bit lane mask as an all-ones / all-zeros vector mask.
inline __m256 lane_mask8(uint32_t bits, int half) {
  const __m256i select = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i b = _mm256_set1_epi32(static_cast<int>((bits >> (8 * half)) & 0xffu));
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(b, select), select));
}

// One tile's softmax step for one query head: scores (16 lanes, the valid ones) become weights in place, and the
// running max, sum and weighted V (acc, head_dim floats) are rescaled to the new max.
inline void tile_softmax8(float* scores, uint32_t valid, float& running_max, float& running_sum, float* acc,
                          int64_t head_dim) {
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 m0 = lane_mask8(valid, 0), m1 = lane_mask8(valid, 1);
  const __m256 s0 = _mm256_blendv_ps(minus_inf, _mm256_load_ps(scores), m0);
  const __m256 s1 = _mm256_blendv_ps(minus_inf, _mm256_load_ps(scores + 8), m1);
  const float new_max = std::max(running_max, hmax8(_mm256_max_ps(s0, s1)));
  const float correction = std::exp(running_max - new_max);
  const __m256 top = _mm256_set1_ps(new_max);
  const __m256 p0 = _mm256_and_ps(exp8(_mm256_sub_ps(s0, top)), m0);
  const __m256 p1 = _mm256_and_ps(exp8(_mm256_sub_ps(s1, top)), m1);
  _mm256_store_ps(scores, p0);
  _mm256_store_ps(scores + 8, p1);
  running_sum = std::fma(running_sum, correction, hsum8(_mm256_add_ps(p0, p1)));
  running_max = new_max;
  const __m256 c = _mm256_set1_ps(correction);
  for (int64_t d = 0; d < head_dim; d += 8) _mm256_storeu_ps(acc + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), c));
}

// head_dim a multiple of 8 up to kWalkMaxDim, group up to kWalkMaxGroup (walk() checks). KV: the cache's element
// type (T, or an 8-bit float of fp8.h).
template <typename T, typename KV>
void walk_avx2(const T* q, const KV* k_cache, const KV* v_cache, const int64_t* blocks, const Visibility& vis,
               int64_t block_size, int64_t kv_heads, int64_t group, int64_t head_dim, int64_t kv_head, float scale,
               T* out) {
  const int64_t nv = head_dim / 8;
  alignas(32) float qf[kWalkMaxGroup * kWalkMaxDim], acc[kWalkMaxGroup * kWalkMaxDim];
  alignas(32) float scores[kWalkMaxGroup][16];
  float running_max[kWalkMaxGroup], running_sum[kWalkMaxGroup];
  for (int64_t g = 0; g < group; ++g) {
    running_max[g] = -std::numeric_limits<float>::infinity();
    running_sum[g] = 0.f;
  }
  for (int64_t i = 0; i < group * head_dim; ++i) qf[i] = to_float(q[i]) * scale;
  std::fill(acc, acc + group * head_dim, 0.f);
  const int64_t token_stride = kv_heads * head_dim;
  int64_t n = 0;
  const int64_t begin = vis.begin(block_size);
  for (int64_t start = begin; start < vis.kend; start += n) {
    n = tile_length(start, vis.kend, block_size);
    const uint32_t valid = tile_mask(vis, start, n);
    if (!valid) continue;
    const int64_t base = key_offset(blocks, start, block_size, token_stride, kv_head, head_dim);
    prefetch_ahead(k_cache, v_cache, blocks, begin, vis.kend, start, n, block_size, token_stride, kv_head, head_dim);
    for (int64_t t = 0; t < n; ++t) {
      const KV* k = k_cache + base + t * token_stride;
      __m256 krow[kWalkMaxDim / 8];
      for (int64_t v = 0; v < nv; ++v) krow[v] = load8(k + v * 8);
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qf + g * head_dim;
        __m256 sum = _mm256_mul_ps(_mm256_load_ps(qg), krow[0]);
        for (int64_t v = 1; v < nv; ++v) sum = _mm256_fmadd_ps(_mm256_load_ps(qg + v * 8), krow[v], sum);
        scores[g][t] = hsum8(sum);
      }
    }
    if (vis.softcap != 0.f)  // (an invisible lane's score is dropped in tile_softmax8, whatever it holds)
      for (int64_t g = 0; g < group; ++g)
        for (int64_t t = 0; t < n; ++t) scores[g][t] = soft_cap(scores[g][t], vis.softcap);
    for (int64_t g = 0; g < group; ++g)
      tile_softmax8(scores[g], valid, running_max[g], running_sum[g], acc + g * head_dim, head_dim);
    for (int64_t t = 0; t < n; ++t) {
      const KV* vrow = v_cache + base + t * token_stride;
      for (int64_t v = 0; v < nv; ++v) {
        const __m256 val = load8(vrow + v * 8);
        for (int64_t g = 0; g < group; ++g) {
          float* a = acc + g * head_dim + v * 8;
          _mm256_store_ps(a, _mm256_fmadd_ps(_mm256_set1_ps(scores[g][t]), val, _mm256_load_ps(a)));
        }
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.f / (running_sum[g] + vis.sink_term(kv_head * group + g, running_max[g]));
    for (int64_t d = 0; d < head_dim; ++d) out[g * head_dim + d] = from_float<T>(acc[g * head_dim + d] * inv);
  }
}

}  // namespace pagellm
#endif

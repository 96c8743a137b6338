// The float32 token walks: one query token of one kv head, its grouped query heads walking the keys once with an
// online softmax, K/V rows widened to float32 on load. walk_scalar serves any head_dim (the portable path);
// walk_vec (16 float lanes) and walk_fixed (head size and group size known at compile time, q and the running
// weighted V in registers) are the AVX-512 ones. walk_bf16.h is the faster bfloat16 walk where its shapes allow;
// walk_avx2.h the 8-lane one for CPUs without AVX-512. Included by paged_kernels.h.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "paged_common.h"
#include "simd_exp.h"  // ops/csrc: exp16

namespace pagellm {
namespace {
template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// The portable walk (any head_dim): one block at a time, invisible keys scored -inf.
template <typename T, typename KV>
void walk_scalar(const T* q, const KV* k_cache, const KV* v_cache, const int64_t* blocks, const Visibility& vis,
                 int64_t block_size, int64_t kv_heads, int64_t group, int64_t head_dim, int64_t kv_head,
                 float scale, T* out) {
  // q and out point at this kv head's first query head; query heads of the group are contiguous.
  std::vector<float> qf(group * head_dim), acc(group * head_dim, 0.f), row(head_dim);
  std::vector<float> running_max(group, -std::numeric_limits<float>::infinity()), running_sum(group, 0.f);
  std::vector<float> scores(group * block_size);
  std::vector<char> seen(block_size);
  for (int64_t g = 0; g < group; ++g) load_row(q + g * head_dim, qf.data() + g * head_dim, head_dim);
  const int64_t token_stride = kv_heads * head_dim;
  for (int64_t start = vis.begin(block_size); start < vis.kend; start += block_size) {
    const int64_t n = std::min(block_size, vis.kend - start);
    const int64_t base = key_offset(blocks, start, block_size, token_stride, kv_head, head_dim);
    bool any = false;
    for (int64_t t = 0; t < n; ++t) any |= (seen[t] = vis.visible(start + t));
    if (!any) continue;
    for (int64_t t = 0; t < n; ++t) {
      load_row(k_cache + base + t * token_stride, row.data(), head_dim);
      for (int64_t g = 0; g < group; ++g)
        scores[g * block_size + t] = seen[t] ? dot(qf.data() + g * head_dim, row.data(), head_dim) * scale
                                             : -std::numeric_limits<float>::infinity();
    }
    if (vis.softcap != 0.f)
      for (int64_t g = 0; g < group; ++g)
        for (int64_t t = 0; t < n; ++t) scores[g * block_size + t] = soft_cap(scores[g * block_size + t], vis.softcap);
    for (int64_t g = 0; g < group; ++g) {
      float* s = scores.data() + g * block_size;
      float block_max = s[0];
      for (int64_t t = 1; t < n; ++t) block_max = std::max(block_max, s[t]);
      const float new_max = std::max(running_max[g], block_max);
      const float correction = std::exp(running_max[g] - new_max);
      float block_sum = 0.f;
      for (int64_t t = 0; t < n; ++t) {
        s[t] = std::exp(s[t] - new_max);
        block_sum += s[t];
      }
      running_sum[g] = running_sum[g] * correction + block_sum;
      running_max[g] = new_max;
      float* a = acc.data() + g * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) a[d] *= correction;
    }
    for (int64_t t = 0; t < n; ++t) {
      load_row(v_cache + base + t * token_stride, row.data(), head_dim);
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * block_size + t];
        float* a = acc.data() + g * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) a[d] += p * row[d];
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.f / (running_sum[g] + vis.sink_term(kv_head * group + g, running_max[g]));
    for (int64_t d = 0; d < head_dim; ++d) out[g * head_dim + d] = from_float<T>(acc[g * head_dim + d] * inv);
  }
}

#if defined(__AVX512F__)
// The vector walk: 16 float lanes, K/V rows converted on load, scores and exp for 16 keys at a time.
template <typename T, typename KV>
void walk_vec(const T* q, const KV* k_cache, const KV* v_cache, const int64_t* blocks, const Visibility& vis,
              int64_t block_size, int64_t kv_heads, int64_t group, int64_t head_dim, int64_t kv_head, float scale,
              T* out) {
  const int64_t nv = head_dim / 16;
  std::vector<float> qf(group * head_dim), acc(group * head_dim, 0.f), running_sum(group, 0.f);
  std::vector<float> running_max(group, -std::numeric_limits<float>::infinity());
  alignas(64) float scores[16 * 16];  // [group][16 keys], group <= 16
  for (int64_t i = 0; i < group * head_dim; ++i) qf[i] = to_float(q[i]) * scale;
  const int64_t token_stride = kv_heads * head_dim;
  int64_t n = 0;
  const int64_t begin = vis.begin(block_size);
  for (int64_t start = begin; start < vis.kend; start += n) {
    n = tile_length(start, vis.kend, block_size);
    const __mmask16 valid = tile_mask(vis, start, n);
    if (!valid) continue;
    const int64_t base = key_offset(blocks, start, block_size, token_stride, kv_head, head_dim);
    prefetch_ahead(k_cache, v_cache, blocks, begin, vis.kend, start, n, block_size, token_stride, kv_head, head_dim);
    for (int64_t t = 0; t < n; ++t) {
      const KV* k = k_cache + base + t * token_stride;
      __m512 krow[16];  // head_dim <= 256
      for (int64_t v = 0; v < nv; ++v) krow[v] = load16(k + v * 16);
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qf.data() + g * head_dim;
        __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(qg), krow[0]);
        for (int64_t v = 1; v < nv; ++v) sum = _mm512_fmadd_ps(_mm512_loadu_ps(qg + v * 16), krow[v], sum);
        scores[g * 16 + t] = _mm512_reduce_add_ps(sum);
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      __m512 s = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, scores + g * 16);
      if (vis.softcap != 0.f) s = _mm512_mask_mov_ps(s, valid, soft_cap16(s, vis.softcap));
      const float new_max = std::max(running_max[g], _mm512_reduce_max_ps(s));
      const float correction = std::exp(running_max[g] - new_max);
      const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(new_max))));
      _mm512_store_ps(scores + g * 16, p);
      running_sum[g] = std::fma(running_sum[g], correction, _mm512_reduce_add_ps(p));
      running_max[g] = new_max;
      float* a = acc.data() + g * head_dim;
      for (int64_t v = 0; v < nv; ++v)
        _mm512_storeu_ps(a + v * 16, _mm512_mul_ps(_mm512_loadu_ps(a + v * 16), _mm512_set1_ps(correction)));
    }
    for (int64_t t = 0; t < n; ++t) {
      const KV* vrow = v_cache + base + t * token_stride;
      for (int64_t v = 0; v < nv; ++v) {
        const __m512 val = load16(vrow + v * 16);
        for (int64_t g = 0; g < group; ++g) {
          float* a = acc.data() + g * head_dim + v * 16;
          _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(scores[g * 16 + t]), val, _mm512_loadu_ps(a)));
        }
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.f / (running_sum[g] + vis.sink_term(kv_head * group + g, running_max[g]));
    for (int64_t d = 0; d < head_dim; ++d) out[g * head_dim + d] = from_float<T>(acc[g * head_dim + d] * inv);
  }
}

// The same walk with the head size and group size known at compile time: q and the running weighted V stay in
// registers (G x NV vectors) instead of memory. Used for the common shapes; others take walk_vec.
template <typename T, typename KV, int NV, int G>
void walk_fixed(const T* q, const KV* k_cache, const KV* v_cache, const int64_t* blocks, const Visibility& vis,
                int64_t block_size, int64_t kv_heads, int64_t kv_head, float scale, T* out) {
  constexpr int64_t head_dim = NV * 16;
  __m512 qv[G][NV], acc[G][NV];
  float running_max[G], running_sum[G];
  alignas(64) float scores[G][16];
  for (int g = 0; g < G; ++g) {
    running_max[g] = -std::numeric_limits<float>::infinity();
    running_sum[g] = 0.f;
    for (int v = 0; v < NV; ++v) {
      qv[g][v] = _mm512_mul_ps(load16(q + g * head_dim + v * 16), _mm512_set1_ps(scale));
      acc[g][v] = _mm512_setzero_ps();
    }
  }
  const int64_t token_stride = kv_heads * head_dim;
  int64_t n = 0;
  const int64_t begin = vis.begin(block_size);
  for (int64_t start = begin; start < vis.kend; start += n) {
    n = tile_length(start, vis.kend, block_size);
    const __mmask16 valid = tile_mask(vis, start, n);
    if (!valid) continue;
    const int64_t base = key_offset(blocks, start, block_size, token_stride, kv_head, head_dim);
    prefetch_ahead(k_cache, v_cache, blocks, begin, vis.kend, start, n, block_size, token_stride, kv_head, head_dim);
    for (int64_t t = 0; t < n; ++t) {
      const KV* k = k_cache + base + t * token_stride;
      __m512 krow[NV];
      for (int v = 0; v < NV; ++v) krow[v] = load16(k + v * 16);
      for (int g = 0; g < G; ++g) {
        __m512 sum = _mm512_mul_ps(qv[g][0], krow[0]);
        for (int v = 1; v < NV; ++v) sum = _mm512_fmadd_ps(qv[g][v], krow[v], sum);
        scores[g][t] = _mm512_reduce_add_ps(sum);
      }
    }
    for (int g = 0; g < G; ++g) {
      __m512 s = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, scores[g]);
      if (vis.softcap != 0.f) s = _mm512_mask_mov_ps(s, valid, soft_cap16(s, vis.softcap));
      const float new_max = std::max(running_max[g], _mm512_reduce_max_ps(s));
      const __m512 correction = _mm512_set1_ps(std::exp(running_max[g] - new_max));
      const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(new_max))));
      _mm512_store_ps(scores[g], p);
      running_sum[g] = std::fma(running_sum[g], _mm512_cvtss_f32(correction), _mm512_reduce_add_ps(p));
      running_max[g] = new_max;
      for (int v = 0; v < NV; ++v) acc[g][v] = _mm512_mul_ps(acc[g][v], correction);
    }
    for (int64_t t = 0; t < n; ++t) {
      const KV* vrow = v_cache + base + t * token_stride;
      __m512 weight[G];
      for (int g = 0; g < G; ++g) weight[g] = _mm512_set1_ps(scores[g][t]);
      for (int v = 0; v < NV; ++v) {
        const __m512 val = load16(vrow + v * 16);
        for (int g = 0; g < G; ++g) acc[g][v] = _mm512_fmadd_ps(weight[g], val, acc[g][v]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    alignas(64) float row[head_dim];
    const __m512 inv = _mm512_set1_ps(1.f / (running_sum[g] + vis.sink_term(kv_head * G + g, running_max[g])));
    for (int v = 0; v < NV; ++v) _mm512_store_ps(row + v * 16, _mm512_mul_ps(acc[g][v], inv));
    for (int64_t d = 0; d < head_dim; ++d) out[g * head_dim + d] = from_float<T>(row[d]);
  }
}

// Runs the fixed-shape walk when (head_dim / 16, group) is one of the instantiated shapes; false otherwise.
template <typename T, typename KV>
bool walk_fixed_shape(int64_t nv, int64_t group, const T* q, const KV* k, const KV* v, const int64_t* blocks,
                      const Visibility& vis, int64_t block_size, int64_t kv_heads, int64_t kv_head, float scale,
                      T* out) {
#define PAGELLM_SHAPE(NV_, G_)                                                                         \
  if (nv == NV_ && group == G_) {                                                                      \
    walk_fixed<T, KV, NV_, G_>(q, k, v, blocks, vis, block_size, kv_heads, kv_head, scale, out);       \
    return true;                                                                                       \
  }
  PAGELLM_SHAPE(4, 1) PAGELLM_SHAPE(4, 2) PAGELLM_SHAPE(4, 3) PAGELLM_SHAPE(4, 4) PAGELLM_SHAPE(4, 6) PAGELLM_SHAPE(4, 7)
  PAGELLM_SHAPE(4, 8)
  PAGELLM_SHAPE(8, 1) PAGELLM_SHAPE(8, 2) PAGELLM_SHAPE(8, 4) PAGELLM_SHAPE(8, 6) PAGELLM_SHAPE(8, 7) PAGELLM_SHAPE(8, 8)
#undef PAGELLM_SHAPE
  return false;
}
#endif

}  // namespace
}  // namespace pagellm

// Paged decode attention on the CPU: one query token per request, K/V read straight from the paged cache.
//
// For each (request, kv head) the grouped query heads walk the request's blocks once with an online softmax
// (running max, running sum, running weighted V), so each K/V byte is read once and nothing is gathered or padded.
// Accumulation is in float32 whatever the cache dtype. The plain-PyTorch twin and oracle is
// pagellm/attention/torch_ref.py (_decode_attention). Plain C ABI (pointers and sizes, no torch headers, loaded
// with ctypes by attention/cpu_paged.py) so that it builds in a second or two; see pagellm/ops/build.py.
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "simd_exp.h"  // ops/csrc: exp16

namespace {

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

template <typename T>
void decode_one(const T* q, const T* k_cache, const T* v_cache, const int64_t* blocks, int64_t seq_len,
                int64_t block_size, int64_t kv_heads, int64_t group, int64_t head_dim, int64_t kv_head,
                float scale, T* out) {
  // q and out point at this kv head's first query head; query heads of the group are contiguous.
  std::vector<float> qf(group * head_dim), acc(group * head_dim, 0.f), row(head_dim);
  std::vector<float> running_max(group, -std::numeric_limits<float>::infinity()), running_sum(group, 0.f);
  std::vector<float> scores(group * block_size);
  for (int64_t g = 0; g < group; ++g) load_row(q + g * head_dim, qf.data() + g * head_dim, head_dim);
  const int64_t token_stride = kv_heads * head_dim;
  for (int64_t start = 0; start < seq_len; start += block_size) {
    const int64_t n = std::min(block_size, seq_len - start);
    const int64_t base = (blocks[start / block_size] * block_size) * token_stride + kv_head * head_dim;
    for (int64_t t = 0; t < n; ++t) {
      load_row(k_cache + base + t * token_stride, row.data(), head_dim);
      for (int64_t g = 0; g < group; ++g)
        scores[g * block_size + t] = dot(qf.data() + g * head_dim, row.data(), head_dim) * scale;
    }
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
    const float inv = 1.f / running_sum[g];
    for (int64_t d = 0; d < head_dim; ++d) out[g * head_dim + d] = from_float<T>(acc[g * head_dim + d] * inv);
  }
}


#if defined(__AVX512F__)
#include <immintrin.h>

// The vector path: 16 float lanes, K/V rows converted on load, scores and exp for 16 tokens at a time.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

template <typename T>
void decode_one_vec(const T* q, const T* k_cache, const T* v_cache, const int64_t* blocks, int64_t seq_len,
                    int64_t block_size, int64_t kv_heads, int64_t group, int64_t head_dim, int64_t kv_head,
                    float scale, T* out) {
  const int64_t nv = head_dim / 16;
  std::vector<float> qf(group * head_dim), acc(group * head_dim, 0.f), running_sum(group, 0.f);
  std::vector<float> running_max(group, -std::numeric_limits<float>::infinity());
  alignas(64) float scores[16 * 16];  // [group][16 tokens], group <= 16
  for (int64_t i = 0; i < group * head_dim; ++i) qf[i] = to_float(q[i]) * scale;
  const int64_t token_stride = kv_heads * head_dim;
  int64_t n = 0;
  for (int64_t start = 0; start < seq_len; start += n) {  // tiles of up to 16 tokens inside one block
    const int64_t in_block = start % block_size;
    n = std::min({int64_t(16), seq_len - start, block_size - in_block});
    const int64_t base = (blocks[start / block_size] * block_size + in_block) * token_stride + kv_head * head_dim;
    for (int64_t t = 0; t < n; ++t) {
      const T* k = k_cache + base + t * token_stride;
      __m512 krow[16];  // head_dim <= 256
      for (int64_t v = 0; v < nv; ++v) krow[v] = load16(k + v * 16);
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qf.data() + g * head_dim;
        __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(qg), krow[0]);
        for (int64_t v = 1; v < nv; ++v) sum = _mm512_fmadd_ps(_mm512_loadu_ps(qg + v * 16), krow[v], sum);
        scores[g * 16 + t] = _mm512_reduce_add_ps(sum);
      }
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    for (int64_t g = 0; g < group; ++g) {
      const __m512 s = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, scores + g * 16);
      const float new_max = std::max(running_max[g], _mm512_reduce_max_ps(s));
      const float correction = std::exp(running_max[g] - new_max);
      const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(new_max))));
      _mm512_store_ps(scores + g * 16, p);
      running_sum[g] = running_sum[g] * correction + _mm512_reduce_add_ps(p);
      running_max[g] = new_max;
      float* a = acc.data() + g * head_dim;
      for (int64_t v = 0; v < nv; ++v)
        _mm512_storeu_ps(a + v * 16, _mm512_mul_ps(_mm512_loadu_ps(a + v * 16), _mm512_set1_ps(correction)));
    }
    for (int64_t t = 0; t < n; ++t) {
      const T* vrow = v_cache + base + t * token_stride;
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
    const float inv = 1.f / running_sum[g];
    for (int64_t d = 0; d < head_dim; ++d) out[g * head_dim + d] = from_float<T>(acc[g * head_dim + d] * inv);
  }
}

// Ask for the next block's rows of this head while the current one is processed: a request's blocks sit anywhere
// in the pool, so the hardware prefetcher cannot guess the jump.
template <typename T>
inline void prefetch_block(const T* k_cache, const T* v_cache, int64_t base, int64_t rows, int64_t token_stride,
                           int64_t head_dim) {
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t byte = 0; byte < head_dim * int64_t(sizeof(T)); byte += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(k_cache + base + t * token_stride) + byte, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(v_cache + base + t * token_stride) + byte, _MM_HINT_T0);
    }
  }
}

// The same walk with the head size and group size known at compile time: q and the running weighted V stay in
// registers (G x NV vectors) instead of memory. Used for the common shapes; others take decode_one_vec.
template <typename T, int NV, int G>
void decode_one_fixed(const T* q, const T* k_cache, const T* v_cache, const int64_t* blocks, int64_t seq_len,
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
  for (int64_t start = 0; start < seq_len; start += n) {
    const int64_t in_block = start % block_size;
    n = std::min({int64_t(16), seq_len - start, block_size - in_block});
    const int64_t base = (blocks[start / block_size] * block_size + in_block) * token_stride + kv_head * head_dim;
    const int64_t next = (start / block_size + 1) * block_size;  // first token of the next block
    if (in_block + n == block_size && next < seq_len)
      prefetch_block(k_cache, v_cache, blocks[next / block_size] * block_size * token_stride + kv_head * head_dim,
                     std::min(block_size, seq_len - next), token_stride, head_dim);
    for (int64_t t = 0; t < n; ++t) {
      const T* k = k_cache + base + t * token_stride;
      __m512 krow[NV];
      for (int v = 0; v < NV; ++v) krow[v] = load16(k + v * 16);
      for (int g = 0; g < G; ++g) {
        __m512 sum = _mm512_mul_ps(qv[g][0], krow[0]);
        for (int v = 1; v < NV; ++v) sum = _mm512_fmadd_ps(qv[g][v], krow[v], sum);
        scores[g][t] = _mm512_reduce_add_ps(sum);
      }
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    for (int g = 0; g < G; ++g) {
      const __m512 s = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, scores[g]);
      const float new_max = std::max(running_max[g], _mm512_reduce_max_ps(s));
      const __m512 correction = _mm512_set1_ps(std::exp(running_max[g] - new_max));
      const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(new_max))));
      _mm512_store_ps(scores[g], p);
      running_sum[g] = running_sum[g] * _mm512_cvtss_f32(correction) + _mm512_reduce_add_ps(p);
      running_max[g] = new_max;
      for (int v = 0; v < NV; ++v) acc[g][v] = _mm512_mul_ps(acc[g][v], correction);
    }
    for (int64_t t = 0; t < n; ++t) {
      const T* vrow = v_cache + base + t * token_stride;
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
    const __m512 inv = _mm512_set1_ps(1.f / running_sum[g]);
    for (int v = 0; v < NV; ++v) _mm512_store_ps(row + v * 16, _mm512_mul_ps(acc[g][v], inv));
    for (int64_t d = 0; d < head_dim; ++d) out[g * head_dim + d] = from_float<T>(row[d]);
  }
}

// Runs the fixed-shape walk when (head_dim / 16, group) is one of the instantiated shapes; false otherwise.
template <typename T>
bool decode_fixed_shape(int64_t nv, int64_t group, const T* q, const T* k, const T* v, const int64_t* blocks,
                        int64_t seq_len, int64_t block_size, int64_t kv_heads, int64_t kv_head, float scale, T* out) {
#define PAGELLM_SHAPE(NV_, G_)                                                                              \
  if (nv == NV_ && group == G_) {                                                                           \
    decode_one_fixed<T, NV_, G_>(q, k, v, blocks, seq_len, block_size, kv_heads, kv_head, scale, out);      \
    return true;                                                                                            \
  }
  PAGELLM_SHAPE(4, 1) PAGELLM_SHAPE(4, 2) PAGELLM_SHAPE(4, 3) PAGELLM_SHAPE(4, 4) PAGELLM_SHAPE(4, 8)
  PAGELLM_SHAPE(8, 1) PAGELLM_SHAPE(8, 2) PAGELLM_SHAPE(8, 4) PAGELLM_SHAPE(8, 8)
#undef PAGELLM_SHAPE
  return false;
}
#endif

template <typename T>
void decode_all(const T* qp, const T* kp, const T* vp, const int64_t* bt, const int64_t* lens, int64_t batch,
                int64_t heads, int64_t head_dim, int64_t block_size, int64_t kv_heads, int64_t max_blocks,
                float scale, T* op) {
  const int64_t group = heads / kv_heads;
  // One work item per request, all its kv heads in turn: a block's heads are contiguous, so the block is streamed
  // from memory once and revisited from cache.
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t offset = (b * heads + h * group) * head_dim;
#if defined(__AVX512F__)
      if (head_dim % 16 == 0 && decode_fixed_shape<T>(head_dim / 16, group, qp + offset, kp, vp,
                                                        bt + b * max_blocks, lens[b], block_size, kv_heads, h,
                                                        scale, op + offset)) {
        continue;
      }
      if (head_dim % 16 == 0 && head_dim <= 256 && group <= 16) {
        decode_one_vec<T>(qp + offset, kp, vp, bt + b * max_blocks, lens[b], block_size, kv_heads, group,
                          head_dim, h, scale, op + offset);
        continue;
      }
#endif
      decode_one<T>(qp + offset, kp, vp, bt + b * max_blocks, lens[b], block_size, kv_heads, group, head_dim, h,
                    scale, op + offset);
    }
  }
}

}  // namespace

extern "C" {

// q, out: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D]; block_table: [B, max_blocks] int64;
// seq_lens: [B] int64 (context length including the query token). All contiguous; H a multiple of KVH.
void pagellm_paged_decode_bf16(const void* q, const void* k_cache, const void* v_cache, const int64_t* block_table,
                               const int64_t* seq_lens, int64_t batch, int64_t heads, int64_t head_dim,
                               int64_t block_size, int64_t kv_heads, int64_t max_blocks, float scale, void* out) {
  decode_all<BFloat16>(static_cast<const BFloat16*>(q), static_cast<const BFloat16*>(k_cache),
                       static_cast<const BFloat16*>(v_cache), block_table, seq_lens, batch, heads, head_dim,
                       block_size, kv_heads, max_blocks, scale, static_cast<BFloat16*>(out));
}

void pagellm_paged_decode_f32(const void* q, const void* k_cache, const void* v_cache, const int64_t* block_table,
                              const int64_t* seq_lens, int64_t batch, int64_t heads, int64_t head_dim,
                              int64_t block_size, int64_t kv_heads, int64_t max_blocks, float scale, void* out) {
  decode_all<float>(static_cast<const float*>(q), static_cast<const float*>(k_cache),
                    static_cast<const float*>(v_cache), block_table, seq_lens, batch, heads, head_dim, block_size,
                    kv_heads, max_blocks, scale, static_cast<float*>(out));
}

}  // extern "C"

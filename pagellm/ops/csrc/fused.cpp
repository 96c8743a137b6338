// Fused element-wise bfloat16 ops of the Llama block, one pass over memory each instead of several torch ops:
//   add_rms_norm:  residual' = x + residual; out = weight * bf16(residual' * rsqrt(mean(residual'^2) + eps))
//   silu_and_mul:  out = silu(gate) * up, with gate_up = [gate | up] along the last dimension
//   rotary:        q', k' = x * cos + rotate_half(x) * sin for each head ("rotate half" layout), from q/k rows
//                  that may be strided views into the fused qkv output, into contiguous outputs; over the first
//                  rot_dim dimensions of each head (the rest copied: Phi-4-mini's partial rotary embedding)
//   dequantize_gguf: at load, a GGUF's blocks (Q4_0, Q4_1, Q4_K: w = d * q + m per 32 inputs; Q8_0: w = d * q) to
//                  gguf's own dequantize's float32 values bit for bit, or those rounded to bfloat16
// Arithmetic is float32 with one bfloat16 rounding where torch's sequence rounds to the model dtype (RMSNorm keeps
// transformers' rounding points). The plain-PyTorch twins and test oracles are in pagellm/model/layers/.
// Plain C ABI; built and loaded by pagellm/ops/build.py. Rows are split across torch's OpenMP threads when a call
// is big enough to pay for the fork.
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16.h"      // f32, bf16
#include "silu.h"      // round_bf16x16, store_bf16x16, silu_mul16 (shared with the packed GEMMs' gate/up epilogues)
#include "simd_exp.h"  // exp16

namespace {

#if defined(__AVX512F__)
inline __m512 load_bf16x16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
#endif

constexpr int64_t kParallelElements = 1 << 15;  // below this a call runs on the calling thread
// add_rms_norm and rotary split from 8,192 elements on (a batch of 16 rows of 576): a fork costs ~0.6 us and at a
// batch of 32 either kernel takes 5-10 us on one thread (add_rms_norm 8.8 -> 5.0 us on two).
constexpr int64_t kParallelRowElements = 1 << 13;

// A GGUF block type's layout: inputs and bytes per block, and for the 4-bit ones where its nibbles start and bytes
// per run of nibbles (a run's low nibbles are the next `run` inputs, its high nibbles the `run` after). Q8_0 is a
// float16 d and 32 signed bytes q, w = d * q.
struct BlockLayout {
  int64_t values, bytes, nibbles_at, run;
};
constexpr int64_t kQ8_0 = 3;
constexpr BlockLayout kLayouts[] = {{32, 18, 2, 16}, {32, 20, 4, 16}, {256, 144, 16, 32}, {32, 34, 2, 0}};

// The float16 in two little-endian bytes, exactly (subnormals, infinities and NaNs included).
inline float half_at(const uint8_t* p) {
  const uint32_t h = p[0] | (p[1] << 8), sign = (h & 0x8000u) << 16, exp = (h >> 10) & 31, man = h & 1023;
  if (exp == 31) return __builtin_bit_cast(float, sign | 0x7f800000u | (man << 13));
  if (exp == 0) return (sign ? -1.f : 1.f) * static_cast<float>(man) * 0x1p-24f;
  return __builtin_bit_cast(float, sign | ((exp + 112) << 23) | (man << 13));
}

// Each 32 inputs' (d, m) of one block, computed as gguf's numpy computes them: Q4_0 (d, -8 d); Q4_1 (d, m); Q4_K
// (d * sc, -(dmin * mn)) with its eight 6-bit scales and minima packed in 12 bytes.
inline void q4_groups(const uint8_t* block, int64_t kind, float* d, float* m) {
  const float scale = half_at(block);
  if (kind == 0) {
    d[0] = scale, m[0] = -8.f * scale;
  } else if (kind == 1) {
    d[0] = scale, m[0] = half_at(block + 2);
  } else {
    const float dmin = half_at(block + 2);
    const uint8_t* s = block + 4;
    for (int j = 0; j < 8; ++j) {
      const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
      const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
      d[j] = scale * static_cast<float>(sc), m[j] = -(dmin * static_cast<float>(mn));
    }
  }
}

template <typename Out, typename Store>
inline void q4_block(const uint8_t* block, const BlockLayout& layout, int64_t kind, Out* out, Store store) {
  float d[8], m[8];
  q4_groups(block, kind, d, m);
  const uint8_t* q = block + layout.nibbles_at;
  for (int64_t at = 0; at < layout.values; at += 2 * layout.run, q += layout.run) {
    const int64_t lo = at / 32, hi = (at + layout.run) / 32, run = layout.run;
#pragma omp simd
    for (int64_t j = 0; j < run; ++j) {
      out[at + j] = store(d[lo] * static_cast<float>(q[j] & 15) + m[lo]);
      out[at + run + j] = store(d[hi] * static_cast<float>(q[j] >> 4) + m[hi]);
    }
  }
}

template <typename Out, typename Store>
inline void q8_0_block(const uint8_t* block, Out* out, Store store) {
  const float d = half_at(block);
  const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
#pragma omp simd
  for (int64_t j = 0; j < 32; ++j) out[j] = store(d * static_cast<float>(q[j]));
}

}  // namespace

extern "C" {

// x, residual, out, residual_out: [rows, n]; residual may be null (then residual_out = x); weight: [n].
void pagellm_add_rms_norm_bf16(const uint16_t* x, const uint16_t* residual, const uint16_t* weight, int64_t rows,
                               int64_t n, float eps, uint16_t* out, uint16_t* residual_out) {
#pragma omp parallel for schedule(static) if (rows * n >= kParallelRowElements)
  for (int64_t r = 0; r < rows; ++r) {
#if defined(__AVX512F__)
    // 16 lanes at a time: the sum of squares in 16 float32 partial sums, then one reduction.
    const uint16_t* xr = x + r * n;
    const uint16_t* rr = residual ? residual + r * n : nullptr;
    uint16_t* res = residual_out + r * n;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = n - i >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (n - i)) - 1);
      __m512 v = load_bf16x16(xr + i, m);
      if (rr) {  // torch rounds the sum to bf16 first
        v = round_bf16x16(_mm512_add_ps(v, load_bf16x16(rr + i, m)));
        store_bf16x16(res + i, v, m);
      } else {
        _mm256_mask_storeu_epi16(res + i, m, _mm256_maskz_loadu_epi16(m, xr + i));
      }
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(n) + eps));
    uint16_t* o = out + r * n;
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = n - i >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (n - i)) - 1);
      const __m512 normed = round_bf16x16(_mm512_mul_ps(load_bf16x16(res + i, m), inv));
      store_bf16x16(o + i, _mm512_mul_ps(load_bf16x16(weight + i, m), normed), m);
    }
#else
    const uint16_t* xr = x + r * n;
    uint16_t* res = residual_out + r * n;
    float sum = 0.f;
    if (residual) {
      const uint16_t* rr = residual + r * n;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = bf16(f32(xr[i]) + f32(rr[i]));  // torch rounds the sum to bf16 first
        res[i] = h;
        sum += f32(h) * f32(h);
      }
    } else {
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) {
        res[i] = xr[i];
        sum += f32(xr[i]) * f32(xr[i]);
      }
    }
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
    uint16_t* o = out + r * n;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) o[i] = bf16(f32(weight[i]) * f32(bf16(f32(res[i]) * inv)));
#endif
  }
}

// gate_up: [rows, 2 * n] (gate then up); out: [rows, n].
void pagellm_silu_and_mul_bf16(const uint16_t* gate_up, int64_t rows, int64_t n, uint16_t* out) {
#pragma omp parallel for schedule(static) if (rows * n >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* g = gate_up + r * 2 * n;
    const uint16_t* u = g + n;
    uint16_t* o = out + r * n;
#if defined(__AVX512F__)
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = n - i >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (n - i)) - 1);
      store_bf16x16(o + i, silu_mul16(load_bf16x16(g + i, m), load_bf16x16(u + i, m)), m);
    }
#else
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i), round_bf16x8(silu_mul8(widen_bf16x8(g + i), widen_bf16x8(u + i))));
#endif
    for (; i < n; ++i) o[i] = bf16(f32(g[i]) / (1.f + std::exp(-f32(g[i]))) * f32(u[i]));
#endif
  }
}

// q: rows of heads * head_dim starting every q_stride elements (likewise k); cos, sin: [max_pos, head_dim];
// positions: [rows]; q_out: [rows, heads, head_dim], k_out: [rows, kv_heads, head_dim] contiguous.
void pagellm_rotary_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k, int64_t k_stride,
                         const uint16_t* cos, const uint16_t* sin, const int64_t* positions, int64_t rows,
                         int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t rot_dim, uint16_t* q_out,
                         uint16_t* k_out) {
  const int64_t half = rot_dim / 2;  // cos and sin rows are rot_dim wide
#pragma omp parallel for schedule(static) if (rows * (heads + kv_heads) * head_dim >= kParallelRowElements)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* c = cos + positions[r] * rot_dim;
    const uint16_t* s = sin + positions[r] * rot_dim;
    for (int64_t h = 0; h < heads + kv_heads; ++h) {
      const bool is_q = h < heads;
      const uint16_t* src = is_q ? q + r * q_stride + h * head_dim : k + r * k_stride + (h - heads) * head_dim;
      uint16_t* dst = is_q ? q_out + (r * heads + h) * head_dim : k_out + (r * kv_heads + h - heads) * head_dim;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float lo = f32(src[i]), hi = f32(src[i + half]);
        dst[i] = bf16(lo * f32(c[i]) - hi * f32(s[i]));
        dst[i + half] = bf16(hi * f32(c[i + half]) + lo * f32(s[i + half]));
      }
      if (rot_dim < head_dim) std::memcpy(dst + rot_dim, src + rot_dim, (head_dim - rot_dim) * sizeof(uint16_t));
    }
  }
}

// raw: rows of row_bytes, whole blocks of block type `kind` (0 Q4_0, 1 Q4_1, 2 Q4_K, 3 Q8_0); out: [rows, inputs],
// float32, or bfloat16 rounded from the float32 value as torch rounds it (to_bf16). d * q is exact in float32 (d is
// a float16, or Q4_K's float16 times a 6-bit scale, and q has 4 bits, or Q8_0's 8: at most 21 significant bits), so
// the sum's is the one rounding, with or without a fused multiply-add, as in gguf's numpy.
void pagellm_dequantize_gguf(const uint8_t* raw, int64_t rows, int64_t row_bytes, int64_t kind, void* out,
                             int64_t to_bf16) {
  const BlockLayout& layout = kLayouts[kind];
  const int64_t blocks = row_bytes / layout.bytes, inputs = blocks * layout.values;
#pragma omp parallel for schedule(static) if (rows * inputs >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = raw + r * row_bytes + b * layout.bytes;
      const int64_t first = r * inputs + b * layout.values;
      const auto to16 = [](float v) { return bf16(v); };
      const auto to32 = [](float v) { return v; };
      if (kind == kQ8_0 && to_bf16)
        q8_0_block(block, static_cast<uint16_t*>(out) + first, to16);
      else if (kind == kQ8_0)
        q8_0_block(block, static_cast<float*>(out) + first, to32);
      else if (to_bf16)
        q4_block(block, layout, kind, static_cast<uint16_t*>(out) + first, to16);
      else
        q4_block(block, layout, kind, static_cast<float*>(out) + first, to32);
    }
  }
}

}  // extern "C"

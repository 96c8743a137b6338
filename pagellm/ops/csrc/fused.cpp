// Fused element-wise bfloat16 ops of the Llama block, one pass over memory each instead of several torch ops:
//   add_rms_norm:  residual' = x + residual; out = weight * bf16(residual' * rsqrt(mean(residual'^2) + eps))
//   add_layer_norm: Cohere's LayerNorm: residual' = x + residual; out = weight * (r - mean(r)) / sqrt(var(r) + eps)
//                  (in float32, rounded once, as transformers computes it; no bias)
//   silu_and_mul:  out = silu(gate) * up, with gate_up = [gate | up] along the last dimension
//   clamped_swiglu: gpt-oss's gating of the same [gate | up]
//   gelu_tanh_and_mul: Gemma's GeGLU, gelu(gate, approximate="tanh") * up, of the same [gate | up]
//   rotary:        q', k' = x * cos + rotate_half(x) * sin for each head ("rotate half" layout), from q/k rows
//                  that may be strided views into the fused qkv output, into contiguous outputs; over the first
//                  rot_dim dimensions of each head (the rest copied: Phi-4-mini's partial rotary embedding)
//   dequantize_gguf: at load, a GGUF's blocks (gguf_blocks.h: Q4_0 to Q8_0, the K-quants, IQ4, F16, BF16) to gguf's
//                  own dequantize's float32 values bit for bit, or those rounded to bfloat16
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

#include "bf16.h"         // f32, bf16
#include "gguf_blocks.h"  // gguf_blocks::decode
#include "silu.h"         // round_bf16x16, store_bf16x16, silu_mul16 (shared with the packed GEMMs' gate/up epilogues)
#include "simd_exp.h"     // exp16, exp2_16

namespace {

#if defined(__AVX512F__)
inline __m512 load_bf16x16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
#endif

constexpr int64_t kParallelElements = 1 << 15;  // below this a call runs on the calling thread

// The row loop of every gating kernel over gate_up [rows, 2 * n] (gate then up) into out [rows, n]: row(g, u, o, n)
// computes one row, rows split across the threads when the call is big enough.
template <typename Row>
void gated_rows(const uint16_t* gate_up, int64_t rows, int64_t n, uint16_t* out, Row row) {
#pragma omp parallel for schedule(static) if (rows * n >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) row(gate_up + r * 2 * n, gate_up + (r * 2 + 1) * n, out + r * n, n);
}

#if defined(__AVX512F__)
// o[i] = op(g[i], u[i]) over n bfloat16 values, 16 float32 lanes at a time (the last masked), rounded as stored.
template <typename Op16>
inline void lanes16(const uint16_t* g, const uint16_t* u, uint16_t* o, int64_t n, Op16 op) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (n - i)) - 1);
    store_bf16x16(o + i, op(load_bf16x16(g + i, m), load_bf16x16(u + i, m)), m);
  }
}
#endif
// add_rms_norm and rotary split from 8,192 elements on (a batch of 16 rows of 576): a fork costs ~0.6 us and at a
// batch of 32 either kernel takes 5-10 us on one thread (add_rms_norm 8.8 -> 5.0 us on two).
constexpr int64_t kParallelRowElements = 1 << 13;

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

// Cohere's LayerNorm with the residual add, as pagellm_add_rms_norm_bf16 takes its arguments: residual' = bf16(x +
// residual) (residual null: x), out = bf16(weight * (r - mean) * rsqrt(mean((r - mean)^2) + eps)).
void pagellm_add_layer_norm_bf16(const uint16_t* x, const uint16_t* residual, const uint16_t* weight, int64_t rows,
                                 int64_t n, float eps, uint16_t* out, uint16_t* residual_out) {
#pragma omp parallel for schedule(static) if (rows * n >= kParallelRowElements)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* xr = x + r * n;
    uint16_t* res = residual_out + r * n;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t h = residual ? bf16(f32(xr[i]) + f32(residual[r * n + i])) : xr[i];  // torch rounds the sum
      res[i] = h;
      sum += f32(h);
    }
    const float mean = sum / static_cast<float>(n);
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < n; ++i) {
      const float c = f32(res[i]) - mean;
      squares += c * c;
    }
    const float inv = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
    uint16_t* o = out + r * n;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) o[i] = bf16(f32(weight[i]) * ((f32(res[i]) - mean) * inv));
  }
}

// gate_up: [rows, 2 * n] (gate then up); out: [rows, n].
void pagellm_silu_and_mul_bf16(const uint16_t* gate_up, int64_t rows, int64_t n, uint16_t* out) {
  gated_rows(gate_up, rows, n, out, [](const uint16_t* g, const uint16_t* u, uint16_t* o, int64_t n) {
#if defined(__AVX512F__)
    lanes16(g, u, o, n, [](__m512 gate, __m512 up) { return silu_mul16(gate, up); });
#else
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i), round_bf16x8(silu_mul8(widen_bf16x8(g + i), widen_bf16x8(u + i))));
#endif
    for (; i < n; ++i) o[i] = bf16(f32(g[i]) / (1.f + std::exp(-f32(g[i]))) * f32(u[i]));
#endif
  });
}

// Gemma's GeGLU: gate_up [rows, 2 * n] (gate then up); out [rows, n] = bf16(gelu_tanh(gate)) * up.
void pagellm_gelu_tanh_and_mul_bf16(const uint16_t* gate_up, int64_t rows, int64_t n, uint16_t* out) {
  gated_rows(gate_up, rows, n, out, [](const uint16_t* g, const uint16_t* u, uint16_t* o, int64_t n) {
#if defined(__AVX512F__)
    lanes16(g, u, o, n, [](__m512 gate, __m512 up) { return gelu_tanh_mul16(gate, up); });
#else
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= n; i += 8) {
      const __m128i gelu = round_bf16x8(gelu_tanh8(widen_bf16x8(g + i)));
      const __m256 wide = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(gelu), 16));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i), round_bf16x8(_mm256_mul_ps(wide, widen_bf16x8(u + i))));
    }
#endif
    for (; i < n; ++i) {
      const float x = f32(g[i]);
      const float gelu = x / (1.f + std::exp(-1.5957691216057308f * x * (1.f + 0.044715f * x * x)));
      o[i] = bf16(f32(bf16(gelu)) * f32(u[i]));
    }
#endif
  });
}

// gpt-oss's experts' gating: gate_up [rows, 2 * n] (gate then up); out [rows, n] = (clamp(up, -limit, limit) + 1) *
// (g * sigmoid(alpha * g)) with g = min(gate, limit), rounded as torch's bfloat16 ops round it.
void pagellm_clamped_swiglu_bf16(const uint16_t* gate_up, int64_t rows, int64_t n, float limit, float alpha,
                                 uint16_t* out) {
  gated_rows(gate_up, rows, n, out, [limit, alpha](const uint16_t* g, const uint16_t* u, uint16_t* o, int64_t n) {
#if defined(__AVX512F__)
    lanes16(g, u, o, n, [limit, alpha](__m512 gate, __m512 up) { return clamped_swiglu16(gate, up, limit, alpha); });
#else
    for (int64_t i = 0; i < n; ++i) {
      const float gate = f32(bf16(std::fmin(f32(g[i]), limit)));
      const float up = f32(bf16(std::fmax(std::fmin(f32(u[i]), limit), -limit)));
      const float sig = f32(bf16(1.f / (1.f + std::exp(-f32(bf16(gate * alpha))))));
      o[i] = bf16(f32(bf16(up + 1.f)) * f32(bf16(gate * sig)));
    }
#endif
  });
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

// raw: rows of row_bytes, whole blocks of block type `kind` (gguf_blocks::Kind); out: [rows, inputs], float32 as
// gguf's numpy computes each value (gguf_blocks.h), or bfloat16 rounded from it as torch rounds it (to_bf16).
void pagellm_dequantize_gguf(const uint8_t* raw, int64_t rows, int64_t row_bytes, int64_t kind, void* out,
                             int64_t to_bf16) {
  const gguf_blocks::BlockType type = gguf_blocks::kBlockTypes[kind];
  const int64_t inputs = row_bytes / type.bytes * type.values;
#pragma omp parallel for schedule(static) if (rows * inputs >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    float v[gguf_blocks::kMaxValues];  // bfloat16 out: the float32 values before their rounding
    for (int64_t at = 0; at < inputs;) {
      const int64_t first = r * inputs + at;
      float* values = to_bf16 ? v : static_cast<float*>(out) + first;
      const int64_t len = gguf_blocks::decode_run(raw + r * row_bytes, kind, at, inputs, values);
      if (to_bf16) {
        uint16_t* o = static_cast<uint16_t*>(out) + first;
#pragma omp simd
        for (int64_t j = 0; j < len; ++j) o[j] = bf16(v[j]);
      }
      at += len;
    }
  }
}

// The kernels' vector exponentials (simd_exp.h: exp16, e^x; exp2_16, 2^x) of n floats, for their accuracy tests.
// Returns 0, out untouched, where the build has no AVX-512.
int64_t pagellm_simd_exp_f32(const float* x, int64_t n, int64_t base2, float* out) {
#if defined(__AVX512F__)
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    _mm512_mask_storeu_ps(out + i, m, base2 ? exp2_16(v) : exp16(v));
  }
  return 1;
#else
  (void)x, (void)n, (void)base2, (void)out;
  return 0;
#endif
}

}  // extern "C"

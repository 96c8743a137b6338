// Fused temperature sampling over whole rows of logits: for each row, the first token whose cumulative mass
// exceeds u * (the row's total mass), where token i's mass is exp((x_i - max) / T), or the row's first argmax
// when T == 0. One pass for the maximum, one pass that writes the masses into a per-thread float32 buffer and
// sums them in fixed chunks (float32 lanes, chunk sums and every running sum in float64), then a walk over the chunk sums and inside the one chunk that holds the target.
// No softmax, normalisation or cumulative-sum tensor is materialised.
//
// Exactness: the walk uses the very chunk sums the total was summed from, so it always reaches the target for
// u < 1. Inside the chunk, the sequential running sum may round differently from the vectorised chunk sum; then
// (and where u * total rounds up to the total) the last token with non-zero mass before that point is taken,
// a choice that float rounding alone decides. Tokens at -inf (bans, grammar masks) have mass exactly 0 and are
// never picked. A row with no finite logit returns token 0.
//
// The plain-PyTorch twin and test oracle is pagellm/sample/sampler.py (softmax, cumsum, searchsorted).
// Plain C ABI; built and loaded by pagellm/ops/build.py. Rows are spread over torch's OpenMP threads.
#include <omp.h>
#if !defined(__AVX512F__)
#error "inverse_cdf.cpp needs AVX-512 (pagellm/sample/native.py then keeps the torch path)"
#endif
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "simd_exp.h"  // exp16

namespace {

constexpr int64_t kChunk = 1024;  // masses summed per chunk (a multiple of 16)

// 16 logits at p (bf16 or f32), lanes past `m` set to -inf.
inline __m512 load16(const void* p, int64_t i, bool bf16, __mmask16 m) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  if (bf16) {
    const __m512i raw = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i));
    return _mm512_mask_blend_ps(m, ninf, _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)));
  }
  return _mm512_mask_loadu_ps(ninf, m, static_cast<const float*>(p) + i);
}

inline __mmask16 lanes(int64_t i, int64_t n) {
  const int64_t left = n - i;
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1u);
}

float row_max(const void* row, int64_t n, bool bf16) {
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 16) best = _mm512_max_ps(best, load16(row, i, bf16, lanes(i, n)));
  return _mm512_reduce_max_ps(best);
}

// The first index of the row's maximum, in one pass: each lane keeps its largest value and the first index it
// was seen at (a later equal value does not replace it), then the lowest index among the lanes that hold the
// maximum. NaN is never greater than anything, so it is passed over; a row with no value above -inf (all -inf or
// NaN) returns 0.
int64_t first_argmax(const void* row, int64_t n, bool bf16) {
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i where = _mm512_setzero_si512();
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 x = load16(row, i, bf16, lanes(i, n));
    const __mmask16 up = _mm512_cmp_ps_mask(x, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, up, x);
    where = _mm512_mask_mov_epi32(where, up, _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int32_t>(i))));
  }
  const float max = _mm512_reduce_max_ps(best);
  const __mmask16 holders = _mm512_cmp_ps_mask(best, _mm512_set1_ps(max), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(holders, where);
}

// Masses exp((x - max) * inv_t) into w[0, n) (exactly 0 at -inf) and their sums per chunk; returns the total.
double masses(const void* row, int64_t n, bool bf16, float max, float inv_t, float* w, std::vector<double>& sums) {
  const __m512 vmax = _mm512_set1_ps(max), vinv = _mm512_set1_ps(inv_t);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  double total = 0.0;
  for (int64_t c = 0, start = 0; start < n; ++c, start += kChunk) {
    const int64_t end = start + kChunk < n ? start + kChunk : n;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = start; i < end; i += 16) {
      const __mmask16 m = lanes(i, end);
      const __m512 x = load16(row, i, bf16, m);
      const __mmask16 live = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ) & m;
      const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_mul_ps(_mm512_sub_ps(x, vmax), vinv)));
      _mm512_mask_storeu_ps(w + i, m, e);
      acc = _mm512_add_ps(acc, e);
    }
    alignas(64) float lane[16];
    _mm512_store_ps(lane, acc);
    double sum = 0.0;
    for (float v : lane) sum += v;
    sums[c] = sum;
    total += sums[c];
  }
  return total;
}

// The token the target falls on, given the masses and chunk sums that `masses` produced.
int64_t walk(const float* w, int64_t n, const std::vector<double>& sums, double target) {
  double running = 0.0;
  int64_t last_live = -1;
  for (int64_t c = 0, start = 0; start < n; ++c, start += kChunk) {
    const int64_t end = start + kChunk < n ? start + kChunk : n;
    if (running + sums[c] <= target) {
      running += sums[c];
      if (sums[c] > 0.0) {
        for (int64_t i = end - 1; i >= start; --i) {
          if (w[i] > 0.f) { last_live = i; break; }
        }
      }
      continue;
    }
    for (int64_t i = start; i < end; ++i) {
      if (w[i] > 0.f) {
        last_live = i;
        running += w[i];
        if (running > target) return i;
      }
    }
    return last_live;  // the sequential sum rounded below the chunk sum
  }
  return last_live;  // u * total rounded up to the total
}

}  // namespace

extern "C" {

// logits: [rows, vocab] as above; out: [rows] each row's first argmax (greedy decoding's token; torch's
// ``max(dim=-1).indices`` is the twin). Rows are spread over the OpenMP threads.
void pagellm_first_argmax_rows(const void* logits, int64_t is_bf16, int64_t rows, int64_t vocab, int64_t row_stride,
                               int64_t* out) {
  const bool bf16 = is_bf16 != 0;
  const int64_t elem = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) out[r] = first_argmax(static_cast<const char*>(logits) + r * row_stride * elem,
                                                           vocab, bf16);
}

// logits: [rows, vocab] with rows `row_stride` elements apart, bfloat16 (is_bf16 = 1) or float32;
// temperature, uniforms: [rows] (temperature 0 = greedy; uniforms in [0, 1)); out: [rows] token ids.
void pagellm_sample_inverse_cdf(const void* logits, int64_t is_bf16, int64_t rows, int64_t vocab,
                                int64_t row_stride, const float* temperature, const float* uniforms, int64_t* out) {
  const bool bf16 = is_bf16 != 0;
  const int64_t elem = bf16 ? 2 : 4;
#pragma omp parallel if (rows > 1)
  {
    std::vector<float> w(static_cast<size_t>(vocab));
    std::vector<double> sums(static_cast<size_t>((vocab + kChunk - 1) / kChunk));
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; ++r) {
      const void* row = static_cast<const char*>(logits) + r * row_stride * elem;
      if (!(temperature[r] > 0.f)) {
        out[r] = first_argmax(row, vocab, bf16);
        continue;
      }
      const float max = row_max(row, vocab, bf16);
      if (!std::isfinite(max)) {
        out[r] = first_argmax(row, vocab, bf16);
        continue;
      }
      const double total = masses(row, vocab, bf16, max, 1.f / temperature[r], w.data(), sums);
      const int64_t picked = walk(w.data(), vocab, sums, static_cast<double>(uniforms[r]) * total);
      out[r] = picked < 0 ? 0 : picked;
    }
  }
}

}  // extern "C"

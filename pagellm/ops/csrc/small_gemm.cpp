// Small-M bfloat16 GEMM for decode steps: y[M, N] = x[M, K] · W[N, K]ᵀ (+ bias), M up to a few dozen rows.
//
// At small M a linear layer is a stream over its weight matrix: every weight byte is used M times, so the speed is
// the memory bandwidth. Each thread takes a contiguous run of output rows (OpenMP, static), walks 4 weight rows at
// once with AVX-512 BF16 dot products (_mm512_dpbf16_ps: 32 bf16 products per instruction, float32 accumulation)
// against up to 4 input rows held in registers, and reduces each accumulator once at the end of K. Larger M is
// processed 4 input rows at a time over the same 4 weight rows, which then come from L1.
// Plain C ABI (no torch headers: builds in about a second); the plain-PyTorch twin and test oracle is
// ``F.linear`` (pagellm/ops/gemm.py).
#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int NR = 4;  // weight rows per tile

inline uint16_t to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline __m512bh load_bh(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh load_bh(const uint16_t* p, __mmask32 m) { return (__m512bh)_mm512_maskz_loadu_epi16(m, p); }

// MR input rows against NR weight rows (w[r] already clamped to valid rows), full K; writes MR x NR sums.
template <int MR>
inline void tile(const uint16_t* x, int64_t ldx, const uint16_t* const* w, int64_t k, float* sums) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_setzero_ps();
  int64_t kk = 0;
  for (; kk + 32 <= k; kk += 32) {
    __m512bh wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = load_bh(w[r] + kk);
    // Two tiles ahead: the rows are contiguous, but a thread's stream alone does not keep enough misses in flight.
    for (int r = 0; r < NR; ++r) _mm_prefetch(reinterpret_cast<const char*>(w[r] + kk + 2 * NR * k), _MM_HINT_T0);
    for (int i = 0; i < MR; ++i) {
      const __m512bh xv = load_bh(x + i * ldx + kk);
      for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], xv, wv[r]);
    }
  }
  if (kk < k) {
    const __mmask32 m = static_cast<__mmask32>((1ull << (k - kk)) - 1);
    __m512bh wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = load_bh(w[r] + kk, m);
    for (int i = 0; i < MR; ++i) {
      const __m512bh xv = load_bh(x + i * ldx + kk, m);
      for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], xv, wv[r]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) sums[i * NR + r] = _mm512_reduce_add_ps(acc[i][r]);
}

template <int MR>
inline void rows_block(const uint16_t* x, int64_t k, const uint16_t* const* w, int64_t n0, int64_t nr, int64_t n,
                       const uint16_t* bias, uint16_t* y) {
  float sums[MR * NR];
  tile<MR>(x, k, w, k, sums);
  for (int i = 0; i < MR; ++i)
    for (int64_t r = 0; r < nr; ++r)
      y[i * n + n0 + r] = to_bf16(sums[i * NR + r] + (bias ? from_bf16(bias[n0 + r]) : 0.f));
}

}  // namespace

extern "C" {

// x: [m, k], w: [n, k], bias: [n] or null, y: [m, n]; all bfloat16 (as uint16), row-major and contiguous.
void pagellm_linear_bf16(const uint16_t* x, int64_t m, int64_t k, const uint16_t* w, int64_t n,
                         const uint16_t* bias, uint16_t* y) {
  const int64_t tiles = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t n0 = t * NR;
    const int64_t nr = n - n0 < NR ? n - n0 : NR;
    const uint16_t* w_rows[NR];
    for (int r = 0; r < NR; ++r) w_rows[r] = w + (n0 + (r < nr ? r : nr - 1)) * k;  // pad with a valid row
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) rows_block<4>(x + i * k, k, w_rows, n0, nr, n, bias, y + i * n);
    switch (m - i) {
      case 3: rows_block<3>(x + i * k, k, w_rows, n0, nr, n, bias, y + i * n); break;
      case 2: rows_block<2>(x + i * k, k, w_rows, n0, nr, n, bias, y + i * n); break;
      case 1: rows_block<1>(x + i * k, k, w_rows, n0, nr, n, bias, y + i * n); break;
      default: break;
    }
  }
}

}  // extern "C"

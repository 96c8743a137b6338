// The AVX2 + FMA register tiles of the packed GEMM, for CPUs without AVX-512 BF16 (AMD Zen 2/3, Intel before
// Cooper Lake); packed_gemm.cpp includes this instead of packed_gemm_avx512.h and uses the same names.
//
// The packed layout is the AVX-512 one: one 64-byte line is a k-pair of 16 columns, (k, k+1) in each 32-bit word.
// A 32-byte half line widens to two float32 vectors without a shuffle: the even k is the word shifted left by 16,
// the odd k is the word with its low half cleared. x is widened to float32 once per call (`widen_rows`, into
// Tile::xf, its rows padded to whole pairs with zeros), so a tile broadcasts each x element straight from memory.
// Each output is a chain of FMAs in k order (k, k+1, the next pair ...), K blocks in sequence, whatever M, the
// tile shape or the thread count: rows are batch-invariant as on the AVX-512 path (the two paths differ in
// rounding, and a machine runs one of them).
//
// Tile shapes (16 ymm registers): MR rows x NR panels keep 2 * MR * NR accumulators, the widened halves and one
// broadcast: MR <= 5 at NR = 1; two rows take two panels and one row four, so that a memory-bound small-M call keeps
// several weight streams in flight. From kWidenRows rows on the weight block is widened to float32 first and the
// tiles are 6 rows x 1 panel (tile_kernel_wide, below). Blocks: kKC pairs of 4 panels is 96 KiB of weights (192 KiB
// widened) and kMC rows of them 192 KiB of widened x, within Zen 3's 512 KiB L2.
#pragma once

#include "silu.h"  // widen_bf16x8, round_bf16x8

namespace {

constexpr int64_t kKC = 384;         // most k-pairs per K block
constexpr int64_t kMC = 64;          // rows per M block
constexpr int kPrefetchPairs = 32;   // software prefetch distance along a panel (2 KiB ahead), into L2
constexpr int kHalf = 8;             // float32 lanes per ymm: a panel is two halves

inline __m256 load_bias8(const uint16_t* bias, int cols) {
  if (cols >= kHalf) return widen_bf16x8(bias);
  alignas(16) uint16_t tmp[kHalf] = {};
  std::memcpy(tmp, bias, static_cast<size_t>(cols) * sizeof(uint16_t));
  return widen_bf16x8(tmp);
}

inline void store_bf16x8(uint16_t* dst, __m256 v, int cols) {
  const __m128i h = round_bf16x8(v);
  if (cols >= kHalf) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), h);
  } else {
    alignas(16) uint16_t tmp[kHalf];
    _mm_store_si128(reinterpret_cast<__m128i*>(tmp), h);
    std::memcpy(dst, tmp, static_cast<size_t>(cols) * sizeof(uint16_t));
  }
}

// Rows [r0, r1) of bf16 x (row stride ldx, k columns) as float32 rows of ldxf columns, zero past k.
void widen_rows(const uint16_t* x, int64_t ldx, int64_t k, float* xf, int64_t ldxf, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* src = x + r * ldx;
    float* dst = xf + r * ldxf;
    int64_t c = 0;
    for (; c + kHalf <= k; c += kHalf) _mm256_storeu_ps(dst + c, widen_bf16x8(src + c));
    for (; c < k; ++c) dst[c] = __builtin_bit_cast(float, static_cast<uint32_t>(src[c]) << 16);
    for (; c < ldxf; ++c) dst[c] = 0.0f;
  }
}

// A tile's starting sums for row i, half h: zero at the first K block, else the partial sums so far.
inline __m256 tile_start(const Tile& t, int i, int h) {
  return t.first ? _mm256_setzero_ps() : _mm256_loadu_ps(t.partial + i * t.ldp + h * kHalf);
}

// The tile's end: its float32 sums to the partial buffer (more K blocks follow) or, with bias, to y as bf16.
template <int MR, int NR>
void finish_tile(const Tile& t, const __m256 (&acc)[MR][2 * NR]) {
  if (!t.last) {
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < 2 * NR; ++j) _mm256_storeu_ps(t.partial + i * t.ldp + j * kHalf, acc[i][j]);
    return;
  }
  for (int j = 0; j < 2 * NR; ++j) {
    const int cols = t.cols - j * kHalf;
    if (cols <= 0) break;
    const __m256 bias = t.bias ? load_bias8(t.bias + j * kHalf, cols) : _mm256_setzero_ps();
    for (int i = 0; i < MR; ++i) store_bf16x8(t.y + i * t.ldy + j * kHalf, _mm256_add_ps(acc[i][j], bias), cols);
  }
}

template <int MR, int NR>
void tile_kernel(const Tile& t) {
  __m256 acc[MR][2 * NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 2 * NR; ++j)
      acc[i][j] = tile_start(t, i, j);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const uint16_t* w = t.w;
  for (int64_t p = 0; p < t.pairs; ++p, w += kPanelPair) {
    for (int j = 0; j < NR; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(w + j * t.panel_stride + kPrefetchPairs * kPanelPair),
                   _MM_HINT_T1);
    if (t.pf)
      for (int j = t.pf_first; j < t.pf_end; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(t.pf + j * t.panel_stride + p * kPanelPair), _MM_HINT_T1);
    if constexpr (NR == 1) {  // both halves widened first: each x element is broadcast once
      __m256 even[2], odd[2];
      for (int j = 0; j < 2; ++j) {
        const __m256i line = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * 2 * kHalf));
        even[j] = _mm256_castsi256_ps(_mm256_slli_epi32(line, 16));
        odd[j] = _mm256_castsi256_ps(_mm256_and_si256(line, high));
      }
      for (int i = 0; i < MR; ++i) {
        const float* xi = t.xf + i * t.ldxf + 2 * p;
        const __m256 x0 = _mm256_broadcast_ss(xi);
        acc[i][0] = _mm256_fmadd_ps(x0, even[0], acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(x0, even[1], acc[i][1]);
        const __m256 x1 = _mm256_broadcast_ss(xi + 1);
        acc[i][0] = _mm256_fmadd_ps(x1, odd[0], acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(x1, odd[1], acc[i][1]);
      }
    } else {  // one or two rows over several panels: one half line at a time (registers)
      for (int j = 0; j < 2 * NR; ++j) {
        const __m256i line = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(w + (j / 2) * t.panel_stride + (j % 2) * 2 * kHalf));
        const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(line, 16));
        const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(line, high));
        for (int i = 0; i < MR; ++i) {
          const float* xi = t.xf + i * t.ldxf + 2 * p;
          acc[i][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(xi), even, acc[i][j]);
          acc[i][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(xi + 1), odd, acc[i][j]);
        }
      }
    }
  }
  finish_tile<MR, NR>(t, acc);
}

// One row's k-pair into its two accumulators (the 16 columns' halves): x[k] times the even k, then x[k + 1] times the
// odd k, the template's order. Inlined into the named-accumulator tile, whose locals it updates in registers.
__attribute__((always_inline)) inline void row_pair(const float* xk, __m256 e0, __m256 e1, __m256 o0, __m256 o1,
                                                    __m256& ca, __m256& cb) {
  __m256 a = _mm256_broadcast_ss(xk);
  ca = _mm256_fmadd_ps(a, e0, ca), cb = _mm256_fmadd_ps(a, e1, cb);
  a = _mm256_broadcast_ss(xk + 1);
  ca = _mm256_fmadd_ps(a, o0, ca), cb = _mm256_fmadd_ps(a, o1, cb);
}

// The 5-row tile (the narrow kernel's full row groups, 5 to 47 rows: decode batches) with named accumulators, for
// the reason tile_kernel_wide<6> gives. Same FMAs in the same order as the template.
template <>
void tile_kernel<5, 1>(const Tile& t) {
  const int64_t ld = t.ldxf;
  const float* x0 = t.xf;
  const float* x3 = t.xf + 3 * ld;
  __m256 c0a = tile_start(t, 0, 0), c0b = tile_start(t, 0, 1), c1a = tile_start(t, 1, 0), c1b = tile_start(t, 1, 1);
  __m256 c2a = tile_start(t, 2, 0), c2b = tile_start(t, 2, 1), c3a = tile_start(t, 3, 0), c3b = tile_start(t, 3, 1);
  __m256 c4a = tile_start(t, 4, 0), c4b = tile_start(t, 4, 1);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const uint16_t* w = t.w;
  for (int64_t p = 0; p < t.pairs; ++p, w += kPanelPair) {
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchPairs * kPanelPair), _MM_HINT_T1);
    if (t.pf)
      for (int j = t.pf_first; j < t.pf_end; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(t.pf + j * t.panel_stride + p * kPanelPair), _MM_HINT_T1);
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2 * kHalf));
    const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16));
    const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16));
    const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(lo, high));
    const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(hi, high));
    const int64_t k = 2 * p;
    row_pair(x0 + k, e0, e1, o0, o1, c0a, c0b);
    row_pair(x0 + ld + k, e0, e1, o0, o1, c1a, c1b);
    row_pair(x0 + 2 * ld + k, e0, e1, o0, o1, c2a, c2b);
    row_pair(x3 + k, e0, e1, o0, o1, c3a, c3b);
    row_pair(x3 + ld + k, e0, e1, o0, o1, c4a, c4b);
  }
  const __m256 sums[5][2] = {{c0a, c0b}, {c1a, c1b}, {c2a, c2b}, {c3a, c3b}, {c4a, c4b}};
  finish_tile<5, 1>(t, sums);
}

// From kWidenRows rows on, each weight block is widened to float32 once per M block (widen_block, into the
// thread's scratch: [panel][pair][k, k+1][16 columns]) and the tiles take kWideMR rows over one panel with the
// weights as they lie: two loads and kWideMR broadcasts feed 2 * kWideMR FMAs per k, with no widening in the loop
// (the M-block's rows amortise the block's). The FMAs are the same, in the same order, as tile_kernel's, so a
// row's bits do not depend on which kernel ran it.
constexpr int64_t kWidenRows = 48;
constexpr int kWideMR = 6;

inline int64_t widened_floats(int64_t m, int width, int64_t kc) {
  return m >= kWidenRows ? width * kc * 2 * kPanel : 0;
}

const float* widen_block(const uint16_t* w, int64_t panel_stride, int nr, int64_t pairs, int64_t m, float* scratch) {
  if (m < kWidenRows) return nullptr;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int j = 0; j < nr; ++j) {
    const uint16_t* src = w + j * panel_stride;
    float* dst = scratch + j * pairs * 2 * kPanel;
    for (int64_t p = 0; p < pairs; ++p, src += kPanelPair, dst += 2 * kPanel) {
      for (int h = 0; h < 2; ++h) {
        const __m256i line = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + h * 2 * kHalf));
        _mm256_storeu_ps(dst + h * kHalf, _mm256_castsi256_ps(_mm256_slli_epi32(line, 16)));
        _mm256_storeu_ps(dst + kPanel + h * kHalf, _mm256_castsi256_ps(_mm256_and_si256(line, high)));
      }
    }
  }
  return scratch;
}

// The rest of an M block's rows (1 to 5) over a widened block. No prefetch of the next block in these tiles:
// widen_block reads it in one sequential pass, which the hardware prefetcher follows.
template <int MR>
void tile_kernel_wide(const Tile& t) {
  __m256 acc[MR][2];
  const float* x[MR];
  for (int i = 0; i < MR; ++i) {
    x[i] = t.xf + i * t.ldxf;
    for (int j = 0; j < 2; ++j)
      acc[i][j] = tile_start(t, i, j);
  }
  const float* wk = t.wf;
  for (int64_t k = 0; k < 2 * t.pairs; ++k, wk += kPanel) {
    const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + kHalf);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(x[i] + k);
      acc[i][0] = _mm256_fmadd_ps(a, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(a, w1, acc[i][1]);
    }
  }
  finish_tile<MR, 1>(t, acc);
}

// The 6-row tile (every full row group) with its twelve accumulators as named variables: as an array GCC keeps
// them in memory, storing every one in every k iteration (twice as slow). Same FMAs in the same order.
template <>
void tile_kernel_wide<6>(const Tile& t) {
  const int64_t ld = t.ldxf;
  const float* x0 = t.xf;
  const float* x3 = t.xf + 3 * ld;
  __m256 c0a = tile_start(t, 0, 0), c0b = tile_start(t, 0, 1), c1a = tile_start(t, 1, 0), c1b = tile_start(t, 1, 1);
  __m256 c2a = tile_start(t, 2, 0), c2b = tile_start(t, 2, 1), c3a = tile_start(t, 3, 0), c3b = tile_start(t, 3, 1);
  __m256 c4a = tile_start(t, 4, 0), c4b = tile_start(t, 4, 1), c5a = tile_start(t, 5, 0), c5b = tile_start(t, 5, 1);
  const float* wk = t.wf;
  for (int64_t k = 0; k < 2 * t.pairs; ++k, wk += kPanel) {
    const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + kHalf);
    __m256 a = _mm256_broadcast_ss(x0 + k);
    c0a = _mm256_fmadd_ps(a, w0, c0a), c0b = _mm256_fmadd_ps(a, w1, c0b);
    a = _mm256_broadcast_ss(x0 + ld + k);
    c1a = _mm256_fmadd_ps(a, w0, c1a), c1b = _mm256_fmadd_ps(a, w1, c1b);
    a = _mm256_broadcast_ss(x0 + 2 * ld + k);
    c2a = _mm256_fmadd_ps(a, w0, c2a), c2b = _mm256_fmadd_ps(a, w1, c2b);
    a = _mm256_broadcast_ss(x3 + k);
    c3a = _mm256_fmadd_ps(a, w0, c3a), c3b = _mm256_fmadd_ps(a, w1, c3b);
    a = _mm256_broadcast_ss(x3 + ld + k);
    c4a = _mm256_fmadd_ps(a, w0, c4a), c4b = _mm256_fmadd_ps(a, w1, c4b);
    a = _mm256_broadcast_ss(x3 + 2 * ld + k);
    c5a = _mm256_fmadd_ps(a, w0, c5a), c5b = _mm256_fmadd_ps(a, w1, c5b);
  }
  const __m256 sums[6][2] = {{c0a, c0b}, {c1a, c1b}, {c2a, c2b}, {c3a, c3b}, {c4a, c4b}, {c5a, c5b}};
  finish_tile<6, 1>(t, sums);
}

using TileFn = void (*)(const Tile&);

constexpr int kMaxMR = 5;
constexpr int kMaxNR = 4;  // panels per group

TileFn tile_fn(int mr, int nr, const float* wide) {
  if (wide) {
    switch (mr) {
      case 1: return tile_kernel_wide<1>;
      case 2: return tile_kernel_wide<2>;
      case 3: return tile_kernel_wide<3>;
      case 4: return tile_kernel_wide<4>;
      case 5: return tile_kernel_wide<5>;
      default: return tile_kernel_wide<6>;
    }
  }
  switch (mr) {
    case 1: return nr == 1 ? tile_kernel<1, 1> : nr == 2 ? tile_kernel<1, 2> : nr == 3 ? tile_kernel<1, 3>
                                                                                   : tile_kernel<1, 4>;
    case 2: return nr == 1 ? tile_kernel<2, 1> : tile_kernel<2, 2>;
    case 3: return tile_kernel<3, 1>;
    case 4: return tile_kernel<4, 1>;
    default: return tile_kernel<5, 1>;
  }
}

inline int max_nr(int mr, const float* wide) { return wide || mr > 2 ? 1 : mr == 1 ? 4 : 2; }
inline int group_width(int64_t) { return kMaxNR; }

// Row groups of an M block: one group of m rows when m <= MR (5, or 6 over a widened block), else groups of MR with
// a short remainder folded into the last two groups (6 = 3 + 3, 7 = 4 + 3, 11 = 5 + 3 + 3 ...).
int next_rows(int64_t left, const float* wide) {
  const int most = wide ? kWideMR : kMaxMR;
  if (left <= most) return static_cast<int>(left);
  if (left < most + 3) return static_cast<int>(left) - 3;
  return most;
}

}  // namespace

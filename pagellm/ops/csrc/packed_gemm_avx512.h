// The AVX-512 BF16 register tiles of the packed GEMM (packed_gemm.cpp includes this where the compiler targets
// AVX-512 BF16; packed_gemm_avx2.h is the same interface in AVX2 + FMA), and the paired tiles of the gate/up entry
// with SiLU·mul (paired_tile_fn; the AVX2 build has none, and that entry declines there). Uses Tile from
// packed_gemm.cpp.
#pragma once

#include "silu.h"  // silu_mul16, store_bf16x16: the gate/up epilogue, bit for bit the SiLU·mul kernel's

namespace {

constexpr int64_t kKC = 512;         // most k-pairs per K block (NR=4: 4 * 512 * 64 B = 128 KiB of weights)
constexpr int64_t kMC = 192;         // rows per M block (x block at most 192 rows * 2 KiB per K block)
constexpr int kPrefetchPairs = 32;   // software prefetch distance along a panel (2 KiB ahead), into L2

inline __m512i pair_at(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

inline __m512i half_pair_at(const uint16_t* p) {  // K odd: the last pair has one real element, the other is zero
  return _mm512_set1_epi32(static_cast<int32_t>(*p));
}

inline __m512 load_bias(const uint16_t* bias, int64_t col, int cols) {
  const __mmask16 m = cols >= kPanel ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << cols) - 1);
  const __m256i h = _mm256_maskz_loadu_epi16(m, bias + col);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline void store_bf16(uint16_t* dst, __m512 v, int cols) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
  if (cols >= kPanel) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
  } else {
    _mm256_mask_storeu_epi16(dst, static_cast<__mmask16>((1u << cols) - 1), h);
  }
}

// A float32 output as the GEMM stores it in bfloat16 (bias 0 added, as store_bf16's caller adds it), read back.
inline __m512 stored_bf16(__m512 v) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(v, _mm512_setzero_ps()));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The epilogue of a paired tile: column block j < NR / 2 is silu(gate) · up of accumulators j and j + NR / 2, each
// rounded as the GEMM stores it, then the SiLU·mul kernel's code (silu.h): that two-call path's bits.
template <int MR, int NR>
void store_silu_mul(const Tile& t, const __m512 (&acc)[MR][NR]) {
  for (int j = 0; j < NR / 2; ++j) {
    const int cols = t.cols - j * kPanel;
    if (cols <= 0) break;
    const __mmask16 m = cols >= kPanel ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << cols) - 1);
    for (int i = 0; i < MR; ++i)
      store_bf16x16(t.y + i * t.ldy + j * kPanel, silu_mul16(stored_bf16(acc[i][j]), stored_bf16(acc[i][j + NR / 2])),
                    m);
  }
}

// MR rows by NR panels; PAIRED: panels NR / 2.. are the up panels of panels 0.. (t.up elements on).
template <int MR, int NR, bool PAIRED = false>
void tile_kernel(const Tile& t) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j)
      acc[i][j] = t.first ? _mm512_setzero_ps() : _mm512_loadu_ps(t.partial + i * t.ldp + j * kPanel);
  int64_t at[NR];  // each panel's offset from t.w
  for (int j = 0; j < NR; ++j)
    at[j] = PAIRED && j >= NR / 2 ? t.up + (j - NR / 2) * t.panel_stride : j * t.panel_stride;
  const int64_t full = t.half_last ? t.pairs - 1 : t.pairs;
  const uint16_t* w = t.w;
  for (int64_t p = 0; p < full; ++p, w += kPanelPair) {
    __m512bh b[NR];
    for (int j = 0; j < NR; ++j) {
      b[j] = (__m512bh)_mm512_loadu_si512(w + at[j]);
      _mm_prefetch(reinterpret_cast<const char*>(w + at[j] + kPrefetchPairs * kPanelPair), _MM_HINT_T1);
    }
    if (t.pf)
      for (int j = t.pf_first; j < t.pf_end; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(t.pf + j * t.panel_stride + p * kPanelPair), _MM_HINT_T1);
    for (int i = 0; i < MR; ++i) {
      const __m512bh a = (__m512bh)pair_at(t.x + i * t.ldx + 2 * p);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
    }
  }
  if (t.half_last) {
    for (int i = 0; i < MR; ++i) {
      const __m512bh a = (__m512bh)half_pair_at(t.x + i * t.ldx + 2 * full);
      for (int j = 0; j < NR; ++j)
        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, (__m512bh)_mm512_loadu_si512(w + at[j]));
    }
  }
  if (!t.last) {
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) _mm512_storeu_ps(t.partial + i * t.ldp + j * kPanel, acc[i][j]);
    return;
  }
  if constexpr (PAIRED) {
    store_silu_mul<MR, NR>(t, acc);
    return;
  }
  for (int j = 0; j < NR; ++j) {
    const int cols = t.cols - j * kPanel;
    if (cols <= 0) break;
    const __m512 bias = t.bias ? load_bias(t.bias, j * kPanel, cols) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i) store_bf16(t.y + i * t.ldy + j * kPanel, _mm512_add_ps(acc[i][j], bias), cols);
  }
}

using TileFn = void (*)(const Tile&);

// MR x NR register tiles: MR * NR <= 24 accumulators plus NR weight registers and one broadcast fit in 32 zmm.
// Panels are walked in groups of kMaxNR, or of kWideNR when M <= kWideRows: at one or two rows the tile is bound
// by memory, and 8 panel streams at once keep more of it in flight than 4.
constexpr int kMaxMR = 8;
constexpr int kMaxNR = 4;
constexpr int kWideNR = 8;
constexpr int kWideRows = 2;

template <int MR>
constexpr TileFn row_of_tiles(int nr) {
  if constexpr (MR <= kWideRows) {
    if (nr > kMaxNR) return nr == 5 ? tile_kernel<MR, 5> : nr == 6 ? tile_kernel<MR, 6> : nr == 7 ? tile_kernel<MR, 7>
                                                                                       : tile_kernel<MR, 8>;
  }
  return nr == 1 ? tile_kernel<MR, 1> : nr == 2 ? tile_kernel<MR, 2> : nr == 3 ? tile_kernel<MR, 3>
                                                                                 : tile_kernel<MR, (MR > 6 ? 3 : 4)>;
}

TileFn tile_fn(int mr, int nr, const float* /*wide: no widened path here*/) {
  switch (mr) {
    case 1: return row_of_tiles<1>(nr);
    case 2: return row_of_tiles<2>(nr);
    case 3: return row_of_tiles<3>(nr);
    case 4: return row_of_tiles<4>(nr);
    case 5: return row_of_tiles<5>(nr);
    case 6: return row_of_tiles<6>(nr);
    case 7: return row_of_tiles<7>(nr);
    default: return row_of_tiles<8>(nr);
  }
}

inline int max_nr(int mr, const float* = nullptr) { return mr > 6 ? 3 : mr <= kWideRows ? kWideNR : kMaxNR; }

// Paired tiles (the gate/up entry): `pairs` gate panels and their up panels, at most 24 accumulators as above.
template <int MR>
constexpr TileFn paired_tiles(int pairs) {
  if constexpr (MR <= kWideRows) {
    if (pairs > kMaxNR / 2) return pairs == 3 ? tile_kernel<MR, 6, true> : tile_kernel<MR, 8, true>;
  }
  if constexpr (MR > 6) return tile_kernel<MR, 2, true>;
  return pairs == 1 ? tile_kernel<MR, 2, true> : tile_kernel<MR, 4, true>;
}

TileFn paired_tile_fn(int mr, int pairs) {
  switch (mr) {
    case 1: return paired_tiles<1>(pairs);
    case 2: return paired_tiles<2>(pairs);
    case 3: return paired_tiles<3>(pairs);
    case 4: return paired_tiles<4>(pairs);
    case 5: return paired_tiles<5>(pairs);
    case 6: return paired_tiles<6>(pairs);
    case 7: return paired_tiles<7>(pairs);
    default: return paired_tiles<8>(pairs);
  }
}

inline int max_pairs(int mr) { return mr > 6 ? 1 : max_nr(mr) / 2; }  // gate panels of a paired tile
inline int group_width(int64_t m) { return m <= kWideRows ? kWideNR : kMaxNR; }

// Row groups of an M block: one group of m rows when m <= 8 (small M: every weight line used by every row in one
// pass), else groups of 6 with the remainder folded into the last group(s) as 7 or 8 rows where it can be.
int next_rows(int64_t left, const float* = nullptr) {
  if (left <= kMaxMR) return static_cast<int>(left);
  if (left == 9) return 5;  // 5 + 4
  return 6;
}

// The dot products take bf16 as it lies: no block is widened to float32 (packed_gemm_avx2.h widens).
inline int64_t widened_floats(int64_t, int, int64_t) { return 0; }
inline const float* widen_block(const uint16_t*, int64_t, int, int64_t, int64_t, float*) { return nullptr; }

}  // namespace

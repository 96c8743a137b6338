// Flash-style bfloat16 attention for a tile of query tokens of one request and one kv head, reading K/V straight
// from the paged cache (prompt chunks, speculative chains and draft trees).
//
// The tile's query vectors (up to kFlashQueries = tokens x grouped heads) share every K/V load. Keys go by in tiles
// of 32: K is transposed into bf16 pairs along the head dimension (kt[pair][key]), so one _mm512_dpbf16_ps adds a
// pair's products for 16 keys at once against a broadcast pair of the query; V is interleaved in key pairs
// (vp[key pair][d]), so P·V is a dpbf16 of a broadcast pair of probabilities against 16 head dimensions. Scores,
// running max, running sum and the output accumulate in float32 (an online softmax); probabilities are rounded to
// bfloat16 for P·V as flash attention does. The interleave leaves the head dimensions of the accumulator in a
// fixed permuted order, undone when the output is written. Oracle: attention/torch_ref.py.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "fp8.h"  // ops/csrc
#include "paged_common.h"
#include "simd_exp.h"  // ops/csrc: exp2_16

#if defined(__AVX512BF16__)
namespace pagellm {

constexpr int kFlashKeys = 32;
constexpr int kFlashQueries = kTileQueries;

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// 32 consecutive elements of a K/V row as bfloat16 (an fp8 cache's widened exactly, fp8.h).
inline __m512i load32_bf16(const BFloat16* p) { return _mm512_loadu_si512(p); }
inline __m512i load32_bf16(const Fp8E4M3* p) { return fp8_load32_bf16(p); }
inline __m512i load32_bf16(const Fp8E5M2* p) { return fp8_load32_bf16(p); }

// 16 x 16 transpose of 32-bit elements (rows in, columns out).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + j]: column j of each 128-bit lane, rows i..i+3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i even0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88), odd0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xdd);
    const __m512i even1 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
    const __m512i odd1 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xdd);
    t[j] = _mm512_shuffle_i32x4(even0, even1, 0x88);       // column j
    t[8 + j] = _mm512_shuffle_i32x4(even0, even1, 0xdd);   // column 8 + j
    t[4 + j] = _mm512_shuffle_i32x4(odd0, odd1, 0x88);     // column 4 + j
    t[12 + j] = _mm512_shuffle_i32x4(odd0, odd1, 0xdd);    // column 12 + j
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

template <int D>
struct FlashTile {
  static constexpr int DP = D / 2;   // bf16 pairs per row
  static constexpr int DV = D / 16;  // float vectors per row
  alignas(64) __m512i kt[DP][2];     // K^T for keys 0-15 and 16-31 of the tile
  alignas(64) __m512i vp[kFlashKeys / 2][DV];
  alignas(64) float s[kFlashQueries][kFlashKeys];
  alignas(64) __m512i p2[kFlashQueries];  // probabilities as bf16, keys in order (= key pairs as dwords)
  alignas(64) float o[kFlashQueries][D];
  float m[kFlashQueries], l[kFlashQueries], corr[kFlashQueries];
};

// Key pairs [0, pairs) of V interleaved for dpbf16 (vp[key pair][d], see the top), a key past nk zero.
template <int D, typename KV>
inline void interleave_values(const KV* const* vrow, int nk, int pairs, __m512i (*vp)[D / 16]) {
  const __m512i zero = _mm512_setzero_si512();
  for (int kp = 0; kp < pairs; ++kp) {
    for (int c = 0; c < D / 32; ++c) {
      const __m512i a = 2 * kp < nk ? load32_bf16(vrow[2 * kp] + 32 * c) : zero;
      const __m512i b = 2 * kp + 1 < nk ? load32_bf16(vrow[2 * kp + 1] + 32 * c) : zero;
      vp[kp][2 * c] = _mm512_unpacklo_epi16(a, b);
      vp[kp][2 * c + 1] = _mm512_unpackhi_epi16(a, b);
    }
  }
}

template <int D, typename KV>
void pack_keys_values(FlashTile<D>& tile, const KV* const* krow, const KV* const* vrow, int nk) {
  const __m512i zero = _mm512_setzero_si512();
  for (int half = 0; half < 2; ++half) {
    if (half * 16 >= nk) {
      for (int p = 0; p < FlashTile<D>::DP; ++p) tile.kt[p][half] = zero;
      continue;
    }
    for (int c = 0; c < D / 32; ++c) {
      __m512i rows[16];
      for (int i = 0; i < 16; ++i) {
        const int key = half * 16 + i;
        rows[i] = key < nk ? load32_bf16(krow[key] + 32 * c) : zero;
      }
      transpose16(rows);
      for (int j = 0; j < 16; ++j) tile.kt[16 * c + j][half] = rows[j];
    }
  }
  interleave_values<D>(vrow, nk, (nk + 1) / 2, tile.vp);
}

// Scores of R query vectors against the tile's keys (HALVES = 1: keys 0-15 only), times scale (flash_tile's:
// the softmax scale times log2(e)).
template <int D, int R, int HALVES>
inline void qk_rows(FlashTile<D>& tile, const BFloat16* const* qrows, int first, float scale) {
  __m512 acc[R][HALVES];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < HALVES; ++h) acc[r][h] = _mm512_setzero_ps();
  for (int p = 0; p < FlashTile<D>::DP; ++p) {
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, qrows[first + r] + 2 * p, sizeof(pair));
      const __m512bh b = as_bh(_mm512_set1_epi32(pair));
      for (int h = 0; h < HALVES; ++h) acc[r][h] = _mm512_dpbf16_ps(acc[r][h], b, as_bh(tile.kt[p][h]));
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < HALVES; ++h) _mm512_store_ps(tile.s[first + r] + 16 * h, _mm512_mul_ps(acc[r][h], sc));
}

template <int D, int HALVES>
void qk_all(FlashTile<D>& tile, const BFloat16* const* qrows, int nq, float scale) {
  int first = 0;
  for (; first + 8 <= nq; first += 8) qk_rows<D, 8, HALVES>(tile, qrows, first, scale);
  switch (nq - first) {
    case 7: qk_rows<D, 7, HALVES>(tile, qrows, first, scale); break;
    case 6: qk_rows<D, 6, HALVES>(tile, qrows, first, scale); break;
    case 5: qk_rows<D, 5, HALVES>(tile, qrows, first, scale); break;
    case 4: qk_rows<D, 4, HALVES>(tile, qrows, first, scale); break;
    case 3: qk_rows<D, 3, HALVES>(tile, qrows, first, scale); break;
    case 2: qk_rows<D, 2, HALVES>(tile, qrows, first, scale); break;
    case 1: qk_rows<D, 1, HALVES>(tile, qrows, first, scale); break;
    default: break;
  }
}

// Online-softmax update of one query vector for this key tile (scores and maxima in log2 units: 2^(s - m) is
// e^((q·k - max) scale)); leaves its probabilities in p2 as bf16.
template <int D>
inline void softmax_row(FlashTile<D>& tile, int qv, uint32_t visible, float cap2) {
  if (visible == 0) {  // nothing to see in this tile: the update is the identity
    tile.corr[qv] = 1.f;
    tile.p2[qv] = _mm512_setzero_si512();
    return;
  }
  const __mmask16 lo = static_cast<__mmask16>(visible), hi = static_cast<__mmask16>(visible >> 16);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 s0 = _mm512_mask_load_ps(ninf, lo, tile.s[qv]);
  __m512 s1 = _mm512_mask_load_ps(ninf, hi, tile.s[qv] + 16);
  if (cap2 != 0.f) {  // Gemma 2's soft cap, in the scores' log2 units
    s0 = _mm512_mask_mov_ps(s0, lo, soft_cap16(s0, cap2));
    s1 = _mm512_mask_mov_ps(s1, hi, soft_cap16(s1, cap2));
  }
  const float new_max = std::max(tile.m[qv], _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
  const __m512 mx = _mm512_set1_ps(new_max);
  const __m512 p0 = _mm512_maskz_mov_ps(lo, exp2_16(_mm512_sub_ps(s0, mx)));
  const __m512 p1 = _mm512_maskz_mov_ps(hi, exp2_16(_mm512_sub_ps(s1, mx)));
  const float correction = std::exp2(tile.m[qv] - new_max);
  tile.l[qv] = tile.l[qv] * correction + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
  tile.m[qv] = new_max;
  tile.corr[qv] = correction;
  tile.p2[qv] = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
}

// o = o * corr + P · V for R query vectors over the tile's first npairs key pairs.
template <int D, int R>
inline void pv_rows(FlashTile<D>& tile, int first, int npairs) {
  constexpr int DV = FlashTile<D>::DV;
  __m512 acc[R][DV];
  for (int r = 0; r < R; ++r) {
    const __m512 c = _mm512_set1_ps(tile.corr[first + r]);
    for (int v = 0; v < DV; ++v) acc[r][v] = _mm512_mul_ps(_mm512_load_ps(tile.o[first + r] + 16 * v), c);
  }
  for (int kp = 0; kp < npairs; ++kp) {
    __m512bh b[R];
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, reinterpret_cast<const int32_t*>(&tile.p2[first + r]) + kp, sizeof(pair));
      b[r] = as_bh(_mm512_set1_epi32(pair));
    }
    for (int v = 0; v < DV; ++v) {
      const __m512bh val = as_bh(tile.vp[kp][v]);
      for (int r = 0; r < R; ++r) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], b[r], val);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < DV; ++v) _mm512_store_ps(tile.o[first + r] + 16 * v, acc[r][v]);
}

template <int D>
void pv_all(FlashTile<D>& tile, int nq, int npairs) {
  constexpr int R = D <= 64 ? 4 : 2;
  int first = 0;
  for (; first + R <= nq; first += R) pv_rows<D, R>(tile, first, npairs);
  for (; first < nq; ++first) pv_rows<D, 1>(tile, first, npairs);
}

// Undo the pair interleave (accumulator lane 4L + i of the low half holds dimension 8L + i, of the high half
// 8L + 4 + i, per 32 dimensions), divide by the running sum and store as bf16.
template <int D>
inline void write_row(const float* o, float l, BFloat16* out) {
  alignas(64) static const int32_t first_idx[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
  alignas(64) static const int32_t second_idx[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
  const __m512i i0 = _mm512_load_si512(first_idx), i1 = _mm512_load_si512(second_idx);
  const __m512 inv = _mm512_set1_ps(1.f / l);
  for (int c = 0; c < D / 32; ++c) {
    const __m512 lo = _mm512_mul_ps(_mm512_load_ps(o + 32 * c), inv);
    const __m512 hi = _mm512_mul_ps(_mm512_load_ps(o + 32 * c + 16), inv);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * c),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(lo, i0, hi)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * c + 16),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(lo, i1, hi)));
  }
}

// The K and V rows of kv head kv_head for keys [k0, k0 + nk) in the paged cache.
template <int D, typename KV>
inline void key_rows(const KV* k_cache, const KV* v_cache, const int64_t* blocks, int64_t k0, int nk,
                     int64_t block_size, int64_t token_stride, int64_t kv_head, const KV** krow, const KV** vrow) {
  // Block by block: one division for the tile, not one per key (a 64-bit division per key was ~10 % of a long
  // prompt's flash tiles).
  int64_t block = k0 / block_size, slot = k0 % block_size;
  int64_t base = blocks[block] * block_size * token_stride + kv_head * D;
  for (int key = 0; key < nk; ++key) {
    if (slot == block_size) {
      slot = 0;
      base = blocks[++block] * block_size * token_stride + kv_head * D;
    }
    krow[key] = k_cache + base + slot * token_stride;
    vrow[key] = v_cache + base + slot * token_stride;
    ++slot;
  }
}

// One work item: tokens [0, m) of a row (q, out: the first token's rows; token stride heads * D), kv head kv_head,
// each token's visibility in vis[]. m * group <= kFlashQueries. KV: the cache's element type (bf16 or fp8).
template <int D, typename KV>
void flash_tile(const BFloat16* q, const KV* k_cache, const KV* v_cache, const int64_t* blocks,
                const Visibility* vis, int m, int64_t group, int64_t heads, int64_t kv_heads, int64_t kv_head,
                int64_t block_size, float scale, BFloat16* out) {
  static thread_local FlashTile<D> tile;
  const int nq = static_cast<int>(m * group);
  const BFloat16* qrows[kFlashQueries];
  int64_t kend = 0, kbegin = vis[0].begin(block_size);
  for (int i = 0; i < m; ++i) {  // under a sliding window: from the first block any token sees (none before it)
    kend = std::max(kend, vis[i].kend);
    kbegin = std::min(kbegin, vis[i].begin(block_size));
  }
  for (int qv = 0; qv < nq; ++qv) {
    qrows[qv] = q + (qv / group) * heads * D + (kv_head * group + qv % group) * D;
    tile.m[qv] = -std::numeric_limits<float>::infinity();
    tile.l[qv] = 0.f;
    for (int v = 0; v < D / 16; ++v) _mm512_store_ps(tile.o[qv] + 16 * v, _mm512_setzero_ps());
  }
  const int64_t token_stride = kv_heads * D;
  const KV* krow[kFlashKeys];
  const KV* vrow[kFlashKeys];
  const float scale2 = scale * 1.44269504088896341f;  // scores in log2 units: the softmax takes 2^x (exp2_16)
  const float cap2 = vis[0].softcap * 1.44269504088896341f;  // Gemma 2's soft cap in those units (0: none)
  for (int64_t k0 = kbegin; k0 < kend; k0 += kFlashKeys) {
    const int nk = static_cast<int>(std::min<int64_t>(kFlashKeys, kend - k0));
    key_rows<D>(k_cache, v_cache, blocks, k0, nk, block_size, token_stride, kv_head, krow, vrow);
    pack_keys_values<D>(tile, krow, vrow, nk);
    if (nk > 16) qk_all<D, 2>(tile, qrows, nq, scale2);
    else qk_all<D, 1>(tile, qrows, nq, scale2);
    for (int i = 0; i < m; ++i) {
      const uint32_t visible = vis[i].mask(k0, nk);
      for (int g = 0; g < group; ++g) softmax_row<D>(tile, static_cast<int>(i * group + g), visible, cap2);
    }
    pv_all<D>(tile, nq, (nk + 1) / 2);
  }
  for (int qv = 0; qv < nq; ++qv) {  // m in log2 units: its natural value is m ln 2
    const int64_t head = kv_head * group + qv % group;
    const float l = tile.l[qv] + vis[0].sink_term(head, tile.m[qv] * 0.693147180559945309f);
    write_row<D>(tile.o[qv], l, out + (qv / group) * heads * D + head * D);
  }
}

}  // namespace pagellm
#endif

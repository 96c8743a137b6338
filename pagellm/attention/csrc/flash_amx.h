// The flash tiles on Intel AMX (CPUs with AMX-BF16): the same work items, visibility, online softmax in float32
// and bf16 probabilities as flash_bf16.h, with both products on AMX tiles and the softmax laid out for them.
//
// Scores are computed transposed, S^T = K · Q^T: the A operand is the key tile's K rows as they are (read in place
// from the cache where a block holds 16 consecutive keys of the tile, else copied out of their blocks into one
// 32-row buffer), the B operand the item's query vectors transposed into bf16 pairs along the head dimension
// (qt[pair][query], made once per item), so one TDPBF16PS gives 16 keys x 16 query vectors over 32 head
// dimensions. With keys in rows and query vectors in lanes, the softmax of 16 query vectors is vertical: running
// max, exponentials (2^x, simd_exp.h's exp2_16) and sums are plain vector operations over the tile's keys (no
// horizontal reductions, no scalar exp per query vector). The probabilities are rounded to bfloat16, paired by key
// and transposed into P rows (p2[query][key pair]), the A operand of O += P · V, whose B operand is V interleaved in
// key pairs (vp[key pair][d], as flash_bf16.h packs it), so the output's head dimensions come out in the flash
// tiles' permuted order and write_row undoes it. The two paths differ only in the order float32 sums are added
// (tests/kernels/test_cpu_paged.py compares them). Oracle: attention/torch_ref.py.
#pragma once

#include "flash_bf16.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PAGELLM_FLASH_AMX 1
#include <atomic>

#include "amx_tiles.h"  // ops/csrc: the tile grant and configuration

namespace pagellm {

// Whether flash tiles run on AMX in this process (pagellm_paged_attention_use_amx): set once at load.
inline std::atomic<bool>& flash_amx() {
  static std::atomic<bool> on{false};
  return on;
}

using pagellm_amx::permitted;

constexpr int kGroups = kFlashQueries / 16;  // 16-query-vector groups of a work item

template <int D>
struct FlashAmxTile {
  static constexpr int DP = D / 2, DV = D / 16;
  alignas(64) uint32_t qt[kGroups][DP][16];          // Q^T: bf16 pairs along the head dimension, one lane a query
  alignas(64) BFloat16 kbuf[kFlashKeys][D];           // the key tile's K rows (zero past its keys)
  alignas(64) __m512i vp[kFlashKeys / 2][DV];         // V interleaved in key pairs (zero past its keys)
  alignas(64) float st[kGroups][kFlashKeys][16];      // S^T, then the probabilities, per group
  alignas(64) __m512i p2[kFlashQueries];              // P rows: a query vector's bf16 probabilities, key pairs
  alignas(64) float o[kFlashQueries][D];
  alignas(64) float m[kFlashQueries], l[kFlashQueries], corr[kFlashQueries];
  alignas(64) uint32_t vis[kFlashQueries];            // visible keys of the tile, per query vector
  bool rescale[kGroups];                              // a group's o needs its corr (some maximum grew)
};

// Q^T of the item's nq query vectors (zero lanes past nq), 32 head dimensions at a time: 16 rows of 16 pairs,
// transposed.
template <int D>
void transpose_queries(FlashAmxTile<D>& tile, const BFloat16* const* qrows, int nq) {
  for (int g = 0; g < kGroups && 16 * g < nq; ++g) {
    for (int c = 0; c < D / 32; ++c) {
      __m512i rows[16];
      for (int i = 0; i < 16; ++i)
        rows[i] = 16 * g + i < nq ? _mm512_loadu_si512(qrows[16 * g + i] + 32 * c) : _mm512_setzero_si512();
      transpose16(rows);
      for (int j = 0; j < 16; ++j) _mm512_store_si512(tile.qt[g][16 * c + j], rows[j]);
    }
  }
}

// Where the scores read the key tile's K rows: each half's 16 rows in place in the cache, when a half is one
// block's 16 consecutive slots (blocks of a multiple of 16 slots; a half past nk reads the first half again, and
// rows past nk are never read back), else copied into kbuf (rows past nk zero).
struct KeyRows {
  const BFloat16* half[2];
  int64_t stride;  // bytes from one key's row to the next
};

// The key tile's K rows (KeyRows) and V into key pairs (rows past nk zero).
template <int D>
KeyRows load_keys_values(FlashAmxTile<D>& tile, const BFloat16* const* krow, const BFloat16* const* vrow, int nk,
                         int64_t block_size, int64_t token_stride) {
  interleave_values<D>(vrow, nk, kFlashKeys / 2, tile.vp);  // every pair: the tile's B operand is all 16
  if (block_size % 16 == 0)
    return {{krow[0], nk > 16 ? krow[16] : krow[0]}, token_stride * int64_t{sizeof(BFloat16)}};
  for (int key = 0; key < kFlashKeys; ++key) {
    if (key < nk) std::memcpy(tile.kbuf[key], krow[key], D * sizeof(BFloat16));
    else std::memset(tile.kbuf[key], 0, D * sizeof(BFloat16));
  }
  return {{tile.kbuf[0], tile.kbuf[16]}, D * int64_t{sizeof(BFloat16)}};
}

// S^T of group g: keys 0-15 in C0 and 16-31 in C1, over D / 32 steps of 32 head dimensions.
template <int D>
void scores_amx(FlashAmxTile<D>& tile, const KeyRows& keys, int g) {
  _tile_zero(0);
  _tile_zero(1);
  for (int step = 0; step < D / 32; ++step) {
    _tile_loadd(4, keys.half[0] + 32 * step, keys.stride);
    _tile_loadd(5, keys.half[1] + 32 * step, keys.stride);
    _tile_loadd(6, tile.qt[g][16 * step], 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
  }
  _tile_stored(0, tile.st[g][0], 64);
  _tile_stored(1, tile.st[g][16], 64);
}

// The online-softmax update of group g's 16 query vectors for this key tile (lanes past nq carry nothing), and
// their probabilities as P rows in p2. m holds each query vector's largest raw score q·k (scale > 0 keeps the
// order), so a score is scaled inside its exponent, e^(s scale - m scale), and a tile that every lane sees whole
// (most of a long prompt's) takes no masks.
template <int D>
void softmax_group(FlashAmxTile<D>& tile, int g, int nk, float scale, float cap) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  if (cap != 0.f)  // Gemma 2's soft cap, in raw units (cap / scale); invisible keys are masked below
    for (int k = 0; k < nk; ++k) _mm512_store_ps(tile.st[g][k], soft_cap16(_mm512_load_ps(tile.st[g][k]), cap));
  const __m512i vis = _mm512_load_si512(tile.vis + 16 * g);
  const uint32_t all = nk >= 32 ? ~0u : (1u << nk) - 1;
  const bool whole = _mm512_cmpneq_epi32_mask(_mm512_and_si512(vis, _mm512_set1_epi32(int32_t(all))),
                                              _mm512_set1_epi32(int32_t(all))) == 0;
  const __m512 m_old = _mm512_load_ps(tile.m + 16 * g);
  __m512 mx = m_old;
  if (whole) {
    for (int k = 0; k < nk; ++k) mx = _mm512_max_ps(mx, _mm512_load_ps(tile.st[g][k]));
  } else {
    for (int k = 0; k < nk; ++k) {  // invisible keys count as -inf (their probabilities are masked below)
      const __mmask16 seen = _mm512_test_epi32_mask(vis, _mm512_set1_epi32(int32_t(1u << k)));
      mx = _mm512_max_ps(mx, _mm512_mask_mov_ps(ninf, seen, _mm512_load_ps(tile.st[g][k])));
    }
  }
  // Lanes whose maximum grew rescale (from -inf: by ~0, their sums and outputs are still 0); the others keep 1.
  // e^((s - m) scale) as 2^(s c - m c), c = scale log2(e); an invisible key's is masked to 0 below.
  const __m512 c2 = _mm512_set1_ps(scale * 1.44269504088896341f);
  const __mmask16 grew = _mm512_cmp_ps_mask(mx, m_old, _CMP_NEQ_OQ);
  const __m512 corr =
      _mm512_mask_mov_ps(_mm512_set1_ps(1.f), grew, exp2_16(_mm512_mul_ps(_mm512_sub_ps(m_old, mx), c2)));
  const __m512 shift = _mm512_mul_ps(mx, c2);
  __m512 sum = _mm512_setzero_ps();
  // Key pairs as 16 bf16 pairs, lane q = (p[q][2 kp], p[q][2 kp + 1]): the two keys' 16 lanes rounded in one
  // instruction, then interleaved.
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  __m512i pairs[16];
  for (int kp = 0; kp < kFlashKeys / 2; ++kp) {
    __m512 p[2];
    for (int half = 0; half < 2; ++half) {
      const int k = 2 * kp + half;
      p[half] = k < nk ? exp2_16(_mm512_fmsub_ps(_mm512_load_ps(tile.st[g][k]), c2, shift)) : _mm512_setzero_ps();
      if (!whole && k < nk)
        p[half] = _mm512_maskz_mov_ps(_mm512_test_epi32_mask(vis, _mm512_set1_epi32(int32_t(1u << k))), p[half]);
      sum = _mm512_add_ps(sum, p[half]);
    }
    pairs[kp] = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
  }
  transpose16(pairs);  // pairs[q]: query vector q's key pairs
  for (int q = 0; q < 16; ++q) tile.p2[16 * g + q] = pairs[q];
  _mm512_store_ps(tile.l + 16 * g, _mm512_fmadd_ps(_mm512_load_ps(tile.l + 16 * g), corr, sum));
  _mm512_store_ps(tile.m + 16 * g, mx);
  _mm512_store_ps(tile.corr + 16 * g, corr);
  tile.rescale[g] = grew != 0;
}

// o = o * corr + P · V for every query vector (rows of a group past nq: zero P, zero o).
template <int D>
void values_amx(FlashAmxTile<D>& tile, int nq) {
  constexpr int DV = FlashAmxTile<D>::DV;
  for (int qv = 0; qv < nq; ++qv) {
    if (!tile.rescale[qv / 16]) {  // every corr of the group is 1: o stays as it is
      qv += 15;
      continue;
    }
    const __m512 c = _mm512_set1_ps(tile.corr[qv]);
    for (int v = 0; v < DV; ++v)
      _mm512_store_ps(tile.o[qv] + 16 * v, _mm512_mul_ps(_mm512_load_ps(tile.o[qv] + 16 * v), c));
  }
  constexpr int64_t kVLine = DV * 64;  // bytes from vp[kp][v] to vp[kp + 1][v]
  for (int r = 0; r < nq; r += 16) {
    _tile_loadd(4, &tile.p2[r], 64);
    for (int v = 0; v < DV; v += 2) {
      _tile_loadd(0, tile.o[r] + 16 * v, D * 4);
      _tile_loadd(1, tile.o[r] + 16 * (v + 1), D * 4);
      _tile_loadd(6, &tile.vp[0][v], kVLine);
      _tile_loadd(7, &tile.vp[0][v + 1], kVLine);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_stored(0, tile.o[r] + 16 * v, D * 4);
      _tile_stored(1, tile.o[r] + 16 * (v + 1), D * 4);
    }
  }
}

// flash_tile (flash_bf16.h) on AMX: the same arguments and result.
template <int D>
void flash_tile_amx(const BFloat16* q, const BFloat16* k_cache, const BFloat16* v_cache, const int64_t* blocks,
                    const Visibility* vis, int m, int64_t group, int64_t heads, int64_t kv_heads, int64_t kv_head,
                    int64_t block_size, float scale, BFloat16* out) {
  static thread_local FlashAmxTile<D> tile;
  const int nq = static_cast<int>(m * group);
  const int padded = (nq + 15) / 16 * 16;
  const BFloat16* qrows[kFlashQueries];
  int64_t kend = 0, kbegin = vis[0].begin(block_size);
  for (int i = 0; i < m; ++i) {  // under a sliding window: from the first block any token sees (none before it)
    kend = std::max(kend, vis[i].kend);
    kbegin = std::min(kbegin, vis[i].begin(block_size));
  }
  for (int qv = 0; qv < padded; ++qv) {
    if (qv < nq) qrows[qv] = q + (qv / group) * heads * D + (kv_head * group + qv % group) * D;
    tile.m[qv] = -std::numeric_limits<float>::infinity();
    tile.l[qv] = 0.f;
    tile.vis[qv] = 0;
    for (int v = 0; v < D / 16; ++v) _mm512_store_ps(tile.o[qv] + 16 * v, _mm512_setzero_ps());
  }
  pagellm_amx::configure(16);  // every tile 16 rows of 64 bytes: C 0-1, A 4-5, B 6-7
  transpose_queries<D>(tile, qrows, nq);
  const int64_t token_stride = kv_heads * D;
  const BFloat16* krow[kFlashKeys];
  const BFloat16* vrow[kFlashKeys];
  for (int64_t k0 = kbegin; k0 < kend; k0 += kFlashKeys) {
    const int nk = static_cast<int>(std::min<int64_t>(kFlashKeys, kend - k0));
    key_rows<D>(k_cache, v_cache, blocks, k0, nk, block_size, token_stride, kv_head, krow, vrow);
    const KeyRows keys = load_keys_values<D>(tile, krow, vrow, nk, block_size, token_stride);
    for (int i = 0; i < m; ++i) {
      const uint32_t visible = vis[i].mask(k0, nk);
      for (int g = 0; g < group; ++g) tile.vis[i * group + g] = visible;
    }
    // Group g + 1's score products go to the tiles before group g's softmax runs, so the two overlap.
    scores_amx<D>(tile, keys, 0);
    for (int g = 0; 16 * g < nq; ++g) {
      if (16 * (g + 1) < nq) scores_amx<D>(tile, keys, g + 1);
      softmax_group<D>(tile, g, nk, scale, vis[0].softcap / scale);
    }
    values_amx<D>(tile, nq);
  }
  _tile_release();
  for (int qv = 0; qv < nq; ++qv) {  // m in unscaled scores: its natural value is m scale
    const int64_t head = kv_head * group + qv % group;
    const float l = tile.l[qv] + vis[0].sink_term(head, tile.m[qv] * scale);
    write_row<D>(tile.o[qv], l, out + (qv / group) * heads * D + head * D);
  }
}

}  // namespace pagellm
#endif

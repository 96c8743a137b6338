// The paged attention kernels (see paged_attention.cpp for what they do) and PAGELLM_ENTRY, which exports one
// (query type, cache type) pair as a C entry point. Included by paged_attention.cpp (the model-dtype caches) and
// paged_attention_fp8.cpp (the 8-bit caches, a library of its own, built only when an fp8 cache is asked for).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "flash_amx.h"
#include "flash_bf16.h"
#include "paged_common.h"
#include "walk_avx2.h"
#include "walk_bf16.h"
#include "walk_f32.h"
#include "simd_exp.h"  // ops/csrc: exp16

namespace pagellm {
namespace {

// The bfloat16 walk (walk_bf16.h) for its shapes (head_dim 64 or 128, the group sizes below); false otherwise.
template <typename KV>
inline bool walk_bf16_shape(int64_t, int64_t, const float*, const KV*, const KV*, const int64_t*,
                            const Visibility&, int64_t, int64_t, int64_t, float, float*) {
  return false;  // float32 rows keep the float32 walk (bitwise independent of their row)
}
template <typename KV>
inline bool walk_bf16_shape(int64_t head_dim, int64_t group, const BFloat16* q, const KV* k, const KV* v,
                            const int64_t* blocks, const Visibility& vis, int64_t block_size, int64_t kv_heads,
                            int64_t kv_head, float scale, BFloat16* out) {
#if defined(__AVX512BF16__)
#define PAGELLM_SHAPE(D_, G_)                                                                          \
  if (head_dim == D_ && group == G_) {                                                                 \
    walk_bf16<D_, G_, KV>(q, k, v, blocks, vis, block_size, kv_heads, kv_head, scale, out);            \
    return true;                                                                                       \
  }
  PAGELLM_SHAPE(64, 1) PAGELLM_SHAPE(64, 2) PAGELLM_SHAPE(64, 3) PAGELLM_SHAPE(64, 4) PAGELLM_SHAPE(64, 6)
  PAGELLM_SHAPE(64, 7) PAGELLM_SHAPE(64, 8)
  PAGELLM_SHAPE(128, 1) PAGELLM_SHAPE(128, 2) PAGELLM_SHAPE(128, 3) PAGELLM_SHAPE(128, 4) PAGELLM_SHAPE(128, 5)
  PAGELLM_SHAPE(128, 6) PAGELLM_SHAPE(128, 7) PAGELLM_SHAPE(128, 8)
#undef PAGELLM_SHAPE
#else
  (void)head_dim, (void)group, (void)q, (void)k, (void)v, (void)blocks, (void)vis, (void)block_size;
  (void)kv_heads, (void)kv_head, (void)scale, (void)out;
#endif
  return false;
}

// One token, one kv head: the fastest walk that serves the shape. KV: the cache's element type (T, or fp8 under
// bfloat16 queries).
template <typename T, typename KV>
void walk(const T* q, const KV* k, const KV* v, const int64_t* blocks, const Visibility& vis, int64_t block_size,
          int64_t kv_heads, int64_t group, int64_t head_dim, int64_t kv_head, float scale, T* out) {
  if (walk_bf16_shape(head_dim, group, q, k, v, blocks, vis, block_size, kv_heads, kv_head, scale, out)) return;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, KV>) {  // an fp8 cache's other shapes take walk_vec (fewer instantiations)
    if (head_dim % 16 == 0 &&
        walk_fixed_shape<T, KV>(head_dim / 16, group, q, k, v, blocks, vis, block_size, kv_heads, kv_head, scale,
                                out))
      return;
  }
  if (head_dim % 16 == 0 && head_dim <= 256 && group <= 16) {
    walk_vec<T, KV>(q, k, v, blocks, vis, block_size, kv_heads, group, head_dim, kv_head, scale, out);
    return;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (head_dim % 8 == 0 && head_dim <= kWalkMaxDim && group <= kWalkMaxGroup) {
    walk_avx2<T, KV>(q, k, v, blocks, vis, block_size, kv_heads, group, head_dim, kv_head, scale, out);
    return;
  }
#endif
  walk_scalar<T, KV>(q, k, v, blocks, vis, block_size, kv_heads, group, head_dim, kv_head, scale, out);
}

struct Step {
  int64_t rows, heads, head_dim, block_size, kv_heads, max_blocks, tree_words, flash_min_tokens;
  const int64_t* block_table;   // [rows, max_blocks]
  const int64_t* query_start;   // [rows + 1]
  const int64_t* seq_lens;      // [rows]
  const int64_t* ctx_end;       // [T]
  const int64_t* ctx_start;     // [T] first key inside a sliding window, or null (no window)
  const uint64_t* tree_bits;    // [T, tree_words] or null
  float scale;
  const float* sinks = nullptr;  // [heads] gpt-oss's attention sinks, or null
  float softcap = 0.f;           // Gemma 2's attention logit soft cap, or 0
};

struct Item {
  int64_t row, kv_head, first, count;  // kv_head < 0: the walk over all kv heads; else one kv head's walk or tile
  int64_t cost;
  bool flash;
};

inline bool flash_fits(const Step& st, int64_t group, bool bf16) {
#if defined(__AVX512BF16__)
  return bf16 && (st.head_dim == 64 || st.head_dim == 128) && group <= kFlashQueries;
#else
  (void)st, (void)group, (void)bf16;
  return false;
#endif
}

// The step's work, most expensive first (a dynamic schedule then balances the threads).
std::vector<Item> plan(const Step& st, bool bf16) {
  const int64_t group = st.heads / st.kv_heads;
  const bool flash = flash_fits(st, group, bf16);
  const int64_t tile = std::max<int64_t>(1, kTileQueries / group);
  // Few walked tokens (small decode batches): one item per (token, kv head), so every thread has work. A kv
  // head's walk is the same code either way, so the split changes no result.
  int64_t walked = 0;
  for (int64_t r = 0; r < st.rows; ++r) {
    const int64_t n = st.query_start[r + 1] - st.query_start[r];
    walked += flash && n >= st.flash_min_tokens ? 0 : n;
  }
  const bool per_head = walked < 4 * omp_get_max_threads();
  std::vector<Item> items;
  for (int64_t r = 0; r < st.rows; ++r) {
    const int64_t first = st.query_start[r], n = st.query_start[r + 1] - first, kend = st.seq_lens[r];
    if (flash && n >= st.flash_min_tokens) {
      for (int64_t t = 0; t < n; t += tile) {
        const int64_t count = std::min(tile, n - t);
        for (int64_t h = 0; h < st.kv_heads; ++h) items.push_back({r, h, first + t, count, count * kend, true});
      }
    } else {
      for (int64_t t = 0; t < n; ++t) {
        if (!per_head) items.push_back({r, -1, first + t, 1, st.kv_heads * kend, false});
        for (int64_t h = 0; per_head && h < st.kv_heads; ++h) items.push_back({r, h, first + t, 1, kend, false});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  return items;
}

#if defined(__AVX512BF16__)
// One flash work item on the path this process runs: AMX tiles where switched on, else AVX-512 BF16.
// An fp8 cache's tiles stay on AVX-512 BF16 (the AMX tiles read bfloat16 rows).
template <int D, typename KV>
inline void flash_tile_on_path(const BFloat16* q, const KV* k, const KV* v, const int64_t* blocks,
                               const Visibility* vis, int m, int64_t group, const Step& st, int64_t kv_head,
                               BFloat16* out) {
#if defined(PAGELLM_FLASH_AMX)
  if constexpr (std::is_same_v<KV, BFloat16>) {
    if (flash_amx().load(std::memory_order_relaxed)) {
      flash_tile_amx<D>(q, k, v, blocks, vis, m, group, st.heads, st.kv_heads, kv_head, st.block_size, st.scale,
                        out);
      return;
    }
  }
#endif
  flash_tile<D, KV>(q, k, v, blocks, vis, m, group, st.heads, st.kv_heads, kv_head, st.block_size, st.scale, out);
}
#endif

// Flash tiles serve bfloat16 only (plan() never makes one for float32).
template <typename KV>
inline void flash_item(const Step&, const Item&, const float*, const KV*, const KV*, const int64_t*,
                       const Visibility*, float*) {}
template <typename KV>
inline void flash_item(const Step& st, const Item& item, const BFloat16* q, const KV* k, const KV* v,
                       const int64_t* blocks, const Visibility* vis, BFloat16* out) {
#if defined(__AVX512BF16__)
  const int64_t group = st.heads / st.kv_heads;
  const int m = static_cast<int>(item.count);
  if (st.head_dim == 64)
    flash_tile_on_path<64>(q, k, v, blocks, vis, m, group, st, item.kv_head, out);
  else
    flash_tile_on_path<128>(q, k, v, blocks, vis, m, group, st, item.kv_head, out);
#else
  (void)st, (void)item, (void)q, (void)k, (void)v, (void)blocks, (void)vis, (void)out;
#endif
}

template <typename T, typename KV>
void run_item(const Step& st, const Item& item, const T* q, const KV* k, const KV* v, T* out) {
  const int64_t group = st.heads / st.kv_heads;
  const int64_t win = st.seq_lens[item.row] - (st.query_start[item.row + 1] - st.query_start[item.row]);
  const int64_t* blocks = st.block_table + item.row * st.max_blocks;
  Visibility vis[kTileQueries];
  for (int64_t i = 0; i < item.count; ++i) {
    vis[i] = token_visibility(st.ctx_end, st.ctx_start, st.tree_bits, st.tree_words, item.first + i, win);
    vis[i].sinks = st.sinks;
    vis[i].softcap = st.softcap;
  }
  const int64_t offset = item.first * st.heads * st.head_dim;
  if (item.flash) {
    flash_item(st, item, q + offset, k, v, blocks, vis, out + offset);
    return;
  }
  const int64_t h0 = item.kv_head < 0 ? 0 : item.kv_head, h1 = item.kv_head < 0 ? st.kv_heads : item.kv_head + 1;
  const int64_t kend = vis[0].kend, token_stride = st.kv_heads * st.head_dim;
  const int64_t first_block = vis[0].begin(st.block_size) / st.block_size;
  for (int64_t h = h0; h < h1; ++h) {
#if defined(__AVX512F__)
    if (h + 1 < h1)  // the next head's first blocks, while this head walks
      for (int64_t b = first_block; b < first_block + kPrefetchBlocks && b * st.block_size < kend; ++b)
        prefetch_block(k, v, blocks, b, kend, st.block_size, token_stride, h + 1, st.head_dim);
#endif
    const int64_t head = offset + h * group * st.head_dim;
    walk<T, KV>(q + head, k, v, blocks, vis[0], st.block_size, st.kv_heads, group, st.head_dim, h, st.scale,
                out + head);
  }
}

template <typename T, typename KV>
void run_step(const Step& st, const T* q, const KV* k, const KV* v, T* out, bool bf16) {
  const std::vector<Item> items = plan(st, bf16);
  const int64_t n = static_cast<int64_t>(items.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) run_item<T, KV>(st, items[i], q, k, v, out);
}

}  // namespace
}  // namespace pagellm

// q, out: [T, H, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D]; block_table: [rows, max_blocks];
// query_start: [rows + 1]; seq_lens: [rows] (context length including the row's query tokens); ctx_end: [T] (each
// token sees the keys before it); ctx_start: [T] (under a sliding window, each token's first key) or null (no
// window); tree_bits: [T, tree_words] bits over its row's own query tokens, or null. All int64 and contiguous; H a
// multiple of KVH. Rows of at least flash_min_tokens tokens take flash tiles (bf16). sinks: [H] float32 logits that
// join each query head's softmax denominator (gpt-oss's attention sinks), or null; softcap: each scaled score
// becomes softcap * tanh(score / softcap) before the softmax (Gemma 2's), or 0.
// TYPE: q and out; KV: the caches' elements (TYPE, or an 8-bit float of ops/csrc/fp8.h under either query type).
#define PAGELLM_ENTRY(NAME, TYPE, KV, BF16)                                                                       \
  void NAME(const void* q, const void* k_cache, const void* v_cache, const int64_t* block_table,                \
            const int64_t* query_start, const int64_t* seq_lens, const int64_t* ctx_end, const int64_t* ctx_start, \
            const uint64_t* tree_bits, int64_t tree_words, int64_t rows, int64_t heads, int64_t head_dim,       \
            int64_t block_size, int64_t kv_heads, int64_t max_blocks, int64_t flash_min_tokens, float scale,    \
            void* out, const float* sinks, float softcap) {                                                      \
    const pagellm::Step st{rows, heads, head_dim, block_size, kv_heads, max_blocks, tree_words, flash_min_tokens, \
                           block_table, query_start, seq_lens, ctx_end, ctx_start, tree_bits, scale, sinks,      \
                           softcap};                                                                             \
    pagellm::run_step<TYPE, KV>(st, static_cast<const TYPE*>(q), static_cast<const KV*>(k_cache),               \
                                static_cast<const KV*>(v_cache), static_cast<TYPE*>(out), BF16);                 \
  }

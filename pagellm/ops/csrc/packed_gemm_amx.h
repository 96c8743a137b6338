// The packed bfloat16 GEMM on Intel AMX tiles: the same packed weight, the same y = x · Wᵀ (+ bias), for CPUs with
// AMX-BF16 (included by packed_gemm.cpp after its Problem and store helpers; compiled only where -march=native has
// AMX, used only where the kernel grants the process the tile data state).
//
// The packed layout is already AMX's B operand: 16 consecutive k-pairs of one panel are 16 lines of 64 bytes
// (16 columns x 2), one B tile loaded with a 64-byte stride. An A tile is 16 rows of x, 32 elements (16 pairs)
// each, read in place with x's row stride. One TDPBF16PS adds the 16 pairs of a 16 x 16 block of outputs into a
// float32 C tile. Tiles: C 0-3 (two row tiles x two panels), A 4-5, B 6-7; per K step two A and two B loads feed
// four products, each operand used twice. Of a pair's weights and a block's x rows, the one each block reads once is
// loaded with TILELOADDT1 (stream_for), and each thread fetches its next work item's first weights while it computes
// the one before (Following).
//
// Every output is the C tile's float32 sum over the K steps in sequence, each step one TDPBF16PS over the same 16
// pairs (a short last step of zero-padded copies), whatever M, the row's block or the thread: rows are
// batch-invariant on this path as on the AVX-512 one. The two paths differ in the summation order inside a step, so a
// process keeps one of them (pagellm_packed_gemm_use_amx, chosen once at load).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PAGELLM_PACKED_GEMM_AMX 1
#include "amx_tiles.h"  // permitted, configure
#include "silu.h"  // round_bf16x16, silu_mul16: the gate/up epilogue, bit for bit the SiLU·mul kernel's

#include <type_traits>

namespace {
namespace amx {

constexpr int kStepPairs = 16;                         // k-pairs per K step (the lines of one B tile)
constexpr int64_t kStepElems = 2 * kStepPairs;         // x elements per K step (64 bytes of an A row)
constexpr int64_t kBlockRows = 32;                     // rows per M block: two A tiles
constexpr int64_t kTileBytes = kStepPairs * 64;        // one B tile: 16 lines of a panel
constexpr int64_t kRangeRows = 256;                    // rows per work item (their x stays in L2 across panels)
constexpr int64_t kStreamBytes = int64_t{256} << 10;    // a y of this size and more is written non-temporally
constexpr int kStreamNone = 0, kStreamA = 1, kStreamB = 2;  // which tile operand is loaded as read once (tiles)
constexpr int64_t kL1PairBytes = int64_t{40} << 10;    // a pair's weights this size or less stay in L1 (of 48 KiB)

using pagellm_amx::permitted;

// A and C tiles hold `rows` rows (16, or M when M < 16 so that small batches are read in place), B tiles 16 lines.
using pagellm_amx::configure;

// A thread's buffers: x rows copied zero-padded (the rows of a short last tile, or every row when K is not a whole
// number of steps), the short last K step of two panels, and the C tiles on their way to y: two of them, the one a
// block stores into and the one its predecessor's rows are still being written from (Pending).
struct Scratch {
  std::vector<uint16_t> a;                               // [rows][kpad]
  alignas(64) uint16_t b_tail[2][kTileBytes / 2];
  alignas(64) float c[2][kBlockRows * 2 * kPanel];       // [32 rows][2 panels x 16], twice
  int current = 0;                                       // the buffer the next block stores into
};

// The A operand of a range of rows: rows [m0, m0 + direct) read in place (whole tiles, K whole steps), the rest
// [m0 + direct, m0 + rows) from a zero-padded copy made once per range.
struct ARows {
  int64_t direct;
  const uint16_t* copy;
  int64_t lda_copy;
};

inline uint16_t* aligned64(uint16_t* p) {
  return reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
}

inline ARows a_rows(const Problem& pb, int64_t m0, int64_t rows, int tile_rows, Scratch& s) {
  // In place: whole 32-row blocks, and a last 16 rows that make one whole tile (or all M rows when M < 16). A rest
  // of other sizes is copied whole, so that it stays one block of two row tiles (24 rows: one pass over the
  // weights, not a 16-row pass and an 8-row one).
  const int64_t rest = rows % kBlockRows;
  const int64_t whole = tile_rows < 16 ? rows : rows - rest + (rest == 16 ? 16 : 0);
  const int64_t direct = pb.k % kStepElems == 0 ? whole : 0;
  const int64_t kpad = (pb.k + kStepElems - 1) / kStepElems * kStepElems;
  const int64_t left = rows - direct;
  if (left > 0) {
    // 32 elements of slack: the copy starts on a 64-byte boundary (a vector's data is only 16-byte aligned, and a
    // misaligned tile row spans two cache lines); kpad keeps every row on one.
    s.a.assign(static_cast<size_t>((left + tile_rows - 1) / tile_rows * tile_rows * kpad + 32), 0);
    uint16_t* copy = aligned64(s.a.data());
    for (int64_t r = 0; r < left; ++r)
      std::memcpy(copy + r * kpad, pb.x + (m0 + direct + r) * pb.ldx, static_cast<size_t>(pb.k) * 2);
    return {direct, copy, kpad * 2};
  }
  return {direct, s.a.data(), kpad * 2};
}

// Which panels a block multiplies together: a pair is panels g and g + second; the next pair starts step panels on.
// Plain GEMM: neighbours (step 2, second 1). Gate/up with SiLU·mul: gate panel g and up panel g + I/16 (step 1).
struct Pairing {
  int64_t step, second;
  bool silu;
};

// Lines of the next panel pair's weights that a block pulls into L2 while it computes, spread over its K steps, so
// that the pair after this one does not start by waiting on memory.
struct Ahead {
  const char* p[2];  // the next pair's panels (the second null when it has one)
  int64_t lines;     // lines of each
};

// A block's outputs in a C buffer, converted and written to y a few rows per K step of the next block (write_rows),
// so the vector work overlaps that block's tile products instead of following its own: 1.04-1.25x the GFLOP/s on
// SmolLM2's shapes at 32 and 2,048 rows (docs/performance.md, Round 14). Only the order of the stores changes, not a
// bit of any output.
struct Pending {
  const Problem* pb = nullptr;  // null: nothing pending
  const Pairing* pair = nullptr;
  const float* c = nullptr;
  int64_t m0 = 0, rows = 0, g = 0, done = 0;
  int panels = 0;

  void write(int64_t n);  // the next n rows (fewer at the end)
  void finish() {
    if (pb) write(rows - done);
    pb = nullptr;
  }
};

// The C tiles of R row tiles x P panels, K steps in sequence; the last step reads B from `tail` (zero-padded
// copies) when the K pairs are not whole steps. Each step also writes a share of the pending block's rows.
// Inlined, as block is, into run_panels: called, they took Ahead through the stack, and GCC copied its two pointers
// with one 16-byte load of two 8-byte stores. A load like that is not forwarded from the store queue; it waits for
// those stores to reach L1, behind the previous block's non-temporal y stores: 7.9 % of a prompt-only run's samples
// (perf annotate, docs/performance.md Round 42).
// S says which operand is loaded with TILELOADDT1, the hint that it will not be read again soon, so that it does not
// push the other out of L1: kStreamA the x rows (a pair's weights are read again by every row block), kStreamB the
// weights, kStreamNone neither (see stream_for).
template <int R, int P, int S>
[[gnu::always_inline]] inline void tiles(const uint16_t* a, int64_t lda, int64_t a_tile, const uint16_t* b0,
                                         const uint16_t* b1, int64_t steps, const Scratch* tail, Ahead ahead,
                                         Pending& pending) {
  const int64_t per_step = (ahead.lines + steps - 1) / steps;
  const int64_t rows_per_step = pending.pb ? (pending.rows + steps - 1) / steps : 0;
  pagellm_amx::zero_c_tiles<R, P>();
  for (int64_t s = 0; s < steps; ++s) {
    const bool last_short = tail && s == steps - 1;
    const uint16_t* bs0 = last_short ? tail->b_tail[0] : b0 + s * (kTileBytes / 2);
    const uint16_t* bs1 = last_short ? tail->b_tail[1] : b1 + s * (kTileBytes / 2);
    const uint16_t* as = a + s * kStepElems;
    for (int64_t i = 0; i < per_step && ahead.lines > 0; ++i, --ahead.lines) {
      _mm_prefetch(ahead.p[0], _MM_HINT_T1);
      ahead.p[0] += 64;
      if (ahead.p[1]) {
        _mm_prefetch(ahead.p[1], _MM_HINT_T1);
        ahead.p[1] += 64;
      }
    }
    if (S == kStreamB) {
      _tile_stream_loadd(6, bs0, 64);
      if (P > 1) _tile_stream_loadd(7, bs1, 64);
    } else {
      _tile_loadd(6, bs0, 64);
      if (P > 1) _tile_loadd(7, bs1, 64);
    }
    if (S == kStreamA) _tile_stream_loadd(4, as, lda); else _tile_loadd(4, as, lda);
    _tile_dpbf16ps(0, 4, 6);
    if (P > 1) _tile_dpbf16ps(1, 4, 7);
    if (R > 1) {
      if (S == kStreamA) _tile_stream_loadd(5, as + a_tile, lda); else _tile_loadd(5, as + a_tile, lda);
      _tile_dpbf16ps(2, 5, 6);
      if (P > 1) _tile_dpbf16ps(3, 5, 7);
    }
    if (rows_per_step && pending.done < pending.rows) pending.write(rows_per_step);
  }
}

template <int R, int P>
void store_tiles(float* c) {
  constexpr int64_t ldc = 2 * kPanel * sizeof(float);
  _tile_stored(0, c, ldc);
  if (P > 1) _tile_stored(1, c + kPanel, ldc);
  if (R > 1) _tile_stored(2, c + 16 * 2 * kPanel, ldc);
  if (R > 1 && P > 1) _tile_stored(3, c + 16 * 2 * kPanel + kPanel, ldc);
}

// Both panels' outputs of each row as one 64-byte store. A y of 256 KiB and more (a prompt chunk's layer outputs,
// the LM head's logits from a few rows on) is written around the caches (non-temporal): each row's line is
// otherwise a store miss, and those stall the tile pipeline and evict the x rows the next blocks read (twice the
// time at 256 rows x 49152; a 32 x 128-token prefill 0.90-0.95 -> 0.83-0.88 s with the bound lowered from 4 MiB,
// decode steps unchanged).
inline void write_lines(const Problem& pb, int64_t m0, int64_t r0, int64_t r1, int64_t g, const float* c) {
  const __m512 bias_lo = pb.bias ? load_bias(pb.bias, g * kPanel, kPanel) : _mm512_setzero_ps();
  const __m512 bias_hi = pb.bias ? load_bias(pb.bias, (g + 1) * kPanel, kPanel) : _mm512_setzero_ps();
  const bool around = pb.m * pb.n * 2 >= kStreamBytes;
  for (int64_t i = r0; i < r1; ++i) {
    uint16_t* dst = pb.y + (m0 + i) * pb.ldy + g * kPanel;
    const __m512 lo = _mm512_add_ps(_mm512_load_ps(c + i * 2 * kPanel), bias_lo);
    const __m512 hi = _mm512_add_ps(_mm512_load_ps(c + i * 2 * kPanel + kPanel), bias_hi);
    const __m512i line = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    if (around && (reinterpret_cast<uintptr_t>(dst) & 63) == 0) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), line);
    } else {
      _mm512_storeu_si512(dst, line);
    }
  }
}

// The value a GEMM output takes once stored as bfloat16 (store_bf16, write_lines) and read back.
inline __m512 as_stored(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// y = silu(gate) * up for 16 columns of each row: the pair's first panel is a gate panel, its second the matching
// up panel. Each is rounded to bfloat16 as the two-call path (GEMM, then silu_and_mul) stores it, and the SiLU·mul
// and its rounding are that kernel's own code (silu.h), so the fused path gives the same bits.
inline void write_silu(const Problem& pb, int64_t m0, int64_t r0, int64_t r1, int64_t g, const float* c) {
  for (int64_t i = r0; i < r1; ++i) {
    const __m512 gate = as_stored(_mm512_load_ps(c + i * 2 * kPanel));
    const __m512 up = as_stored(_mm512_load_ps(c + i * 2 * kPanel + kPanel));
    const __m512i out = _mm512_castps_si512(round_bf16x16(silu_mul16(gate, up)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb.y + (m0 + i) * pb.ldy + g * kPanel),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(out, 16)));
  }
}

// Rows [r0, r1) of a block's outputs (C buffer c: rows [m0, m0 + rows) of the pair at panel g) into y.
void write_rows(const Problem& pb, const Pairing& pair, int64_t m0, int64_t r0, int64_t r1, int64_t g, int panels,
                const float* c) {
  if (pair.silu) {
    write_silu(pb, m0, r0, r1, g, c);
    return;
  }
  if (panels == 2 && pb.n - g * kPanel >= 2 * kPanel) {  // whole lines of 32 outputs
    write_lines(pb, m0, r0, r1, g, c);
    return;
  }
  for (int j = 0; j < panels; ++j) {
    const int64_t cols64 = pb.n - (g + j) * kPanel;
    if (cols64 <= 0) break;
    const int cols = static_cast<int>(cols64 < kPanel ? cols64 : kPanel);
    const __m512 bias = pb.bias ? load_bias(pb.bias, (g + j) * kPanel, cols) : _mm512_setzero_ps();
    for (int64_t i = r0; i < r1; ++i)
      store_bf16(pb.y + (m0 + i) * pb.ldy + (g + j) * kPanel,
                 _mm512_add_ps(_mm512_load_ps(c + i * 2 * kPanel + j * kPanel), bias), cols);
  }
}

// The operand a problem's tiles load as read once, where a pair's weights meet several row blocks (M > 32): the x
// rows where the pair fits L1, else (K of 1,536: 96 KiB) the weights. Measured against plain loads
// (docs/performance.md, Round 42): gate/up with SiLU 1.13-1.21x at 256 and 2,048 rows, the plain products up to
// 1.13x at 2,048. At M <= 32 plain loads, as before: there read-once loads measured within the noise.
inline int stream_for(const Problem& pb) {
  if (pb.m <= kBlockRows) return kStreamNone;
  return pb.kpairs * 2 * 64 > kL1PairBytes ? kStreamB : kStreamA;
}

// Rows [m0, m0 + rows) (at most kBlockRows) times the pair at panel g (`panels`: one or two) into a C buffer, left
// pending (written during the next block, or by the caller's finish) once the block before it is finished; below 16
// rows written at once. Inlined (see tiles).
[[gnu::always_inline]] inline void block(const Problem& pb, const Pairing& pair, const uint16_t* a, int64_t lda,
                                         int tile_rows, int64_t m0, int64_t rows, int64_t g, int panels, Ahead ahead,
                                         Scratch& s, Pending& pending) {
  const int64_t steps = (pb.kpairs + kStepPairs - 1) / kStepPairs;
  const int64_t tail_pairs = pb.kpairs % kStepPairs;
  const uint16_t* b0 = pb.w + g * pb.panel_stride;
  const uint16_t* b1 = b0 + pair.second * pb.panel_stride;
  if (tail_pairs) {  // the short last step: its pairs copied, the rest of the tile zero
    for (int j = 0; j < panels; ++j) {
      std::memset(s.b_tail[j], 0, sizeof(s.b_tail[j]));
      std::memcpy(s.b_tail[j], (j ? b1 : b0) + (steps - 1) * (kTileBytes / 2), tail_pairs * 64);
    }
  }
  const Scratch* tail = tail_pairs ? &s : nullptr;
  const int64_t a_tile = 16 * lda / 2;  // elements from the first A tile to the second (tile_rows is 16 then)
  const bool two_rows = rows > tile_rows;
  float* c = s.c[s.current];
  const auto run_tiles = [&](auto r, auto p) {
    constexpr int R = decltype(r)::value, P = decltype(p)::value;
    const int stream = stream_for(pb);
    if (stream == kStreamA)
      tiles<R, P, kStreamA>(a, lda, a_tile, b0, b1, steps, tail, ahead, pending);
    else if (stream == kStreamB)
      tiles<R, P, kStreamB>(a, lda, a_tile, b0, b1, steps, tail, ahead, pending);
    else
      tiles<R, P, kStreamNone>(a, lda, a_tile, b0, b1, steps, tail, ahead, pending);
    pending.finish();
    store_tiles<R, P>(c);
  };
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  if (two_rows && panels > 1) {
    run_tiles(Two{}, Two{});
  } else if (two_rows) {
    run_tiles(Two{}, One{});
  } else if (panels > 1) {
    run_tiles(One{}, Two{});
  } else {
    run_tiles(One{}, One{});
  }
  if (tile_rows < 16) {  // a few rows: too little to overlap, written at once
    write_rows(pb, pair, m0, 0, rows, g, panels, c);
    return;
  }
  pending = Pending{&pb, &pair, c, m0, rows, g, 0, panels};
  s.current ^= 1;
}

void Pending::write(int64_t n) {
  const int64_t end = done + n < rows ? done + n : rows;
  write_rows(*pb, *pair, m0, done, end, g, panels, c);
  done = end;
}

// Panels in the pair at panel g of a run ending at p1: two, or one where a plain GEMM's run has an odd count.
inline int pair_panels(const Pairing& pair, int64_t g, int64_t p1) {
  return pair.silu || p1 - g > 1 ? 2 : 1;
}

// The first pair of the work item a thread takes after this one (panels 0: none), whose weights the item's last
// pair pulls into L2. Without it every item started on weights from DRAM: at 576 outputs an item is one pair, and
// its first row block waited on all of them (docs/performance.md, Round 42).
struct Following {
  int64_t g = 0;
  int panels = 0;
};

// One piece of a thread's work: pairs starting in panels [p0, p1) times rows [m0, m0 + rows), a pair at a time
// (its weights stay in L1 or L2 while every row block passes over them), rows in blocks of 32 (the range's rows
// stay in L2).
void run_panels(const Problem& pb, const Pairing& pair, int64_t p0, int64_t p1, int64_t m0, int64_t rows,
                int tile_rows, Following after, Scratch& s, Pending& pending) {
  const ARows a = a_rows(pb, m0, rows, tile_rows, s);
  const int64_t blocks = (a.direct + kBlockRows - 1) / kBlockRows + (rows - a.direct + kBlockRows - 1) / kBlockRows;
  const int64_t panel_lines = pb.panel_stride * 2 / 64;
  for (int64_t g = p0; g < p1; g += pair.step) {
    const int panels = pair_panels(pair, g, p1);
    // The next pair's lines (after the item's last pair, the first pair of the thread's next item), a share to each
    // of this pair's row blocks. Below 16 rows a pair's few tile products leave no room for them: the hardware
    // prefetcher keeps up alone (the LM head at 4 rows took 1.2x as long with them).
    const int64_t next = g + pair.step < p1 ? g + pair.step : after.g;
    const int next_panels = g + pair.step < p1 ? pair_panels(pair, next, p1) : after.panels;
    const int64_t lines = tile_rows < 16 ? 0 : panel_lines;
    const char* first = reinterpret_cast<const char*>(pb.w + next * pb.panel_stride);
    const char* second = reinterpret_cast<const char*>(pb.w + (next + pair.second) * pb.panel_stride);
    int64_t b = 0;
    const auto ahead = [&]() {
      const int64_t from = lines * b / blocks, to = lines * (b + 1) / blocks;
      ++b;
      return Ahead{{first + from * 64, next_panels > 1 ? second + from * 64 : nullptr}, next_panels ? to - from : 0};
    };
    for (int64_t i = 0; i < a.direct; i += kBlockRows)
      block(pb, pair, pb.x + (m0 + i) * pb.ldx, pb.ldx * 2, tile_rows, m0 + i,
            a.direct - i < kBlockRows ? a.direct - i : kBlockRows, g, panels, ahead(), s, pending);
    for (int64_t i = a.direct; i < rows; i += kBlockRows)
      block(pb, pair, a.copy + (i - a.direct) * (a.lda_copy / 2), a.lda_copy, tile_rows, m0 + i,
            rows - i < kBlockRows ? rows - i : kBlockRows, g, panels, ahead(), s, pending);
  }
}

// One thread's share: tiles configured for this M, chunks from the shared counter, the tile state released after.
void run(const Problem& pb, const Pairing& pair, const Chunks& chunks, std::atomic<int64_t>& next) {
  const int tile_rows = static_cast<int>(pb.m < 16 ? pb.m : 16);
  configure(tile_rows);
  Scratch scratch;
  Pending pending;
  const int64_t items = chunks.items * ((pb.m + kRangeRows - 1) / kRangeRows);
  // Each item is claimed one item ahead, so that its weights are on their way while the one before computes. A
  // thread the OS preempts holds back one item more than before (of about 8 a thread).
  int64_t c = next.fetch_add(1, std::memory_order_relaxed);
  while (c < items) {
    const int64_t c_next = next.fetch_add(1, std::memory_order_relaxed);
    int64_t p0, p1;
    chunks.range(c % chunks.items, pb.panels, &p0, &p1);
    Following after;
    if (c_next < items) {
      int64_t q0, q1;
      chunks.range(c_next % chunks.items, pb.panels, &q0, &q1);
      if (q0 < q1) after = {q0, pair_panels(pair, q0, q1)};
    }
    const int64_t m0 = c / chunks.items * kRangeRows;
    if (p0 < p1)
      run_panels(pb, pair, p0, p1, m0, pb.m - m0 < kRangeRows ? pb.m - m0 : kRangeRows, tile_rows, after, scratch,
                 pending);
    c = c_next;
  }
  pending.finish();
  _mm_sfence();  // the non-temporal stores are visible before the threads meet
  _tile_release();
}

}  // namespace amx
}  // namespace
#endif

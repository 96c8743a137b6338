// The W8A8 int8 GEMM on Intel AMX tiles (CPUs with AMX-INT8): the same packed weight, the same quantized rows and
// the same epilogue as the VNNI tiles of packed_gemm_w8a8.cpp (included by it after its Problem and epilogue
// helpers; compiled only where -march=native has AMX, used only where the kernel grants the tile data state).
//
// The packed layout is already AMX's B operand: 16 consecutive k-quads of a panel are 16 lines of 64 bytes (16
// columns x 4 int8), one B tile. An A tile is 16 rows of q(x) + 128, 64 bytes (16 quads) each, read in place. One
// TDPBUSD multiplies those unsigned bytes by the signed weights, four products per int32 lane, and adds them into a
// 16 x 16 int32 C tile: the VNNI tiles' vpdpbusd on 16 times the work. Tiles: C 0-3 (two row tiles x two panels),
// A 4-5, B 6-7.
//
// The sums are exact int32 (no saturation on either path), so every output is the integer the VNNI tiles compute and
// the epilogue (the same code) rounds it to the same bits: the two paths give the same result for every M, N, K.
// A short last K step reads its B lines from a zero-padded copy; its A lines run past the row's quads into the next
// row, which multiply those zero weights. A tile's rows past M are read and their sums dropped: the rows buffer
// holds whole tiles of rows and a line of slack (packed_gemm_w8a8.cpp, run).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define PAGELLM_W8A8_AMX 1
#include "amx_tiles.h"  // permitted, configure

namespace {
namespace amx8 {

constexpr int64_t kStepQuads = 16;                 // k-quads per K step (the lines of one B tile)
constexpr int64_t kTileBytes = kStepQuads * kQuad;  // one B tile: 16 lines of a panel
constexpr int64_t kBlockRows = 32;                 // rows per block: two A tiles
constexpr int64_t kRangeRows = 512;                // rows per work item (their q(x) stays in L2 across panels)
constexpr int64_t kStreamBytes = int64_t{256} << 10;  // a y of this size and more is written non-temporally
// Fewer rows take the VNNI tiles: bound by the weights' bytes there, they read them as fast (docs/performance.md).
constexpr int64_t kMinRows = 16;

using pagellm_amx::configure;
using pagellm_amx::permitted;

// A thread's buffers: the short last K step of two panels, and two blocks' int32 sums on their way to y: the one a
// block stores into and the one the block before it is still being written from (Pending).
struct Scratch {
  alignas(64) int8_t b_tail[2][kTileBytes];
  alignas(64) int32_t c[2][kBlockRows][2 * kPanel];  // [buffer][row][two panels x 16]
  int current = 0;                                   // the buffer the next block stores into
};

// The epilogue of the panel starting at output column col (the VNNI tiles' Columns).
inline Columns columns(const Problem& pb, int64_t col, bool bias) {
  return Columns(pb.off + col, pb.sw + col, bias && pb.bias ? pb.bias + col : nullptr, static_cast<int>(pb.n - col));
}

// Rows [r0, r1) of a block's sums c (rows m0.. of panels g and g + 1, `panels` of them; with up_panels the gate
// panel g and its up panel) into y, through the VNNI tiles' epilogue code. Two whole panels go as one 64-byte line a
// row, written around the caches when y is large (kStreamBytes) and the line aligned: each row's line is otherwise
// a store miss (the LM head at 256 rows: 0.72x the bfloat16 GEMM's speed before, as that one's write_lines found).
void write_rows(const Problem& pb, const int32_t (*c)[2 * kPanel], int64_t m0, int64_t r0, int64_t r1, int64_t g,
                int panels) {
  const int64_t col = g * kPanel;
  if (pb.up_panels) {
    const Columns gate = columns(pb, col, false), up = columns(pb, (g + pb.up_panels) * kPanel, false);
    for (int64_t i = r0; i < r1; ++i)
      store_bf16x16(pb.y + (m0 + i) * pb.ldy + col,
                    silu_of(gate, _mm512_load_si512(c[i]), up, _mm512_load_si512(c[i] + kPanel), pb.sx[m0 + i]),
                    gate.mask);
    return;
  }
  if (panels == 2 && pb.n - col >= 2 * kPanel) {  // whole lines of 32 outputs
    const Columns lo = columns(pb, col, true), hi = columns(pb, col + kPanel, true);
    const bool around = pb.m * pb.n * 2 >= kStreamBytes;
    for (int64_t i = r0; i < r1; ++i) {
      const float sx = pb.sx[m0 + i];
      uint16_t* dst = pb.y + (m0 + i) * pb.ldy + col;
      const __m512i line = _mm512_inserti64x4(_mm512_castsi256_si512(lo.out(_mm512_load_si512(c[i]), sx)),
                                              hi.out(_mm512_load_si512(c[i] + kPanel), sx), 1);
      if (around && (reinterpret_cast<uintptr_t>(dst) & 63) == 0) {
        _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), line);
      } else {
        _mm512_storeu_si512(dst, line);
      }
    }
    return;
  }
  for (int j = 0; j < panels && col + j * kPanel < pb.n; ++j) {
    const Columns cols = columns(pb, col + j * kPanel, true);
    for (int64_t i = r0; i < r1; ++i)
      _mm256_mask_storeu_epi16(pb.y + (m0 + i) * pb.ldy + col + j * kPanel, cols.mask,
                               cols.out(_mm512_load_si512(c[i] + j * kPanel), pb.sx[m0 + i]));
  }
}

// A block's sums waiting for y, written a few rows per K step of the next block (so the vector work overlaps that
// block's tile products), the rest by finish(). Only the order of the stores changes, not a bit of any output.
struct Pending {
  const int32_t (*c)[2 * kPanel] = nullptr;  // null: nothing pending
  int64_t m0 = 0, rows = 0, g = 0, done = 0;
  int panels = 0;

  void write(const Problem& pb, int64_t n) {
    const int64_t end = done + n < rows ? done + n : rows;
    write_rows(pb, c, m0, done, end, g, panels);
    done = end;
  }
  void finish(const Problem& pb) {
    if (c) write(pb, rows - done);
    c = nullptr;
  }
};

// The weights of the next panel pair a thread multiplies (its item's next pair, or after the last the first of its
// next item) that the current pair pulls into L2 as it goes, a share per row block spread over the block's K steps,
// so that the next pair does not start by waiting on memory: the lines of its two panels.
struct Ahead {
  const char* p[2] = {nullptr, nullptr};  // the next lines of each panel (the second null when there is one)
  int64_t left = 0;                        // lines of each panel still to ask for
  int64_t per_block = 0;                   // lines of each panel a block asks for

  void ask(int64_t lines) {
    for (int64_t i = 0; i < lines && left > 0; ++i, --left) {
      _mm_prefetch(p[0], _MM_HINT_T1);
      p[0] += 64;
      if (p[1]) {
        _mm_prefetch(p[1], _MM_HINT_T1);
        p[1] += 64;
      }
    }
  }
};

// The C tiles of R row tiles x P panels over every K step; the last reads B from `tail` when K is not whole steps.
// Each step also writes a share of the pending block's rows and asks for a share of the next item's weights.
template <int R, int P>
void tiles(const Problem& pb, const uint8_t* a, const int8_t* b0, const int8_t* b1, int64_t steps,
           const Scratch* tail, Pending& pending, Ahead& ahead) {
  const int64_t lda = 4 * pb.quads;
  const int64_t rows_per_step = pending.c ? (pending.rows + steps - 1) / steps : 0;
  const int64_t ask_per_step = (ahead.per_block + steps - 1) / steps;
  pagellm_amx::zero_c_tiles<R, P>();
  for (int64_t s = 0; s < steps; ++s) {
    const bool last_short = tail && s == steps - 1;
    _tile_loadd(6, last_short ? tail->b_tail[0] : b0 + s * kTileBytes, 64);
    if (P > 1) _tile_loadd(7, last_short ? tail->b_tail[1] : b1 + s * kTileBytes, 64);
    _tile_loadd(4, a + s * 64, lda);
    _tile_dpbusd(0, 4, 6);
    if (P > 1) _tile_dpbusd(1, 4, 7);
    if (R > 1) {
      _tile_loadd(5, a + 16 * lda + s * 64, lda);
      _tile_dpbusd(2, 5, 6);
      if (P > 1) _tile_dpbusd(3, 5, 7);
    }
    if (rows_per_step && pending.done < pending.rows) pending.write(pb, rows_per_step);
    if (ahead.left > 0) ahead.ask(ask_per_step);
  }
}

template <int R, int P>
void store_tiles(int32_t (*c)[2 * kPanel]) {
  constexpr int64_t ldc = 2 * kPanel * sizeof(int32_t);
  _tile_stored(0, c[0], ldc);
  if (P > 1) _tile_stored(1, c[0] + kPanel, ldc);
  if (R > 1) _tile_stored(2, c[16], ldc);
  if (R > 1 && P > 1) _tile_stored(3, c[16] + kPanel, ldc);
}

// The panel multiplied with the panel at `first`: its neighbour, or with up_panels its up panel.
inline const int8_t* second_panel(const Problem& pb, const int8_t* first) {
  return first + (pb.up_panels ? pb.up_panels : 1) * pb.panel_stride;
}

// A pair of panels as a block multiplies it: the panel g and its second (`panels`: one or two), and where K is not
// whole steps their short last step, copied once per pair with the rest of the tile zero (tail, in the scratch).
struct Pair {
  int64_t g;
  int panels;
  const int8_t* b[2];
  const Scratch* tail;
};

Pair pair_at(const Problem& pb, int64_t g, int panels, Scratch& s) {
  const int8_t* first = pb.w + g * pb.panel_stride;
  Pair pair{g, panels, {first, second_panel(pb, first)}, nullptr};
  const int64_t steps = (pb.quads + kStepQuads - 1) / kStepQuads;
  const int64_t tail_quads = pb.quads % kStepQuads;
  if (tail_quads) {
    for (int j = 0; j < panels; ++j) {
      std::memset(s.b_tail[j], 0, sizeof(s.b_tail[j]));
      std::memcpy(s.b_tail[j], pair.b[j] + (steps - 1) * kTileBytes, static_cast<size_t>(tail_quads * kQuad));
    }
    pair.tail = &s;
  }
  return pair;
}

// Rows [m0, m0 + rows) (at most kBlockRows) times a pair into a C buffer, left pending once the block before it is
// finished.
void block(const Problem& pb, const Pair& pair, int64_t m0, int64_t rows, Scratch& s, Pending& pending, Ahead& ahead) {
  const int64_t steps = (pb.quads + kStepQuads - 1) / kStepQuads;
  const int8_t *b0 = pair.b[0], *b1 = pair.b[1];
  const Scratch* tail = pair.tail;
  const uint8_t* a = pb.xq + m0 * 4 * pb.quads;
  int32_t(*c)[2 * kPanel] = s.c[s.current];
  if (rows > 16 && pair.panels > 1) {
    tiles<2, 2>(pb, a, b0, b1, steps, tail, pending, ahead), pending.finish(pb), store_tiles<2, 2>(c);
  } else if (rows > 16) {
    tiles<2, 1>(pb, a, b0, b1, steps, tail, pending, ahead), pending.finish(pb), store_tiles<2, 1>(c);
  } else if (pair.panels > 1) {
    tiles<1, 2>(pb, a, b0, b1, steps, tail, pending, ahead), pending.finish(pb), store_tiles<1, 2>(c);
  } else {
    tiles<1, 1>(pb, a, b0, b1, steps, tail, pending, ahead), pending.finish(pb), store_tiles<1, 1>(c);
  }
  pending = Pending{c, m0, rows, pair.g, 0, pair.panels};
  s.current ^= 1;
}

// The pair at panel g of a run of panels ending at `end` (g >= end: none), to ask for over `blocks` row blocks.
Ahead ahead_of(const Problem& pb, int64_t g, int64_t end, int64_t blocks) {
  Ahead out;
  if (g >= end) return out;
  const int8_t* first = pb.w + g * pb.panel_stride;
  out.p[0] = reinterpret_cast<const char*>(first);
  out.p[1] = pb.up_panels || end - g > 1 ? reinterpret_cast<const char*>(second_panel(pb, first)) : nullptr;
  out.left = pb.panel_stride / 64;
  out.per_block = (out.left + blocks - 1) / blocks;
  return out;
}

// One thread's share: work items (a chunk of panels x a range of rows) from the shared counter, each a pair of
// panels at a time over the range's row blocks (the pair's weights stay in L1 or L2 while the rows pass), the tile
// state released after. Plain: pairs of neighbouring panels. Gate/up: each gate panel with its up panel. A thread
// takes its next item when it starts one, so that its last pair can ask for the next item's first.
void run(const Problem& pb, const Chunks& chunks, std::atomic<int64_t>& next) {
  configure(16);
  Scratch scratch;
  Pending pending;
  const int64_t ranges = (pb.m + kRangeRows - 1) / kRangeRows;
  const int64_t total = chunks.items * ranges;
  const int64_t step = pb.up_panels ? 1 : 2;
  for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < total;) {
    const int64_t after = next.fetch_add(1, std::memory_order_relaxed);
    int64_t p0, p1, n0 = 0, n1 = 0;
    chunks.range(c % chunks.items, pb.panels, &p0, &p1);
    if (after < total) chunks.range(after % chunks.items, pb.panels, &n0, &n1);
    const int64_t m0 = c / chunks.items * kRangeRows;
    const int64_t m1 = pb.m - m0 < kRangeRows ? pb.m : m0 + kRangeRows;
    const int64_t blocks = (m1 - m0 + kBlockRows - 1) / kBlockRows;
    for (int64_t g = p0; g < p1; g += step) {
      const int panels = pb.up_panels || p1 - g > 1 ? 2 : 1;
      const bool last = g + step >= p1;
      Ahead ahead = last ? ahead_of(pb, n0, n1, blocks) : ahead_of(pb, g + step, p1, blocks);
      const Pair pair = pair_at(pb, g, panels, scratch);
      for (int64_t r = m0; r < m1; r += kBlockRows)
        block(pb, pair, r, m1 - r < kBlockRows ? m1 - r : kBlockRows, scratch, pending, ahead);
    }
    c = after;
  }
  pending.finish(pb);
  _mm_sfence();  // the non-temporal stores are visible before the threads meet
  _tile_release();
}

}  // namespace amx8
}  // namespace
#endif

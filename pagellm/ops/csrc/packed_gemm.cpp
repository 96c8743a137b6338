// bfloat16 GEMM over a pre-packed weight: y[M, N] = x[M, K] · W[N, K]ᵀ (+ bias), any M.
//
// Packed layout (made once at load time by pagellm/ops/gemm.py `pack`): W is cut into panels of 16 output
// columns; a panel holds its K in pairs, [ceil(K/2)][16 columns][2], so one 64-byte line is the next k-pair of
// all 16 columns, exactly the operand of one _mm512_dpbf16_ps (packed_gemm_avx512.h; packed_gemm_avx2.h widens it
// to float32 for CPUs without AVX-512 BF16). Panels are contiguous one after the other, so a
// run of panels is one contiguous piece of memory. N is padded to a multiple of 16 and K to an even count with
// zeros.
//
// The register tile is MR input rows x NR panels (NR * 16 output columns) of float32 accumulators. Per k-pair it
// loads NR weight lines and broadcasts MR pairs of x (one 32-bit broadcast each), then issues MR*NR dot products:
// no horizontal reductions, each accumulator is a finished run of 16 outputs. Each panel stream is prefetched
// 2 KiB ahead into L2 (_MM_HINT_T1: prefetches into L1 compete with the tile's own loads for L1 miss slots; with
// T1 a batch-1 decode step in the engine took 0.85-0.94 of its time with T0; docs/performance.md, round 6).
// The OpenMP threads take contiguous runs of panels (chunks, about 8 per thread; the last one cut in one piece per thread when the chunks do not
// divide among the threads) from a shared counter, so a thread the OS preempts delays only its current chunk (at small M each chunk streams its slice of the weight at DRAM speed), and walk all M rows over
// each. K is processed in equal blocks of at most kKC pairs: a weight block (NR panels x KC pairs) then
// stays in L2 while every row group of an M block passes over it, and partial sums live in a per-thread float32
// buffer between K blocks. While the second and later row groups compute on a block, they prefetch the next
// block from DRAM (see Tile::pf), so compute and memory overlap at M of a few dozen rows. Each output is summed
// in the same order (k-pairs in sequence, K blocks in sequence) whatever M, its row group or the thread count, so
// results are batch-invariant. The plain-PyTorch twin and test oracle is `F.linear` (pagellm/ops/gemm.py).
#include <immintrin.h>
#include <omp.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kPanel = 16;           // output columns per panel (one zmm of float32)
constexpr int64_t kPanelPair = 32;   // bf16 elements per k-pair of a panel (64 bytes)
// How one K block's tile starts and ends: from zero or from the float32 partial sums, to the partials or to y.
struct Tile {
  const uint16_t* x;     // first row, at this K block's first pair
  int64_t ldx;           // elements between rows of x
  const uint16_t* w;     // first panel, at this K block's first pair
  int64_t panel_stride;  // elements between panels (Kp/2 * 32)
  int64_t pairs;         // k-pairs in this block (the last one may be a half pair, see `half_last`)
  bool half_last;        // K odd and this block ends at K: the last pair's second x element is past the row
  float* partial;        // [MR][NR * 16] float32 partial sums (row stride ldp), or null when K fits one block
  int64_t ldp;
  bool first, last;      // first K block (start from zero) / last K block (write y)
  uint16_t* y;           // first row, first column of the tile
  int64_t ldy;
  const uint16_t* bias;  // at the tile's first column, or null
  int cols;              // valid output columns of the tile (<= NR * 16; the rest is padding)
  // While a later row group computes on weights already in L2, it pulls panels [pf_first, pf_end) of the next
  // weight block (same panel stride) from DRAM into L2, one line per panel per k-pair, so that the next block's
  // first row group does not wait on memory (M > 8; at M <= 8 a single pass streams and prefetches ahead).
  const uint16_t* pf;    // the next block's first panel at its first pair, or null
  int pf_first, pf_end;
  const float* xf;       // AVX2 path: x widened to float32 (row stride ldxf, pairs whole), at this block's first pair
  int64_t ldxf;
  const float* wf;       // AVX2 path from kWidenRows rows: this panel's block widened to float32 ([pairs][2][16]), or null
  int64_t up = 0;        // paired tiles (the gate/up entry): elements from a gate panel to its up panel
};

}  // namespace

#include "gemm_chunks.h"  // how the threads share the panels (chunks from a counter) and how many run

#if defined(__AVX512BF16__)
#include "packed_gemm_avx512.h"  // tile kernels, tile shapes and block sizes for AVX-512 BF16
#else
#include "packed_gemm_avx2.h"  // the same in AVX2 + FMA (bf16 widened to float32)
#endif

namespace {

struct Problem {
  const uint16_t* x;
  int64_t m, k, ldx;
  const uint16_t* w;
  int64_t panels;  // ceil(n / 16)
  int64_t n;
  const uint16_t* bias;
  uint16_t* y;
  int64_t ldy;
  int64_t kpairs, kc, panel_stride;  // k-pairs, k-pairs per K block, elements between panels
  int width;                          // panels per group (group_width(m))
  const float* xf = nullptr;          // AVX2 path: x widened to float32 (widen_rows), row stride ldxf; else null
  int64_t ldxf = 0;
  int64_t up_panels = 0;  // the gate/up entry (AVX-512): panels from a gate panel to its up panel (n: gate columns)
  int slots() const { return up_panels ? 2 * width : width; }  // accumulator panels of a group
};

// One weight block of a thread's walk: panels [g, g + nr) over k-pairs [k0, k0 + kc).
struct Block {
  int64_t g;
  int nr;
  int64_t k0;
};

// Most panels of a tile of mr rows; paired (the gate/up entry, AVX-512 only): most gate panels, each with its up one.
inline int tile_panels(int mr, const float* wide, bool paired) {
#if defined(__AVX512BF16__)
  if (paired) return max_pairs(mr);
#endif
  (void)paired;
  return max_nr(mr, wide);
}

// All row groups of rows [m0, m0 + mb) over one weight block; `next` is the block after it (for prefetching).
// ``scratch`` is the thread's buffer for the block widened to float32 (widen_block; null where the path has none).
void run_block(const Problem& pb, const Block& b, const Block* next, int64_t m0, int64_t mb, float* partial,
               float* scratch) {
  const int64_t pairs = pb.kpairs - b.k0 < pb.kc ? pb.kpairs - b.k0 : pb.kc;
  const float* wide = scratch ? widen_block(pb.w + b.g * pb.panel_stride + b.k0 * kPanelPair, pb.panel_stride, b.nr,
                                            pairs, pb.m, scratch)
                              : nullptr;
  int groups = 0;
  for (int64_t i = 0; i < mb; i += next_rows(mb - i, wide)) ++groups;
  const int next_panels = next ? next->nr : 0;
  const int per_group = groups > 1 ? (next_panels + groups - 2) / (groups - 1) : 0;
  const bool paired = pb.up_panels > 0;
  int group = 0;
  for (int64_t i = 0; i < mb; ++group) {
    const int mr = next_rows(mb - i, wide);
    const int most = tile_panels(mr, wide, paired);
    const int nr_here = b.nr < most ? b.nr : most;
    for (int64_t gg = b.g; gg < b.g + b.nr; gg += nr_here) {
      const int nrr = static_cast<int>(b.g + b.nr - gg < nr_here ? b.g + b.nr - gg : nr_here);
      Tile t;
      t.x = pb.x + (m0 + i) * pb.ldx + 2 * b.k0;
      t.ldx = pb.ldx;
      t.xf = pb.xf ? pb.xf + (m0 + i) * pb.ldxf + 2 * b.k0 : nullptr;
      t.ldxf = pb.ldxf;
      t.w = pb.w + gg * pb.panel_stride + b.k0 * kPanelPair;
      t.panel_stride = pb.panel_stride;
      t.pairs = pairs;
      t.half_last = (pb.k & 1) && b.k0 + pairs == pb.kpairs;
      t.ldp = pb.slots() * kPanel;
      t.partial = partial ? partial + i * t.ldp + (gg - b.g) * (paired ? 2 : 1) * kPanel : nullptr;
      t.first = b.k0 == 0;
      t.last = b.k0 + pairs == pb.kpairs;
      t.y = pb.y + (m0 + i) * pb.ldy + gg * kPanel;
      t.ldy = pb.ldy;
      t.bias = pb.bias ? pb.bias + gg * kPanel : nullptr;
      const int64_t cols = pb.n - gg * kPanel;
      t.cols = static_cast<int>(cols < nrr * kPanel ? cols : nrr * kPanel);
      const bool prefetching = per_group > 0 && group > 0 && gg == b.g;
      t.pf = prefetching ? pb.w + next->g * pb.panel_stride + next->k0 * kPanelPair : nullptr;
      t.pf_first = (group - 1) * per_group;
      t.pf_end = t.pf_first + per_group < next_panels ? t.pf_first + per_group : next_panels;
      t.wf = wide ? wide + (gg - b.g) * pairs * 2 * kPanel : nullptr;
      t.up = pb.up_panels * pb.panel_stride;
#if defined(__AVX512BF16__)
      if (paired) {
        paired_tile_fn(mr, nrr)(t);
        continue;
      }
#endif
      tile_fn(mr, nrr, wide)(t);
    }
    i += mr;
  }
}

// One chunk of a thread's work: panels [p0, p1), every row of x: M blocks, then panel groups, then K blocks.
// ``partial`` is the thread's float32 buffer (used only when K takes several blocks), ``scratch`` its widened block.
void run_panels(const Problem& pb, int64_t p0, int64_t p1, float* partial, float* scratch) {
  const bool blocked = pb.kpairs > pb.kc;
  std::vector<Block> blocks;
  for (int64_t g = p0; g < p1; g += pb.width)
    for (int64_t k0 = 0; k0 < pb.kpairs; k0 += pb.kc)
      blocks.push_back({g, static_cast<int>(p1 - g < pb.width ? p1 - g : pb.width), k0});
  for (int64_t m0 = 0; m0 < pb.m; m0 += kMC) {
    const int64_t mb = pb.m - m0 < kMC ? pb.m - m0 : kMC;
    for (size_t b = 0; b < blocks.size(); ++b)
      run_block(pb, blocks[b], b + 1 < blocks.size() ? &blocks[b + 1] : nullptr, m0, mb,
                blocked ? partial : nullptr, scratch);
  }
}

// One thread's share on the AVX-512 or AVX2 path: chunks from the shared counter, with its float32 partial-sum
// buffer and (AVX2, from kWidenRows rows) its buffer for a weight block widened to float32.
void run_tiles(const Problem& pb, const Chunks& chunks, std::atomic<int64_t>& next) {
  const int64_t rows = pb.m < kMC ? pb.m : kMC;
  std::vector<float> partial(pb.kpairs > pb.kc ? static_cast<size_t>(rows * pb.slots() * kPanel) : 0);
  std::vector<float> scratch(widened_floats(pb.m, pb.width, pb.kc));
  for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks.items;
       c = next.fetch_add(1, std::memory_order_relaxed)) {
    int64_t p0, p1;
    chunks.range(c, pb.panels, &p0, &p1);
    if (p0 < p1) run_panels(pb, p0, p1, partial.data(), scratch.empty() ? nullptr : scratch.data());
  }
}

}  // namespace

#include "packed_gemm_amx.h"  // the AMX tile path, where the compiler targets AMX (uses Problem and the helpers above)

namespace {
// Which path this process runs (pagellm_packed_gemm_use_amx): one for its lifetime, so that rows stay
// batch-invariant (the two paths sum inside a K step in different orders).
std::atomic<bool> g_amx{false};
}  // namespace

extern "C" {

// Turns the AMX path on (want > 0, where it is compiled in and the kernel grants the tile state) or off (want 0);
// want < 0 only asks. Returns whether it is on. The Python side sets it once after loading (pagellm/ops/gemm.py).
int pagellm_packed_gemm_use_amx(int want) {
#ifdef PAGELLM_PACKED_GEMM_AMX
  if (want >= 0) g_amx = want > 0 && amx::permitted();
#else
  (void)want;
#endif
  return g_amx ? 1 : 0;
}

// The vector path this build was compiled with (the AMX tiles, where switched on, run instead of it).
const char* pagellm_packed_gemm_vector_path() {
#if defined(__AVX512BF16__)
  return "AVX-512 BF16";
#else
  return "AVX2";
#endif
}

// x: [m, k] bf16 rows with stride ldx; w: packed (see the top of this file) for n outputs and k inputs; bias: [n]
// or null; y: [m, n] with row stride ldy. Uses torch's OpenMP threads, which take runs of panels from a counter.
void pagellm_packed_linear_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const uint16_t* w, int64_t n,
                                const uint16_t* bias, uint16_t* y, int64_t ldy) {
  if (m <= 0) return;
  const int64_t kpairs = (k + 1) / 2;
  const int64_t kblocks = (kpairs + kKC - 1) / kKC;
  const int64_t kc = (kpairs + kblocks - 1) / kblocks;  // equal K blocks: 288 pairs are one block, 768 two of 384
  const bool use_amx = g_amx.load(std::memory_order_relaxed);
  Problem pb{x, m, k, ldx, w, (n + kPanel - 1) / kPanel, n, bias, y, ldy, kpairs, kc, kpairs * kPanelPair,
             use_amx ? 2 : group_width(m)};
  const int threads = threads_for(m * n * k);
  const Chunks chunks = make_chunks(pb.panels, threads, pb.width);
  std::atomic<int64_t> next{0};
#if !defined(__AVX512BF16__)
  thread_local std::vector<float> widened;  // the calling thread's, grown to the largest call
  if (widened.size() < static_cast<size_t>(m * 2 * kpairs)) widened.resize(static_cast<size_t>(m * 2 * kpairs));
  float* const xf = widened.data();  // the region's other threads see their own `widened`: pass the pointer
  pb.xf = xf;
  pb.ldxf = 2 * kpairs;
#endif
#pragma omp parallel num_threads(threads)
  {
#if !defined(__AVX512BF16__)
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    widen_rows(x, ldx, k, xf, pb.ldxf, m * t / nt, m * (t + 1) / nt);
#pragma omp barrier
#endif
#ifdef PAGELLM_PACKED_GEMM_AMX
    if (use_amx) amx::run(pb, amx::Pairing{2, 1, false}, chunks, next); else
#endif
    run_tiles(pb, chunks, next);
  }
}

// y[m, n2 / 2] = silu(gate) * up of x · Wᵀ for the packed gate/up weight W [n2, k] (gate rows first, then up
// rows), in one pass: the gate/up product is never written. On the AMX path and the AVX-512 BF16 one (tiles that
// pair gate panel j with up panel j), where n2 / 2 is whole panels; returns 0, or -1 (nothing written) where it
// does not run, and the caller makes the two calls (this GEMM, then silu_and_mul), which give the same bits.
int pagellm_packed_linear_silu_mul_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const uint16_t* w,
                                        int64_t n2, uint16_t* y, int64_t ldy) {
  const int64_t half = n2 / 2, kpairs = (k + 1) / 2;
  if (n2 % (2 * kPanel) != 0) return -1;
  const int threads = threads_for(m * n2 * k);
  std::atomic<int64_t> next{0};
#ifdef PAGELLM_PACKED_GEMM_AMX
  if (g_amx.load(std::memory_order_relaxed)) {
    if (m <= 0) return 0;
    const Problem pb{x, m, k, ldx, w, half / kPanel, half, nullptr, y, ldy, kpairs, kpairs, kpairs * kPanelPair, 1};
    const Chunks chunks = make_chunks(pb.panels, threads, pb.width);
#pragma omp parallel num_threads(threads)
    amx::run(pb, amx::Pairing{1, half / kPanel, true}, chunks, next);
    return 0;
  }
#endif
#if defined(__AVX512BF16__)
  if (m <= 0) return 0;
  const int64_t kblocks = (kpairs + kKC - 1) / kKC;
  Problem pb{x, m, k, ldx, w, half / kPanel, half, nullptr, y, ldy, kpairs, (kpairs + kblocks - 1) / kblocks,
             kpairs * kPanelPair, group_width(m) / 2};
  pb.up_panels = half / kPanel;
  const Chunks chunks = make_chunks(pb.panels, threads, pb.width);
#pragma omp parallel num_threads(threads)
  run_tiles(pb, chunks, next);
  return 0;
#else
  (void)x, (void)m, (void)ldx, (void)w, (void)y, (void)ldy, (void)threads, (void)next;
  return -1;
#endif
}

// out[r] = W[ids[r]] (k bf16 each) read back out of the packed layout: the embedding lookup of a tied LM head.
// Returns 0, or -1 (nothing written) when an id is outside [0, n).
int pagellm_packed_rows_bf16(const uint16_t* w, int64_t n, int64_t k, const int64_t* ids, int64_t count,
                             uint16_t* out) {
  for (int64_t r = 0; r < count; ++r)
    if (ids[r] < 0 || ids[r] >= n) return -1;
  const int64_t kpairs = (k + 1) / 2, panel_stride = kpairs * kPanelPair;
#pragma omp parallel for schedule(static) if (count >= 256)
  for (int64_t r = 0; r < count; ++r) {
    const uint16_t* src = w + (ids[r] / kPanel) * panel_stride + (ids[r] % kPanel) * 2;
    uint16_t* dst = out + r * k;
    for (int64_t p = 0; p < k / 2; ++p) std::memcpy(dst + 2 * p, src + p * kPanelPair, 2 * sizeof(uint16_t));
    if (k & 1) dst[k - 1] = src[(kpairs - 1) * kPanelPair];
  }
  return 0;
}

// out = the packed layout of a row-major bfloat16 W [n, k] ([ceil(n/16)][ceil(k/2)][16][2], zero padded): what
// gemm.py's `pack` makes with a torch permute, here in one pass over each panel's 16 rows (the panels over torch's
// OpenMP threads), at load time for every packed weight.
void pagellm_pack_bf16(const uint16_t* w, int64_t n, int64_t k, uint16_t* out) {
  const int64_t panels = (n + kPanel - 1) / kPanel, kpairs = (k + 1) / 2, panel_stride = kpairs * kPanelPair;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    uint16_t* panel = out + p * panel_stride;
    for (int c = 0; c < kPanel; ++c) {
      const int64_t row = p * kPanel + c;
      uint16_t* dst = panel + 2 * c;
      if (row >= n) {
        for (int64_t q = 0; q < kpairs; ++q) dst[q * kPanelPair] = dst[q * kPanelPair + 1] = 0;
        continue;
      }
      const uint16_t* src = w + row * k;
      for (int64_t q = 0; q < k / 2; ++q) std::memcpy(dst + q * kPanelPair, src + 2 * q, 2 * sizeof(uint16_t));
      if (k & 1) {
        dst[(kpairs - 1) * kPanelPair] = src[k - 1];
        dst[(kpairs - 1) * kPanelPair + 1] = 0;
      }
    }
  }
}

}  // extern "C"

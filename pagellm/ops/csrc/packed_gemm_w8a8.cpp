// int8 GEMM over a pre-packed int8 weight (W8A8): y[M, N] = (q(x) · Qᵀ) · s_x · s_w (+ bias), bfloat16 in and out.
//
// The weight W [N, K] is quantized once at load time (pagellm/ops/gemm_w8a8.py `quantize`): per output column j,
// s_w[j] = max|W[j]| / 127 and Q[j] = round(W[j] / s_w[j]) in [-127, 127]. Each call quantizes its rows of x the
// same way, per row (dynamic, per token): s_x[i] = max|x[i]| / 127, q(x[i]) = round(x[i] · (127 / max|x[i]|)), then
// multiplies the int8 matrices exactly in int32 and scales each output once in float32.
//
// Packed layout (`pack`): panels of 16 output columns, K in quads, [ceil(N/16)][ceil(K/4)][16][4] int8, so one
// 64-byte line is the next four k of all 16 columns: exactly the operand of one _mm512_dpbusd_epi32 (VNNI), which
// multiplies unsigned bytes by signed ones. x goes in unsigned, q(x) + 128; each column's sum over its K, times 128,
// is subtracted again in the epilogue: Σ (q + 128) · Q = Σ q · Q + 128 · Σ Q. Behind the panels lie the per-column
// float32 scales and int32 offsets (128 · Σ Q), one per padded column each. K is padded with zeros to whole quads.
//
// The register tile is MR rows x NR panels of int32 accumulators; per k-quad it loads NR weight lines, broadcasts
// MR quads of x and issues MR*NR dot products, like the bfloat16 kernel (packed_gemm.cpp) with twice its
// multiply-adds per instruction. Threads take runs of panels from a counter (gemm_chunks.h); K runs in blocks of at
// most kKCQ quads with int32 partial sums between them, which are exact, so every output is the same integer
// whatever M, the blocking or the thread count, and the epilogue rounds it identically: batch-invariant rows. The
// epilogue is float32 ((acc - offset) · s_x) · s_w, then + bias, each op rounded (this source is built with
// -ffp-contract=off), then rounded to nearest-even bfloat16. The plain-PyTorch twin and test oracle is
// `gemm_w8a8.reference_linear`, which computes the same bits.
//
// The gate/up entry (pagellm_packed_linear_silu_mul_w8a8) pairs each gate panel with its up panel in one tile and
// writes silu(gate) · up from the accumulators: gate and up are each rounded to bfloat16 first, as the GEMM's own
// output would be, and then go through the SiLU·mul kernel's code (silu.h), so it gives that two-call path's bits
// without writing or reading the [M, 2I] product.
//
// With AMX-INT8, calls of 16 rows and more take AMX tiles (packed_gemm_w8a8_amx.h: the panels are their B operand,
// the exact sums go through this epilogue, Columns, so the bits are the same). Packing and rows: w8a8_layout.h.
#include <immintrin.h>
#include <omp.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemm_chunks.h"
#include "w8a8_layout.h"  // kPanel, kQuad, col_mask, widen_bf16, quantize_rows, quantize_column
#include "silu.h"  // round_bf16x16, silu_mul16, store_bf16x16: the SiLU·mul kernel's (ops/csrc/fused.cpp)

namespace {

using pagellm_w8a8::col_mask, pagellm_w8a8::kPanel, pagellm_w8a8::kQuad, pagellm_w8a8::quantize_column,
    pagellm_w8a8::quantize_rows, pagellm_w8a8::widen_bf16;
constexpr int64_t kKCQ = 512;       // most k-quads per K block (NR = 4: 4 * 512 * 64 B = 128 KiB of weights)
constexpr int64_t kMC = 192;        // rows per M block
constexpr int kPrefetchQuads = 32;  // software prefetch distance along a panel (2 KiB ahead), into L2
constexpr int kMaxMR = 8, kMaxNR = 4, kWideNR = 8, kWideRows = 2;

struct Tile {
  const uint8_t* x;      // first row of q(x) + 128, at this K block's first quad
  int64_t ldx;           // bytes between rows of x
  const int8_t* w;       // first panel, at this K block's first quad
  int64_t panel_stride;  // bytes between panels
  int64_t quads;         // k-quads in this block
  int32_t* partial;      // [MR][NR * 16] int32 partial sums (row stride ldp), or null when K fits one block
  int64_t ldp;
  bool first, last;      // first K block (start from zero) / last K block (write y)
  uint16_t* y;           // first row, first column of the tile
  int64_t ldy;
  const float* sx;       // the tile's rows' scales
  const float* sw;       // the tile's columns' scales
  const int32_t* off;    // the tile's columns' offsets (128 · Σ Q)
  const uint16_t* bias;  // at the tile's first column, or null
  int cols;              // valid output columns of the tile (<= NR * 16; paired: gate columns, <= NR / 2 * 16)
  int64_t up;            // paired tiles: bytes from a gate panel to its up panel
  int64_t up_cols;       // paired tiles: columns from a gate column's scale and offset to its up column's
};

// float32 -> bfloat16, rounded to nearest even (finite values; the epilogue makes no NaN from finite input).
inline __m256i round_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

// acc += Σ of 4 products u8(a) · s8(b) per int32 lane. In asm with the accumulator tied: GCC 12 compiles the
// intrinsic's accumulator as a fresh register, copying (and spilling) each of a tile's 24 per step.
inline __m512i dot_quads(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// A panel's epilogue, the VNNI and the AMX tiles' alike: its columns' offsets and scales (and bias), and an output
// in float32, ((acc - offset) · s_x) · s_w (+ bias), each op rounded.
struct Columns {
  __m512i off;
  __m512 sw, bias;
  __mmask16 mask;  // the panel's columns that exist
  bool has_bias;

  Columns(const int32_t* o, const float* s, const uint16_t* b, int cols)
      : off(_mm512_loadu_si512(o)), sw(_mm512_loadu_ps(s)), mask(col_mask(cols)), has_bias(b != nullptr) {
    bias = b ? widen_bf16(_mm256_maskz_loadu_epi16(mask, b)) : _mm512_setzero_ps();
  }
  __m512 scaled(__m512i acc, float sx) const {  // without the bias
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc, off)), _mm512_set1_ps(sx)), sw);
  }
  __m256i out(__m512i acc, float sx) const {  // the output as bfloat16
    const __m512 f = scaled(acc, sx);
    return round_bf16(has_bias ? _mm512_add_ps(f, bias) : f);
  }
};

// silu(gate) · up of a gate panel's sum and its up panel's, each rounded to bfloat16 first as the GEMM's own output
// would be, through the SiLU·mul kernel's code.
inline __m512 silu_of(const Columns& gate, __m512i g, const Columns& up, __m512i u, float sx) {
  return silu_mul16(round_bf16x16(gate.scaled(g, sx)), round_bf16x16(up.scaled(u, sx)));
}

// The epilogue of a paired tile: column block j < NR / 2 is silu(gate) · up of accumulators j and j + NR / 2.
template <int MR, int NR>
void store_silu_mul(const Tile& t, const __m512i (&acc)[MR][NR]) {
  for (int j = 0; j < NR / 2; ++j) {
    const int cols = t.cols - j * kPanel;
    if (cols <= 0) break;
    const Columns gate(t.off + j * kPanel, t.sw + j * kPanel, nullptr, cols);
    const Columns up(t.off + t.up_cols + j * kPanel, t.sw + t.up_cols + j * kPanel, nullptr, cols);
    for (int i = 0; i < MR; ++i)
      store_bf16x16(t.y + i * t.ldy + j * kPanel, silu_of(gate, acc[i][j], up, acc[i][j + NR / 2], t.sx[i]),
                    gate.mask);
  }
}

// MR rows by NR panels; PAIRED: panels NR / 2.. are the up panels of panels 0.. (t.up bytes on).
template <int MR, int NR, bool PAIRED>
void tile_kernel(const Tile& t) {
  __m512i acc[MR][NR];  // this block's sums; the earlier blocks' (t.partial) are added after the loop
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_si512();
  int64_t at[NR];  // each panel's offset from t.w
  for (int j = 0; j < NR; ++j)
    at[j] = PAIRED && j >= NR / 2 ? t.up + (j - NR / 2) * t.panel_stride : j * t.panel_stride;
  const int8_t* w = t.w;
  for (int64_t q = 0; q < t.quads; ++q, w += kQuad) {
    __m512i b[NR];
    for (int j = 0; j < NR; ++j) {
      b[j] = _mm512_loadu_si512(w + at[j]);
      _mm_prefetch(reinterpret_cast<const char*>(w + at[j] + kPrefetchQuads * kQuad), _MM_HINT_T1);
    }
    for (int i = 0; i < MR; ++i) {
      int32_t quad;
      std::memcpy(&quad, t.x + i * t.ldx + 4 * q, sizeof(quad));
      const __m512i a = _mm512_set1_epi32(quad);
      for (int j = 0; j < NR; ++j) acc[i][j] = dot_quads(acc[i][j], a, b[j]);
    }
  }
  if (!t.first)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j)
        acc[i][j] = _mm512_add_epi32(acc[i][j], _mm512_loadu_si512(t.partial + i * t.ldp + j * kPanel));
  if (!t.last) {
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) _mm512_storeu_si512(t.partial + i * t.ldp + j * kPanel, acc[i][j]);
    return;
  }
  if constexpr (PAIRED) {
    store_silu_mul<MR, NR>(t, acc);
    return;
  }
  for (int j = 0; j < NR; ++j) {
    const int cols = t.cols - j * kPanel;
    if (cols <= 0) break;
    const Columns col(t.off + j * kPanel, t.sw + j * kPanel, t.bias ? t.bias + j * kPanel : nullptr, cols);
    for (int i = 0; i < MR; ++i)
      _mm256_mask_storeu_epi16(t.y + i * t.ldy + j * kPanel, col.mask, col.out(acc[i][j], t.sx[i]));
  }
}

using TileFn = void (*)(const Tile&);

// MR x NR tiles: MR * NR <= 24 accumulators plus NR weight registers and one broadcast fit in 32 zmm; at one or two
// rows (bound by memory) 8 panel streams at once.
template <int MR>
constexpr TileFn row_of_tiles(int nr) {
  if constexpr (MR <= kWideRows) {
    if (nr > kMaxNR) return nr == 5 ? tile_kernel<MR, 5, false> : nr == 6 ? tile_kernel<MR, 6, false>
                          : nr == 7 ? tile_kernel<MR, 7, false> : tile_kernel<MR, 8, false>;
  }
  return nr == 1 ? tile_kernel<MR, 1, false> : nr == 2 ? tile_kernel<MR, 2, false>
       : nr == 3 ? tile_kernel<MR, 3, false> : tile_kernel<MR, (MR > 6 ? 3 : 4), false>;
}

// Paired tiles of `pairs` gate panels and their up panels (at most 24 accumulators, as above).
template <int MR>
constexpr TileFn paired_tiles(int pairs) {
  if constexpr (MR <= kWideRows) {
    if (pairs > kMaxNR / 2) return pairs == 3 ? tile_kernel<MR, 6, true> : tile_kernel<MR, 8, true>;
  }
  if constexpr (MR > 6) return tile_kernel<MR, 2, true>;
  return pairs == 1 ? tile_kernel<MR, 2, true> : tile_kernel<MR, 4, true>;
}

template <int MR>
constexpr TileFn tiles(int nr, bool paired) { return paired ? paired_tiles<MR>(nr) : row_of_tiles<MR>(nr); }

TileFn tile_fn(int mr, int nr, bool paired) {
  switch (mr) {
    case 1: return tiles<1>(nr, paired);
    case 2: return tiles<2>(nr, paired);
    case 3: return tiles<3>(nr, paired);
    case 4: return tiles<4>(nr, paired);
    case 5: return tiles<5>(nr, paired);
    case 6: return tiles<6>(nr, paired);
    case 7: return tiles<7>(nr, paired);
    default: return tiles<8>(nr, paired);
  }
}

// Most panels of a tile of mr rows (paired: most gate panels, each with its up panel).
inline int max_nr(int mr, bool paired) {
  const int nr = mr > 6 ? 3 : mr <= kWideRows ? kWideNR : kMaxNR;
  return paired ? (mr > 6 ? 1 : nr / 2) : nr;
}

int next_rows(int64_t left) {  // one group of up to 8 rows, else groups of 6 (9 = 5 + 4)
  if (left <= kMaxMR) return static_cast<int>(left);
  return left == 9 ? 5 : 6;
}

struct Problem {
  const uint8_t* xq;  // q(x) + 128, [m][4 * quads]
  const float* sx;
  int64_t m, n, quads, kc, panels, panel_stride;
  const int8_t* w;
  const float* sw;
  const int32_t* off;
  const uint16_t* bias;
  uint16_t* y;
  int64_t ldy;
  int width;           // panels per group (paired: gate panels)
  int64_t up_panels;   // the gate/up entry: panels from a gate panel to its up panel (n: the gate columns); else 0
  int slots() const { return up_panels ? 2 * width : width; }  // accumulator panels of a group
};

}  // namespace

#include "packed_gemm_w8a8_amx.h"  // the AMX tiles, where the compiler targets AMX-INT8 (uses Problem and the above)

namespace {

// Whether this process multiplies on AMX tiles (pagellm_packed_gemm_w8a8_use_amx). Both paths give the same bits.
std::atomic<bool> g_amx{false};

// Rows [m0, m0 + mb) over panels [g, g + nr) and k-quads [k0, k0 + kc).
void run_block(const Problem& pb, int64_t g, int nr, int64_t k0, int64_t m0, int64_t mb, int32_t* partial) {
  const int64_t quads = pb.quads - k0 < pb.kc ? pb.quads - k0 : pb.kc;
  const bool paired = pb.up_panels > 0;
  for (int64_t i = 0; i < mb;) {
    const int mr = next_rows(mb - i);
    const int nr_here = nr < max_nr(mr, paired) ? nr : max_nr(mr, paired);
    for (int64_t gg = g; gg < g + nr; gg += nr_here) {
      const int nrr = static_cast<int>(g + nr - gg < nr_here ? g + nr - gg : nr_here);
      Tile t;
      t.x = pb.xq + (m0 + i) * 4 * pb.quads + 4 * k0;
      t.ldx = 4 * pb.quads;
      t.w = pb.w + gg * pb.panel_stride + k0 * kQuad;
      t.panel_stride = pb.panel_stride;
      t.quads = quads;
      t.ldp = pb.slots() * kPanel;
      t.partial = partial ? partial + i * t.ldp + (gg - g) * (paired ? 2 : 1) * kPanel : nullptr;
      t.first = k0 == 0;
      t.last = k0 + quads == pb.quads;
      t.y = pb.y + (m0 + i) * pb.ldy + gg * kPanel;
      t.ldy = pb.ldy;
      t.sx = pb.sx + m0 + i;
      t.sw = pb.sw + gg * kPanel;
      t.off = pb.off + gg * kPanel;
      t.bias = pb.bias ? pb.bias + gg * kPanel : nullptr;
      const int64_t cols = pb.n - gg * kPanel;
      t.cols = static_cast<int>(cols < nrr * kPanel ? cols : nrr * kPanel);
      t.up = pb.up_panels * pb.panel_stride;
      t.up_cols = pb.up_panels * kPanel;
      tile_fn(mr, nrr, paired)(t);
    }
    i += mr;
  }
}

// One thread's share: chunks of panels from the shared counter, each over every row (M blocks, panel groups, K
// blocks), with its int32 partial-sum buffer.
void run_tiles(const Problem& pb, const Chunks& chunks, std::atomic<int64_t>& next) {
  const int64_t rows = pb.m < kMC ? pb.m : kMC;
  std::vector<int32_t> partial(pb.quads > pb.kc ? static_cast<size_t>(rows * pb.slots() * kPanel) : 0);
  int32_t* const part = partial.empty() ? nullptr : partial.data();
  for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks.items;
       c = next.fetch_add(1, std::memory_order_relaxed)) {
    int64_t p0, p1;
    chunks.range(c, pb.panels, &p0, &p1);
    for (int64_t m0 = 0; m0 < pb.m && p0 < p1; m0 += kMC) {
      const int64_t mb = pb.m - m0 < kMC ? pb.m - m0 : kMC;
      for (int64_t g = p0; g < p1; g += pb.width)
        for (int64_t k0 = 0; k0 < pb.quads; k0 += pb.kc)
          run_block(pb, g, static_cast<int>(p1 - g < pb.width ? p1 - g : pb.width), k0, m0, mb, part);
    }
  }
}

// y[m, n] for `panels` packed panels (n outputs; with up_panels > 0, n gate outputs whose up panels lie up_panels
// on, and y = silu(gate) · up): x quantized by rows over the threads, then the tiles.
void run(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const int8_t* w, int64_t panels, int64_t n,
         int64_t up_panels, const uint16_t* bias, uint16_t* y, int64_t ldy) {
  const int64_t quads = (k + 3) / 4;
  const int64_t kblocks = (quads + kKCQ - 1) / kKCQ;
  const int64_t panel_stride = quads * kQuad;
  const float* sw = reinterpret_cast<const float*>(w + panels * panel_stride);
  const int32_t* off = reinterpret_cast<const int32_t*>(sw + panels * kPanel);
  thread_local std::vector<uint8_t> xq;  // the calling thread's, grown to the largest call
  thread_local std::vector<float> sx;
  // Whole 16-row tiles of rows and a line of slack: what the AMX tiles read (packed_gemm_w8a8_amx.h).
  const size_t xq_bytes = static_cast<size_t>((m + 15) / 16 * 16 * 4 * quads + 64);
  if (xq.size() < xq_bytes) xq.resize(xq_bytes);
  if (sx.size() < static_cast<size_t>(m)) sx.resize(static_cast<size_t>(m));
#ifdef PAGELLM_W8A8_AMX
  const bool use_amx = m >= amx8::kMinRows && g_amx.load(std::memory_order_relaxed);
#else
  const bool use_amx = false;
#endif
  // Panels per group: the VNNI tiles' accumulator panels; on AMX a pair of panels, or one gate panel with its up.
  const int width = use_amx ? (up_panels ? 1 : 2) : (m <= kWideRows ? kWideNR : kMaxNR) / (up_panels ? 2 : 1);
  const int64_t out_panels = up_panels ? up_panels : panels;
  const Problem pb{xq.data(), sx.data(), m, n, quads, (quads + kblocks - 1) / kblocks, out_panels, panel_stride, w,
                   sw, off, bias, y, ldy, width, up_panels};
  const int threads = threads_for(m * (up_panels ? 2 * n : n) * k);
  const Chunks chunks = make_chunks(out_panels, threads, width);
  std::atomic<int64_t> next{0};
  uint8_t* const xqp = xq.data();  // the region's other threads see their own thread_locals: pass the pointers
  float* const sxp = sx.data();
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    quantize_rows(x, ldx, k, quads, xqp, sxp, m * t / nt, m * (t + 1) / nt);
#pragma omp barrier
#ifdef PAGELLM_W8A8_AMX
    if (use_amx) amx8::run(pb, chunks, next); else
#endif
    run_tiles(pb, chunks, next);
  }
}

}  // namespace

extern "C" {

// Turns the AMX tiles on (want > 0, where compiled in and the kernel grants the tile state) or off (want 0); want
// < 0 only asks. Returns whether they are on. The Python side sets it once after loading (pagellm/ops/gemm_w8a8.py).
int pagellm_packed_gemm_w8a8_use_amx(int want) {
#ifdef PAGELLM_W8A8_AMX
  if (want >= 0) g_amx = want > 0 && amx8::permitted();
#else
  (void)want;
#endif
  return g_amx ? 1 : 0;
}

// The packed operand (`pack(*quantize(W))` of gemm_w8a8.py, byte for byte) of a bfloat16 W [n, k], written into
// out (its size: panels * quads * 64 bytes, then 8 bytes per padded column): the panels over torch's OpenMP threads.
// Returns 0, or -1 where a weight is not finite (out then incomplete).
int pagellm_quantize_pack_w8a8(const uint16_t* w, int64_t n, int64_t k, int8_t* out) {
  const int64_t panels = (n + kPanel - 1) / kPanel, quads = (k + 3) / 4;
  float* const scales = reinterpret_cast<float*>(out + panels * quads * kQuad);
  int32_t* const offsets = reinterpret_cast<int32_t*>(scales + panels * kPanel);
  int failed = 0;
#pragma omp parallel for schedule(static) reduction(| : failed)
  for (int64_t p = 0; p < panels; ++p) {
    int8_t* panel = out + p * quads * kQuad;
    std::memset(panel, 0, static_cast<size_t>(quads * kQuad));
    for (int c = 0; c < kPanel; ++c) {
      const int64_t col = p * kPanel + c;
      float scale = 0.0f;
      int64_t sum = 0;
      if (col < n) failed |= !quantize_column(w + col * k, k, panel, c, &scale, &sum);
      scales[col] = scale;
      offsets[col] = static_cast<int32_t>(128 * sum);
    }
  }
  return failed ? -1 : 0;
}

// x: [m, k] bf16 rows with stride ldx; w: packed (see the top of this file) for n outputs and k inputs, scales and
// offsets behind the panels; bias: [n] bf16 or null; y: [m, n] bf16 with row stride ldy. The signature of
// pagellm_packed_linear_bf16, so the decoder stack calls either. Uses torch's OpenMP threads.
void pagellm_packed_linear_w8a8(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const int8_t* w, int64_t n,
                                const uint16_t* bias, uint16_t* y, int64_t ldy) {
  if (m > 0) run(x, m, k, ldx, w, (n + kPanel - 1) / kPanel, n, 0, bias, y, ldy);
}

// y[m, n2 / 2] = silu(gate) · up of x · Wᵀ for the packed gate/up weight W [n2, k] (gate rows first, then up rows),
// in one pass, bit for bit this GEMM followed by silu_and_mul. Where n2 / 2 is whole panels: returns 0, else -1
// and nothing written (the caller makes the two calls). The signature of pagellm_packed_linear_silu_mul_bf16.
int pagellm_packed_linear_silu_mul_w8a8(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const int8_t* w,
                                        int64_t n2, uint16_t* y, int64_t ldy) {
  if (n2 % (2 * kPanel) != 0) return -1;
  if (m > 0) run(x, m, k, ldx, w, n2 / kPanel, n2 / 2, n2 / (2 * kPanel), nullptr, y, ldy);
  return 0;
}

}  // extern "C"

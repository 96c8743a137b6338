// 4-bit GEMM over pre-packed weights with a scale and a minimum per group of 32 (W4A8): bfloat16 in and out,
// y[M, N] = Σ_g (P_g · d_g + m_g · S_g) · s_x (+ bias).
//
// The weight W [N, K] is quantized once at load time (pagellm/ops/gemm_w4a8.py `quantize`), in groups of 32 inputs
// per output column, as llama.cpp's Q4_1 is: d = (max - min) / 15 and m = min, both stored as float16, and
// q = round((W - m) / d) in [0, 15], so W ≈ d · q + m. Each call quantizes its rows of x as the int8 kernel does
// (packed_gemm_w8a8.cpp), per row: s_x = max|x| / 127, q(x) = round(x · (127 / max|x|)) in [-127, 127], and keeps
// each row's group sums S_g = Σ q(x) over the group. Then for each output, over the groups in order, in float32:
// f = f + P_g · d_g, f = f + m_g · S_g, where P_g = Σ q · q(x) is the group's exact int32 dot product; finally
// y = f · s_x (+ bias), each op rounded (this source is built with -ffp-contract=off) and then rounded to
// nearest-even bfloat16. The plain-PyTorch twin and test oracle, `gemm_w4a8.reference_linear`, computes the same
// bits, and every output is the same whatever M, the tiling or the thread count: batch-invariant rows.
//
// Packed layout (`pack`): panels of 16 output columns; per panel, per group of 32 inputs, five 64-byte lines: four
// of nibbles, then the 16 float16 d and the 16 float16 m. Nibble line l holds k = 8l .. 8l + 7 of the group: byte
// 4c + i has k = 8l + i of column c in its low nibble and k = 8l + 4 + i in its high one, so the low nibbles of a
// line are the unsigned operand of one _mm512_dpbusd_epi32 (VNNI: unsigned bytes times signed ones) against four
// broadcast bytes of q(x), and the high nibbles of another. A group's 320 bytes are contiguous, so a panel streams
// in order. K is padded with zeros to whole groups, N to whole panels (their d and m are zero).
//
// The register tile is MR rows x NR panels, with one int32 accumulator (the group's dot products) and one float32
// sum per cell; per nibble line it unpacks NR lines and issues 2 · MR · NR dot products. Threads take runs of
// panels from a counter (gemm_chunks.h). The gate/up entry pairs each gate panel with its up panel in one tile and
// writes silu(gate) · up from the sums, each rounded to bfloat16 first as the GEMM's own output would be, then
// through the SiLU·mul kernel's code (silu.h): the two-call path's bits.
//
// W4A16 (gemm_w4a16.py; built where the compiler targets AVX-512 BF16): the same weights and tiles times bfloat16
// rows, not quantized. A nibble line shifted by 0, 8, 4 or 12 bits has in each 32-bit lane two 16-bit words whose
// low nibbles are two inputs of a column, which vpermw looks up as their exact bfloat16 values; vdpbf16ps multiplies
// them by a broadcast pair of x, so P = Σ q · x in float32, and f += P · d, f += m · S with S the group's float32
// sum of x. MXFP4 (gemm_mxfp4.py) is W4A16 with another table: each nibble an E2M1 code, d a power of two, m 0.
// Its twin is F.linear in float32 over d · q + m (d · e2m1(q)): the same sums up to float32 rounding.
#include <immintrin.h>
#include <omp.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemm_chunks.h"
#include "silu.h"  // round_bf16x16, silu_mul16, store_bf16x16
#include "w4a8_layout.h"

namespace {

using namespace pagellm_w4a8;  // the layout (w4a8_layout.h) is this file's own

constexpr int kPrefetchGroups = 12;       // software prefetch distance along a panel (3.75 KiB ahead), into L2
constexpr int64_t kMC = 192;              // rows per M block
constexpr int kMaxMR = 6;

struct Tile {
  const int8_t* x;       // first row of q(x), at its first group (W4A8)
  const uint16_t* xb;    // first row of x, at its first group (W4A16: bfloat16, zero-padded to whole groups)
  int64_t ldx;           // elements between rows of q(x) or x
  const float* sums;     // first row's group sums S_g (float32, exact)
  int64_t lds;           // floats between rows of sums
  const uint8_t* w;      // first panel
  int64_t panel_stride;  // bytes between panels
  int64_t groups;
  uint16_t* y;           // first row, first column of the tile
  int64_t ldy;
  const float* sx;       // the tile's rows' scales
  const uint16_t* bias;  // at the tile's first column, or null
  int cols;              // valid output columns of the tile (paired: gate columns)
  int64_t up;            // paired tiles: bytes from a gate panel to its up panel
  const uint16_t* table;  // W4A16: each nibble's bfloat16 value, 32 entries (i and i + 16 alike; kIntegers, kE2M1)
};


// acc += Σ of 4 products u8(a) · s8(b) per int32 lane (the accumulator tied in asm, as in packed_gemm_w8a8.cpp).
inline __m512i dot_quads(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

inline __m512i broadcast_quad(const int8_t* p) {
  int32_t quad;
  std::memcpy(&quad, p, sizeof(quad));
  return _mm512_set1_epi32(quad);
}

#ifdef __AVX512BF16__
// W4A16: one group of the tile, P = Σ q · x in float32 (vdpbf16ps, each nibble an exact bfloat16 times x), then
// f += P · d and f += m · S (each op rounded). Lane c of a nibble line is byte b_i = q(8l + i) | q(8l + 4 + i) << 4
// at bits 8i: shifted right by 0, 8, 4 or 12 bits, its two 16-bit words start with the nibbles of inputs (0, 2),
// (1, 3), (4, 6) or (5, 7), and vpermw looks each word's low 5 bits up in the tile's table (bfloat16(i mod 16), or
// MXFP4's values): one shift and one lookup per operand. x's rows come in that pair order (copy_rows), so each operand takes one broadcast.
template <int MR, int NR>
inline void group_step_bf16(const Tile& t, const uint8_t* w, const int64_t (&at)[NR], int64_t g,
                            __m512 (&f)[MR][NR]) {
  const __m512i values = _mm512_load_si512(t.table);
  constexpr int kShift[4] = {0, 8, 4, 12};
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint16_t* x = t.xb + g * kGroup;
  auto operand = [&](__m512i v, int p) { return _mm512_permutexvar_epi16(_mm512_srli_epi32(v, kShift[p]), values); };
  auto line = [&](int j, int l) {
    _mm_prefetch(reinterpret_cast<const char*>(w + at[j] + kPrefetchGroups * kGroupBytes + l * kLine), _MM_HINT_T1);
    return _mm512_loadu_si512(w + at[j] + l * kLine);
  };
  auto pair = [&](int i, int l, int p) {  // x's pair p of the line (pair order), broadcast
    int32_t two;
    std::memcpy(&two, x + i * t.ldx + 8 * l + 2 * p, sizeof(two));
    return (__m512bh)_mm512_set1_epi32(two);
  };
  for (int l = 0; l < kNibbleLines; ++l) {
    if constexpr (MR == 1) {  // one row: its pairs once, each panel's operands made and used in turn
      const __m512bh bc[4] = {pair(0, l, 0), pair(0, l, 1), pair(0, l, 2), pair(0, l, 3)};
      for (int j = 0; j < NR; ++j) {
        const __m512i v = line(j, l);
        for (int p = 0; p < 4; ++p) acc[0][j] = _mm512_dpbf16_ps(acc[0][j], (__m512bh)operand(v, p), bc[p]);
      }
    } else {  // several rows: each panel's line once, then pair by pair every panel's operand and each row's x
      __m512i v[NR];
      for (int j = 0; j < NR; ++j) v[j] = line(j, l);
      for (int p = 0; p < 4; ++p) {
        __m512i op[NR];
        for (int j = 0; j < NR; ++j) op[j] = operand(v[j], p);
        for (int i = 0; i < MR; ++i) {
          const __m512bh bc = pair(i, l, p);
          for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)op[j], bc);
        }
      }
    }
  }
  for (int j = 0; j < NR; ++j) {
    const uint8_t* scales = w + at[j] + kNibbleLines * kLine;
    _mm_prefetch(reinterpret_cast<const char*>(scales + kPrefetchGroups * kGroupBytes), _MM_HINT_T1);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 32)));
    for (int i = 0; i < MR; ++i) {
      f[i][j] = _mm512_add_ps(f[i][j], _mm512_mul_ps(acc[i][j], d));
      f[i][j] = _mm512_add_ps(f[i][j], _mm512_mul_ps(m, _mm512_set1_ps(t.sums[i * t.lds + g])));
    }
  }
}
#endif

// One group of the tile: its exact dot products, then f += P · d and f += m · S (each op rounded).
template <int MR, int NR>
inline void group_step(const Tile& t, const uint8_t* w, const int64_t (&at)[NR], int64_t g, __m512 (&f)[MR][NR]) {
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  __m512i acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_si512();
  const int8_t* x = t.x + g * kGroup;
  for (int l = 0; l < kNibbleLines; ++l) {
    __m512i lo[NR], hi[NR];
    for (int j = 0; j < NR; ++j) {
      const __m512i v = _mm512_loadu_si512(w + at[j] + l * kLine);
      lo[j] = _mm512_and_si512(v, nibble);
      hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      _mm_prefetch(reinterpret_cast<const char*>(w + at[j] + kPrefetchGroups * kGroupBytes + l * kLine),
                   _MM_HINT_T1);
    }
    for (int i = 0; i < MR; ++i) {
      const __m512i a = broadcast_quad(x + i * t.ldx + 8 * l), b = broadcast_quad(x + i * t.ldx + 8 * l + 4);
      for (int j = 0; j < NR; ++j) acc[i][j] = dot_quads(dot_quads(acc[i][j], lo[j], a), hi[j], b);
    }
  }
  for (int j = 0; j < NR; ++j) {
    const uint8_t* scales = w + at[j] + kNibbleLines * kLine;
    _mm_prefetch(reinterpret_cast<const char*>(scales + kPrefetchGroups * kGroupBytes), _MM_HINT_T1);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 32)));
    for (int i = 0; i < MR; ++i) {
      f[i][j] = _mm512_add_ps(f[i][j], _mm512_mul_ps(_mm512_cvtepi32_ps(acc[i][j]), d));
      f[i][j] = _mm512_add_ps(f[i][j], _mm512_mul_ps(m, _mm512_set1_ps(t.sums[i * t.lds + g])));
    }
  }
}

// MR rows by NR panels; PAIRED: panels NR / 2.. are the up panels of panels 0.. (t.up bytes on). A16: the rows are
// bfloat16 (t.xb), not quantized (no row scale).
template <int MR, int NR, bool PAIRED, bool A16>
void tile_kernel(const Tile& t) {
  __m512 f[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) f[i][j] = _mm512_setzero_ps();
  int64_t at[NR];  // each panel's offset from t.w
  for (int j = 0; j < NR; ++j)
    at[j] = PAIRED && j >= NR / 2 ? t.up + (j - NR / 2) * t.panel_stride : j * t.panel_stride;
  const uint8_t* w = t.w;
  for (int64_t g = 0; g < t.groups; ++g, w += kGroupBytes) {
#ifdef __AVX512BF16__
    if constexpr (A16) {
      group_step_bf16<MR, NR>(t, w, at, g, f);
      continue;
    }
#endif
    group_step<MR, NR>(t, w, at, g, f);
  }
  constexpr int kOut = PAIRED ? NR / 2 : NR;
  for (int j = 0; j < kOut; ++j) {
    const int cols = t.cols - j * kPanel;
    if (cols <= 0) break;
    const __mmask16 m = col_mask(cols);
    const __m512 bias = !PAIRED && t.bias ? widen_bf16(_mm256_maskz_loadu_epi16(m, t.bias + j * kPanel))
                                          : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i) {
      const __m512 sx = _mm512_set1_ps(A16 ? 1.0f : t.sx[i]);
      __m512 out = A16 ? f[i][j] : _mm512_mul_ps(f[i][j], sx);
      if constexpr (PAIRED) {
        const __m512 up = A16 ? f[i][j + NR / 2] : _mm512_mul_ps(f[i][j + NR / 2], sx);
        out = silu_mul16(round_bf16x16(out), round_bf16x16(up));
      } else if (t.bias) {
        out = _mm512_add_ps(out, bias);
      }
      store_bf16x16(t.y + i * t.ldy + j * kPanel, out, m);
    }
  }
}

using TileFn = void (*)(const Tile&);

// Most accumulator panels of a tile of mr rows: 2 · MR · NR accumulators, 2 · NR unpacked lines and two broadcasts
// fit in 32 zmm (paired tiles: an even count). One row streams 8 panels (its 16 accumulators leave the compiler room
// to use each unpacked line as it is made): about 3 % faster than 6 at one row (docs/performance.md, Round 29).
constexpr int max_nr(int mr, bool paired) {
  return mr == 1 ? 8 : mr == 2 ? 4 : mr == 3 ? (paired ? 2 : 3) : 2;
}

template <int MR, int NR, bool PAIRED, bool A16>
TileFn pick_nr(int nr) {
  if constexpr (NR <= 0) {
    return nullptr;
  } else {
    return nr == NR ? tile_kernel<MR, NR, PAIRED, A16> : pick_nr<MR, NR - (PAIRED ? 2 : 1), PAIRED, A16>(nr);
  }
}

template <int MR, bool A16>
TileFn pick(int nr, bool paired) {
  return paired ? pick_nr<MR, max_nr(MR, true), true, A16>(nr) : pick_nr<MR, max_nr(MR, false), false, A16>(nr);
}

template <bool A16>
TileFn tile_fn(int mr, int nr, bool paired) {
  switch (mr) {
    case 1: return pick<1, A16>(nr, paired);
    case 2: return pick<2, A16>(nr, paired);
    case 3: return pick<3, A16>(nr, paired);
    case 4: return pick<4, A16>(nr, paired);
    case 5: return pick<5, A16>(nr, paired);
    default: return pick<6, A16>(nr, paired);
  }
}

int next_rows(int64_t left) {  // one group of up to 6 rows, else groups of 6 (7 = 4 + 3)
  if (left <= kMaxMR) return static_cast<int>(left);
  return left == 7 ? 4 : kMaxMR;
}

struct Problem {
  const int8_t* xq;  // q(x), [m][groups * 32] (W4A8)
  const uint16_t* xb;  // x, [m][groups * 32] bfloat16 zero-padded (W4A16), or null
  const float* sums;  // [m][groups]
  const float* sx;
  int64_t m, n, groups, panels, panel_stride;
  const uint8_t* w;
  const uint16_t* bias;
  uint16_t* y;
  int64_t ldy;
  int width;          // output panels per run of tiles
  int64_t up_panels;  // the gate/up entry: panels from a gate panel to its up panel (n: the gate columns); else 0
  const uint16_t* table;  // W4A16: the nibbles' values (kIntegers or kE2M1); W4A8: null
};

// Rows [m0, m0 + mb) over output panels [g, g + np).
void run_block(const Problem& pb, int64_t g, int np, int64_t m0, int64_t mb) {
  const bool paired = pb.up_panels > 0;
  const int per = paired ? 2 : 1;  // accumulator panels per output panel
  for (int64_t i = 0; i < mb;) {
    const int mr = next_rows(mb - i);
    const int most = max_nr(mr, paired) / per;
    for (int64_t gg = g; gg < g + np; gg += most) {
      const int nrr = static_cast<int>(g + np - gg < most ? g + np - gg : most);
      Tile t;
      t.x = pb.xq + (m0 + i) * kGroup * pb.groups;
      t.xb = pb.xb ? pb.xb + (m0 + i) * kGroup * pb.groups : nullptr;
      t.ldx = kGroup * pb.groups;
      t.sums = pb.sums + (m0 + i) * pb.groups;
      t.lds = pb.groups;
      t.w = pb.w + gg * pb.panel_stride;
      t.panel_stride = pb.panel_stride;
      t.groups = pb.groups;
      t.y = pb.y + (m0 + i) * pb.ldy + gg * kPanel;
      t.ldy = pb.ldy;
      t.sx = pb.sx + m0 + i;
      t.bias = pb.bias ? pb.bias + gg * kPanel : nullptr;
      const int64_t cols = pb.n - gg * kPanel;
      t.cols = static_cast<int>(cols < nrr * kPanel ? cols : nrr * kPanel);
      t.up = pb.up_panels * pb.panel_stride;
      t.table = pb.table;
      (pb.xb ? tile_fn<true>(mr, nrr * per, paired) : tile_fn<false>(mr, nrr * per, paired))(t);
    }
    i += mr;
  }
}

// One thread's share: chunks of output panels from the shared counter, each over every row.
void run_tiles(const Problem& pb, const Chunks& chunks, std::atomic<int64_t>& next) {
  for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks.items;
       c = next.fetch_add(1, std::memory_order_relaxed)) {
    int64_t p0, p1;
    chunks.range(c, pb.panels, &p0, &p1);
    for (int64_t m0 = 0; m0 < pb.m && p0 < p1; m0 += kMC) {
      const int64_t mb = pb.m - m0 < kMC ? pb.m - m0 : kMC;
      for (int64_t g = p0; g < p1; g += pb.width)
        run_block(pb, g, static_cast<int>(p1 - g < pb.width ? p1 - g : pb.width), m0, mb);
    }
  }
}

// y[m, n] for `panels` packed panels (n outputs; with up_panels > 0, n gate outputs whose up panels lie up_panels
// on, and y = silu(gate) · up): x quantized (W4A8) or copied (a16: W4A16) by rows over the threads, then the tiles.
void run(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const uint8_t* w, int64_t panels, int64_t n,
         int64_t up_panels, const uint16_t* bias, uint16_t* y, int64_t ldy, const uint16_t* table) {
  const bool a16 = table != nullptr;
  const int64_t groups = (k + kGroup - 1) / kGroup;
  thread_local std::vector<int8_t> xq;  // the calling thread's, grown to the largest call
  thread_local std::vector<uint16_t> xb;
  thread_local std::vector<float> sums, sx;
  if (!a16 && xq.size() < static_cast<size_t>(m * kGroup * groups)) xq.resize(static_cast<size_t>(m * kGroup * groups));
  if (a16 && xb.size() < static_cast<size_t>(m * kGroup * groups)) xb.resize(static_cast<size_t>(m * kGroup * groups));
  if (sums.size() < static_cast<size_t>(m * groups)) sums.resize(static_cast<size_t>(m * groups));
  if (sx.size() < static_cast<size_t>(m)) sx.resize(static_cast<size_t>(m));
  const int width = (m == 1 ? 8 : m == 2 ? 4 : 2) / (up_panels ? 2 : 1);
  const int64_t out_panels = up_panels ? up_panels : panels;
  int8_t* const xqp = xq.data();  // the region's other threads see their own thread_locals: pass the pointers
  uint16_t* const xbp = a16 ? xb.data() : nullptr;
  float* const sump = sums.data();
  float* const sxp = sx.data();
  const Problem pb{xqp, xbp, sump, sxp, m, n, groups, out_panels, groups * kGroupBytes, w, bias, y,
                   ldy, width < 1 ? 1 : width, up_panels, table};
  const int threads = threads_for(m * (up_panels ? 2 * n : n) * k);
  const Chunks chunks = make_chunks(out_panels, threads, pb.width);
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    if (a16) {
      copy_rows(x, ldx, k, groups, xbp, sump, m * t / nt, m * (t + 1) / nt);
    } else {
      quantize_rows(x, ldx, k, groups, xqp, sump, sxp, m * t / nt, m * (t + 1) / nt);
    }
#pragma omp barrier
    run_tiles(pb, chunks, next);
  }
}

// The entries' bodies, W4A8 (table null) or W4A16 (the nibbles' values): y = x · Wᵀ (+ bias), and the gate/up one
// (-1 where n2 / 2 is not whole panels).
void linear(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const uint8_t* w, int64_t n, const uint16_t* bias,
            uint16_t* y, int64_t ldy, const uint16_t* table) {
  if (m > 0) run(x, m, k, ldx, w, (n + kPanel - 1) / kPanel, n, 0, bias, y, ldy, table);
}

int linear_silu_mul(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const uint8_t* w, int64_t n2, uint16_t* y,
                    int64_t ldy, const uint16_t* table) {
  if (n2 % (2 * kPanel) != 0) return -1;
  if (m > 0) run(x, m, k, ldx, w, n2 / kPanel, n2 / 2, n2 / (2 * kPanel), nullptr, y, ldy, table);
  return 0;
}

}  // namespace

extern "C" {

// The packed operand (`pack(*quantize(W))` of gemm_w4a8.py, byte for byte) of a bfloat16 W [n, k], written into
// out (panels * groups * 320 bytes): each panel's groups quantized and laid out in one pass, the panels over torch's
// OpenMP threads. Returns 0, or -1 where a weight is not finite or a group's d or m overflows float16 (out then
// incomplete).
int pagellm_quantize_pack_w4a8(const uint16_t* w, int64_t n, int64_t k, uint8_t* out) {
  return pack_panels(n, k, out, [&](int64_t row, int64_t g, int valid, uint8_t* q, uint16_t* d, uint16_t* m) {
    return quantize_group(w + row * k + g * kGroup, valid, q, d, m) &&
           (*d & 0x7c00) != 0x7c00 && (*m & 0x7c00) != 0x7c00;  // float16 inf or NaN
  });
}

// The packed operand (`pack(q, d, m)` of gemm_w4a8.py, byte for byte) of a 4-bit checkpoint's integers q, given as
// the bfloat16 values of a weight w [n, k], with each group's float16 d and m [n, ceil(k / 32)]. Returns 0, or -1
// where a value of w is not a whole number in [0, 15] (out then incomplete).
int pagellm_pack_groups_w4a8(const uint16_t* w, int64_t n, int64_t k, const uint16_t* d, const uint16_t* m,
                             uint8_t* out) {
  const int64_t groups = (k + kGroup - 1) / kGroup;
  return pack_panels(n, k, out, [&](int64_t row, int64_t g, int valid, uint8_t* q, uint16_t* dq, uint16_t* mq) {
    *dq = d[row * groups + g];
    *mq = m[row * groups + g];
    return take_group(w + row * k + g * kGroup, valid, q);
  });
}

// x: [m, k] bf16 rows with stride ldx; w: packed (see the top of this file) for n outputs and k inputs; bias: [n]
// bf16 or null; y: [m, n] bf16 with row stride ldy. The signature of pagellm_packed_linear_bf16, so the decoder
// stack calls either. Uses torch's OpenMP threads.
void pagellm_packed_linear_w4a8(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const uint8_t* w, int64_t n,
                                const uint16_t* bias, uint16_t* y, int64_t ldy) {
  linear(x, m, k, ldx, w, n, bias, y, ldy, nullptr);
}

// y[m, n2 / 2] = silu(gate) · up of x · Wᵀ for the packed gate/up weight W [n2, k] (gate rows first, then up rows),
// in one pass, bit for bit this GEMM followed by silu_and_mul. Where n2 / 2 is whole panels: returns 0, else -1
// and nothing written (the caller makes the two calls). The signature of pagellm_packed_linear_silu_mul_bf16.
int pagellm_packed_linear_silu_mul_w4a8(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const uint8_t* w,
                                        int64_t n2, uint16_t* y, int64_t ldy) {
  return linear_silu_mul(x, m, k, ldx, w, n2, y, ldy, nullptr);
}

#ifdef __AVX512BF16__
// W4A16 (gemm_w4a16.py): the same packed weights times bfloat16 rows, not quantized: per group P = Σ q · x in
// float32 (vdpbf16ps), then f += P · d and f += m · S with S the group's sum of x; y = f (+ bias) in bfloat16.
// The entries' signatures are the W4A8 ones'; quantize_pack is the same packing.
void pagellm_packed_linear_w4a16(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const uint8_t* w, int64_t n,
                                 const uint16_t* bias, uint16_t* y, int64_t ldy) {
  linear(x, m, k, ldx, w, n, bias, y, ldy, kIntegers);
}

int pagellm_packed_linear_silu_mul_w4a16(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const uint8_t* w,
                                         int64_t n2, uint16_t* y, int64_t ldy) {
  return linear_silu_mul(x, m, k, ldx, w, n2, y, ldy, kIntegers);
}

int pagellm_quantize_pack_w4a16(const uint16_t* w, int64_t n, int64_t k, uint8_t* out) {
  return pagellm_quantize_pack_w4a8(w, n, k, out);
}

// MXFP4 (gemm_mxfp4.py: gpt-oss's experts kept as its checkpoint stores them): the W4A16 entries with each nibble
// an E2M1 code, d the block's power of two and m 0, so the packed weight is the checkpoint's values exactly.
void pagellm_packed_linear_mxfp4(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const uint8_t* w, int64_t n,
                                 const uint16_t* bias, uint16_t* y, int64_t ldy) {
  linear(x, m, k, ldx, w, n, bias, y, ldy, kE2M1);
}

int pagellm_packed_linear_silu_mul_mxfp4(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const uint8_t* w,
                                         int64_t n2, uint16_t* y, int64_t ldy) {
  return linear_silu_mul(x, m, k, ldx, w, n2, y, ldy, kE2M1);
}
#endif

}  // extern "C"

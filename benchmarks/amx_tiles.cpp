// What one core's AMX unit reaches on this machine, by where its tile operands come from: the ceiling the packed
// GEMM (pagellm/ops/csrc/packed_gemm_amx.h) is measured against. Built and run by benchmarks/amx_tiles.py.
//
// Every case runs the GEMM's inner step, C 2 x 2 tiles fed by two A and two B tile loads per four TDPBF16PS, and
// prints GFLOP/s: tiles already loaded; operands cycling through regions the size of L1, L2 and beyond; x rows 16
// bytes off a 64-byte boundary (each tile row then spans two cache lines); and the kernel's own structure on two
// threads (256-row ranges of x, 32-row blocks, panel pairs from a shared counter, C stored per block) with and
// without writing y, plainly or non-temporally.
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure() {
  Config cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  asm volatile("" ::: "memory");
  _tile_loadconfig(&cfg);
}

uint16_t* zeros(int64_t bytes) {
  auto* p = static_cast<uint16_t*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096));
  std::memset(p, 0, bytes);
  return p;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

constexpr double kFlopPerTdp = 2.0 * 16 * 16 * 32;

// Steps of two A tiles (32 rows lda bytes apart) and two B tiles (2 KiB): A walks its rows 64 bytes a step, block
// of 32 rows after block, through a_bytes; B walks b_bytes; both start over at the end.
double step_rate(int64_t a_bytes, int64_t b_bytes, int64_t lda, int64_t a_offset) {
  uint16_t* a_base = zeros(a_bytes + 4096);
  uint16_t* b = zeros(b_bytes);
  const uint16_t* a = a_base + a_offset / 2;
  const int64_t per_block = lda / 64, blocks = a_bytes / (32 * lda), positions = per_block * blocks;
  const int64_t b_steps = b_bytes / 2048, n = 4000000;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = i % positions;
    const uint16_t* as = a + p / per_block * 16 * lda + p % per_block * 32;
    const uint16_t* bs = b + i % b_steps * 1024;
    _tile_loadd(6, bs, 64);
    _tile_loadd(7, bs + 512, 64);
    _tile_loadd(4, as, lda);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, as + 8 * lda, lda);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  const double s = seconds_since(t0);
  std::free(a_base), std::free(b);
  return n * 4 * kFlopPerTdp / s / 1e9;
}

double registers_rate() {
  const int64_t n = 10000000;
  _tile_zero(0);  // the macros are statements: one each
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  return n * 4 * kFlopPerTdp / seconds_since(t0) / 1e9;
}

// The kernel's structure: y[m, n] = x[m, k] · Wᵀ, W in 16-column panels (k / 2 pairs of 64 bytes each), work items
// (panel pair, 256-row range) from a shared counter, pair fastest; per 32-row block the four C tiles are stored and
// (write = 1 plainly, 2 non-temporally) converted to bf16 lines of y. Best of 10, GFLOP/s of all threads.
double kernel_rate(int64_t m, int64_t k, int64_t n, int write) {
  uint16_t* x = zeros(m * k * 2);
  uint16_t* w = zeros(n * k * 2);
  uint16_t* y = zeros(m * n * 2);
  const int64_t panel = k / 2 * 32, steps = k / 32, pairs = n / 32, ranges = m / 256;
  double best = 0;
  for (int rep = 0; rep < 10; ++rep) {
    std::atomic<int64_t> next{0};
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel
    {
      configure();
      alignas(64) float c[32 * 32];
      for (int64_t item = next.fetch_add(1); item < pairs * ranges; item = next.fetch_add(1)) {
        const int64_t g = item % pairs * 2, r0 = item / pairs * 256;
        const uint16_t* b0 = w + g * panel;
        const uint16_t* b1 = b0 + panel;
        for (int64_t block = 0; block < 8; ++block) {
          const uint16_t* a = x + (r0 + 32 * block) * k;
          _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
          for (int64_t s = 0; s < steps; ++s) {
            _tile_loadd(6, b0 + s * 512, 64);
            _tile_loadd(7, b1 + s * 512, 64);
            _tile_loadd(4, a + s * 32, k * 2);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, a + 16 * k + s * 32, k * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
          _tile_stored(0, c, 128);
          _tile_stored(1, c + 16, 128);
          _tile_stored(2, c + 512, 128);
          _tile_stored(3, c + 528, 128);
          for (int i = 0; write && i < 32; ++i) {
            uint16_t* dst = y + (r0 + 32 * block + i) * n + g * 16;
            const __m512i line = (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(c + 32 * i + 16), _mm512_load_ps(c + 32 * i));
            if (write == 2) _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), line);
            else _mm512_storeu_si512(dst, line);
          }
        }
      }
      _mm_sfence();
      _tile_release();
    }
    const double rate = 2.0 * m * n * k / seconds_since(t0) / 1e9;
    best = rate > best ? rate : best;
  }
  std::free(x), std::free(w), std::free(y);
  return best;
}

}  // namespace

int main() {
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) != 0) {
    std::printf("the kernel does not grant AMX tile data to this process\n");
    return 1;
  }
  configure();
  std::printf("one core, GFLOP/s:\n");
  std::printf("  tiles already loaded                         %6.0f\n", registers_rate());
  std::printf("  A and B from L1 (16 KiB each)                %6.0f\n", step_rate(16 << 10, 16 << 10, 64, 0));
  std::printf("  A from L1, B from L2 (1 MiB)                 %6.0f\n", step_rate(16 << 10, 1 << 20, 64, 0));
  std::printf("  A rows of 576 (295 KiB), B from L2 (512 KiB) %6.0f\n", step_rate(295 << 10, 512 << 10, 1152, 0));
  std::printf("  the same, x 16 bytes off a 64-byte boundary  %6.0f\n", step_rate(295 << 10, 512 << 10, 1152, 16));
  std::printf("  A and B beyond L2 (8 MiB each)               %6.0f\n", step_rate(8 << 20, 8 << 20, 64, 0));
  _tile_release();
  std::printf("the kernel's structure, %d threads, 2048 x 576 x 960 (qkv), GFLOP/s:\n", omp_get_max_threads());
  std::printf("  tiles only                                   %6.0f\n", kernel_rate(2048, 576, 960, 0));
  std::printf("  y written                                    %6.0f\n", kernel_rate(2048, 576, 960, 1));
  std::printf("  y written non-temporally                     %6.0f\n", kernel_rate(2048, 576, 960, 2));
  return 0;
}

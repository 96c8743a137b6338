// The routed experts of one mixture-of-experts layer in one call: for each expert that tokens chose, gather those
// tokens' rows, run the expert's SwiGLU MLP on them through the packed GEMM, and add each row's result, scaled by
// its routing weight, into the output row of its token.
//
// Per expert, exactly the sequence of native calls the Python layer makes (pagellm/model/layers/moe.py,
// SparseMoeBlock.routed), to the same kernels, in the same order, so the result is bit for bit the Python path's:
//   h   = silu_and_mul(packed_gemm(x[rows], W_gate_up))   (in one pass where the GEMM offers it: the same bits)
//   y   = packed_gemm(h, W_down)
//   out[rows] = bf16(out[rows] + bf16(y * scale))          (torch's index_add_ of the scaled bf16 rows)
// with the experts taken in ascending order, as the Python loop (and transformers) sum them. The caller sorts the
// (token, choice) pairs by expert: `rows` lists their tokens expert after expert, `scales` their routing weights
// (float32; Qwen's already rounded to bf16, as its Python path multiplies in bf16), `counts` how many each expert
// has. What this saves is the Python around the kernels: per expert, seven torch ops and two ctypes calls.
// The kernels are not compiled in here: the caller passes the addresses of their C entry points in their own
// libraries (ops/csrc/packed_gemm.cpp or packed_gemm_w8a8.cpp, ops/csrc/fused.cpp; see pagellm/ops/moe.py).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"  // f32, bf16

namespace {

struct MoeKernels {
  void (*linear)(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const uint16_t* w, int64_t n,
                 const uint16_t* bias, uint16_t* y, int64_t ldy);
  void (*silu_and_mul)(const uint16_t* gate_up, int64_t rows, int64_t n, uint16_t* out);
  // gate/up GEMM and SiLU·mul in one pass where the GEMM can (0), else -1 and nothing written; may be null.
  int (*linear_silu_mul)(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const uint16_t* w, int64_t n2,
                         uint16_t* y, int64_t ldy);
};

// The calling thread's scratch rows, grown to the largest call (the GEMMs' own threads only read and write the
// pointers they are handed).
struct Workspace {
  std::vector<uint16_t> x, gate_up, h, y;
  void fit(int64_t rows, int64_t hidden, int64_t inter) {
    auto grow = [](std::vector<uint16_t>& v, int64_t n) {
      if (v.size() < static_cast<size_t>(n)) v.resize(static_cast<size_t>(n));
    };
    grow(x, rows * hidden), grow(gate_up, rows * 2 * inter), grow(h, rows * inter), grow(y, rows * hidden);
  }
};

}  // namespace

extern "C" {

// x: [tokens, hidden] bf16 rows (row stride ldx); gate_up[e], down[e]: expert e's packed [2 * inter, hidden] and
// [hidden, inter] weights; rows, scales: the (token, weight) pairs grouped by expert, counts[e] of them for expert
// e; out: [tokens, hidden] bf16, overwritten. Returns 0, or -1 (out untouched) where a row names no token.
int pagellm_moe_experts_bf16(const MoeKernels* k, const uint16_t* const* gate_up, const uint16_t* const* down,
                             int64_t experts, int64_t hidden, int64_t inter, const uint16_t* x, int64_t tokens,
                             int64_t ldx, const int64_t* rows, const float* scales, const int64_t* counts,
                             uint16_t* out) {
  int64_t pairs = 0, largest = 0;
  for (int64_t e = 0; e < experts; ++e) pairs += counts[e], largest = counts[e] > largest ? counts[e] : largest;
  for (int64_t p = 0; p < pairs; ++p)
    if (rows[p] < 0 || rows[p] >= tokens) return -1;
  std::memset(out, 0, static_cast<size_t>(tokens * hidden) * sizeof(uint16_t));
  thread_local Workspace ws;
  ws.fit(largest, hidden, inter);
  int64_t start = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t m = counts[e];
    if (m == 0) continue;
    const int64_t* chosen = rows + start;
    for (int64_t r = 0; r < m; ++r)
      std::memcpy(ws.x.data() + r * hidden, x + chosen[r] * ldx, static_cast<size_t>(hidden) * sizeof(uint16_t));
    if (k->linear_silu_mul == nullptr ||
        k->linear_silu_mul(ws.x.data(), m, hidden, hidden, gate_up[e], 2 * inter, ws.h.data(), inter) != 0) {
      k->linear(ws.x.data(), m, hidden, hidden, gate_up[e], 2 * inter, nullptr, ws.gate_up.data(), 2 * inter);
      k->silu_and_mul(ws.gate_up.data(), m, inter, ws.h.data());
    }
    k->linear(ws.h.data(), m, inter, inter, down[e], hidden, nullptr, ws.y.data(), hidden);
    for (int64_t r = 0; r < m; ++r) {
      const float scale = scales[start + r];
      const uint16_t* y = ws.y.data() + r * hidden;
      uint16_t* o = out + chosen[r] * hidden;
      for (int64_t i = 0; i < hidden; ++i) o[i] = bf16(f32(o[i]) + f32(bf16(f32(y[i]) * scale)));
    }
    start += m;
  }
  return 0;
}

}  // extern "C"

// A mixture-of-experts layer in one call: the router's GEMM, the routing (softmax over the experts in float32, the
// top_k most probable, renormalised where the model says so; gpt-oss's: the softmax of its top_k logits), and for
// each expert that tokens chose: gather those tokens' rows, run the expert's SwiGLU MLP on them through the packed
// GEMM (gpt-oss's: with biases and its clamped SwiGLU), and add each row's result, scaled by its routing weight,
// into the output row of its token. The Python layer (pagellm/model/layers/moe.py) and the
// native decoder stack (decoder_stack.cpp, through MoeLayer) both call pagellm_moe_forward_bf16, so they agree bit
// for bit.
//
// The experts' part makes exactly the sequence of native calls of the Python loop (SparseMoeBlock.routed_torch), to
// the same kernels, in the same order, so given the same routing it is bit for bit that loop's:
//   h   = silu_and_mul(packed_gemm(x[rows], W_gate_up))   (in one pass where the GEMM offers it: the same bits)
//   y   = packed_gemm(h, W_down)
//   out[rows] = bf16(out[rows] + bf16(y * scale))          (torch's index_add_ of the scaled bf16 rows)
// with the experts taken in ascending order, as the Python loop (and transformers) sum them. The routing is
// torch's up to the last bits of the softmax (its twin is model/layers/moe.py `route`): the (token, choice) pairs
// sorted by expert, tokens ascending within one (a counting sort: torch's stable argsort's order), `scales` their
// routing weights (Qwen's rounded to bf16, as its Python path multiplies in bf16). What this saves is the Python
// around the kernels: per expert, seven torch ops and two ctypes calls; per layer, the router and routing ops.
// The kernels are not compiled in here: the caller passes the addresses of their C entry points in their own
// libraries (ops/csrc/packed_gemm.cpp or packed_gemm_w8a8.cpp, ops/csrc/fused.cpp; see pagellm/ops/moe.py).
#include <algorithm>
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
  // the bfloat16 GEMM, for the router (which stays bfloat16 when the experts are int8)
  void (*router_linear)(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const uint16_t* w, int64_t n,
                        const uint16_t* bias, uint16_t* y, int64_t ldy);
  // gpt-oss's clamped SwiGLU over [gate | up] (fused.cpp pagellm_clamped_swiglu_bf16)
  void (*clamped_swiglu)(const uint16_t* gate_up, int64_t rows, int64_t n, float limit, float alpha, uint16_t* out);
};

// One layer's router and experts, as pagellm/ops/moe.py binds them.
struct MoeLayer {
  const MoeKernels* kernels;
  const uint16_t* router;          // packed bf16 [experts, hidden]
  const uint16_t* const* gate_up;  // [experts] packed [2 * inter, hidden]
  const uint16_t* const* down;     // [experts] packed [hidden, inter]
  int64_t experts, top_k, hidden, inter;
  int64_t renormalize;             // divide the top_k probabilities by their sum
  int64_t weights_in_model_dtype;  // round the routing weights to bf16 (Qwen)
  // Qwen2-MoE's shared expert (null where there is none): packed [2 * shared_inter, hidden] and
  // [hidden, shared_inter] in the experts' format, and its gate, packed bf16 [1, hidden]
  const uint16_t* shared_gate_up;
  const uint16_t* shared_down;
  const uint16_t* shared_gate;
  int64_t shared_inter;
  // gpt-oss's (null or 0 where a model has none): the router's bias [experts]; each expert's gate/up bias
  // [2 * inter] and its down projection's [hidden] (null on tensor-parallel ranks but the first: its partial sums
  // take it once), added after that GEMM as the Python layer adds it; routing weights as the softmax of the top_k
  // logits; the clamped SwiGLU's limit (0: SiLU) and alpha
  const uint16_t* router_bias;
  const uint16_t* const* gate_up_bias;
  const uint16_t* const* down_bias;
  int64_t softmax_top_k;
  float swiglu_limit, swiglu_alpha;
};

// The calling thread's scratch rows, grown to the largest call (the GEMMs' own threads only read and write the
// pointers they are handed).
struct Workspace {
  std::vector<uint16_t> x, gate_up, h, y, logits;
  std::vector<int64_t> rows, counts, chosen, sorted;  // rows: the counting sort's offsets; sorted: its result
  std::vector<float> scales, probs, weights;
  void fit(int64_t rows, int64_t hidden, int64_t inter) {
    auto grow = [](std::vector<uint16_t>& v, int64_t n) {
      if (v.size() < static_cast<size_t>(n)) v.resize(static_cast<size_t>(n));
    };
    grow(x, rows * hidden), grow(gate_up, rows * 2 * inter), grow(h, rows * inter), grow(y, rows * hidden);
  }
};

// The (token, choice) pairs of `tokens` rows of router logits, grouped by expert (see the top of this file).
void route(const uint16_t* logits, int64_t tokens, int64_t experts, int64_t top_k, bool renormalize,
           bool weights_in_model_dtype, int64_t* rows, float* scales, int64_t* counts, Workspace& ws,
           bool softmax_top_k = false) {
  ws.probs.resize(static_cast<size_t>(experts));
  ws.chosen.resize(static_cast<size_t>(tokens * top_k));
  ws.weights.resize(static_cast<size_t>(tokens * top_k));
  std::fill(counts, counts + experts, int64_t{0});
  float* p = ws.probs.data();
  for (int64_t t = 0; t < tokens; ++t) {
    const uint16_t* l = logits + t * experts;
    float top = -INFINITY, sum = 0.f;
    for (int64_t e = 0; e < experts; ++e) top = std::max(top, f32(l[e]));
    if (softmax_top_k) {  // gpt-oss: rank by the logits, the softmax of the chosen ones below
      for (int64_t e = 0; e < experts; ++e) p[e] = f32(l[e]) - top;  // ordered as the logits
    } else {
      for (int64_t e = 0; e < experts; ++e) sum += p[e] = std::exp(f32(l[e]) - top);
      for (int64_t e = 0; e < experts; ++e) p[e] /= sum;
    }
    int64_t* chosen = ws.chosen.data() + t * top_k;
    float* w = ws.weights.data() + t * top_k;
    float picked = 0.f;
    for (int64_t j = 0; j < top_k; ++j) {  // the most probable left; exact ties: the lower index (torch: unspecified)
      int64_t best = -1;
      for (int64_t e = 0; e < experts; ++e)
        if (p[e] > -INFINITY && (best < 0 || p[e] > p[best])) best = e;
      chosen[j] = best, w[j] = p[best], p[best] = -INFINITY;
      picked += w[j];
    }
    if (softmax_top_k) {  // torch.softmax of the chosen logits in float32 (w[0] is the largest)
      const float first = w[0];
      float total = 0.f;
      for (int64_t j = 0; j < top_k; ++j) total += w[j] = std::exp(w[j] - first);
      for (int64_t j = 0; j < top_k; ++j) w[j] /= total;
    }
    for (int64_t j = 0; j < top_k; ++j) {
      if (renormalize && !softmax_top_k) w[j] /= picked;
      if (weights_in_model_dtype) w[j] = f32(bf16(w[j]));
      ++counts[chosen[j]];
    }
  }
  ws.rows.assign(static_cast<size_t>(experts), 0);  // each expert's next free place
  for (int64_t e = 1; e < experts; ++e) ws.rows[e] = ws.rows[e - 1] + counts[e - 1];
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    const int64_t at = ws.rows[ws.chosen[i]]++;
    rows[at] = i / top_k, scales[at] = ws.weights[i];
  }
}

// out += sigmoid(x · gate) * shared(x), rounded as the Python layer's torch ops round (each op to bf16).
void add_shared_expert(const MoeLayer* l, const uint16_t* x, int64_t tokens, int64_t ldx, uint16_t* out,
                       Workspace& ws) {
  const MoeKernels* k = l->kernels;
  const int64_t hidden = l->hidden, si = l->shared_inter;
  ws.fit(tokens, hidden, si);
  if (k->linear_silu_mul == nullptr ||
      k->linear_silu_mul(x, tokens, hidden, ldx, l->shared_gate_up, 2 * si, ws.h.data(), si) != 0) {
    k->linear(x, tokens, hidden, ldx, l->shared_gate_up, 2 * si, nullptr, ws.gate_up.data(), 2 * si);
    k->silu_and_mul(ws.gate_up.data(), tokens, si, ws.h.data());
  }
  k->linear(ws.h.data(), tokens, si, si, l->shared_down, hidden, nullptr, ws.y.data(), hidden);
  ws.logits.resize(static_cast<size_t>(tokens));  // the router's logits are used up: the gate's [tokens, 1]
  k->router_linear(x, tokens, hidden, ldx, l->shared_gate, 1, nullptr, ws.logits.data(), 1);
  for (int64_t t = 0; t < tokens; ++t) {
    const float gate = f32(bf16(1.f / (1.f + std::exp(-f32(ws.logits[t])))));
    const uint16_t* y = ws.y.data() + t * hidden;
    uint16_t* o = out + t * hidden;
    for (int64_t i = 0; i < hidden; ++i) o[i] = bf16(f32(o[i]) + f32(bf16(gate * f32(y[i]))));
  }
}

// h = act(x[rows] · W_gate_up + b) for expert e into ws.h (SiLU·mul in the GEMM's pass where it offers one).
void expert_hidden(const MoeLayer* l, int64_t e, int64_t m, Workspace& ws) {
  const MoeKernels* k = l->kernels;
  const int64_t hidden = l->hidden, inter = l->inter;
  const uint16_t* bias = l->gate_up_bias ? l->gate_up_bias[e] : nullptr;
  if (l->swiglu_limit == 0.f && bias == nullptr && k->linear_silu_mul != nullptr &&
      k->linear_silu_mul(ws.x.data(), m, hidden, hidden, l->gate_up[e], 2 * inter, ws.h.data(), inter) == 0)
    return;
  k->linear(ws.x.data(), m, hidden, hidden, l->gate_up[e], 2 * inter, bias, ws.gate_up.data(), 2 * inter);
  if (l->swiglu_limit != 0.f)
    k->clamped_swiglu(ws.gate_up.data(), m, inter, l->swiglu_limit, l->swiglu_alpha, ws.h.data());
  else
    k->silu_and_mul(ws.gate_up.data(), m, inter, ws.h.data());
}

void run_experts(const MoeLayer* l, const uint16_t* x, int64_t tokens, int64_t ldx, const int64_t* rows,
                 const float* scales, const int64_t* counts, uint16_t* out, Workspace& ws) {
  const int64_t experts = l->experts, hidden = l->hidden, inter = l->inter;
  int64_t largest = 0;
  for (int64_t e = 0; e < experts; ++e) largest = counts[e] > largest ? counts[e] : largest;
  std::memset(out, 0, static_cast<size_t>(tokens * hidden) * sizeof(uint16_t));
  ws.fit(largest, hidden, inter);
  int64_t start = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t m = counts[e];
    if (m == 0) continue;
    const int64_t* chosen = rows + start;
    for (int64_t r = 0; r < m; ++r)
      std::memcpy(ws.x.data() + r * hidden, x + chosen[r] * ldx, static_cast<size_t>(hidden) * sizeof(uint16_t));
    expert_hidden(l, e, m, ws);
    l->kernels->linear(ws.h.data(), m, inter, inter, l->down[e], hidden, nullptr, ws.y.data(), hidden);
    const uint16_t* bias = l->down_bias ? l->down_bias[e] : nullptr;
    for (int64_t r = 0; r < m; ++r) {
      const float scale = scales[start + r];
      uint16_t* y = ws.y.data() + r * hidden;
      uint16_t* o = out + chosen[r] * hidden;
      if (bias)  // the Python layer adds it to the GEMM's bfloat16 output
        for (int64_t i = 0; i < hidden; ++i) y[i] = bf16(f32(y[i]) + f32(bias[i]));
      for (int64_t i = 0; i < hidden; ++i) o[i] = bf16(f32(o[i]) + f32(bf16(f32(y[i]) * scale)));
    }
    start += m;
  }
}

}  // namespace

extern "C" {

// x: [tokens, hidden] bf16 rows (row stride ldx); the layer's experts (its router unused); rows, scales: the
// (token, weight) pairs grouped by expert, counts[e] of them for expert e; out: [tokens, hidden] bf16, overwritten.
// Returns 0, or -1 (out untouched) where a row names no token.
int pagellm_moe_experts_bf16(const MoeLayer* l, const uint16_t* x, int64_t tokens, int64_t ldx, const int64_t* rows,
                             const float* scales, const int64_t* counts, uint16_t* out) {
  int64_t pairs = 0;
  for (int64_t e = 0; e < l->experts; ++e) pairs += counts[e];
  for (int64_t p = 0; p < pairs; ++p)
    if (rows[p] < 0 || rows[p] >= tokens) return -1;
  thread_local Workspace ws;
  run_experts(l, x, tokens, ldx, rows, scales, counts, out, ws);
  return 0;
}

// The routing alone (for tests): logits [tokens, experts] bf16 → rows, scales [tokens * top_k], counts [experts].
void pagellm_moe_route_bf16(const uint16_t* logits, int64_t tokens, int64_t experts, int64_t top_k,
                            int64_t renormalize, int64_t weights_in_model_dtype, int64_t* rows, float* scales,
                            int64_t* counts, int64_t softmax_top_k) {
  thread_local Workspace ws;
  route(logits, tokens, experts, top_k, renormalize != 0, weights_in_model_dtype != 0, rows, scales, counts, ws,
        softmax_top_k != 0);
}

// The whole layer: out [tokens, hidden] (overwritten) = Σ over each token's top_k experts of weight · expert(x).
void pagellm_moe_forward_bf16(const MoeLayer* l, const uint16_t* x, int64_t tokens, int64_t ldx, uint16_t* out) {
  if (tokens <= 0) return;
  thread_local Workspace ws;
  const int64_t pairs = tokens * l->top_k;
  ws.logits.resize(static_cast<size_t>(tokens * l->experts));
  ws.scales.resize(static_cast<size_t>(pairs));
  ws.counts.resize(static_cast<size_t>(l->experts));
  ws.sorted.resize(static_cast<size_t>(pairs));
  l->kernels->router_linear(x, tokens, l->hidden, ldx, l->router, l->experts, l->router_bias, ws.logits.data(),
                            l->experts);
  route(ws.logits.data(), tokens, l->experts, l->top_k, l->renormalize != 0, l->weights_in_model_dtype != 0,
        ws.sorted.data(), ws.scales.data(), ws.counts.data(), ws, l->softmax_top_k != 0);
  run_experts(l, x, tokens, ldx, ws.sorted.data(), ws.scales.data(), ws.counts.data(), out, ws);
  if (l->shared_gate_up) add_shared_expert(l, x, tokens, ldx, out, ws);
}

}  // extern "C"

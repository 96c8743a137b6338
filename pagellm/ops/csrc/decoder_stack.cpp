// The bfloat16 Llama decoder stack in one call: embedding output -> the first `num_layers` decoder layers -> final
// RMSNorm, for one flat batch of T tokens of mixed rows (decodes, prompt chunks, speculative chains and trees),
// each layer writing its K/V rows into its paged cache and attending with the paged attention kernel.
//
// Per layer, exactly the sequence of native calls the Python layers make (pagellm/model/llama.py), to the same
// kernels, in the same order (on tensor-parallel ranks with the same all-reduce after o_proj and after down_proj or
// the experts, a callback into the caller's collective), so the result is bit for bit the result of the Python path:
//   h, res = add_rms_norm(x, res)            (first layer: res = x; Cohere's: add_layer_norm, here and at the end)
//   qkv    = packed_gemm(h, W_qkv) + b_qkv       (each GEMM's input rows first reordered where its weight is a
//                                                  4-bit act-order one: the Python layers' index_select)
//   q, k   = rms_norm(q / k of each head)             (Qwen3 only: contiguous copies, per-head rows)
//   q, k   = rotary(qkv[:, :q], qkv[:, q:q+kv])      (into contiguous rows; copied unrotated in a NoPE layer)
//   cache[slot[t]] = k[t], v[t]                      (write_kv)
//   x      = packed_gemm(paged_attention(q), W_o)   (times the residual scale, Granite's, as each sublayer's x;
//                                                     Gemma 2's scores soft-capped inside the attention kernel,
//                                                     gpt-oss's sinks in its softmax; gpt-oss's o_proj bias added
//                                                     after the ranks' sum, as the Python layer adds it)
//   h, res = add_rms_norm(x, res)             (Gemma's: x = rms_norm(x) first, and its pre-MLP norm's weight;
//                                              Cohere's: res = res + x, and the MLP takes the first norm's h)
//   x      = packed_gemm(silu_and_mul(packed_gemm(h, W_gate_up)), W_down)   (the inner two in one pass where
//            the GEMM offers it: pagellm_packed_linear_silu_mul_bf16 (AMX, AVX-512), _w8a8 (int8); the same bits;
//            Gemma's GeGLU, gelu_tanh_and_mul, in place of silu_and_mul; then, Gemma's, x = rms_norm(x))
//            or, in a mixture of experts' sparse layer, x = moe(h): the layer's router, routing and experts in the
//            call the Python layer makes too (ops/csrc/moe.cpp pagellm_moe_forward_bf16)
// then out = add_rms_norm(x, res).out. A pipeline stage's call takes the previous stage's x and res (res given: the
// first layer adds it, as every later layer does) and, unless it is the last stage, hands x and res on as they are
// (no final norm). What it saves is everything around the kernels: Python dispatch, torch
// allocations (one grow-only per-thread workspace instead), views, index ops and ctypes marshalling per layer.
// The kernels are not compiled in here: the caller passes the addresses of their C entry points in their own
// libraries (ops/csrc/packed_gemm.cpp, ops/csrc/fused.cpp, attention/csrc/paged_attention.cpp; see
// pagellm/ops/decoder_stack.py), so this file builds in a fraction of a second and always runs the kernels'
// current code. The plain-PyTorch twin and oracle is the Python layer stack.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

#include "bf16.h"
#include "fp8.h"

namespace {

// The kernels' C entry points (signatures as exported by their sources).
struct StackKernels {
  void (*linear)(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const uint16_t* w, int64_t n,
                 const uint16_t* bias, uint16_t* y, int64_t ldy);
  void (*add_rms_norm)(const uint16_t* x, const uint16_t* residual, const uint16_t* weight, int64_t rows,
                       int64_t n, float eps, uint16_t* out, uint16_t* residual_out);
  void (*silu_and_mul)(const uint16_t* gate_up, int64_t rows, int64_t n, uint16_t* out);
  void (*rotary)(const uint16_t* q, int64_t q_stride, const uint16_t* k, int64_t k_stride, const uint16_t* cos,
                 const uint16_t* sin, const int64_t* positions, int64_t rows, int64_t heads, int64_t kv_heads,
                 int64_t head_dim, int64_t rot_dim, uint16_t* q_out, uint16_t* k_out);
  void (*attention)(const void* q, const void* k_cache, const void* v_cache, const int64_t* block_table,
                    const int64_t* query_start, const int64_t* seq_lens, const int64_t* ctx_end,
                    const int64_t* ctx_start, const uint64_t* tree_bits, int64_t tree_words, int64_t rows,
                    int64_t heads, int64_t head_dim, int64_t block_size, int64_t kv_heads, int64_t max_blocks,
                    int64_t flash_min_tokens, float scale, void* out, const float* sinks, float softcap);
  // gate/up GEMM and SiLU·mul in one pass where the GEMM can (0), else -1 and nothing written; may be null.
  int (*linear_silu_mul)(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const uint16_t* w, int64_t n2,
                         uint16_t* y, int64_t ldy);
  // a mixture of experts' layer (ops/csrc/moe.cpp, its MoeLayer as `layer`); null where no layer has experts
  void (*moe)(const void* layer, const uint16_t* x, int64_t tokens, int64_t ldx, uint16_t* out);
  // tensor parallelism: sum n bfloat16 values in place across the ranks (the caller's collective, as the Python
  // layers' row-parallel o_proj and down_proj, and a mixture's experts, call it); null on one rank
  void (*all_reduce)(uint16_t* data, int64_t n);
  // Gemma's GeGLU (StackShape::gelu), as silu_and_mul; null where no model needs it
  void (*gelu_and_mul)(const uint16_t* gate_up, int64_t rows, int64_t n, uint16_t* out);
  // Cohere's LayerNorm (StackShape::layer_norm), as add_rms_norm takes its arguments
  void (*add_layer_norm)(const uint16_t* x, const uint16_t* residual, const uint16_t* weight, int64_t rows,
                         int64_t n, float eps, uint16_t* out, uint16_t* residual_out);
};

// One decoder layer's weights (packed GEMM weights as made by pagellm/ops/gemm.py `pack`, or all four the int8
// operands of pagellm/ops/gemm_w8a8.py `pack`: StackKernels::linear is then the int8 GEMM's entry) and its caches.
struct StackLayer {
  const uint16_t* input_norm;  // [hidden], or null with StackShape::post_norms
  const uint16_t* qkv;         // packed [(heads + 2 kv_heads) * head_dim, hidden]
  const uint16_t* qkv_bias;    // [(heads + 2 kv_heads) * head_dim] or null
  const uint16_t* o;           // packed [hidden, heads * head_dim]
  const uint16_t* post_norm;   // [hidden]: before the MLP; with StackShape::post_norms, on attention's output;
                               // null with StackShape::parallel
  const uint16_t* gate_up;     // packed [2 * intermediate, hidden]
  const uint16_t* down;        // packed [hidden, intermediate]
  void* k_cache;               // [num_blocks, block_size, kv_heads, head_dim] of StackShape::kv_format elements
  void* v_cache;
  const uint16_t* q_norm;      // [head_dim] RMSNorm weight over each head's q (Qwen3), or null (then k_norm too);
  const uint16_t* k_norm;      // [head_dim]  ([heads * head_dim], [kv_heads * head_dim] with qk_all_heads)
  const void* moe;             // a sparse layer's MoeLayer (gate_up and down unused), or null: a dense MLP
  int64_t windowed;            // 1: attends inside the model's sliding window (StackStep::ctx_start); 0: every key
  int64_t rotated;             // 1: q and k take the rotary embedding; 0: a NoPE layer (SmolLM3's): not rotated
  // The order [K] in which a 4-bit act-order GEMM weight takes its inputs (gemm.input_order), or null: in order.
  const int64_t *qkv_order, *o_order, *gate_up_order, *down_order;
  const uint16_t* post_ffn_norm;  // [hidden] on the MLP's output, with StackShape::post_norms or sandwich; else null
  const uint16_t* pre_ffn_norm;   // [hidden] before the MLP, with StackShape::sandwich; else null
  const uint16_t *cos, *sin;      // this layer's own rotary tables (Gemma 3's sliding layers), or null: the stack's
  const float* sinks;             // [heads] gpt-oss's attention sinks, one logit per head, or null
  const uint16_t* o_bias;         // [hidden] o_proj's bias (gpt-oss's), added after the ranks' sum, or null
};

enum KvFormat : int64_t { kKvBf16 = 0, kKvFp8E4M3 = 1, kKvFp8E5M2 = 2 };

struct StackShape {
  int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size;
  int64_t cache_slots, max_positions;  // slots per cache (num_blocks * block_size), rows of cos/sin
  int64_t rot_dim;                     // rotated dimensions of each head, the width of cos/sin (<= head_dim)
  float eps, scale;
  int64_t kv_format;  // KvFormat of every layer's cache; `attention` is the entry for it
  float residual_scale;  // each sublayer's output times this before it joins the residual (Granite's); 1: none
  // 1: OLMo's layer: no norm before attention or the MLP, each one's output normed (post_norm, post_ffn_norm)
  // before it joins the residual stream, which is their input
  int64_t post_norms;
  int64_t qk_all_heads;  // 1: q_norm and k_norm span all of a token's heads (OLMo's), not each head
  // 1: Gemma 2 and 3's layer: Llama's norms before attention (input_norm) and the MLP (pre_ffn_norm), and each
  // one's output normed (post_norm, post_ffn_norm) before it joins the residual stream
  int64_t sandwich;
  int64_t gelu;   // 1: the MLP's gate is GeGLU (Gemma's, StackKernels::gelu_and_mul), not SiLU
  float softcap;  // attention scores capped at softcap * tanh(score / softcap) (Gemma 2's); 0: not capped
  int64_t layer_norm;  // 1: the hidden states' norms (each layer's input norm, the final norm) are Cohere's LayerNorm
  // 1: Cohere's layer: attention and the MLP both take the input norm's output; attention's output joins the
  // residual stream, the MLP's is the layer's x
  int64_t parallel;
};

using NormFn = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, int64_t, int64_t, float, uint16_t*,
                        uint16_t*);

// The hidden states' norm: Cohere's LayerNorm, else RMSNorm.
NormFn hidden_norm(const StackKernels& f, const StackShape& s) {
  return s.layer_norm ? f.add_layer_norm : f.add_rms_norm;
}

// The step's tokens and the attention metadata of attention/cpu_paged.py CpuPagedMetadata.
struct StackStep {
  int64_t tokens, rows, max_blocks, tree_words, flash_min_tokens;
  const int64_t* positions;    // [T]
  const int64_t* slots;        // [T] cache slot of each token
  const int64_t* block_table;  // [rows, max_blocks]
  const int64_t* query_start;  // [rows + 1]
  const int64_t* seq_lens;     // [rows]
  const int64_t* ctx_end;      // [T]
  const uint64_t* tree_bits;   // [T, tree_words] or null
  const int64_t* ctx_start;    // [T] each token's first key inside the sliding window (windowed layers), or null
};

// Scratch rows for one step, carved out of a grow-only per-thread buffer (no allocation once it has grown).
struct Scratch {
  uint16_t *x, *res, *h, *wide, *q, *k, *attn, *act, *kn, *ordered;
};

Scratch scratch_for(const StackShape& s, int64_t t, bool reorders) {
  // On a 64-byte boundary, as every array carved out of it (operator new gives 16 bytes, and glibc's large blocks
  // sit 16 bytes past a page): a misaligned row of x makes each 64-byte AMX tile row and each output line span two
  // cache lines (one core's tile rate 0.6x, benchmarks/amx_tiles.py; a 32 x 128-token prefill 1.2 -> 1.0 s).
  struct Free {
    void operator()(uint16_t* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<uint16_t[], Free> buffer;
  thread_local int64_t capacity = 0;
  const int64_t qkv = (s.heads + 2 * s.kv_heads) * s.head_dim;
  const int64_t wide = qkv > 2 * s.intermediate ? qkv : 2 * s.intermediate;  // qkv, then gate_up, share it
  const int64_t inputs = s.hidden > s.heads * s.head_dim ? s.hidden : s.heads * s.head_dim;
  // any GEMM's inputs, reordered (only where a layer's weights take their inputs in an order of their own)
  const int64_t ordered = !reorders ? 0 : inputs > s.intermediate ? inputs : s.intermediate;
  const int64_t per_token = 3 * s.hidden + wide + 2 * s.heads * s.head_dim + 2 * s.kv_heads * s.head_dim +
                            s.intermediate + ordered + 40;  // + 40: 64-byte slack per array
  const int64_t need = per_token * t;
  if (need > capacity) {
    buffer.reset(static_cast<uint16_t*>(std::aligned_alloc(64, (need * sizeof(uint16_t) + 63) / 64 * 64)));
    if (!buffer) throw std::bad_alloc();
    capacity = need;
  }
  uint16_t* p = buffer.get();
  auto take = [&p, t](int64_t width) {
    uint16_t* out = p;
    p += (width * t + 31) / 32 * 32;  // keep each array on a 64-byte boundary
    return out;
  };
  Scratch sc;
  sc.x = take(s.hidden);
  sc.res = take(s.hidden);
  sc.h = take(s.hidden);
  sc.wide = take(wide);
  sc.q = take(s.heads * s.head_dim);
  sc.k = take(s.kv_heads * s.head_dim);
  sc.attn = take(s.heads * s.head_dim);
  sc.act = take(s.intermediate);
  sc.kn = take(s.kv_heads * s.head_dim);
  sc.ordered = take(ordered);
  return sc;
}

// The t rows [t, k] of a GEMM's input x with their inputs in the weight's `order` (an act-order weight's; the
// Python layers' index_select), in `out`; x itself where the order is null.
const uint16_t* in_order(const uint16_t* x, int64_t t, int64_t k, const int64_t* order, uint16_t* out) {
  if (!order) return x;
  for (int64_t i = 0; i < t; ++i) {
    const uint16_t* row = x + i * k;
    uint16_t* dst = out + i * k;
    for (int64_t j = 0; j < k; ++j) dst[j] = row[order[j]];
  }
  return out;
}

// n bfloat16 values rounded into an 8-bit cache row (fp8.h: the bits torch's float8 conversion gives).
template <typename F>
void store_fp8(F* dst, const uint16_t* src, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    pagellm::fp8_store16(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)));
  }
#endif
  for (; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    dst[i] = pagellm::fp8_from_float<F>(f);
  }
}

void store_row(int64_t format, void* cache, int64_t slot, const uint16_t* src, int64_t row) {
  if (format == kKvFp8E4M3)
    store_fp8(static_cast<pagellm::Fp8E4M3*>(cache) + slot * row, src, row);
  else if (format == kKvFp8E5M2)
    store_fp8(static_cast<pagellm::Fp8E5M2*>(cache) + slot * row, src, row);
  else
    std::memcpy(static_cast<uint16_t*>(cache) + slot * row, src, row * sizeof(uint16_t));
}

// write_kv: each token's rotated k row and its v row (a view into the qkv output) into its cache slot.
void write_kv(const StackShape& s, const StackStep& st, const uint16_t* k, const uint16_t* qkv, int64_t qkv_n,
              void* k_cache, void* v_cache) {
  const int64_t row = s.kv_heads * s.head_dim, v_off = (s.heads + s.kv_heads) * s.head_dim;
  for (int64_t t = 0; t < st.tokens; ++t) {
    store_row(s.kv_format, k_cache, st.slots[t], k + t * row, row);
    store_row(s.kv_format, v_cache, st.slots[t], qkv + t * qkv_n + v_off, row);
  }
}

// Ask for the cache lines write_kv will store into, with intent to write, before the qkv GEMM: a decode step's
// slots are scattered over the pool and long out of the caches, and each store that misses would otherwise wait
// for its line in write_kv (about 1 ms of a batch-32 step over 30 layers). Only for small steps (at most
// kPrefetchSlotBytes of K and V), so that a prompt chunk's rows do not push the GEMM's blocks out of L2.
constexpr int64_t kPrefetchSlotBytes = 128 * 1024;

void prefetch_slots(const StackShape& s, const StackStep& st, const void* k_cache, const void* v_cache) {
  const int64_t bytes = s.kv_heads * s.head_dim * (s.kv_format == kKvBf16 ? 2 : 1);
  if (2 * bytes * st.tokens > kPrefetchSlotBytes) return;
  for (int64_t t = 0; t < st.tokens; ++t) {
    const char* kp = static_cast<const char*>(k_cache) + st.slots[t] * bytes;
    const char* vp = static_cast<const char*>(v_cache) + st.slots[t] * bytes;
    for (int64_t b = 0; b < bytes; b += 64) {
      __builtin_prefetch(kp + b, 1, 3);
      __builtin_prefetch(vp + b, 1, 3);
    }
  }
}

// x *= scale, each product rounded to bfloat16 as torch rounds a bfloat16 tensor times a float (in float32).
void scale_rows(uint16_t* x, int64_t n, float scale) {
  if (scale == 1.0f) return;
#pragma omp parallel for simd schedule(static) if (n >= (int64_t{1} << 16))
  for (int64_t i = 0; i < n; ++i) x[i] = bf16(f32(x[i]) * scale);
}

// Each of the t rows of x plus bias [n], rounded to bfloat16 as torch rounds a bfloat16 tensor plus a row.
void add_bias(uint16_t* x, const uint16_t* bias, int64_t t, int64_t n) {
#pragma omp parallel for schedule(static) if (t * n >= (int64_t{1} << 16))
  for (int64_t i = 0; i < t; ++i) {
    uint16_t* row = x + i * n;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) row[j] = bf16(f32(row[j]) + f32(bias[j]));
  }
}

// x += y, each sum rounded to bfloat16 as torch rounds a sum of two bfloat16 tensors.
void add_rows(uint16_t* x, const uint16_t* y, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= (int64_t{1} << 16))
  for (int64_t i = 0; i < n; ++i) x[i] = bf16(f32(x[i]) + f32(y[i]));
}

// The MLP's output as it joins the residual: scaled (Granite's), or normed (post_norms, sandwich; in place).
void finish_mlp(const StackKernels& f, const StackShape& s, const StackLayer& l, int64_t t, const Scratch& sc) {
  scale_rows(sc.x, t * s.hidden, s.residual_scale);
  if (s.post_norms || s.sandwich) f.add_rms_norm(sc.x, nullptr, l.post_ffn_norm, t, s.hidden, s.eps, sc.x, sc.x);
}

// Attention's output x joining the residual stream, and the MLP's input: h, res = add_rms_norm(x, res) (Llama's);
// OLMo's: the stream takes x normed and is the MLP's input (h unused); Gemma's: x normed, then Llama's with the
// pre-MLP norm; Cohere's: the stream takes x, and the MLP the input norm's h. Returns the MLP's input.
const uint16_t* join_attention(const StackKernels& f, const StackShape& s, const StackLayer& l, int64_t t,
                               const Scratch& sc) {
  if (s.parallel) {
    add_rows(sc.res, sc.x, t * s.hidden);
    return sc.h;
  }
  if (s.post_norms) {
    f.add_rms_norm(sc.x, nullptr, l.post_norm, t, s.hidden, s.eps, sc.h, sc.x);
    add_rows(sc.res, sc.h, t * s.hidden);
    return sc.res;
  }
  if (s.sandwich) f.add_rms_norm(sc.x, nullptr, l.post_norm, t, s.hidden, s.eps, sc.x, sc.x);
  f.add_rms_norm(sc.x, sc.res, s.sandwich ? l.pre_ffn_norm : l.post_norm, t, s.hidden, s.eps, sc.h, sc.res);
  return sc.h;
}

// The dense MLP of input h into sc.x: down(act(gate_up(h))), act SiLU·mul (the gate/up GEMM and SiLU in one pass
// where the GEMM offers it) or GeGLU.
void dense_mlp(const StackKernels& f, const StackShape& s, const StackLayer& l, int64_t t, const uint16_t* mlp_in,
               const Scratch& sc) {
  const int64_t gate_up = 2 * s.intermediate;
  const uint16_t* h = in_order(mlp_in, t, s.hidden, l.gate_up_order, sc.ordered);
  if (s.gelu) {
    f.linear(h, t, s.hidden, s.hidden, l.gate_up, gate_up, nullptr, sc.wide, gate_up);
    f.gelu_and_mul(sc.wide, t, s.intermediate, sc.act);
  } else if (!f.linear_silu_mul || f.linear_silu_mul(h, t, s.hidden, s.hidden, l.gate_up, gate_up, sc.act,
                                                     s.intermediate) != 0) {
    f.linear(h, t, s.hidden, s.hidden, l.gate_up, gate_up, nullptr, sc.wide, gate_up);
    f.silu_and_mul(sc.wide, t, s.intermediate, sc.act);
  }
  f.linear(in_order(sc.act, t, s.intermediate, l.down_order, sc.ordered), t, s.intermediate, s.intermediate, l.down,
           s.hidden, nullptr, sc.x, s.hidden);
}

void decoder_layer(const StackKernels& f, const StackShape& s, const StackStep& st, const StackLayer& l,
                   const uint16_t* cos, const uint16_t* sin, bool first, const Scratch& sc) {
  const int64_t t = st.tokens, qd = s.heads * s.head_dim, kvd = s.kv_heads * s.head_dim, qkv_n = qd + 2 * kvd;
  prefetch_slots(s, st, l.k_cache, l.v_cache);
  if (!s.post_norms) {
    hidden_norm(f, s)(sc.x, first ? nullptr : sc.res, l.input_norm, t, s.hidden, s.eps, sc.h, sc.res);
  } else if (first) {  // the residual stream is attention's input, unnormed
    std::memcpy(sc.res, sc.x, t * s.hidden * sizeof(uint16_t));
  } else {
    add_rows(sc.res, sc.x, t * s.hidden);
  }
  const uint16_t* attn_in = s.post_norms ? sc.res : sc.h;
  f.linear(in_order(attn_in, t, s.hidden, l.qkv_order, sc.ordered), t, s.hidden, s.hidden, l.qkv, qkv_n,
           l.qkv_bias, sc.wide, qkv_n);
  const uint16_t *q = sc.wide, *k = sc.wide + qd;
  int64_t q_stride = qkv_n, k_stride = qkv_n;
  if (l.q_norm) {  // each head's q and k normalised, as rows of head_dim (attn is free until attention)
    for (int64_t i = 0; i < t; ++i) {
      std::memcpy(sc.attn + i * qd, sc.wide + i * qkv_n, qd * sizeof(uint16_t));
      std::memcpy(sc.kn + i * kvd, sc.wide + i * qkv_n + qd, kvd * sizeof(uint16_t));
    }
    // In place: the kernel reads each element of a row before it writes that element. Rows of one head, or of
    // all a token's heads (qk_all_heads).
    const int64_t q_width = s.qk_all_heads ? qd : s.head_dim, k_width = s.qk_all_heads ? kvd : s.head_dim;
    f.add_rms_norm(sc.attn, nullptr, l.q_norm, t * qd / q_width, q_width, s.eps, sc.attn, sc.attn);
    f.add_rms_norm(sc.kn, nullptr, l.k_norm, t * kvd / k_width, k_width, s.eps, sc.kn, sc.kn);
    q = sc.attn, k = sc.kn, q_stride = qd, k_stride = kvd;
  }
  f.rotary(q, q_stride, k, k_stride, l.cos ? l.cos : cos, l.sin ? l.sin : sin, st.positions, t, s.heads, s.kv_heads,
           s.head_dim, l.rotated ? s.rot_dim : 0, sc.q, sc.k);  // 0 rotated dimensions: a copy
  write_kv(s, st, sc.k, sc.wide, qkv_n, l.k_cache, l.v_cache);
  f.attention(sc.q, l.k_cache, l.v_cache, st.block_table, st.query_start, st.seq_lens, st.ctx_end,
              l.windowed ? st.ctx_start : nullptr, st.tree_bits, st.tree_words, st.rows, s.heads, s.head_dim,
              s.block_size, s.kv_heads, st.max_blocks, st.flash_min_tokens, s.scale, sc.attn, l.sinks, s.softcap);
  f.linear(in_order(sc.attn, t, qd, l.o_order, sc.ordered), t, qd, qd, l.o, s.hidden, nullptr, sc.x, s.hidden);
  if (f.all_reduce) f.all_reduce(sc.x, t * s.hidden);
  if (l.o_bias) add_bias(sc.x, l.o_bias, t, s.hidden);
  scale_rows(sc.x, t * s.hidden, s.residual_scale);
  const uint16_t* mlp_in = join_attention(f, s, l, t, sc);
  if (l.moe) {
    f.moe(l.moe, mlp_in, t, s.hidden, sc.x);  // this rank's slice of every expert (and of a shared expert)
    if (f.all_reduce) f.all_reduce(sc.x, t * s.hidden);
    finish_mlp(f, s, l, t, sc);
    return;
  }
  dense_mlp(f, s, l, t, mlp_in, sc);
  if (f.all_reduce) f.all_reduce(sc.x, t * s.hidden);
  finish_mlp(f, s, l, t, sc);
}

}  // namespace

extern "C" {

// n bfloat16 values rounded into 8-bit floats of KvFormat `format` (1 or 2) as write_kv stores them; for tests.
void pagellm_stack_fp8_from_bf16(const uint16_t* src, int64_t n, int64_t format, uint8_t* dst) {
  store_row(format, dst, 0, src, n);
}

// kernels: the entry points to call; layers: [num_layers] (see StackLayer); x: [T, hidden] embedding rows, or a
// previous pipeline stage's hidden rows with residual_in its [T, hidden] residual (else null; both read only);
// cos, sin: [max_pos, rot_dim]; final_norm: [hidden], out: [T, hidden] final-norm hidden states; or final_norm
// null (a stage before the last; num_layers >= 1): out and residual_out [T, hidden] the last layer's x and residual.
// num_layers may be 0 (out = norm(x)). Returns 0, or -1 (nothing written) when a slot or a position is out of
// range.
int pagellm_decoder_stack_bf16(const StackKernels* kernels, const StackLayer* layers, int64_t num_layers,
                               const StackShape* shape, const StackStep* step, const uint16_t* x,
                               const uint16_t* residual_in, const uint16_t* cos, const uint16_t* sin,
                               const uint16_t* final_norm, uint16_t* out, uint16_t* residual_out) {
  const StackShape& s = *shape;
  const StackStep& st = *step;
  for (int64_t t = 0; t < st.tokens; ++t)
    if ((num_layers > 0 && (st.slots[t] < 0 || st.slots[t] >= s.cache_slots)) || st.positions[t] < 0 ||
        st.positions[t] >= s.max_positions)
      return -1;
  if (st.tokens <= 0) return 0;
  bool reorders = false;
  for (int64_t i = 0; i < num_layers; ++i)
    reorders |= layers[i].qkv_order || layers[i].o_order || layers[i].gate_up_order || layers[i].down_order;
  const Scratch sc = scratch_for(s, st.tokens, reorders);
  const int64_t bytes = st.tokens * s.hidden * sizeof(uint16_t);
  std::memcpy(sc.x, x, bytes);
  if (residual_in) std::memcpy(sc.res, residual_in, bytes);
  for (int64_t i = 0; i < num_layers; ++i)
    decoder_layer(*kernels, s, st, layers[i], cos, sin, i == 0 && !residual_in, sc);
  if (!final_norm) {  // a stage before the last: x and the residual go on to the next stage
    std::memcpy(out, sc.x, bytes);
    std::memcpy(residual_out, sc.res, bytes);
    return 0;
  }
  const uint16_t* residual = num_layers || residual_in ? sc.res : nullptr;
  hidden_norm(*kernels, s)(sc.x, residual, final_norm, st.tokens, s.hidden, s.eps, out, sc.res);
  return 0;
}

}  // extern "C"

// Paged attention on the CPU for a whole step: decodes, prompt chunks, speculative chains and draft trees in one
// call, K/V read straight from the paged cache.
//
// Every query token sees the keys its Visibility names (paged_common.h): the keys before its ctx_end (causal rows:
// up to itself) plus, in draft-tree rows, the row's own tokens its bitmask allows. Work items run in parallel:
//  - the walk: one token of one row, all its kv heads in turn (one kv head per item when few tokens walk, as at
//    batch 1, so that every thread has work); for each (token, kv head) the grouped query heads
//    walk the keys once with an online softmax (running max, running sum, running weighted V). Decode rows always
//    take it, and every float32 row: a float32 token then takes exactly the instructions a decode of that token
//    would, whatever its row looks like, so a prompt computed after a prefix-cache hit reproduces the same prompt
//    computed without one bit for bit. In bfloat16 (AVX-512 BF16, head_dim 64 or 128) the walk takes its keys in
//    bf16 dot products (walk_bf16.h); float32 rows and other shapes widen K/V to float32 (walk_f32.h: walk_fixed,
//    walk_vec), and CPUs with AVX2 but no AVX-512 take the 8-lane walk_avx2.h (walk_scalar where none serves).
//  - the flash tile (flash_bf16.h, bfloat16 with AVX-512 BF16, head_dim 64 or 128): up to 48 query vectors (tokens
//    x grouped heads) of one row and one kv head share each K/V tile, with bfloat16 dot products.
// The cache may also hold 8-bit floats under bfloat16 or float32 queries (--kv-cache-dtype fp8*, ops/csrc/fp8.h):
// every walk (the AVX2 one too) and the AVX-512 flash tiles widen its rows exactly as they load them (the AMX tiles
// read bfloat16 only; an fp8 cache takes the AVX-512 tiles); those
// entries are paged_attention_fp8.cpp's, a library of their own. Accumulation is in float32 whatever the cache
// dtype. The kernels are paged_kernels.h's. The plain-PyTorch twin and oracle is pagellm/attention/torch_ref.py.
// Plain C ABI (pointers and sizes, no torch headers, loaded with ctypes by attention/cpu_paged.py) so that it builds
// in seconds; see pagellm/ops/build.py.
#include "paged_kernels.h"

extern "C" {

PAGELLM_ENTRY(pagellm_paged_attention_bf16, pagellm::BFloat16, pagellm::BFloat16, true)
PAGELLM_ENTRY(pagellm_paged_attention_f32, float, float, false)

// Flash tiles on AMX (want > 0, where compiled in and the kernel grants the tile state) or AVX-512 BF16 (want 0);
// want < 0 only asks. Returns whether AMX is on. The Python side sets it once after loading
// (pagellm/attention/cpu_paged.py).
int pagellm_paged_attention_use_amx(int want) {
#if defined(PAGELLM_FLASH_AMX)
  if (want >= 0) pagellm::flash_amx() = want > 0 && pagellm::permitted();
  return pagellm::flash_amx() ? 1 : 0;
#else
  (void)want;
  return 0;
#endif
}

}  // extern "C"

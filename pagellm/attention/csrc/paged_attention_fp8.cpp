// Paged attention over an 8-bit KV cache (--kv-cache-dtype fp8_e4m3 | fp8_e5m2): the kernels of paged_kernels.h
// instantiated for float8 caches under bfloat16 and float32 queries. A library of its own so that the model-dtype
// one keeps its short build (a cold start compiles it); attention/cpu_paged.py and the native decoder stack load
// this one only when a float8 cache is bound. Same arguments as paged_attention.cpp's entries.
#include "paged_kernels.h"

extern "C" {

PAGELLM_ENTRY(pagellm_paged_attention_bf16_fp8e4m3, pagellm::BFloat16, pagellm::Fp8E4M3, true)
PAGELLM_ENTRY(pagellm_paged_attention_bf16_fp8e5m2, pagellm::BFloat16, pagellm::Fp8E5M2, true)
PAGELLM_ENTRY(pagellm_paged_attention_f32_fp8e4m3, float, pagellm::Fp8E4M3, false)
PAGELLM_ENTRY(pagellm_paged_attention_f32_fp8e5m2, float, pagellm::Fp8E5M2, false)

}  // extern "C"

"""``kv_cache_dtype`` (``--kv-cache-dtype``): an 8-bit KV cache through the whole engine, on tiny models: the cache
holds more tokens in the same memory, every attention path serves it (the native kernel, the plain-PyTorch twin, the
self-speculative draft beside it), prefix-cache hits reproduce misses, and every block comes back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagellm import LLM, SamplingParams

# 2 layers x 2 KV heads x 16 dims x 2 (K and V) x 4 bytes = 512 B per float32 token; 256 blocks of 16 tokens.
SMALL_KV = 256 * 16 * 512
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 19, 40, 70)]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _all_free(llm: LLM) -> bool:
    kv = llm.engine.core.scheduler.kv
    return kv.num_free_blocks == kv.pool.num_blocks and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("dtype,ratio", [("float32", 4), ("bfloat16", 2)])
def test_a_float8_cache_holds_more_tokens_in_the_same_memory(tiny_llama: Path, dtype: str, ratio: int) -> None:
    auto = LLM(str(tiny_llama), dtype=dtype, kv_cache_memory=SMALL_KV)
    fp8 = LLM(str(tiny_llama), dtype=dtype, kv_cache_memory=SMALL_KV, kv_cache_dtype="fp8")
    assert fp8.engine.runtime.num_blocks == ratio * auto.engine.runtime.num_blocks
    caches = fp8.engine.core.executor.worker.runner.kv_caches
    assert caches and all(c.dtype == torch.float8_e4m3fn for c in caches)
    e5m2 = LLM(str(tiny_llama), dtype=dtype, kv_cache_memory=SMALL_KV, kv_cache_dtype="fp8_e5m2")
    assert all(c.dtype == torch.float8_e5m2 for c in e5m2.engine.core.executor.worker.runner.kv_caches)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_the_native_kernel_and_the_reference_generate_the_same_tokens(tiny_llama: Path, kv_cache_dtype: str) -> None:
    """float32 model, float8 cache: the C++ walks and torch_ref's SDPA read the same stored values."""
    prompts = _prompts()
    runs = {}
    for backend in ("cpu_paged", "torch_ref"):
        llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV, kv_cache_dtype=kv_cache_dtype,
                  attention_backend=backend, max_num_batched_tokens=32)
        runs[backend] = _greedy(llm, prompts)
        assert _all_free(llm)
    assert runs["cpu_paged"] == runs["torch_ref"]
    assert all(len(tokens) == GREEDY.max_tokens for tokens in runs["cpu_paged"])


def test_prefix_cache_hits_over_a_float8_cache_reproduce_misses(tiny_llama: Path) -> None:
    """A prompt served after its prefix was cached reads the rounded K/V the miss wrote: the same tokens."""
    prompt = _prompts()[3]
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV, kv_cache_dtype="fp8")
    miss = _greedy(llm, [prompt])
    hit = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert hit.num_cached_tokens >= 64 and [list(hit.outputs[0].token_ids)] == miss
    assert _all_free(llm)


def test_self_speculative_decoding_over_a_float8_cache_is_lossless(tiny_llama: Path) -> None:
    """The draft keeps its own cache in the model's dtype beside the target's float8 one; greedy verification
    makes the tokens the target's alone."""
    prompts = [p + p[:6] + p for p in _prompts()[:3]]  # repetition: drafts get accepted
    kwargs = dict(dtype="bfloat16", kv_cache_memory=SMALL_KV, kv_cache_dtype="fp8", max_num_batched_tokens=64)
    plain = _greedy(LLM(str(tiny_llama), **kwargs), prompts)
    spec = LLM(str(tiny_llama), speculative_config={"method": "draft_model", "num_speculative_tokens": 3,
                                                    "draft_layers": 1, "disable_by_batch_size": None}, **kwargs)
    assert _greedy(spec, prompts) == plain
    assert _all_free(spec)


def test_an_unknown_cache_dtype_names_the_choices(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'; use auto, fp8, fp8_e4m3 or fp8_e5m2"):
        LLM(str(tiny_llama), kv_cache_dtype="int8")


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_the_float8_kernels_are_built_at_start_only_for_a_float8_cache(monkeypatch: pytest.MonkeyPatch,
                                                                       kv_dtype: torch.dtype) -> None:
    """Their library compiles as long as the rest together; a default cold start does not wait for it."""
    from pagellm import native_build
    from pagellm.attention import cpu_paged
    from pagellm.worker import worker

    started: list[Path] = []
    monkeypatch.setattr(native_build, "start_in_background", lambda jobs: started.extend(j.args[0] for j in jobs))
    worker._start_kernel_builds(torch.bfloat16, kv_dtype, "auto", None)
    assert cpu_paged.SOURCE in started
    assert (cpu_paged.FP8_SOURCE in started) == (kv_dtype != torch.bfloat16)

"""Pipeline parallelism (``pipeline_parallel_size``: the decoder layers split into consecutive stages, stage 0 in the
engine's process, the others in worker processes): greedy tokens equal transformers' with stages of equal and
unequal sizes, chunked prefill, prefix-cache hits, preemption, n-gram speculation and grammars, and with stages of
tensor-parallel ranks; each stage holds only its own layers and their KV cache; what does not split is refused by
name. (LoRA adapters on stages: ``test_lora.py``.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_parity import (_prompts, assert_greedy_parity, assert_seeded_grammar, run, scored,
                         scored_with_and_without_the_stack)

from pagellm import LLM, SamplingParams
from pagellm.ops import decoder_stack, gemm_w4a16, gemm_w8a8

PP = dict(dtype="float32", pipeline_parallel_size=2)


@pytest.mark.parametrize(("arch", "overrides"), [("llama", {}), ("qwen3", {"num_hidden_layers": 3, "seed": 2}),
                                                 ("qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),
                                                 ("qwen2", {"num_hidden_layers": 3, "use_sliding_window": True,
                                                            "sliding_window": 20, "max_window_layers": 1})])
def test_greedy_parity_chunked_and_with_prefix_hits(tiny_model_factory, arch: str, overrides: dict) -> None:
    model_dir = tiny_model_factory(arch, **overrides)
    llm = LLM(str(model_dir), max_num_batched_tokens=40, **PP)
    try:
        layers = 2 if arch == "llama" else 3  # the MoE model's middle layer is dense
        stage0 = llm.engine.core.executor.worker.runner
        assert len(stage0.model.model.layers) == len(stage0.kv_caches) == -(-layers // 2)  # stage 0: the larger
        prompts = _prompts(seed=15, shared_prefix=21)
        first = run(llm, prompts)
        assert_greedy_parity(model_dir, prompts, first)
        assert run(llm, prompts) == first and sum(s.prefix_cache_hits for s in llm.last_stats) > 0
    finally:
        llm.shutdown()


def test_three_stages_with_preemption_speculation_and_grammars(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("llama", num_hidden_layers=3, seed=5)
    llm = LLM(str(model_dir), kv_cache_memory=24 * 16 * 768, max_model_len=160, pipeline_parallel_size=3,
              dtype="float32",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None})
    try:
        prompts = _prompts(seed=4)
        ours = run(llm, prompts)
        assert sum(s.num_preemptions for s in llm.last_stats) > 0, "the pool was meant to force preemptions"
        assert_greedy_parity(model_dir, prompts, ours)
        kv = llm.engine.core.scheduler.kv
        assert kv.num_free_blocks == kv.pool.num_blocks
        assert_seeded_grammar(llm, seed=9)
    finally:
        llm.shutdown()


@pytest.mark.skipif(not decoder_stack.available(), reason="the native decoder stack does not run here")
@pytest.mark.parametrize("quantization", [None, "w8a8_int8", "w4a8_int4", "w4a16_int4"],
                         ids=["bf16", "int8", "int4", "w4a16"])
def test_bfloat16_stages_run_the_native_stack_bit_for_bit(tiny_model_factory, monkeypatch: pytest.MonkeyPatch,
                                                           quantization: str | None) -> None:
    """In bfloat16 each stage runs its layers in one native call (the first taking the previous stage's hidden rows
    and residual, the last ending with the final norm): the same tokens and logprobs, bit for bit, as one process
    running all the layers in one call, and as the stages on the Python layers; int8 and 4-bit
    weights (``--quantization w8a8_int8``, ``w4a8_int4``) too, each stage quantizing its own layers."""
    if quantization and not gemm_w8a8.available():
        pytest.skip("the quantized GEMMs need AVX-512 VNNI")
    if quantization == "w4a16_int4" and not gemm_w4a16.available():
        pytest.skip("the W4A16 kernel needs AVX-512 BF16 and VNNI")
    model_dir = tiny_model_factory("llama", num_hidden_layers=3, seed=5)
    prompts = _prompts(seed=16)[:4]
    stages = scored_with_and_without_the_stack(monkeypatch, model_dir, prompts, "run_stage", pipeline_parallel_size=2,
                                               quantization=quantization, max_num_batched_tokens=40)
    monkeypatch.setenv("PAGELLM_NATIVE_DECODER", "1")
    one_process = scored(LLM(str(model_dir), dtype="bfloat16", quantization=quantization, max_num_batched_tokens=40),
                         prompts)
    assert stages["1"] == one_process == stages["0"]


def test_embeddings_and_prompt_logprobs_come_from_the_last_stage(tiny_llama: Path) -> None:
    """What the runner reads off the final hidden states besides sampling (pooling, prompt logprobs) is the last
    stage's, broadcast: equal to one process's."""
    prompts = _prompts(seed=18)[:3]
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)
    results = []
    for size in (2, 1):
        llm = LLM(str(tiny_llama), dtype="float32", pipeline_parallel_size=size)
        try:
            embeddings = [e.embedding for e in llm.embed(prompts, use_tqdm=False)]
            outputs = llm.generate(prompts, params, use_tqdm=False)
            logprobs = [[{k: round(v.logprob, 4) for k, v in entry.items()} if entry else None
                         for entry in o.prompt_logprobs] for o in outputs]
            results.append((embeddings, logprobs))
        finally:
            llm.shutdown()
    assert results[0][1] == results[1][1]
    assert all(a == pytest.approx(b, abs=1e-5) for a, b in zip(results[0][0], results[1][0]))


def test_stages_of_tensor_parallel_ranks(tiny_model_factory) -> None:
    """Two stages of two tensor-parallel ranks each (four processes): each stage's ranks meet in their own group
    (shared memory), stage to stage rank by rank; greedy tokens equal transformers'."""
    model_dir = tiny_model_factory("qwen2", num_hidden_layers=3, seed=7)
    llm = LLM(str(model_dir), max_num_batched_tokens=40, tensor_parallel_size=2, **PP)
    try:
        parallel = llm.engine.core.executor.worker.parallel
        assert (parallel.tp_size, parallel.pp_size) == (2, 2) and parallel.comm is not None
        prompts = _prompts(seed=17, shared_prefix=19)
        assert_greedy_parity(model_dir, prompts, run(llm, prompts))
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(pipeline_parallel_size=3), r"the model's 2 decoder layers cannot fill pipeline_parallel_size \(3\) stages"),
    (dict(pipeline_parallel_size=2, kv_transfer_config={
        "kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": "/tmp/pagellm-kv-never-made"}}),
     "kv_transfer_config runs with tensor_parallel_size and pipeline_parallel_size 1"),
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be a positive integer"),
])
def test_what_does_not_split_is_refused(tiny_llama: Path, kwargs: dict, message: str) -> None:
    with pytest.raises((ValueError, RuntimeError), match=message):
        LLM(str(tiny_llama), **{"dtype": "float32", **kwargs})

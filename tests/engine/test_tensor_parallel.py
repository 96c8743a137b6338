"""Tensor parallelism (``tensor_parallel_size=2``: rank 0 in the engine's process, rank 1 in a worker process fed
through the shared-memory ring): greedy tokens equal transformers' on every tiny architecture (the experts of a
mixture split like dense MLPs), with chunked prefill, prefix-cache hits, preemption, n-gram speculation and
grammars; what does not shard is refused by name; a dead rank fails the next step instead of hanging; shutdown
leaves no process behind."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from test_parity import (_prompts, assert_greedy_parity, assert_seeded_grammar, prompt_logprobs, run,
                         scored_with_and_without_the_stack)
from test_gpt_oss import _mxfp4_twins
from test_weight_only import _checkpoint

from pagellm import LLM, SamplingParams
from pagellm.model.compressed_tensors import write_w8a8
from pagellm.ops import decoder_stack, gemm, gemm_mxfp4, gemm_w4a8, gemm_w4a16, gemm_w8a8

TP = dict(dtype="float32", tensor_parallel_size=2)


@pytest.mark.parametrize(("arch", "overrides"), [("llama", {}), ("qwen2", {}), ("qwen3", {}),
                                                 ("mistral", {"seed": 6, "tie_word_embeddings": True}),
                                                 ("mistral", {"seed": 11, "sliding_window": 20}), ("phi3", {}),
                                                 ("olmo2", {}), ("mixtral", {}), ("qwen2_moe", {}),
                                                 ("gpt_oss", {})])
def test_greedy_parity_chunked_and_with_prefix_hits(tiny_model_factory, arch: str, overrides: dict) -> None:
    model_dir = tiny_model_factory(arch, **overrides)
    llm = LLM(str(model_dir), max_num_batched_tokens=40, **TP)
    try:
        prompts = _prompts(seed=11, shared_prefix=21)
        first = run(llm, prompts)
        assert_greedy_parity(model_dir, prompts, first)
        assert run(llm, prompts) == first and sum(s.prefix_cache_hits for s in llm.last_stats) > 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("arch", "overrides"), [("qwen2_moe", {}), ("mixtral", {"num_local_experts": 3}),
                                                 ("gpt_oss", {})])
def test_expert_parallel_ranks_hold_whole_experts(tiny_model_factory, arch: str, overrides: dict) -> None:
    """enable_expert_parallel: each rank holds a run of whole experts (3 over 2 ranks: 2 and 1) and computes the
    pairs routed to them; Qwen2-MoE's shared expert stays split. Greedy tokens still equal transformers'."""
    model_dir = tiny_model_factory(arch, **overrides)
    llm = LLM(str(model_dir), max_num_batched_tokens=40, enable_expert_parallel=True, **TP)
    try:
        model = llm.engine.core.executor.worker.runner.model
        block, moe = model.model.layers[0].mlp, model.cfg.moe
        assert block.expert_range == range(0, -(-moe.num_experts // 2))
        assert len(block.experts) == len(block.expert_range)
        assert block.experts[0].gate_up_proj.weight.shape[0] == 2 * moe.intermediate_size  # whole, not a slice
        if block.shared_expert is not None:
            assert block.shared_expert.gate_up_proj.weight.shape[0] == moe.shared_intermediate_size  # split in two
        prompts = _prompts(seed=14)
        assert_greedy_parity(model_dir, prompts, run(llm, prompts))
    finally:
        llm.shutdown()


@pytest.mark.skipif(not gemm_mxfp4.runs_here(), reason="the MXFP4 GEMM needs AVX-512 BF16 and VNNI")
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_mxfp4_experts_stay_4_bit_across_ranks(tiny_model_factory, tmp_path: Path, expert_parallel: bool) -> None:
    """gpt-oss's MXFP4 experts in bfloat16 across two ranks: each rank packs its slice of every expert's codes and
    groups (gate/up rows, down's inputs in whole groups of 32), or whole experts with expert parallelism, and the
    prompt log-probabilities are one rank's within bfloat16's rounding."""
    packed, _ = _mxfp4_twins(tiny_model_factory("gpt_oss"), tmp_path)
    prompt = _prompts(seed=3)[-1]
    logprobs = []
    for tp in (1, 2):
        llm = LLM(str(packed), dtype="bfloat16", tensor_parallel_size=tp, enable_expert_parallel=expert_parallel)
        try:
            expert = llm.engine.core.executor.worker.runner.model.model.layers[0].mlp.experts[0]
            assert gemm.weight_format(expert.down_proj.weight) == gemm_mxfp4.FORMAT
            logprobs.append(prompt_logprobs(llm, prompt))
        finally:
            llm.shutdown()
    assert (logprobs[0] - logprobs[1]).abs().mean().item() < 0.02


def _int8_greedy(model_dir: Path, prompts: list[list[int]], tp: int, quantization: str | None) -> tuple[LLM, list]:
    llm = LLM(str(model_dir), dtype="bfloat16", tensor_parallel_size=tp, quantization=quantization,
              kv_cache_memory="64MiB")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    return llm, [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.skipif(not gemm_w8a8.available(), reason="the int8 and 4-bit GEMMs need AVX-512 VNNI")
@pytest.mark.parametrize("source", ["online", "checkpoint", "gptq"])
def test_quantized_weights_split_across_ranks(tiny_model_factory, tmp_path: Path, source: str) -> None:
    """int8 weights (``--quantization w8a8_int8``, or a compressed-tensors W8A8 checkpoint) and a GPTQ checkpoint's
    4-bit ones (``--quantization w4a8_int4``) on tensor-parallel ranks: each rank holds the rows (q/k/v, gate/up) or
    columns (o, down) of its slice with their scales (per output channel, or per 32 inputs) and quantizes its own
    activations. Greedy tokens equal one process's over the same weights, up to float ties: where they part, both
    tokens are in the one process's top 2."""
    model_dir, fmt = tiny_model_factory("llama"), "w8a8_int8"
    quantization = fmt
    if source == "checkpoint":
        model_dir, quantization = write_w8a8(model_dir, tmp_path / "w8a8"), None
    if source == "gptq":
        model_dir, layers = _checkpoint(model_dir, tmp_path / "gptq", "gptq")
        quantization = fmt = "w4a8_int4"
    prompts = _prompts(seed=17)
    single, expected = _int8_greedy(model_dir, prompts, 1, quantization)
    ranks, got = _int8_greedy(model_dir, prompts, 2, quantization)
    try:
        layer = ranks.engine.core.executor.worker.runner.model.model.layers[0]
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert gemm.weight_format(linear.weight) == fmt
        assert gemm.packed_shape(layer.mlp.down_proj.weight) == (64, 64)  # [hidden, intermediate / 2]
        if source == "gptq":  # rank 0's columns of down_proj: the first half of the checkpoint's inputs
            q, _, _ = gemm_w4a8.unpack(layer.mlp.down_proj.weight.data, 64, 64)
            assert torch.equal(q.to(torch.int16), layers["model.layers.0.mlp.down_proj"][0][:, :64])
        exact = 0
        for ours, theirs in zip(got, expected):
            step = next((i for i, (a, b) in enumerate(zip(ours.token_ids, theirs.token_ids)) if a != b), None)
            if step is None:
                exact += 1
                continue
            top2 = sorted(theirs.logprobs[step].items(), key=lambda kv: -kv[1].logprob)[:2]
            assert {ours.token_ids[step], theirs.token_ids[step]} <= {token for token, _ in top2}, step
        assert exact >= len(prompts) // 2
    finally:
        ranks.shutdown()


@pytest.mark.skipif(not decoder_stack.available(), reason="the native decoder stack does not run here")
@pytest.mark.parametrize(("arch", "quantization"), [("llama", None), ("qwen2", None), ("qwen3", "w8a8_int8"),
                                                    ("llama", "w4a8_int4"), ("llama", "w4a16_int4"),
                                                    ("qwen2_moe", None), ("mixtral", None), ("gemma3", None),
                                                    ("gpt_oss", None), ("cohere2", None)])
def test_ranks_run_the_native_stack_as_their_python_layers_do(tiny_model_factory, monkeypatch: pytest.MonkeyPatch,
                                                              arch: str, quantization: str | None) -> None:
    """In bfloat16 each rank runs its slice of every layer in the one-call native stack, which sums the
    row-parallel outputs (o_proj, down_proj, a mixture's experts) through the ranks' all-reduce: the same tokens and
    logprobs, bit for bit, as the ranks on the Python layers (with q/k/v bias, Qwen3's q/k norms, int8 and 4-bit
    weights too; Gemma 3's layer, its sliding layers' own rope base; gpt-oss's sinks and o_proj bias, the bias
    added after the ranks' sum; Cohere's parallel sublayers, each summed through the ranks). A mixture's Python
    layers with the stack off take torch's routing and expert loop, its twin (the same tokens, logprobs to
    rounding, as on one rank: ``test_moe.py``)."""
    if quantization == "w4a16_int4" and not gemm_w4a16.available():
        pytest.skip("the W4A16 kernel needs AVX-512 BF16 and VNNI")
    if quantization and not gemm_w8a8.available():
        pytest.skip("the quantized GEMMs need AVX-512 VNNI")
    results = scored_with_and_without_the_stack(monkeypatch, tiny_model_factory(arch), _prompts(seed=19)[:6],
                                                tensor_parallel_size=2, quantization=quantization,
                                                max_num_batched_tokens=40)
    if arch in ("qwen2_moe", "mixtral", "gpt_oss"):
        assert [tokens for tokens, _ in results["1"]] == [tokens for tokens, _ in results["0"]]
        assert [lp for _, lp in results["1"]] == pytest.approx([lp for _, lp in results["0"]], abs=1e-3)
    else:
        assert results["1"] == results["0"]


def test_preemption_speculation_and_grammars_across_ranks(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("llama")
    llm = LLM(str(model_dir), kv_cache_memory=24 * 16 * 512, max_model_len=160,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None},
              **TP)
    try:
        prompts = _prompts(seed=3)
        ours = run(llm, prompts)
        assert sum(s.num_preemptions for s in llm.last_stats) > 0, "the pool was meant to force preemptions"
        assert_greedy_parity(model_dir, prompts, ours)
        kv = llm.engine.core.scheduler.kv
        assert kv.num_free_blocks == kv.pool.num_blocks
        assert_seeded_grammar(llm, seed=5)  # seeded sampling agrees across ranks and runs
    finally:
        llm.shutdown()


def test_a_vocabulary_that_does_not_divide_is_padded(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("llama", seed=8, vocab_size=317)  # 159 + 158 rows, one of padding
    llm = LLM(str(model_dir), **TP)
    try:
        prompts = _prompts(seed=13)
        assert_greedy_parity(model_dir, prompts, run(llm, prompts))
    finally:
        llm.shutdown()


def test_bfloat16_ranks_run_the_native_kernels_deterministically(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="bfloat16", tensor_parallel_size=2)
    try:
        prompts = _prompts(seed=12)[:4]
        first = run(llm, prompts)
        assert run(llm, prompts) == first
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(tensor_parallel_size=3), r"attention heads \(4\) is not divisible by tensor_parallel_size \(3\)"),
    (dict(tensor_parallel_size=4), r"key/value heads \(2\) is not divisible by tensor_parallel_size \(4\)"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer"),
])
def test_what_does_not_shard_is_refused(tiny_llama: Path, kwargs: dict, message: str) -> None:
    before = _children()
    with pytest.raises((ValueError, RuntimeError), match=message):
        LLM(str(tiny_llama), dtype="float32", **kwargs)
    assert _children() == before  # the worker processes that did start are gone


def test_a_dead_rank_fails_the_next_step_and_shutdown_cleans_up(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), **TP)
    (worker,) = llm.engine.core.executor.procs
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 died \(exit code -9\)"):
        llm.generate(["Hi"], SamplingParams(max_tokens=4), use_tqdm=False)
    llm.shutdown()
    assert not any(p.is_alive() for p in llm.engine.core.executor.procs)


def _children() -> set[int]:
    tasks = Path(f"/proc/{os.getpid()}/task")
    pids: set[int] = set()
    for task in tasks.iterdir():
        try:
            pids |= {int(p) for p in (task / "children").read_text().split()}
        except OSError:  # a thread that ended meanwhile
            pass
    return {pid for pid in pids if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()}


def test_the_gloo_twin_gives_the_same_tokens(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The collectives' fast path (shared memory) against its oracle (gloo), end to end."""
    prompts = _prompts(seed=14)[:5]
    outputs = []
    for shm in ("1", "0"):
        monkeypatch.setenv("PAGELLM_TP_SHM_COMM", shm)
        llm = LLM(str(tiny_llama), **TP)
        try:
            assert (llm.engine.core.executor.worker.parallel.comm is not None) == (shm == "1")
            outputs.append(run(llm, prompts))
        finally:
            llm.shutdown()
    assert outputs[0] == outputs[1]

"""vLLM's ``LLM.collective_rpc`` and ``worker_extension_cls``: a method of the worker (an extension's too) or a
function sent by value runs on every rank, and the results come back in rank order; a rank's failure raises, naming
the rank, and leaves no answer behind for the next call. What a call does to the weights shows in the outputs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from async_utils import collect, engine_config
from safetensors.torch import load_file
from worker_extensions import WeightTools, fail_on, ranks, slow_on

from pagellm import LLM, SamplingParams
from pagellm.engine.async_engine import AsyncLLM

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
DOWN = "model.layers.0.mlp.down_proj.weight"


def test_one_worker_runs_extension_methods_and_functions(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=64, worker_extension_cls="worker_extensions:WeightTools")
    assert llm.collective_rpc("weight_shape", args=(DOWN,)) == [(64, 128)]  # [hidden, intermediate]
    assert llm.collective_rpc(ranks, kwargs={"offset": 5}) == [(5, 1, 0)]
    with pytest.raises(ValueError, match="the worker has no method 'nope' .*worker_extension_cls"):
        llm.collective_rpc("nope")
    with pytest.raises(ValueError, match="the worker has no method '_load_model'"):
        llm.collective_rpc("_load_model")
    with pytest.raises(RuntimeError, match="rank 0 refuses"):
        llm.collective_rpc("fail")
    with pytest.raises(ValueError, match="replaces the worker's own execute_model"):
        LLM(str(tiny_llama), dtype="float32", max_model_len=64, worker_extension_cls="worker_extensions:Clashing")
    with pytest.raises(ValueError, match="--worker-extension-cls 'worker_extensions:Nowhere' cannot be imported"):
        LLM(str(tiny_llama), dtype="float32", max_model_len=64, worker_extension_cls="worker_extensions:Nowhere")


def test_every_tensor_parallel_rank_answers_in_rank_order(tiny_llama: Path) -> None:
    """Two ranks: each holds half of down_proj's inputs and of lm_head's rows; scaling lm_head through the call
    scales every shard (their squares add up to the checkpoint's, times the factor's square), and zeroing it on every
    rank makes every logit 0, so greedy picks token 0."""
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=64, tensor_parallel_size=2,
              worker_extension_cls=WeightTools)
    try:
        with pytest.raises(RuntimeError, match="collective_rpc failed on rank 0: RuntimeError: rank 0 refuses"):
            llm.collective_rpc("fail")
        with pytest.raises(RuntimeError, match="on rank 0: ValueError: collective_rpc: the worker has no method"):
            llm.collective_rpc("nope")
        with pytest.raises(RuntimeError, match="collective_rpc failed on rank 1: ValueError: rank 1 was told"):
            llm.collective_rpc(fail_on, args=(1,))
        assert llm.collective_rpc("weight_shape", args=(DOWN,)) == [(64, 64), (64, 64)]
        assert llm.collective_rpc(ranks, kwargs={"offset": 1}) == [(1, 2, 0), (2, 2, 0)]
        with pytest.raises(RuntimeError, match="rank 1 did not answer in time"):  # rank 1 takes 3 s, 0.3 s given
            llm.collective_rpc(slow_on, timeout=0.3, args=(1, 3.0))
        assert llm.collective_rpc(ranks) == [(0, 2, 0), (1, 2, 0)]  # its late answer is not taken for this one
        with pytest.raises(ValueError, match="must pickle to reach the ranks"):
            llm.collective_rpc(lambda worker: 0)
        lm_head = load_file(tiny_llama / "model.safetensors")["lm_head.weight"]
        squares = llm.collective_rpc("scale_weight", args=("lm_head.weight", 2.0))
        assert len(squares) == 2 and sum(squares) == pytest.approx(4 * float(lm_head.pow(2).sum()), rel=1e-5)
        llm.collective_rpc("scale_weight", args=("lm_head.weight", 0.0))
        assert llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == [0, 0, 0, 0]
    finally:
        llm.shutdown()


def test_async_llm_calls_the_workers_in_the_core_process(tiny_llama: Path) -> None:
    """``AsyncLLM.collective_rpc``: the call crosses to the engine core's process and the results come back; a
    method's own error comes back too, and the core serves on."""
    engine = AsyncLLM.from_config(engine_config(tiny_llama, worker_extension_cls="worker_extensions:WeightTools"))
    try:
        with asyncio.Runner() as loop:
            assert loop.run(engine.collective_rpc("weight_shape", args=(DOWN,))) == [(64, 128)]
            assert loop.run(engine.collective_rpc(ranks, kwargs={"offset": 2})) == [(2, 1, 0)]
            with pytest.raises(RuntimeError, match="collective_rpc failed in the engine core: RuntimeError: rank 0"):
                loop.run(engine.collective_rpc("fail"))
            with pytest.raises(ValueError, match="the worker has no method 'nope'"):
                loop.run(engine.collective_rpc("nope"))
            with pytest.raises(ValueError, match="must pickle to reach the engine core"):
                loop.run(engine.collective_rpc(lambda worker: 0))
            loop.run(engine.collective_rpc("scale_weight", args=("lm_head.weight", 0.0)))
            outputs = loop.run(collect(engine.generate([1, 2, 3], GREEDY, "after")))
            assert outputs[-1].outputs[0].token_ids == [0, 0, 0, 0]  # cumulative outputs, vLLM's default
    finally:
        engine.shutdown()


def test_every_data_parallel_core_answers(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGELLM_NUM_THREADS", "2")  # a thread for each of the two cores
    engine = AsyncLLM.from_config(engine_config(tiny_llama, data_parallel_size=2))
    try:
        with asyncio.Runner() as loop:
            assert loop.run(engine.collective_rpc(ranks)) == [(0, 1, 0), (0, 1, 0)]  # core by core
    finally:
        engine.shutdown()

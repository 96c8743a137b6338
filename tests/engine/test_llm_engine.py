"""vLLM's step-wise ``LLMEngine`` and its ``EngineArgs`` on a tiny model: a loop of one's own gives transformers'
greedy tokens, each output kind returns what vLLM's does, ids are checked, aborts and bad requests leave nothing
behind, and ``EngineArgs`` round-trips vLLM's command lines into the engine (``LLM(**asdict(args))`` included).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
from pathlib import Path

import msgspec
import pytest
from async_utils import SMALL_KV, TIMEOUT_S, all_blocks_free, collect
from lora_utils import build_lora_adapter
from test_parity import MAX_TOKENS, _prompts, assert_greedy_parity

from pagellm import LLM, SamplingParams
from pagellm.engine.async_engine import AsyncLLM
from pagellm.engine.exceptions import EngineDeadError
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine_args import AsyncEngineArgs, EngineArgs
from pagellm.lora import LoRARequest
from pagellm.metrics.log import LogStatsSink
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import RequestOutputKind


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV,
                                                 max_num_batched_tokens=64, enable_lora=True, disable_log_stats=True))


def drain(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    """Every output of every request, by request id, until none is unfinished."""
    seen: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


def assert_nothing_left(engine: LLMEngine) -> None:
    kv = engine.engine_core.core.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert not engine.engine_core.has_unfinished_requests() and not engine.output_processor.requests
    assert engine.get_num_unfinished_requests() == 0


def greedy(**overrides) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **overrides})


def grows(outs: list[RequestOutput]) -> bool:
    """Each output's tokens extend the previous one's (cumulative outputs)."""
    ids = [o.outputs[0].token_ids for o in outs]
    return all(later[:len(earlier)] == earlier and len(later) > len(earlier) for earlier, later in zip(ids, ids[1:]))


def test_a_step_loop_gives_transformers_greedy_tokens_as_cumulative_outputs(engine: LLMEngine,
                                                                            tiny_llama: Path) -> None:
    prompts = _prompts(seed=11)[:6]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"req-{i}", prompt, greedy())
    assert engine.get_num_unfinished_requests() == 6
    seen = drain(engine)
    assert sorted(seen) == sorted(f"req-{i}" for i in range(6))
    for outs in seen.values():  # vLLM's default kind: each output holds the whole completion so far
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert grows(outs)
    assert_greedy_parity(tiny_llama, prompts, [seen[f"req-{i}"][-1].outputs[0].token_ids for i in range(6)])
    assert_nothing_left(engine)


def test_each_output_kind(engine: LLMEngine) -> None:
    prompt = _prompts(seed=12)[3]
    engine.add_request("whole", prompt, greedy())
    engine.add_request("delta", prompt, greedy(output_kind=RequestOutputKind.DELTA))
    engine.add_request("final", prompt, greedy(output_kind=RequestOutputKind.FINAL_ONLY))
    sampled = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=8, ignore_eos=True)
    engine.add_request("pair", prompt, sampled)
    engine.add_request("best", prompt, msgspec.structs.replace(sampled, n=1, best_of=3))
    seen = drain(engine)
    whole = seen["whole"][-1].outputs[0]
    deltas = seen["delta"]
    assert len(deltas) > 1 and [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert [t for d in deltas for t in d.outputs[0].token_ids] == whole.token_ids
    assert "".join(d.outputs[0].text for d in deltas) == whole.text
    (final,) = seen["final"]
    assert final.finished and final.outputs[0].token_ids == whole.token_ids and final.outputs[0].text == whole.text
    pair = seen["pair"]  # one output per step, holding both samples
    assert [c.index for c in pair[-1].outputs] == [0, 1] and all(len(c.token_ids) == 8 for c in pair[-1].outputs)
    assert pair[-1].outputs[0].token_ids != pair[-1].outputs[1].token_ids
    for i in range(2):  # sample i is what a lone request with seed 3 + i samples
        engine.add_request("alone", prompt, msgspec.structs.replace(sampled, n=1, seed=3 + i))
        assert drain(engine)["alone"][-1].outputs[0].token_ids == pair[-1].outputs[i].token_ids
    (best,) = seen["best"]
    assert best.finished and len(best.outputs) == 1 and best.outputs[0].logprobs is None
    assert_nothing_left(engine)


def test_ids_aborts_and_bad_requests_leave_nothing_behind(engine: LLMEngine) -> None:
    prompt = _prompts(seed=13)[5]
    engine.add_request("a", prompt, greedy())
    with pytest.raises(ValueError, match="'a' is unfinished already"):
        engine.add_request("a", prompt, greedy())
    engine.add_request("b", prompt, greedy(n=2))
    with pytest.raises(ValueError, match="clashes with the core id '1_b'"):
        engine.add_request("1_b", prompt, greedy())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", list(range(200)) * 40, greedy())
    with pytest.raises(ValueError, match="request_id must be a string"):
        engine.add_request(7, prompt, greedy())  # type: ignore[arg-type]
    assert engine.get_num_unfinished_requests() == 2
    outputs = engine.step() + engine.step()
    assert {o.request_id for o in outputs} <= {"a", "b"}
    engine.abort_request(["a", "unknown"])
    engine.abort_request("b")
    assert not engine.has_unfinished_requests() and engine.step() == []
    assert_nothing_left(engine)
    engine.add_request("a", prompt, greedy(max_tokens=2))  # an id is free again once its request ended
    assert drain(engine)["a"][-1].outputs[0].finish_reason == "length"


def test_engine_args_take_vllm_command_lines(tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--model", str(tiny_llama), "--dtype", "float32", "--max-model-len", "0.4k", "--max-num-seqs", "4",
         "--kv-cache-memory", str(SMALL_KV), "--gpu-memory-utilization", "0.8", "--enforce-eager"]))
    assert (args.max_model_len, args.max_num_seqs, args.block_size, args.gpu_memory_utilization) == (400, 4, 16, 0.8)
    with caplog.at_level(logging.WARNING, logger="pagellm.no_effect"):
        config = args.create_engine_config()
    assert config.model_config.max_model_len == 400 and config.scheduler_config.max_num_seqs == 4
    assert "gpu_memory_utilization has no effect" in caplog.text and "enforce_eager has no effect" in caplog.text
    llm = LLM(**dataclasses.asdict(args))  # vLLM's other way in
    assert llm.config.model_config.max_model_len == 400 and llm.llm_engine.stats_sink is not None
    (out,) = llm.generate([[5, 6, 7]], greedy(), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == MAX_TOKENS
    assert llm.get_metrics()  # disable_log_stats=False, EngineArgs' default as vLLM's: the series are kept
    llm.shutdown()
    async_args = AsyncEngineArgs.from_cli_args(AsyncEngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--enable-log-requests", "--disable-log-stats"]))
    assert async_args.enable_log_requests and async_args.disable_log_stats and async_args.model is None
    with pytest.raises(TypeError):
        EngineArgs(max_num_sequences=4)  # a misspelt argument is an error, as vLLM's dataclass gives it


def test_async_llm_from_engine_args_takes_vllms_calls(tiny_llama: Path, engine: LLMEngine, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """``AsyncLLM.from_engine_args(AsyncEngineArgs(...))`` as vLLM's: whole outputs by default (vLLM's
    ``output_kind``), ``generate``'s keywords (``sampling_params``, ``lora_request``), ``await get_tokenizer()``,
    ``abort`` of several ids; ``enable_log_requests`` logs each request."""
    prompt = _prompts(seed=14)[2]
    adapter = LoRARequest("attn", 1, str(build_lora_adapter(tiny_llama, tmp_path / "attn", 1, ["q_proj"], 4)))
    expected = {}
    for name, lora in (("plain", None), ("adapted", adapter)):
        engine.add_request(name, prompt, greedy(lora_request=lora))
        expected[name] = drain(engine)[name][-1].outputs[0]
    assert expected["plain"].token_ids != expected["adapted"].token_ids
    args = AsyncEngineArgs(model=str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV, enable_lora=True,
                           enable_log_requests=True)
    async_engine = AsyncLLM.from_engine_args(args)

    async def scenario() -> None:
        assert (await async_engine.get_tokenizer()).encode("hi") == engine.get_tokenizer().encode("hi")
        outs = await collect(async_engine.generate(prompt=prompt, sampling_params=greedy(), request_id="online"))
        assert grows(outs) and outs[-1].finished
        assert outs[-1].outputs[0].token_ids == expected["plain"].token_ids
        assert outs[-1].outputs[0].text == expected["plain"].text
        adapted = await collect(async_engine.generate(prompt, greedy(), "tuned", lora_request=adapter))
        assert adapted[-1].outputs[0].token_ids == expected["adapted"].token_ids
        streams = [async_engine.generate(prompt, greedy(max_tokens=400), name) for name in ("x", "y")]
        for stream in streams:
            await stream.__anext__()
        await async_engine.abort(["x", "y"])
        for stream in streams:
            assert (await collect(stream))[-1].outputs[0].finish_reason == "abort"
        assert await all_blocks_free(async_engine)

    try:
        with caplog.at_level(logging.INFO):
            asyncio.run(asyncio.wait_for(scenario(), TIMEOUT_S))
        assert "online" in caplog.text and "tuned" in caplog.text  # the request log lines
        assert isinstance(async_engine.stats_sink, LogStatsSink)  # disable_log_stats=False: the periodic line
    finally:
        async_engine.shutdown()
    assert isinstance(async_engine.dead_error, EngineDeadError)

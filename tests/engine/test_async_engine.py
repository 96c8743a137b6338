"""``AsyncLLM`` over a real engine-core process on a tiny model: parity with ``LLM``, delta streaming, concurrency,
aborts (consumer gone, ``abort()``, stop strings) giving every KV block back, reused ids, ``n > 1`` siblings,
start-up errors, a killed core, and a clean shutdown.

One engine serves the module (starting a core process costs a few seconds); each test runs its coroutine on one
module-wide event loop. Nothing sleeps for a fixed time: waits poll a condition under a timeout.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any

import msgspec
import pytest
from async_utils import (all_blocks_free, collect, engine_config, greedy, offline_llm, runner,
                         started_engine, wait_until)

from pagellm import LLM, SamplingParams
from pagellm.engine.async_engine import AsyncLLM
from pagellm.engine.exceptions import EngineDeadError
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import RequestOutputKind

PROMPTS = ["hi", "the quick brown fox", "a", "0123456789 counting", "zz top"]
run = pytest.fixture(scope="module")(runner)


engine = pytest.fixture(scope="module")(started_engine)
llm = pytest.fixture(scope="module")(offline_llm)


def joined(deltas: list[RequestOutput]) -> tuple[str, list[int]]:
    return "".join(d.outputs[0].text for d in deltas), [t for d in deltas for t in d.outputs[0].token_ids]


def assert_delta_stream(deltas: list[RequestOutput], request_id: str) -> None:
    assert deltas and all(d.request_id == request_id for d in deltas)
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert all(d.outputs[0].finish_reason is None for d in deltas[:-1])
    assert deltas[-1].outputs[0].finish_reason is not None


# ---------------------------------------------------------------------------------------------- serving


def test_runtime_and_tokenizer(engine: AsyncLLM, llm: LLM) -> None:
    assert engine.runtime == llm.engine.runtime
    assert engine.tokenizer.encode("hi") == llm.tokenizer.encode("hi")
    assert engine.is_running and not engine.errored and engine.client.process.is_alive()
    assert engine.config.scheduler_config.max_num_batched_tokens == 2048  # the servers' default step budget


def test_greedy_matches_llm_and_deltas_concatenate(engine: AsyncLLM, llm: LLM, run: Any) -> None:
    params = [greedy(12, ignore_eos=True), greedy(5), greedy(20, ignore_eos=True), greedy(1), greedy(9)]
    expected = llm.generate(PROMPTS, params, use_tqdm=False)

    async def main() -> list[list[RequestOutput]]:
        return await asyncio.gather(*(collect(engine.generate(p, sp, f"r{i}"))
                                      for i, (p, sp) in enumerate(zip(PROMPTS, params))))

    for i, (deltas, full) in enumerate(zip(run(main()), expected)):
        assert_delta_stream(deltas, f"r{i}")
        text, token_ids = joined(deltas)
        assert (text, token_ids) == (full.outputs[0].text, full.outputs[0].token_ids)
        assert deltas[-1].outputs[0].finish_reason == full.outputs[0].finish_reason
        assert deltas[-1].prompt == PROMPTS[i] and deltas[-1].prompt_token_ids == full.prompt_token_ids
        m = deltas[-1].metrics
        assert m.arrival_time <= m.first_token_time <= m.finished_time
    assert run(all_blocks_free(engine))


def test_output_kinds_cumulative_and_final_only(engine: AsyncLLM, llm: LLM, run: Any) -> None:
    """vLLM's ``output_kind``: CUMULATIVE yields every sibling's whole output so far each time (each yield extends the
    last), FINAL_ONLY yields once, at the end, with all n siblings; both end as the offline engine's outputs."""
    seeded = SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=8, ignore_eos=True, logprobs=1)
    (expected,) = llm.generate([PROMPTS[0]], seeded, use_tqdm=False)
    want = [(c.index, c.text, c.token_ids) for c in expected.outputs]
    kinds = {kind: msgspec.structs.replace(seeded, output_kind=kind) for kind in RequestOutputKind}
    for attempt in range(3):  # a consumer that falls behind gets its outputs merged: one yield shows no growth
        cumulative = run(collect(engine.generate(PROMPTS[0], kinds[RequestOutputKind.CUMULATIVE], f"cum-{attempt}")))
        assert [o.finished for o in cumulative] == [False] * (len(cumulative) - 1) + [True]
        if len(cumulative) > 1:
            break
    assert len(cumulative) > 1
    for before, after in zip(cumulative, cumulative[1:]):
        grown = {c.index: c.token_ids for c in after.outputs}
        assert all(grown[c.index][:len(c.token_ids)] == c.token_ids for c in before.outputs)
    assert [(c.index, c.text, c.token_ids) for c in cumulative[-1].outputs] == want
    assert all(len(c.logprobs) == len(c.token_ids) for c in cumulative[-1].outputs)
    (final,) = run(collect(engine.generate(PROMPTS[0], kinds[RequestOutputKind.FINAL_ONLY], "final")))
    assert final.finished and [(c.index, c.text, c.token_ids) for c in final.outputs] == want
    deltas = run(collect(engine.generate(PROMPTS[0], kinds[RequestOutputKind.DELTA], "delta")))
    assert all(len(d.outputs) == 1 for d in deltas)  # the default: each sibling's new text, one at a time
    assert run(all_blocks_free(engine))


def _paced(engine: AsyncLLM, run: Any, params: SamplingParams) -> list[RequestOutput]:
    """One stream of PROMPTS[1] under ``params`` (its deltas), where no delta but the first and the last
    has fewer than ``params.stream_interval`` tokens. A consumer that falls behind gets its queued deltas merged, so
    on a loaded machine a stream can come in two large deltas, which show nothing of the pacing: such a stream is
    checked, then asked for again (three tries)."""
    for attempt in range(3):
        deltas = run(collect(engine.generate(PROMPTS[1], params, f"paced-{attempt}")))
        assert_delta_stream(deltas, f"paced-{attempt}")
        sizes = [len(d.outputs[0].token_ids) for d in deltas]
        assert all(size >= params.stream_interval for size in sizes[1:-1]), sizes
        assert len(sizes) <= 2 + (params.max_tokens - sizes[0]) // params.stream_interval, sizes
        if len(sizes) >= 3:
            return deltas
    raise AssertionError(f"three streams each came in under three deltas: {sizes}")


def test_stream_interval_sends_tokens_in_groups(engine: AsyncLLM, llm: LLM, run: Any) -> None:
    """vLLM's ``stream_interval``: the first token at once, then a delta per 4 new tokens (the last may be shorter);
    the tokens and text are the offline engine's, and each of n=2 siblings is paced on its own."""
    params = greedy(30, ignore_eos=True, stream_interval=4)
    expected = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
    deltas = _paced(engine, run, params)
    assert joined(deltas) == (expected.text, expected.token_ids)
    seeded = SamplingParams(temperature=0.9, seed=5, n=2, max_tokens=9, ignore_eos=True, stream_interval=3,
                            output_kind=RequestOutputKind.DELTA)
    by_sibling: dict[int, list[int]] = {0: [], 1: []}
    for d in run(collect(engine.generate(PROMPTS[2], seeded, "paced-n"))):
        by_sibling[d.outputs[0].index].append(len(d.outputs[0].token_ids))
    assert all(sum(s) == 9 and all(n >= 3 for n in s[1:-1]) for s in by_sibling.values()), by_sibling
    with pytest.raises(ValueError, match="stream_interval must be >= 1"):
        SamplingParams(stream_interval=0)
    assert run(all_blocks_free(engine))


def test_token_id_prompts_and_stop_strings(engine: AsyncLLM, llm: LLM, run: Any) -> None:
    text = llm.generate("hi", greedy(24, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    stop = next(ch for i, ch in enumerate(text) if i > 2 and ch.isascii() and ch.isalnum() and text.index(ch) == i)
    params = greedy(24, ignore_eos=True, stop=[stop])
    expected = llm.generate("hi", params, use_tqdm=False)[0].outputs[0]
    deltas = run(collect(engine.generate(llm.tokenizer.encode("hi"), params, "ids")))
    assert_delta_stream(deltas, "ids")
    assert deltas[0].prompt is None
    assert joined(deltas) == (expected.text, expected.token_ids)
    assert deltas[-1].outputs[0].finish_reason == "stop" and deltas[-1].outputs[0].stop_reason == stop
    assert run(all_blocks_free(engine))  # the stop string aborted the request in the core


def test_many_concurrent_requests(engine: AsyncLLM, run: Any) -> None:
    async def main() -> list[list[RequestOutput]]:
        return await asyncio.gather(*(collect(engine.generate(f"p{i}", greedy(1 + i % 7, ignore_eos=True),
                                                              f"c{i}")) for i in range(40)))

    results = run(main())
    assert [len(joined(d)[1]) for d in results] == [1 + i % 7 for i in range(40)]
    stats = run(engine.get_stats())
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0.0
    assert stats.num_generation_tokens >= sum(1 + i % 7 for i in range(40))
    assert run(all_blocks_free(engine))


# ---------------------------------------------------------------------------------------------- aborts


def test_consumer_that_breaks_frees_its_blocks(engine: AsyncLLM, run: Any) -> None:
    async def main() -> None:
        seen = 0
        async for out in engine.generate("x" * 100, greedy(400, ignore_eos=True), "breaker"):
            seen += len(out.outputs[0].token_ids)
            if seen >= 2:
                assert await engine.get_num_free_blocks() < engine.runtime.num_blocks
                break
        await wait_until(lambda: all_blocks_free(engine))
        stats = await engine.get_stats()
        assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0.0

    run(main())
    assert not engine.output_processor.has_unfinished_requests()


def test_cancelled_consumer_frees_its_blocks(engine: AsyncLLM, run: Any) -> None:
    async def main() -> None:
        first = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate("y" * 50, greedy(400, ignore_eos=True), "cancelled"):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: all_blocks_free(engine))  # the abort was sent in the generator's finally

    run(main())


def test_abort_by_id_ends_every_stream_with_that_id(engine: AsyncLLM, run: Any) -> None:
    async def main() -> list[list[RequestOutput]]:
        started = [asyncio.Event(), asyncio.Event()]

        async def consume(i: int) -> list[RequestOutput]:
            outs = []
            async for out in engine.generate(f"same prompt {i}", greedy(400, ignore_eos=True), "same"):
                outs.append(out)
                started[i].set()
            return outs

        tasks = [asyncio.create_task(consume(i)) for i in range(2)]
        await asyncio.gather(*(e.wait() for e in started))
        await engine.abort("same")
        return await asyncio.gather(*tasks)

    for outs in run(main()):
        assert_delta_stream(outs, "same")
        assert outs[-1].outputs[0].finish_reason == "abort" and len(joined(outs)[1]) < 400
    assert run(all_blocks_free(engine))


def test_reused_request_ids(engine: AsyncLLM, llm: LLM, run: Any) -> None:
    prompts = ["one", "two", "three"]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(6, ignore_eos=True), use_tqdm=False)]

    async def main() -> list[list[RequestOutput]]:
        return await asyncio.gather(*(collect(engine.generate(p, greedy(6, ignore_eos=True), "dup"))
                                      for p in prompts))

    for _ in range(2):  # the same id again, after the first ones finished
        results = run(main())
        assert [joined(d)[1] for d in results] == expected
        assert all(d.request_id == "dup" for outs in results for d in outs)


# ---------------------------------------------------------------------------------------------- n > 1


def test_n_siblings_share_the_prompt_blocks(engine: AsyncLLM, run: Any) -> None:
    prompt = "a prompt long enough to fill two sixteen-token blocks, and then some"
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    run(engine.reset_prefix_cache())
    before = run(engine.get_stats())
    outs = run(collect(engine.generate(prompt, params, "fan")))
    after = run(engine.get_stats())
    by_index: dict[int, list[RequestOutput]] = {0: [], 1: []}
    for out in outs:
        assert out.request_id == "fan" and len(out.outputs) == 1
        by_index[out.outputs[0].index].append(out)
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    for deltas in by_index.values():
        assert deltas[-1].outputs[0].finish_reason == "length"
        assert all(d.outputs[0].finish_reason is None for d in deltas[:-1])
        assert len(joined(deltas)[1]) == 8
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    assert hits >= 32 and max(d[-1].num_cached_tokens for d in by_index.values()) >= 32
    # Sibling i samples as a lone request with seed 7 + i would.
    for i in range(2):
        alone = run(collect(engine.generate(prompt, msgspec.structs.replace(params, n=1, seed=7 + i), "alone")))
        assert joined(alone) == joined(by_index[i])
    assert run(all_blocks_free(engine))


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(("prompt", "match"), [("x" * 600, "the prompt has 600 tokens but max_model_len is 512"),
                                               ("", "the prompt is empty"),
                                               ([1, 320], r"must be in \[0, 320\)")])
def test_bad_prompts_raise_before_queueing(engine: AsyncLLM, run: Any, prompt: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run(collect(engine.generate(prompt, greedy(2), "bad")))
    assert not engine.output_processor.has_unfinished_requests()
    stats = run(engine.get_stats())
    assert stats.num_waiting_reqs == stats.num_running_reqs == 0


def test_startup_error_is_a_value_error(tiny_llama: Path) -> None:
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=r"kv_cache_memory=100000 bytes.*raise kv_cache_memory to at least"):
        AsyncLLM.from_config(engine_config(tiny_llama, kv_cache_memory=100_000))
    assert set(multiprocessing.active_children()) <= before  # the failed core was reaped


def test_tokenizer_error_stops_the_started_core(tiny_llama: Path, tmp_path: Path) -> None:
    # The tokenizer loads while the core starts; when it fails, the core it started must not outlive the error.
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).symlink_to(tiny_llama / name)
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="no tokenizer files"):
        AsyncLLM.from_config(engine_config(tmp_path))
    assert set(multiprocessing.active_children()) <= before


def test_killed_core_fails_pending_and_new_requests(tiny_llama: Path, run: Any) -> None:
    eng = AsyncLLM.from_config(engine_config(tiny_llama))
    try:
        async def main() -> None:
            started = asyncio.Event()

            async def consume() -> None:
                async for _ in eng.generate("k" * 40, greedy(400, ignore_eos=True), "doomed"):
                    started.set()

            task = asyncio.create_task(consume())
            await started.wait()
            os.kill(eng.client.process.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match=r"died \(exit code -9\)"):
                await asyncio.wait_for(task, 10)
            assert eng.errored and not eng.is_running
            with pytest.raises(EngineDeadError):
                await eng.check_health()
            with pytest.raises(EngineDeadError):
                await collect(eng.generate("new", greedy(2), "new"))
            with pytest.raises(EngineDeadError):
                await eng.get_stats()

        run(main())
    finally:
        eng.shutdown()
    assert not os.path.exists(eng.client.ipc_dir) and eng.client.process not in multiprocessing.active_children()


def test_shutdown_leaves_nothing_behind(engine: AsyncLLM, run: Any) -> None:
    """Last test of the module: it stops the shared engine."""
    async def main() -> None:
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate("s" * 40, greedy(400, ignore_eos=True), "pending"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        engine.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            await task
        with pytest.raises(EngineDeadError):
            await collect(engine.generate("late", greedy(2), "late"))

    process = engine.client.process
    run(main())
    assert not process.is_alive() and process.exitcode == 0
    assert not os.path.exists(engine.client.ipc_dir)
    assert not engine.is_running and not engine.errored
    assert not multiprocessing.active_children()

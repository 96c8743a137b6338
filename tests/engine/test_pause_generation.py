"""vLLM's ``pause_generation`` / ``resume_generation`` on ``AsyncLLM`` over a real engine-core process: while paused,
new requests wait before reaching the core; the requests in flight end (``abort``), finish first (``wait``) or freeze
where they are (``keep``) and then go on to the offline engine's exact output; every KV block comes back."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from async_utils import (all_blocks_free, collect, engine_config, greedy, offline_llm, runner, started_engine,
                         wait_until)

from pagellm import LLM
from pagellm.engine.async_engine import AsyncLLM
from pagellm.outputs import RequestOutput

run = pytest.fixture(scope="module")(runner)
LONG = greedy(48, ignore_eos=True)
SHORT = greedy(6, ignore_eos=True)


engine = pytest.fixture(scope="module")(started_engine)
offline = pytest.fixture(scope="module")(offline_llm)


def _ids(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.outputs[0].token_ids]


async def _started(engine: AsyncLLM, prompt: str, params: Any, request_id: str) -> tuple[Any, list[RequestOutput]]:
    """A stream that has given its first output."""
    stream = engine.generate(prompt, params, request_id)
    return stream, [await stream.__anext__()]


async def _waiting(engine: AsyncLLM, prompt: str, request_id: str) -> asyncio.Task:
    """A request sent while paused: it waits at the gate (the core never sees it)."""
    task = asyncio.ensure_future(collect(engine.generate(prompt, SHORT, request_id)))
    await wait_until(lambda: _async(len(engine._pause._waiters) == 1))
    assert request_id not in engine._by_request_id and not task.done()
    return task


async def _async(value: bool) -> bool:
    return value


def test_keep_freezes_the_requests_in_flight_and_resumes_them_exactly(engine: AsyncLLM, offline: LLM,
                                                                       run: Any) -> None:
    async def main() -> tuple[list[int], list[int]]:
        stream, got = await _started(engine, "the quick brown fox", LONG, "kept")
        await engine.pause_generation(mode="keep")
        assert await engine.is_paused()
        tokens = [(await engine.get_stats()).num_generation_tokens for _ in range(6)]
        assert len(set(tokens)) == 1, tokens  # no step ran between the round trips through the core
        stats = await engine.get_stats()
        assert stats.num_running_reqs + stats.num_waiting_reqs == 1  # frozen in the core, its blocks held
        later = await _waiting(engine, "zz top", "later")
        await engine.resume_generation()
        got += [o async for o in stream]
        return _ids(got), _ids(await later)

    kept, later = run(main())
    assert kept == offline.generate("the quick brown fox", LONG, use_tqdm=False)[0].outputs[0].token_ids
    assert later == offline.generate("zz top", SHORT, use_tqdm=False)[0].outputs[0].token_ids
    assert not run(engine.is_paused()) and run(all_blocks_free(engine))


def test_abort_ends_the_requests_in_flight(engine: AsyncLLM, offline: LLM, run: Any) -> None:
    async def main() -> tuple[list[RequestOutput], list[int]]:
        stream, got = await _started(engine, "a", LONG, "aborted")
        await engine.pause_generation()  # abort, vLLM's default
        got += [o async for o in stream]
        assert await all_blocks_free(engine)
        later = await _waiting(engine, "hi", "after-abort")
        await engine.resume_generation()
        return got, _ids(await later)

    got, later = run(main())
    assert got[-1].finished and got[-1].outputs[0].finish_reason == "abort" and len(_ids(got)) < 48
    assert later == offline.generate("hi", SHORT, use_tqdm=False)[0].outputs[0].token_ids


def test_wait_returns_once_the_requests_in_flight_have_finished(engine: AsyncLLM, run: Any) -> None:
    async def main() -> list[RequestOutput]:
        stream, got = await _started(engine, "0123456789 counting", LONG, "waited")
        consumer = asyncio.ensure_future(collect(stream))
        await engine.pause_generation(mode="wait")
        assert not engine._tracked  # it has ended: nothing is in flight when the pause returns
        later = await _waiting(engine, "a", "after-wait")
        await engine.resume_generation()
        await later
        return got + await consumer

    got = run(main())
    assert len(_ids(got)) == 48 and got[-1].outputs[0].finish_reason == "length"
    assert run(all_blocks_free(engine))


def test_a_bad_mode_is_refused(engine: AsyncLLM, run: Any) -> None:
    with pytest.raises(ValueError, match="pause mode must be one of abort, wait, keep"):
        run(engine.pause_generation(mode="drain"))
    assert not run(engine.is_paused())



def test_past_max_num_queued_reqs_a_request_is_refused(tiny_llama: Path, offline: LLM, run: Any) -> None:
    """vLLM's ``max_num_queued_reqs``: requests in flight (sent, or waiting at the pause) count against it; the one
    that would go past it fails at once, one that leaves while waiting makes room, and once all end the count is 0."""
    from pagellm.engine.exceptions import EngineOverloadedError

    engine = AsyncLLM.from_config(engine_config(tiny_llama, max_num_queued_reqs=2))

    async def main() -> tuple[list[int], list[int]]:
        stream, got = await _started(engine, "the quick brown fox", LONG, "first")
        await engine.pause_generation(mode="keep")
        leaving = await _waiting(engine, "zz top", "leaves")
        assert engine._pause.in_flight == 2
        with pytest.raises(EngineOverloadedError, match="limit of 2 requests in flight"):
            await collect(engine.generate("a", SHORT, "refused"))
        leaving.cancel()  # a client gone while its request waited
        await wait_until(lambda: _async(engine._pause.in_flight == 1 and not engine._pause._waiters))
        later = await _waiting(engine, "zz top", "later")
        await engine.resume_generation()
        got += [o async for o in stream]
        return _ids(got), _ids(await later)

    try:
        first, later = run(main())
        assert first == offline.generate("the quick brown fox", LONG, use_tqdm=False)[0].outputs[0].token_ids
        assert later == offline.generate("zz top", SHORT, use_tqdm=False)[0].outputs[0].token_ids
        assert engine._pause.in_flight == 0 and run(all_blocks_free(engine))
        assert len(_ids(run(collect(engine.generate("hi", SHORT, "after"))))) == 6
    finally:
        engine.shutdown()


def test_past_max_num_queued_tokens_a_request_is_refused(tiny_llama: Path, run: Any) -> None:
    """vLLM's ``max_num_queued_tokens``: prompts without a first output (here held at a pause) count against it; at
    the limit a new request fails at once; a request that leaves, or that has its first output, counts no more."""
    from pagellm.engine.exceptions import EngineOverloadedError

    from pagellm.metrics.prometheus import PrometheusSink

    sink = PrometheusSink("tiny")
    engine = AsyncLLM.from_config(engine_config(tiny_llama, max_num_queued_tokens=30), stats_sink=sink)
    gate = engine._pause

    async def main() -> None:
        stream, _ = await _started(engine, "a prompt of forty characters, or so: ok", LONG, "decoding")
        assert gate.queued_tokens == 0  # its first output is out: its prompt left the backlog
        await engine.pause_generation(mode="keep")
        held = await _waiting(engine, "twenty characters...", "held")
        assert gate.queued_tokens == 20
        second = await _waiting(engine, "another twenty chars", "second")  # under the limit when it came
        await wait_until(lambda: _async(gate.queued_tokens == 40))
        with pytest.raises(EngineOverloadedError, match="prefill backlog is at its limit of 30 prompt tokens"):
            await collect(engine.generate("x", SHORT, "refused"))
        held.cancel()
        await wait_until(lambda: _async(gate.queued_tokens == 20 and len(gate._waiters) == 1))
        later = asyncio.ensure_future(collect(engine.generate("zz", SHORT, "later")))
        await wait_until(lambda: _async(gate.queued_tokens == 22))
        await engine.resume_generation()
        await stream.aclose()
        assert [len(_ids(await task)) for task in (second, later)] == [6, 6]

    try:
        run(main())
        assert gate.queued_tokens == 0 and not gate._prefilling and run(all_blocks_free(engine))
        assert 'pagellm:admission_rejections_total{model_name="tiny",reason="max_num_queued_tokens"} 1.0' in \
            sink.render().decode()
    finally:
        engine.shutdown()


def test_a_request_waiting_at_a_pause_fails_when_the_engine_stops(tiny_llama: Path, run: Any) -> None:
    from pagellm.engine.exceptions import EngineDeadError

    engine = AsyncLLM.from_config(engine_config(tiny_llama))

    async def main() -> None:
        await engine.pause_generation(mode="keep")
        waiting = await _waiting(engine, "hi", "stranded")
        engine.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            await waiting

    try:
        run(main())
    finally:
        engine.shutdown()


def test_a_second_pause_in_another_mode_runs_the_core_again(engine: AsyncLLM, run: Any) -> None:
    """A keep pause, then a wait pause: the frozen request runs to its end (the wait returns), and after resume the
    core steps again."""
    async def main() -> list[RequestOutput]:
        stream, got = await _started(engine, "hi", LONG, "frozen-then-waited")
        consumer = asyncio.ensure_future(collect(stream))
        await engine.pause_generation(mode="keep")
        await engine.pause_generation(mode="wait")  # would wait forever on a core still frozen
        await engine.resume_generation()
        assert len(_ids(await collect(engine.generate("a", SHORT, "after-both")))) == 6
        return got + await consumer

    got = run(main())
    assert len(_ids(got)) == 48 and got[-1].outputs[0].finish_reason == "length"
    assert not run(engine.is_paused()) and run(all_blocks_free(engine))

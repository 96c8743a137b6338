"""``AsyncLLM`` with ``data_parallel_size=2``: two engine-core processes behind one frontend (``DPClient``). Each
core keeps to its own CPU; requests spread over both and answer as one engine does; siblings share a core, and a
chat's later turns its earlier ones'; stats read as one engine's, with each core's own; aborts give every block back
on both; each core runs its own tensor-parallel ranks; a killed core fails the engine and stops the other. The
router's rules in unit tests, and the refusals.

One engine serves the module (two core processes); each test runs its coroutine on one module-wide event loop.
Waits poll a condition under a timeout.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any, Iterator

import pytest
from async_utils import SMALL_KV, all_blocks_free, collect, greedy, runner, wait_until
from async_utils import engine_config as tiny_config
from proc_utils import descendants, without_trackers

from pagellm import LLM, SamplingParams
from pagellm.config import EngineConfig
from pagellm.engine.async_engine import AsyncLLM
from pagellm.engine.core_proc import Placement
from pagellm.engine.dp_client import DPClient, Router, placements
from pagellm.engine.exceptions import EngineDeadError
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import RequestOutputKind

USES_RAY = True  # one such module at a time across make test's workers (tests/conftest.py: Ray takes one local
# instance, and some of these tests check that none runs)

PROMPTS = ["hi", "the quick brown fox", "a", "0123456789 counting", "zz top", "one more prompt"]
run = pytest.fixture(scope="module")(runner)


def engine_config(model_dir: Path, **overrides: Any) -> EngineConfig:
    return tiny_config(model_dir, **{"data_parallel_size": 2, **overrides})


def start(config: EngineConfig) -> AsyncLLM:
    """The engine on two threads, one per core (the tests' other engines run one thread)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGELLM_NUM_THREADS", "2")
        return AsyncLLM.from_config(config)


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Iterator[AsyncLLM]:
    eng = start(engine_config(tiny_llama))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV)


def cores(engine: AsyncLLM) -> DPClient:
    assert isinstance(engine.client, DPClient)
    return engine.client


def tokens(deltas: list[RequestOutput]) -> list[int]:
    return [t for d in deltas for t in d.outputs[0].token_ids]


# ---------------------------------------------------------------------------------------------- placement


def test_placements_split_the_cpus_and_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGELLM_NUM_THREADS")
    assert placements(2, cpus=[0, 1, 2, 3], threads=None) == [Placement((0, 1), 4 // 2), Placement((2, 3), 2)]
    assert placements(2, cpus=[4, 5, 6], threads=2) == [Placement((4,), 1), Placement((5, 6), 1)]
    assert placements(1, cpus=[0, 1], threads=None) == [Placement((0, 1), 2)]
    with pytest.raises(ValueError, match=r"data_parallel_size=3 needs a CPU and a thread for each engine core; "
                                         r"this process may use 2 CPUs and 2 threads"):
        placements(3, cpus=[0, 1], threads=None)
    with pytest.raises(ValueError, match="may use 4 CPUs and 1 threads"):
        placements(2, cpus=[0, 1, 2, 3], threads=1)
    monkeypatch.setenv("PAGELLM_NUM_THREADS", "2")
    assert placements(2, cpus=[0, 1, 2, 3]) == [Placement((0, 1), 1), Placement((2, 3), 1)]


def test_the_router_balances_unfinished_requests() -> None:
    router = Router(2, block_size=None)
    assert [router.route([f"r{i}"], [1, 2, 3, 4] * 8) for i in range(4)] == [0, 1, 0, 1]  # no affinity: in turn
    assert router.route(["a", "b"], [5]) == 0 and router.loads == [4, 2]  # siblings stay together
    assert [router.route([f"s{i}"], [6]) for i in range(2)] == [1, 1]
    assert router.release("a") == 0 and router.release("a") is None and router.loads == [3, 4]
    assert router.route(["t"], [7]) == 0 and router.routed == [5, 4]


def test_the_router_sends_a_prompt_to_the_core_that_had_its_leading_blocks() -> None:
    router = Router(2, block_size=4)
    chat = list(range(100, 112))  # three whole blocks
    assert router.route(["turn1"], chat) == 0
    router.release("turn1")
    later = [router.route([f"turn{i}"], chat + list(range(i * 10, i * 10 + 9))) for i in range(2, 6)]
    assert later == [0, 0, 0, 0]  # by load alone they would go to core 1 (0 unfinished against 1, 2, 3)
    assert router.route(["salted"], chat, salt="tenant") == 1  # another cache_salt: other blocks
    for busy, idle, to in [(10, 6, 0), (10, 5, 1), (50, 40, 0), (51, 40, 1)]:  # slack max(4, least // 4)
        router = Router(2, block_size=4)
        assert router.route(["turn1"], chat) == 0
        router.loads[:] = [busy, idle]
        assert router.route(["turn2"], chat + [1]) == to


def test_a_prefix_on_every_core_pulls_toward_none() -> None:
    router = Router(2, block_size=4)
    system = [9] * 8  # one system prompt before every request
    cores = [router.route([f"r{i}"], system + [i]) for i in range(12)]
    assert cores == [0] * 5 + [1] * 5 + [0, 1]  # learned by core 1 once core 0 is 5 busier; then by load alone
    assert router.loads == [6, 6]


def test_the_router_forgets_the_least_recently_routed_blocks() -> None:
    for capacity, to in [(4, 0), (2, 1)]:
        router = Router(2, block_size=4, capacity=capacity)
        assert router.route(["a"], [1] * 8) == 0
        router.release("a")
        assert router.route(["b"], [2] * 8) == 1
        router.release("b")
        assert router.route(["x"], [0]) == 0  # core 0 one busier: by load alone, core 1
        assert router.route(["c"], [1] * 8) == to  # core 0 had its blocks, unless they were forgotten


def test_offline_and_connector_refuse_data_parallelism(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match=r"data_parallel_size > 1 runs engine cores behind a server"):
        LLM(str(tiny_llama), dtype="float32", data_parallel_size=2)
    with pytest.raises(ValueError, match="kv_transfer_config runs with data_parallel_size 1"):
        EngineConfig.from_kwargs(model=str(tiny_llama), data_parallel_size=2, kv_transfer_config={
            "kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": "/tmp/unused"}})
    with pytest.raises(ValueError, match="data_parallel_size > 1 runs each core's ranks as worker processes"):
        EngineConfig.from_kwargs(model=str(tiny_llama), data_parallel_size=2, tensor_parallel_size=2,
                                 distributed_executor_backend="ray")
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer, got 0"):
        EngineConfig.from_kwargs(model=str(tiny_llama), data_parallel_size=0)


# ---------------------------------------------------------------------------------------------- serving


def test_each_core_keeps_to_its_own_cpus(engine: AsyncLLM, llm: LLM) -> None:
    client = cores(engine)
    affinity = [os.sched_getaffinity(core.process.pid) for core in client.engines]
    assert len(affinity) == 2 and affinity[0] and affinity[1] and not affinity[0] & affinity[1]
    assert affinity[0] | affinity[1] <= os.sched_getaffinity(0)
    assert engine.runtime.num_blocks == sum(core.runtime.num_blocks for core in client.engines)
    assert engine.runtime.num_blocks == 2 * llm.engine.runtime.num_blocks  # kv_cache_memory is per core


def test_requests_spread_over_both_cores_and_answer_as_one_engine(engine: AsyncLLM, llm: LLM, run: Any) -> None:
    params = [greedy(12, ignore_eos=True), greedy(5), greedy(20, ignore_eos=True), greedy(1), greedy(9),
              greedy(16, ignore_eos=True)]
    expected = llm.generate(PROMPTS, params, use_tqdm=False)
    before = list(cores(engine).router.routed)

    async def main() -> list[list[RequestOutput]]:
        return await asyncio.gather(*(collect(engine.generate(p, sp, f"r{i}"))
                                      for i, (p, sp) in enumerate(zip(PROMPTS, params))))

    for deltas, full in zip(run(main()), expected):
        assert tokens(deltas) == full.outputs[0].token_ids
        assert "".join(d.outputs[0].text for d in deltas) == full.outputs[0].text
        assert deltas[-1].outputs[0].finish_reason == full.outputs[0].finish_reason
    routed = [after - b for after, b in zip(cores(engine).router.routed, before)]
    assert routed == [3, 3]  # six requests at once: each to the core with fewer unfinished ones
    assert run(all_blocks_free(engine))
    stats = run(engine.get_stats())
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0.0


def test_stats_gauges_sum_the_cores(engine: AsyncLLM, run: Any) -> None:
    async def main() -> None:
        started = [asyncio.Event(), asyncio.Event()]

        async def consume(i: int) -> None:
            async for _ in engine.generate(f"long one {i}", greedy(400, ignore_eos=True), f"g{i}"):
                started[i].set()

        before = list(cores(engine).router.routed)
        tasks = [asyncio.create_task(consume(i)) for i in range(2)]
        await asyncio.gather(*(e.wait() for e in started))
        assert [a - b for a, b in zip(cores(engine).router.routed, before)] == [1, 1]
        stats = await engine.get_stats()
        assert stats.num_running_reqs == 2 and stats.kv_cache_usage > 0.0  # one running on each core
        assert [(c.num_running_reqs, c.num_waiting_reqs) for c in stats.engine_cores] == [(1, 0), (1, 0)]
        assert all(c.kv_cache_usage > 0.0 for c in stats.engine_cores)
        assert stats.kv_cache_usage == sum(c.kv_cache_usage for c in stats.engine_cores) / 2
        await engine.abort("g0")
        await engine.abort("g1")
        await asyncio.gather(*tasks)
        await wait_until(lambda: all_blocks_free(engine))
        assert cores(engine).router.loads == [0, 0] and not cores(engine).router._owner

    run(main())


def test_siblings_share_one_core_and_its_prefix_cache(engine: AsyncLLM, run: Any) -> None:
    prompt = "a prompt long enough to fill two sixteen-token blocks, and then some"
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    run(engine.reset_prefix_cache())
    before, routed = run(engine.get_stats()), list(cores(engine).router.routed)
    outs = run(collect(engine.generate(prompt, params, "fan")))
    after = run(engine.get_stats())
    assert sorted(a - b for a, b in zip(cores(engine).router.routed, routed)) == [0, 2]
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 32
    assert sorted(len(tokens([o for o in outs if o.outputs[0].index == i])) for i in range(2)) == [8, 8]
    assert run(all_blocks_free(engine))


def test_later_turns_go_to_the_core_that_holds_the_earlier_ones(engine: AsyncLLM, run: Any) -> None:
    history = engine.tokenizer.encode("a conversation long enough to fill three sixteen-token blocks of the tiny "
                                      "model's cache, and some more words")
    assert len(history) >= 48
    run(engine.reset_prefix_cache())
    for turn in range(4):
        before, routed = run(engine.get_stats()), list(cores(engine).router.routed)
        reply = run(collect(engine.generate(history, greedy(8, ignore_eos=True), f"turn{turn}")))
        got = [a - b for a, b in zip(cores(engine).router.routed, routed)]
        hits = run(engine.get_stats()).prefix_cache_hits - before.prefix_cache_hits
        if turn == 0:
            first = got
        else:  # by load alone (both idle) the turns would alternate between the cores
            assert got == first and hits >= 48
        history = history + tokens(reply) + engine.tokenizer.encode(f" and then {turn}")
    assert run(all_blocks_free(engine))


def test_each_core_runs_its_own_tensor_parallel_ranks(tiny_llama: Path, llm: LLM, run: Any) -> None:
    params = greedy(6, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], params, use_tqdm=False)]
    eng = start(engine_config(tiny_llama, tensor_parallel_size=2))
    try:
        async def main() -> list[list[RequestOutput]]:
            return await asyncio.gather(*(collect(eng.generate(p, params, f"tp{i}"))
                                          for i, p in enumerate(PROMPTS[:4])))

        assert [tokens(d) for d in run(main())] == expected
        assert cores(eng).router.routed == [2, 2]
        for core in cores(eng).engines:  # each core process started its own rank 1
            assert len(without_trackers(descendants(core.process.pid))) == 1
    finally:
        eng.shutdown()


def test_a_killed_core_fails_the_engine_and_stops_the_other(tiny_llama: Path, run: Any) -> None:
    eng = start(engine_config(tiny_llama))
    client = cores(eng)
    try:
        async def main() -> None:
            started = [asyncio.Event(), asyncio.Event()]

            async def consume(i: int) -> None:
                async for _ in eng.generate(f"doomed {i}", greedy(400, ignore_eos=True), f"d{i}"):
                    started[i].set()

            tasks = [asyncio.create_task(consume(i)) for i in range(2)]
            await asyncio.gather(*(e.wait() for e in started))
            os.kill(client.engines[1].process.pid, signal.SIGKILL)
            for task in tasks:  # the request on the surviving core fails too: the engine is one
                with pytest.raises(EngineDeadError, match=r"data-parallel engine core 1: .*died \(exit code -9\)"):
                    await asyncio.wait_for(task, 10)
            assert eng.errored and not eng.is_running
            with pytest.raises(EngineDeadError):
                await collect(eng.generate("new", greedy(2), "new"))
            with pytest.raises(EngineDeadError, match="data-parallel engine core 1"):
                await eng.get_stats()

        run(main())
        survivor = client.engines[0].process  # stopped (SIGTERM) by the client, not left serving nobody:
        run(wait_until(lambda: asyncio.sleep(0, survivor.exitcode is not None), 15))  # reaped by its stop thread
        assert survivor.exitcode == 0
    finally:
        eng.shutdown()
    assert not any(os.path.exists(core.ipc_dir) for core in client.engines)
    assert not {core.process for core in client.engines} & set(multiprocessing.active_children())


def test_a_core_that_fails_to_start_stops_the_other(tiny_llama: Path) -> None:
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=r"kv_cache_memory=100000 bytes.*raise kv_cache_memory to at least"):
        start(engine_config(tiny_llama, kv_cache_memory=100_000))
    assert set(multiprocessing.active_children()) <= before

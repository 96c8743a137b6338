"""Helpers for the tests that drive ``AsyncLLM`` over engine-core processes: collect a stream, poll a condition
under a timeout (never a fixed sleep), check that every KV block came back."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

from pagellm import LLM, SamplingParams
from pagellm.config import EngineConfig
from pagellm.engine.async_engine import AsyncLLM
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import RequestOutputKind

KV_BYTES_PER_TOKEN = 512  # tiny llama: 2 layers x 2 KV heads x 16 dims x 2 (K, V) x 4 bytes
SMALL_KV = 256 * 16 * KV_BYTES_PER_TOKEN
TIMEOUT_S = 30.0


def engine_config(model_dir: Path, **overrides: Any) -> EngineConfig:
    """The tiny model in float32 with a KV cache of 256 blocks (per engine core)."""
    args: dict[str, Any] = dict(model=str(model_dir), dtype="float32", kv_cache_memory=SMALL_KV)
    args.update(overrides)
    return EngineConfig.from_kwargs(**args)


def runner() -> Iterator[Callable[[Awaitable[Any]], Any]]:
    """A module's ``run`` fixture: each test's coroutine on one event loop, under ``TIMEOUT_S``."""
    with asyncio.Runner() as loop:
        yield lambda coro: loop.run(asyncio.wait_for(coro, TIMEOUT_S))


def greedy(max_tokens: int, **overrides: Any) -> SamplingParams:
    """Greedy parameters that stream deltas (what the servers ask ``AsyncLLM.generate`` for)."""
    return SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, "output_kind": RequestOutputKind.DELTA,
                             **overrides})


async def collect(gen: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [out async for out in gen]


async def wait_until(predicate: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def all_blocks_free(engine: AsyncLLM) -> bool:
    return await engine.get_num_free_blocks() == engine.runtime.num_blocks


def started_engine(tiny_llama: Path) -> Iterator[AsyncLLM]:
    """A module's ``engine`` fixture: the tiny model's ``AsyncLLM`` over one core process, shut down after."""
    engine = AsyncLLM.from_config(engine_config(tiny_llama))
    yield engine
    engine.shutdown()


def offline_llm(tiny_llama: Path) -> LLM:
    """A module's offline twin of ``started_engine``: the same model, dtype and KV cache."""
    return LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV)

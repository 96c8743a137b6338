"""Sleep mode (vLLM's ``enable_sleep_mode``, ``LLM.sleep`` / ``wake_up``): asleep, the KV cache's memory goes back
to the OS (the process's resident memory falls by about the cache's size), the prefix cache forgets its blocks and
requests are refused by name; awake, the engine answers as before. Only an idle engine with sleep mode sleeps."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagellm import LLM, SamplingParams
from pagellm.engine.exceptions import EngineSleepingError
from pagellm.worker.kv_prefault import populate

KV_BYTES = 64 << 20
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_sleep_gives_the_kv_cache_memory_back_and_wake_up_serves_again(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=256, kv_cache_memory=KV_BYTES, enable_sleep_mode=True)
    prompt = list(range(40, 80))
    before = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    caches = llm.engine.core.executor.worker.runner.kv_caches
    for cache in caches:  # every page resident, as a server's idle-time population leaves them
        assert populate(cache.data_ptr(), cache.numel() * cache.element_size())
    cache_bytes = sum(c.numel() * c.element_size() for c in caches)
    assert cache_bytes > 0.9 * KV_BYTES
    awake = _resident_bytes()
    llm.sleep()
    assert llm.is_sleeping() and llm.engine.core.scheduler.kv.pool.cached == {}
    assert awake - _resident_bytes() > 0.9 * cache_bytes
    with pytest.raises(EngineSleepingError, match="asleep .*wake it up first"):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping()
    after = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert after.outputs[0].token_ids == before and after.num_cached_tokens == 0  # the cache started empty
    with pytest.raises(ValueError, match="sleep level 2: use 1"):
        llm.sleep(level=2)


def test_only_an_idle_engine_with_sleep_mode_sleeps(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="without sleep mode: start it with enable_sleep_mode"):
        llm.sleep()
    sleepy = LLM(str(tiny_llama), dtype="float32", max_model_len=64, enable_sleep_mode=True)
    sleepy._add_requests([[1, 2, 3]], [GREEDY], [0])
    with pytest.raises(ValueError, match="only an idle engine sleeps: 1 requests are unfinished"):
        sleepy.sleep()


def test_every_tensor_parallel_rank_sleeps_and_wakes(tiny_llama: Path) -> None:
    """The ranks in worker processes get the command too: after a sleep the engine (both ranks' caches emptied)
    still answers as before."""
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=64, tensor_parallel_size=2, enable_sleep_mode=True)
    try:
        before = llm.generate([[9, 8, 7, 6]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        llm.sleep()
        llm.wake_up()
        assert llm.generate([[9, 8, 7, 6]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before
    finally:
        llm.shutdown()

"""Sleep mode (vLLM's ``enable_sleep_mode``, ``LLM.sleep`` / ``wake_up``): asleep, the KV cache's memory goes back
to the OS (the process's resident memory falls by about the cache's size), the prefix cache forgets its blocks and
requests are refused by name; awake, the engine answers as before. Level 2 drops the weights too, and waking up loads
the checkpoint last loaded. Only an idle engine with sleep mode sleeps."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from pagellm import LLM, SamplingParams
from pagellm.engine.exceptions import EngineSleepingError
from pagellm.worker.kv_prefault import populate

KV_BYTES = 64 << 20
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


SHAPES = dict(hidden_size=512, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=4)  # 33 MB


def _resident_bytes(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
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
    with pytest.raises(ValueError, match="sleep level 3: use 1 .* or 2"):
        llm.sleep(level=3)


def test_level_two_drops_the_weights_and_waking_loads_the_checkpoint_last_loaded(
        tiny_model_factory: Callable[..., Path]) -> None:
    """vLLM's level 2, for an RL loop's weight update: the weights' memory goes back to the OS too; a checkpoint
    loaded while asleep is what the engine wakes with (loaded once), and a later level-2 sleep wakes with it again."""
    first, second = tiny_model_factory("llama", seed=0, **SHAPES), tiny_model_factory("llama", seed=1, **SHAPES)
    prompt = [[5, 6, 7, 8]]
    expected = LLM(str(second), dtype="float32", max_model_len=64).generate(prompt, GREEDY, use_tqdm=False)
    llm = LLM(str(first), dtype="float32", max_model_len=64, kv_cache_memory=4 << 20, enable_sleep_mode=True)
    own = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert own != expected[0].outputs[0].token_ids
    runner = llm.engine.core.executor.worker.runner
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    awake = _resident_bytes()
    llm.sleep(level=2)
    assert awake - _resident_bytes() > 0.9 * weight_bytes
    with pytest.raises(EngineSleepingError):
        llm.generate(prompt, GREEDY, use_tqdm=False)
    llm.wake_up()
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == own
    llm.sleep(level=2)
    llm.update_weights_from_disk(str(second))
    loaded = runner.model
    llm.wake_up()
    assert runner.model is loaded  # waking did not load it a second time
    for _ in range(2):
        assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
            expected[0].outputs[0].token_ids
        llm.sleep(level=2)
        llm.wake_up()


def test_wake_up_tags_wake_the_weights_apart(tiny_llama: Path) -> None:
    """vLLM's ``wake_up(tags=...)``: "weights" loads what a level-2 sleep dropped and the engine stays asleep;
    "kv_cache" then wakes it without loading them again."""
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=64, enable_sleep_mode=True)
    runner = llm.engine.core.executor.worker.runner
    own = llm.generate([[3, 4, 5]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm.sleep(level=2)
    assert runner.model is None
    for bad in (["gpu"], "weights", []):
        with pytest.raises(ValueError, match="give a list of 'weights' and/or 'kv_cache'"):
            llm.wake_up(tags=bad)  # type: ignore[arg-type]
    llm.wake_up(tags=["weights"])
    loaded = runner.model
    assert loaded is not None and llm.is_sleeping()
    with pytest.raises(EngineSleepingError):
        llm.generate([[3, 4, 5]], GREEDY, use_tqdm=False)
    llm.wake_up(tags=["kv_cache"])
    assert runner.model is loaded and not llm.is_sleeping()
    assert llm.generate([[3, 4, 5]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == own


def test_only_an_idle_engine_with_sleep_mode_sleeps(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="without sleep mode: start it with enable_sleep_mode"):
        llm.sleep()
    sleepy = LLM(str(tiny_llama), dtype="float32", max_model_len=64, enable_sleep_mode=True)
    sleepy._add_requests([[1, 2, 3]], [GREEDY], [0])
    with pytest.raises(ValueError, match="only an idle engine sleeps: 1 requests are unfinished"):
        sleepy.sleep()
    drafting = LLM(str(tiny_llama), dtype="float32", max_model_len=64, enable_sleep_mode=True,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="sleep level 2 runs without speculative decoding"):
        drafting.sleep(level=2)


def test_every_tensor_parallel_rank_sleeps_and_wakes(tiny_model_factory: Callable[..., Path]) -> None:
    """The ranks in worker processes get the command too: after a sleep the engine (both ranks' caches emptied)
    still answers as before, and after a level-2 sleep too (rank 1's process gives its half of the weights back,
    and each rank loads its shard again)."""
    llm = LLM(str(tiny_model_factory("llama", **SHAPES)), dtype="float32", max_model_len=64, tensor_parallel_size=2,
              kv_cache_memory=4 << 20, enable_sleep_mode=True)
    try:
        before = llm.generate([[9, 8, 7, 6]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        model = llm.engine.core.executor.worker.runner.model
        shard_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        del model  # rank 0's weights are dropped too, so nothing here may hold them
        rank1 = llm.engine.core.executor.procs[0].pid
        for level in (1, 2):
            awake = _resident_bytes(rank1)
            llm.sleep(level)
            assert (awake - _resident_bytes(rank1) > 0.8 * shard_bytes) == (level == 2)
            llm.wake_up()
            assert llm.generate([[9, 8, 7, 6]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before
    finally:
        llm.shutdown()

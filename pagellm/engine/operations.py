"""What ``AsyncLLM`` does to its running engine besides serving requests (vLLM's ``AsyncLLM`` has the same calls):
stats and free blocks, the prefix cache's reset, sleep mode and weight updates, ``collective_rpc``, pausing and
resuming generation (``pause.PauseGate``), and the core's profiler. ``EngineOperations`` is ``AsyncLLM``'s base
class: each call goes to the core as a utility call through ``client``, and the ones that need an idle or a live
engine check the frontend's state first."""

from __future__ import annotations

import asyncio
import pickle
import threading
from typing import TYPE_CHECKING, Any, Callable

import msgspec

from pagellm.engine.exceptions import SLEEP_MODE_OFF, check_sleep_level, wake_tags
from pagellm.executor.ranks import rpc_payload
from pagellm.metrics.stats import SchedulerStats

if TYPE_CHECKING:
    from pagellm.config import EngineConfig
    from pagellm.engine.client import MPClient
    from pagellm.engine.pause import PauseGate
    from pagellm.engine.request_stream import Tracked
    from pagellm.metrics.sink import StatsSink


class EngineOperations:
    """The operations; ``AsyncLLM`` sets the state they use."""

    config: EngineConfig
    client: MPClient
    stats_sink: StatsSink
    _lock: threading.Lock
    _stats: SchedulerStats
    _tracked: dict[str, Tracked]
    _asleep: bool
    _pause: PauseGate
    _drop: Callable[[list[str], bool], None]

    async def get_stats(self) -> SchedulerStats:
        """Current gauges (running, waiting, KV usage) and every counter summed since the engine started."""
        fresh = await self.client.call_utility("get_stats")
        self.stats_sink.record(fresh, None)  # its counters (if any) happened between steps: count them too
        with self._lock:
            self._stats.accumulate(fresh)
            return msgspec.msgpack.decode(msgspec.msgpack.encode(self._stats), type=SchedulerStats)

    async def get_num_free_blocks(self) -> int:
        """Free KV blocks now (``runtime.num_blocks`` when no request holds any)."""
        return await self.client.call_utility("num_free_blocks")

    async def reset_prefix_cache(self) -> bool:
        return await self.client.call_utility("reset_prefix_cache")

    async def sleep(self, level: int = 1) -> None:
        """Sleep mode (``enable_sleep_mode``, vLLM's ``/sleep``): the KV cache's memory goes back to the OS and new
        requests fail with ``EngineSleepingError`` until ``wake_up``. ``level`` 2 drops the weights too (an RL loop's
        weight update follows): ``wake_up`` loads the checkpoint last loaded, unless ``update_weights_from_disk``
        already loaded another meanwhile."""
        check_sleep_level(level)
        if not self.config.cache_config.enable_sleep_mode:
            raise ValueError(SLEEP_MODE_OFF)
        self._check_idle("sleeps")
        await self.client.call_utility("sleep", level)
        self._asleep = True

    async def update_weights_from_disk(self, model: str | None = None) -> None:
        """Serve the weights of ``model`` (a checkpoint folder or .gguf of the served model's architecture and shapes;
        None: the served model's own, read again) from now on (SGLang's ``/update_weights_from_disk``; an RL loop's
        new policy). Only an idle engine updates; the prefix cache starts empty."""
        self._check_idle("updates its weights")
        await self.client.call_utility("update_weights", model)

    def _check_idle(self, what: str) -> None:
        with self._lock:
            unfinished = len(self._tracked)
        if unfinished:
            raise ValueError(f"only an idle engine {what}: {unfinished} requests are unfinished (let them finish, or "
                             "abort them)")

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's ``tags`` (``exceptions.wake_tags``): ``["weights"]`` loads dropped weights only, still asleep."""
        woken = wake_tags(tags)
        await self.client.call_utility("wake_up", list(woken))
        if "kv_cache" in woken:
            self._asleep = False

    async def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                             kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's ``collective_rpc`` (as ``LLM.collective_rpc``): ``method`` on every worker of every engine core,
        their results in rank order (core by core with data parallelism). The call and its results cross to the
        core's process pickled, so they must pickle (a worker method's name, or a module-level function)."""
        payload = rpc_payload(method, args, kwargs, "the engine core")
        return pickle.loads(await self.client.call_utility("collective_rpc", payload, timeout))

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        """vLLM's: new requests wait until ``resume_generation``; those in flight end (``abort``), finish first
        (``wait``) or freeze (``keep``), see ``engine/pause.py``. ``clear_cache`` then forgets the prefix cache's blocks
        (not with ``keep``, whose requests hold theirs)."""
        self._pause.close(mode)
        if (mode == "keep") != self._pause.core_frozen:  # a keep freezes the core; another mode (again) runs it
            await self.client.call_utility("pause" if mode == "keep" else "resume")
            self._pause.core_frozen = mode == "keep"
        if mode == "abort":
            with self._lock:
                live = list(self._tracked)
            self._drop(live, notify=True)
        while self._tracked and mode != "keep":  # the ends of the aborted or finishing requests, a step or so away
            await asyncio.sleep(0.01)
        if clear_cache and mode != "keep":
            await self.reset_prefix_cache()

    async def resume_generation(self) -> None:
        if self._pause.core_frozen:
            await self.client.call_utility("resume")
            self._pause.core_frozen = False
        self._pause.open()

    async def is_paused(self) -> bool:
        return self._pause.paused

    async def is_sleeping(self) -> bool:
        return await self.client.call_utility("is_sleeping")

    async def start_profile(self) -> bool:
        """Start the core's torch profiler; False when one records already (ValueError without ``profiler_dir``)."""
        self.config.profiler_config.require()
        return await self.client.call_utility("start_profile")

    async def stop_profile(self) -> list[str]:
        """Stop it; the trace and summary files written (none when nothing was recording)."""
        self.config.profiler_config.require()
        return await self.client.call_utility("stop_profile")

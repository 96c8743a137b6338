"""Data parallelism (``--data-parallel-size N``): ``DPClient``, N engine cores behind one frontend.

Each core is an ``MPClient`` (``client.py``): its own process, with a whole copy of the model (and its own
tensor-parallel or pipeline ranks, if any), its own scheduler and its own KV cache. ``DPClient`` offers the
``MPClient`` interface that ``AsyncLLM`` uses, so the frontend (tokenizer, detokenizer, streams, the HTTP and gRPC
servers) is one for all of them. Contract, beyond ``MPClient``'s:

- **Start.** The cores start at once, each on its own slice of the CPUs this process may use and with its share of
  the threads (``placements``: PAGELLM_NUM_THREADS, else the CPUs, split evenly; fewer than one each is refused).
  ``while_starting`` runs once. When one core fails to start, the others are stopped and its error is raised.
- **Routing** (``Router``). ``add_requests`` sends one call's requests (the siblings of ``n > 1``, which share
  their prompt's KV blocks through the prefix cache) to one core: the one with the fewest unfinished requests (ties
  taken in turn), unless another was given more of the prompt's leading blocks before (with prefix caching on: a
  chat's earlier turns, a long shared document) and is at most ``max(AFFINITY_SLACK, least // 4)`` requests busier;
  then that one, whose prefix cache likely holds them. The router remembers which cores were given which leading
  blocks (chained hashes of whole blocks with the request's ``cache_salt``, the latest ``PREFIX_CAPACITY``); a
  prefix given to every core (a shared system prompt) pulls toward none. A request is its core's until it finishes
  (``finish_reasons``), is refused (``errors``) or is aborted; ``abort_requests`` sends each id to its own core.
- **Stats.** Each core's step stats go on with the gauges of all the cores (running and waiting requests summed,
  the KV cache usage their mean; each core's own in ``engine_cores``) and the step's own counters, so the
  frontend's gauges and counters read as one engine's. Utility calls go to every core and their answers are
  merged (``_MERGE``).
- **runtime** is core 0's with ``num_blocks`` summed over the cores: the KV blocks of the whole engine.
- **Death.** The first core to die fails the client: ``on_dead`` gets one ``EngineDeadError`` naming the core,
  every later send raises it, and the other cores are stopped.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import os
import pickle
import threading
from collections import OrderedDict
from typing import Any, Callable

import msgspec

from pagellm import envs
from pagellm.config import EngineConfig
from pagellm.engine.client import MPClient, UtilityCalls
from pagellm.engine.core_proc import Placement
from pagellm.engine.exceptions import EngineDeadError
from pagellm.engine.wire import EngineCoreOutputs, EngineCoreRequest, UtilityMethod
from pagellm.metrics.stats import CoreGauges, SchedulerStats
from pagellm.worker.runtime import RuntimeInfo

logger = logging.getLogger(__name__)

AFFINITY_SLACK = 4          # a prompt's cached blocks outweigh this many more unfinished requests on their core
PREFIX_CAPACITY = 1 << 17   # leading-block hashes the router remembers (least recently routed forgotten first)


def placements(size: int, cpus: list[int] | None = None, threads: int | None = None) -> list[Placement]:
    """Each of ``size`` cores' CPUs (consecutive slices of ``cpus``, the ones this process may use) and threads
    (``threads``, else PAGELLM_NUM_THREADS, else one per CPU, split evenly)."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    total = threads or envs.num_threads() or len(cpus)
    if total < size or len(cpus) < size:
        raise ValueError(f"data_parallel_size={size} needs a CPU and a thread for each engine core; this process "
                         f"may use {len(cpus)} CPUs and {total} threads (PAGELLM_NUM_THREADS)")
    return [Placement(tuple(cpus[i * len(cpus) // size:(i + 1) * len(cpus) // size]), total // size)
            for i in range(size)]


def core_config(config: EngineConfig, rank: int) -> EngineConfig:
    """Engine core ``rank``'s config: its KV events carry its rank, on endpoints of its own (``for_rank``)."""
    events = config.kv_events_config
    return dataclasses.replace(config, kv_events_config=events.for_rank(rank)) if events.publishes else config


def _merge_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """One engine's stats from its cores': gauges and counters summed, the KV cache usage their mean."""
    merged = SchedulerStats()
    for one in stats:
        merged.accumulate(one)  # counters summed; the gauges, overwritten, come from every core below
    return _with_gauges(merged, stats)


def _with_gauges(stats: SchedulerStats, cores: list[SchedulerStats]) -> SchedulerStats:
    """``stats`` with the gauges of all the ``cores``: running and waiting requests summed, KV usage their mean, and
    each core's own (``engine_cores``)."""
    return msgspec.structs.replace(stats, num_running_reqs=sum(one.num_running_reqs for one in cores),
                                   num_waiting_reqs=sum(one.num_waiting_reqs for one in cores),
                                   kv_cache_usage=sum(one.kv_cache_usage for one in cores) / len(cores),
                                   engine_cores=[CoreGauges(one.num_running_reqs, one.num_waiting_reqs,
                                                            one.kv_cache_usage) for one in cores])


_MERGE: dict[str, Callable[[list[Any]], Any]] = {
    "get_stats": _merge_stats,
    "reset_prefix_cache": all,
    "sleep": all,
    "update_weights": all,
    "wake_up": all,
    "pause": all,
    "resume": all,
    # every core's workers, core by core (each core's list pickled in its process)
    "collective_rpc": lambda parts: pickle.dumps([result for part in parts for result in pickle.loads(part)]),
    "is_sleeping": all,
    "num_free_blocks": sum,
    "start_profile": all,
    "stop_profile": lambda files: [name for one in files for name in one],
}


class Router:
    """Which core takes each call's requests (see the module docstring's Routing). Not thread-safe (``DPClient``
    holds its lock)."""

    def __init__(self, size: int, block_size: int | None, capacity: int = PREFIX_CAPACITY) -> None:
        self.loads = [0] * size                            # unfinished requests per core
        self.routed = [0] * size                           # requests each core was given
        self.block_size = block_size                       # None: no prefix affinity (prefix caching off)
        self.capacity = capacity
        self._owner: dict[str, int] = {}                   # unfinished request id → its core
        self._blocks: OrderedDict[int, int] = OrderedDict()  # chained hash of leading blocks → bitmask of cores
        self._turn = itertools.count()

    def route(self, request_ids: list[str], tokens: list[int], salt: str | None = None) -> int:
        """The core for requests sharing the prompt ``tokens`` (siblings), now counted as its unfinished ones."""
        size = len(self.loads)
        start = next(self._turn) % size
        least = min(((start + i) % size for i in range(size)), key=self.loads.__getitem__)
        hashes = self._hashes(tokens, salt)
        depth = [0] * size  # leading blocks of the prompt each core was given before
        for i, h in enumerate(hashes):
            cores = self._blocks.get(h, 0)
            if not cores:
                break
            for c in range(size):
                depth[c] += depth[c] == i and cores >> c & 1
        best = max(range(size), key=lambda c: (depth[c], -self.loads[c]))
        core = least
        if depth[best] > depth[least] and \
                self.loads[best] - self.loads[least] <= max(AFFINITY_SLACK, self.loads[least] // 4):
            core = best
        for h in hashes:  # this core now holds these blocks (or soon will)
            self._blocks[h] = self._blocks.get(h, 0) | 1 << core
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
        for request_id in request_ids:
            self._owner[request_id] = core
        self.loads[core] += len(request_ids)
        self.routed[core] += len(request_ids)
        return core

    def release(self, request_id: str) -> int | None:
        """Forget an unfinished request (finished, refused or aborted); its core, or ``None`` if it had none."""
        core = self._owner.pop(request_id, None)
        if core is not None:
            self.loads[core] -= 1
        return core

    def _hashes(self, tokens: list[int], salt: str | None) -> list[int]:
        if self.block_size is None:
            return []
        chained, out, size = hash(salt), [], self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            chained = hash((chained, tuple(tokens[start:start + size])))
            out.append(chained)
        return out


class DPClient(UtilityCalls):
    """``size`` engine cores behind one frontend (see the module docstring for the contract)."""

    def __init__(self, config: EngineConfig, on_outputs: Callable[[EngineCoreOutputs], None],
                 on_dead: Callable[[EngineDeadError], None], startup_timeout_s: float = 600.0,
                 while_starting: Callable[[], None] | None = None) -> None:
        size = config.parallel_config.data_parallel_size
        places = placements(size)
        self._on_outputs, self._on_dead = on_outputs, on_dead
        self._lock = threading.Lock()
        prefix = config.cache_config.enable_prefix_caching and envs.dp_prefix_affinity()
        self.router = Router(size, config.cache_config.block_size if prefix else None)
        self._gauges = [SchedulerStats() for _ in range(size)]  # each core's latest gauges
        self._dead: str | None = None
        self._closing = False
        self._stop_lock = threading.Lock()
        with concurrent.futures.ThreadPoolExecutor(size, thread_name_prefix="dp-start") as pool:
            futures = [pool.submit(MPClient, core_config(config, i), self._outputs_of(i), self._dead_of(i),
                                   startup_timeout_s,
                                   while_starting if i == 0 else None, places[i], f"pagellm-engine-core-dp{i}")
                       for i in range(size)]
            concurrent.futures.wait(futures)
        self.engines: list[MPClient] = [f.result() for f in futures if f.exception() is None]
        failed = [f.exception() for f in futures if f.exception() is not None]
        if failed:
            self.shutdown()
            raise failed[0]
        blocks = sum(engine.runtime.num_blocks for engine in self.engines)
        self.runtime: RuntimeInfo = dataclasses.replace(self.engines[0].runtime, num_blocks=blocks)
        logger.info("%d data-parallel engine cores, on CPUs %s", size, [p.cpus for p in places])

    # ------------------------------------------------------------------------------------------- sends
    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        with self._lock:
            core = self.router.route([r.request_id for r in requests], requests[0].prompt_token_ids,
                                     requests[0].cache_salt)
        self.engines[core].add_requests(requests)

    def abort_requests(self, request_ids: list[str]) -> None:
        by_core: dict[int, list[str]] = {}
        with self._lock:
            for request_id in request_ids:
                core = self.router.release(request_id)
                if core is not None:
                    by_core.setdefault(core, []).append(request_id)
        for core, ids in by_core.items():
            self.engines[core].abort_requests(ids)

    def call_utility_future(self, method: UtilityMethod, *args: Any) -> concurrent.futures.Future:
        """One call on every core; the future holds their merged answer, or the first failure."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        parts = [engine.call_utility_future(method, *args) for engine in self.engines]
        merged: concurrent.futures.Future = concurrent.futures.Future()

        def done(_: concurrent.futures.Future) -> None:
            if merged.done() or not all(part.done() for part in parts):
                return
            error = next((part.exception() for part in parts if part.exception() is not None), None)
            try:
                if error is not None:
                    merged.set_exception(error)
                else:
                    merged.set_result(_MERGE[method]([part.result() for part in parts]))
            except concurrent.futures.InvalidStateError:  # set by another part's callback meanwhile
                pass

        for part in parts:
            part.add_done_callback(done)
        return merged

    # ------------------------------------------------------------------------------------------- outputs
    def _outputs_of(self, core: int) -> Callable[[EngineCoreOutputs], None]:
        def on_outputs(outputs: EngineCoreOutputs) -> None:  # on core ``core``'s output thread
            with self._lock:
                for request_id in itertools.chain(outputs.step.finish_reasons, (e.request_id for e in outputs.errors)):
                    self.router.release(request_id)
                if outputs.stats is not None:
                    self._gauges[core] = outputs.stats
                    outputs.stats = _with_gauges(outputs.stats, self._gauges)
            self._on_outputs(outputs)
        return on_outputs

    # ------------------------------------------------------------------------------------------- lifecycle
    def _dead_of(self, core: int) -> Callable[[EngineDeadError], None]:
        def on_dead(error: EngineDeadError) -> None:
            with self._lock:
                if self._dead is not None:
                    return
                self._dead = str(error) if self._closing else f"data-parallel engine core {core}: {error}"
            self._on_dead(EngineDeadError(self._dead))
            if not self._closing:  # the others serve no purpose without it: stopped, off this output thread
                threading.Thread(target=self._stop_engines, name="dp-stop", daemon=True).start()
        return on_dead

    def shutdown(self) -> None:
        """Stop every core (each as ``MPClient.shutdown`` does); returns once all are gone."""
        self._closing = True
        self._stop_engines()

    def _stop_engines(self) -> None:
        with self._stop_lock:  # a shutdown() during the stop after a death waits for it
            for engine in getattr(self, "engines", []):
                engine.shutdown()

"""Tensor parallelism over a Ray cluster (``distributed_executor_backend="ray"``): rank 0 runs in the engine core's
process, ranks 1..N-1 in Ray actors that a placement group puts on the cluster's nodes.

Contract:
- ``RayExecutor(config)`` connects to the Ray cluster ``RAY_ADDRESS`` names (else a running local one, else it starts
  a local instance), reserves one bundle of ``threads_per_rank`` CPUs per rank (``PACK``: as few nodes as fit;
  bundle 0, rank 0's, on the engine core's node) and starts one actor per remote rank in its bundle, with the
  engine core's ``PAGELLM_*`` environment. A cluster with fewer CPUs than the ranks need fails at once, naming both.
- The ranks join one gloo group at the engine core's address: loopback when every actor landed on the engine core's
  node (then the collectives go through shared memory, as ``multiproc``'s do), else the node's IP (gloo over TCP;
  ``GLOO_SOCKET_IFNAME`` picks the interface). Each rank loads its own shard from ``model`` (the path must exist on
  every node). It returns once every rank has loaded, or raises the first rank's error.
- ``execute_model`` sends the step (msgpack bytes) to every actor, runs rank 0, then collects the actors' results:
  a rank that failed or died makes the step raise ``RuntimeError`` naming it (a rank killed between steps is seen by
  the collectives first: shared memory checks its process, gloo its socket).
- ``shutdown`` stops the actors, kills any that hang, and frees the placement group; actors whose engine core was
  killed are ended by Ray (their owner died). When the executor connected to Ray itself, it disconnects, which stops
  the local instance it started (a cluster it joined keeps running).
- Profiling records rank 0 only.
"""

from __future__ import annotations

import logging
import os
import traceback
from typing import Any, Callable, Optional

import msgspec

from pagellm import envs
from pagellm.config import EngineConfig
from pagellm.executor.ranks import (COLLECTIVE_TIMEOUT_S, Command, RankZeroExecutor, build_worker, close_comm,
                                    join_group, join_watching, leave_group, open_store, rpc_payload, rpc_results,
                                    run_rpc, store_address, threads_per_rank)
from pagellm.sched.output import ModelRunnerOutput, SchedulerOutput
from pagellm.worker.runtime import RuntimeInfo

logger = logging.getLogger(__name__)

_PLACEMENT_TIMEOUT_S = 120  # an autoscaling cluster may add a node meanwhile
_START_TIMEOUT_S = 600  # loading a model and building kernels on a cold node
_STOP_TIMEOUT_S = 10
_DEATH_WAIT_S = 5  # after a collective failed: how long Ray may take to report the rank's death
_ENCODER = msgspec.msgpack.Encoder()


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RuntimeError("distributed_executor_backend='ray' needs Ray: pip install 'pagellm[ray]'") from None
    return ray


def connect() -> tuple[Any, bool]:
    """The ``ray`` module, connected: to ``RAY_ADDRESS``'s cluster, a running local one, or a new local instance;
    and whether this call connected it (then ``ray.shutdown()`` is ours to call: it ends an instance we started)."""
    ray = import_ray()
    if ray.is_initialized():
        return ray, False
    ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, logging_level=logging.WARNING)
    return ray, True


class RankActor:
    """One tensor-parallel rank inside a Ray actor: it builds its ``Worker`` and follows rank 0's commands."""

    def __init__(self) -> None:
        self.worker: Any = None
        self.decoder = msgspec.msgpack.Decoder(Command)

    def where(self) -> tuple[str, int]:
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def start(self, config: EngineConfig, rank: int, size: int, address: str, shm: bool,
              threads: int) -> RuntimeInfo:
        try:
            join_group(rank, size, address)
            self.worker = build_worker(config, rank, size, shm, threads)
        except BaseException as exc:  # reaches rank 0 as the start-up error (the traceback goes to the log)
            logger.debug("rank %d failed to start:\n%s", rank, traceback.format_exc())
            raise RuntimeError(f"{type(exc).__name__}: {exc}") from None
        return self.worker.runtime

    def run(self, payload: bytes) -> Any:
        command = self.decoder.decode(payload)
        if command.kind == "rpc":
            return run_rpc(self.worker, command.payload)
        if command.kind == "execute":
            self.worker.execute_model(command.sched)
        elif command.kind == "idle":
            self.worker.set_idle(command.idle)
        elif command.kind == "sleep":
            self.worker.set_asleep(command.asleep, command.level)
        elif command.kind == "update":
            self.worker.update_weights(command.model)

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            close_comm(self.worker)
            self.worker = None
        leave_group()


class RayExecutor(RankZeroExecutor):
    def __init__(self, config: EngineConfig) -> None:
        self.ray, self._owns_ray = connect()
        size = config.parallel_config.world_size
        self.threads = threads_per_rank(size)
        self.group: Any = None
        self.actors: list[Any] = []
        self.worker: Any = None
        try:
            shm = self._start(config, size)
        except BaseException:
            self._stop_ranks()
            if self.worker is not None:
                self.worker.shutdown()
                close_comm(self.worker)
            leave_group()
            self._disconnect()
            raise
        self.runtime: RuntimeInfo = self.worker.runtime
        self._register_exit()
        logger.info("%d ranks on Ray (%s), %d threads each, %s", size, config.parallel_config.describe(),
                    self.threads, "one node (shared memory between ranks)" if shm else "gloo between ranks")

    def _start(self, config: EngineConfig, size: int) -> bool:
        """Place the ranks, start the actors, load every rank; whether the collectives use shared memory."""
        ray = self.ray
        self.group = self._place(size)
        self._start_actors(size)
        node = ray.get_runtime_context().get_node_id()
        local = all(where[0] == node for where in self.where)
        host = "127.0.0.1" if local else ray.util.get_node_ip_address()
        store = open_store(size, host)
        shm = local and envs.tp_shm_comm()
        refs = [actor.start.remote(config, rank, size, store_address(store), shm, self.threads)
                for rank, actor in enumerate(self.actors, start=1)]
        self._join(refs, size, store)
        self.worker = build_worker(config, 0, size, shm, self.threads)
        self._check_runtimes(refs)
        return shm

    def _place(self, size: int) -> Any:
        """A placement group of one bundle per rank, bundle 0 on this node; refused at once when it cannot fit."""
        from ray.util.placement_group import placement_group

        ray = self.ray
        cpus = ray.cluster_resources().get("CPU", 0)
        if cpus < size * self.threads:
            raise RuntimeError(f"the Ray cluster has {cpus:g} CPUs; {size} tensor-parallel ranks of {self.threads} "
                               f"threads need {size * self.threads} (set PAGELLM_NUM_THREADS or add nodes)")
        # Rank 0's bundle on this node, by its id (several nodes may share an address, so not ``node:<ip>``).
        here = {"ray.io/node-id": ray.get_runtime_context().get_node_id()}
        group = placement_group([{"CPU": self.threads} for _ in range(size)], strategy="PACK",
                                bundle_label_selector=[here] + [{} for _ in range(size - 1)])
        try:
            ray.get(group.ready(), timeout=_PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(group)
            raise RuntimeError(f"Ray could not place {size} bundles of {self.threads} CPUs within "
                               f"{_PLACEMENT_TIMEOUT_S}s (free now: {ray.available_resources()})") from None
        return group

    def _start_actors(self, size: int) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        env = {name: value for name, value in os.environ.items() if name.startswith("PAGELLM_")}
        remote = self.ray.remote(RankActor)
        for rank in range(1, size):
            strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank)
            self.actors.append(remote.options(
                num_cpus=self.threads, scheduling_strategy=strategy,
                runtime_env={"env_vars": env}).remote())
        self.where = self.ray.get([actor.where.remote() for actor in self.actors], timeout=_START_TIMEOUT_S)

    def _join(self, refs: list[Any], size: int, store: Any) -> None:
        def check() -> None:
            done, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
            for ref in done:  # a failure (or, once joined, already a runtime: kept for _check_runtimes)
                self._result(refs.index(ref) + 1, ref, _START_TIMEOUT_S)

        join_watching(size, store, check)

    def _check_runtimes(self, refs: list[Any]) -> None:
        for rank, ref in enumerate(refs, start=1):
            runtime = self._result(rank, ref, _START_TIMEOUT_S)
            if runtime != self.worker.runtime:
                raise RuntimeError(f"tensor-parallel rank {rank} found {runtime}, rank 0 {self.worker.runtime}")

    def _result(self, rank: int, ref: Any, timeout: float) -> Any:
        """What rank's call returned; its failure or death as a ``RuntimeError`` that names it."""
        ray = self.ray
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.RayActorError as exc:
            raise RuntimeError(f"tensor-parallel rank {rank} (Ray actor) died: {exc}") from None
        except ray.exceptions.RayTaskError as exc:
            raise RuntimeError(f"tensor-parallel rank {rank} failed: {exc.cause}") from None
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"tensor-parallel rank {rank} did not answer within {timeout}s") from None

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        payload = _ENCODER.encode(Command("execute", sched))
        refs = [actor.run.remote(payload) for actor in self.actors]
        try:
            output = self.worker.execute_model(sched)
        except RuntimeError as exc:  # a collective that lost a rank: name the rank when Ray knows it
            raise self._failed_rank(refs) or exc
        for rank, ref in enumerate(refs, start=1):
            self._result(rank, ref, COLLECTIVE_TIMEOUT_S)
        return output

    def _failed_rank(self, refs: list[Any]) -> Optional[RuntimeError]:
        """The error of the first rank whose call failed or whose actor died (waiting a moment for Ray to know)."""
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=_DEATH_WAIT_S)
        for ref in ready:
            try:
                self._result(refs.index(ref) + 1, ref, 0)
            except RuntimeError as exc:
                return exc
        return None

    def set_idle(self, idle: bool) -> None:
        self._on_ranks(Command("idle", idle=idle), lambda: self.worker.set_idle(idle))

    def set_asleep(self, asleep: bool, level: int = 1) -> None:
        self._on_ranks(Command("sleep", asleep=asleep, level=level), lambda: self.worker.set_asleep(asleep, level))

    def update_weights(self, model: str | None) -> None:
        self.worker.weights_source(model)  # a bad checkpoint is refused before any rank loads it
        self._on_ranks(Command("update", model=model), lambda: self.worker.update_weights(model))

    def collective_rpc(self, method: Any, args: tuple = (), kwargs: dict[str, Any] | None = None,
                       timeout: float | None = None) -> list[Any]:
        payload = rpc_payload(method, args, kwargs)
        refs = [actor.run.remote(_ENCODER.encode(Command("rpc", payload=payload))) for actor in self.actors]
        answers = [run_rpc(self.worker, payload)]
        wait = COLLECTIVE_TIMEOUT_S if timeout is None else timeout
        answers += [self._result(rank, ref, wait) for rank, ref in enumerate(refs, start=1)]
        return rpc_results(answers)

    def _on_ranks(self, command: Command, on_rank_zero: Callable[[], None]) -> None:
        """``command`` on every actor's rank and ``on_rank_zero`` here, each actor's answer awaited."""
        refs = [actor.run.remote(_ENCODER.encode(command)) for actor in self.actors]
        on_rank_zero()
        for rank, ref in enumerate(refs, start=1):
            self._result(rank, ref, COLLECTIVE_TIMEOUT_S)

    def _after_shutdown(self) -> None:
        self._disconnect()

    def _disconnect(self) -> None:
        """Leave the cluster if this executor joined it (the engine core exits without interpreter teardown, so
        Ray's own exit hook would not run): a local instance it started stops with all its processes."""
        if self._owns_ray:
            self.ray.shutdown()

    def _stop_ranks(self) -> None:
        ray = self.ray
        if self.actors:
            try:
                ray.get([actor.stop.remote() for actor in self.actors], timeout=_STOP_TIMEOUT_S)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                pass  # a dead or hung actor: killed below
            for actor in self.actors:
                ray.kill(actor)
            self.actors = []
        if self.group is not None:
            ray.util.remove_placement_group(self.group)
            self.group = None

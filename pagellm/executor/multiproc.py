"""Tensor and pipeline parallelism over processes: rank 0 runs in the engine core's process, ranks 1..N-1 in worker
processes that each step's ``SchedulerOutput`` reaches through a shared-memory broadcast ring.

Contract:
- ``MultiprocExecutor(config)`` spawns ``world_size - 1`` worker processes (tensor × pipeline ranks), joins them in
  one ``torch.distributed`` group (gloo: CPU collectives) and builds its own rank-0 ``Worker``; each rank loads its
  shard of its stage's layers (``distributed/groups.ParallelState``: attention heads, MLP columns, vocabulary) and a
  KV cache for its heads, and runs on its share of the threads. It returns once every rank has loaded, or raises the
  first rank's error.
- ``execute_model`` broadcasts the step (msgpack, ``distributed/shm_ring.py``) and runs rank 0; all ranks run the
  same forward pass, meet in the layers' all-reduces (through shared memory, ``distributed/shm_comm.py``; gloo
  with ``PAGELLM_TP_SHM_COMM=0`` or for tensors too large) and sample alike (the same logits and seeds), so each keeps
  the same per-request state; rank 0's output is the step's. ``set_idle`` reaches every rank.
- A worker process that dies makes the next step raise (``RuntimeError`` naming its exit code), and a collective
  waiting on a dead rank gives up after ``COLLECTIVE_TIMEOUT_S``, so the engine core fails instead of hanging.
- ``shutdown`` stops the workers (a message, then a join, then a kill for a worker that hangs) and frees the ring;
  a worker whose engine core was killed notices within a second and exits, so none outlives it.
- Profiling records rank 0 only.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import os
import time
import traceback
from typing import Any

import msgspec

from pagellm import envs
from pagellm.config import EngineConfig
from pagellm.distributed.shm_ring import RingReader, ShmRing
from pagellm.executor.ranks import (COLLECTIVE_TIMEOUT_S, Command, RankZeroExecutor, build_worker, close_comm,
                                    join_group, join_watching, leave_group, open_store, rpc_payload, rpc_results,
                                    run_rpc, store_address, threads_per_rank)
from pagellm.sched.output import ModelRunnerOutput, SchedulerOutput
from pagellm.worker.runtime import RuntimeInfo

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 600  # loading a model and building kernels on a cold machine
_PARENT_POLL_S = 1.0  # how often an idle worker checks that the engine core still lives
_ENCODER = msgspec.msgpack.Encoder()


def _build_worker(config: EngineConfig, rank: int, size: int) -> Any:
    return build_worker(config, rank, size, envs.tp_shm_comm(), threads_per_rank(size))


def _worker_main(config: EngineConfig, rank: int, size: int, address: str, reader: RingReader, pipe: Any) -> None:
    """A worker process: join the group, load this rank's shard, then follow the ring until told to stop."""
    try:
        join_group(rank, size, address)
        worker = _build_worker(config, rank, size)
        pipe.send(("ready", worker.runtime))
    except BaseException as exc:  # the engine core reports it and stops the others
        logger.debug("rank %d failed to start:\n%s", rank, traceback.format_exc())
        pipe.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    decoder = msgspec.msgpack.Decoder(Command)
    parent = os.getppid()
    try:
        while True:
            try:
                command = decoder.decode(reader.get(timeout=_PARENT_POLL_S))
            except TimeoutError:
                if os.getppid() != parent:  # the engine core is gone (killed): never outlive it
                    logger.warning("rank %d: the engine core is gone; exiting", rank)
                    break
                continue
            if command.kind == "execute":
                worker.execute_model(command.sched)
            elif command.kind == "idle":
                worker.set_idle(command.idle)
            elif command.kind == "sleep":
                worker.set_asleep(command.asleep, command.level)
            elif command.kind == "update":
                worker.update_weights(command.model)
            elif command.kind == "rpc":
                _answer(pipe, command.call, run_rpc(worker, command.payload))
            else:
                break
    finally:
        worker.shutdown()
        close_comm(worker)
        reader.detach()


def _answer(pipe: Any, call: int, answer: tuple[str, Any]) -> None:
    try:
        pipe.send((call, answer))
    except Exception as exc:  # a result that does not pickle
        pipe.send((call, ("error", f"the result cannot reach rank 0 ({type(exc).__name__}: {exc})")))


class MultiprocExecutor(RankZeroExecutor):
    def __init__(self, config: EngineConfig) -> None:
        size = config.parallel_config.world_size
        ctx = mp.get_context("spawn")
        store = open_store(size)
        self.ring = ShmRing(size - 1, ctx)
        self.pipes, self.procs = [], []
        self._started: dict[int, RuntimeInfo] = {}  # ranks whose runtime came while rank 0 was still joining
        self._calls = itertools.count(1)  # collective_rpc's call numbers
        for rank in range(1, size):
            parent, child = ctx.Pipe()
            process = ctx.Process(target=_worker_main, name=f"pagellm-tp{rank}", daemon=True,
                                  args=(config, rank, size, store_address(store), self.ring.reader(rank - 1), child))
            process.start()
            child.close()
            self.pipes.append(parent)
            self.procs.append(process)
        try:
            self._join(size, store)
            self.worker = _build_worker(config, 0, size)
            self._wait_ready()
        except BaseException:
            self._stop_ranks()
            leave_group()
            raise
        self.runtime: RuntimeInfo = self.worker.runtime
        self._register_exit()  # an LLM dropped without shutdown() still stops its workers and frees the ring
        logger.info("%d ranks (%s), %d threads each", size, config.parallel_config.describe(), threads_per_rank(size))

    def _join(self, size: int, store: Any) -> None:
        def check() -> None:
            for rank, (pipe, process) in enumerate(zip(self.pipes, self.procs), start=1):
                if rank not in self._started and pipe.poll():  # a failure (or, once joined, already its runtime)
                    self._started[rank] = self._receive_start(rank, pipe, process)
                if not process.is_alive():
                    raise RuntimeError(f"tensor-parallel rank {rank} died while starting (exit code "
                                       f"{process.exitcode})")

        join_watching(size, store, check)

    @staticmethod
    def _receive_start(rank: int, pipe: Any, process: Any) -> RuntimeInfo:
        """A rank's start-up report: its runtime, or the error it failed with (raised)."""
        try:
            kind, value = pipe.recv()
        except EOFError:
            raise RuntimeError(f"tensor-parallel rank {rank} died while starting (exit code "
                               f"{process.exitcode})") from None
        if kind == "error":
            raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {value}")
        return value

    def _wait_ready(self) -> None:
        for rank, (pipe, process) in enumerate(zip(self.pipes, self.procs), start=1):
            value = self._started.get(rank)
            if value is None:
                if not pipe.poll(_START_TIMEOUT_S):
                    raise RuntimeError(f"tensor-parallel rank {rank} did not start within {_START_TIMEOUT_S}s")
                value = self._receive_start(rank, pipe, process)
            if value != self.worker.runtime:
                raise RuntimeError(f"tensor-parallel rank {rank} found {value}, rank 0 {self.worker.runtime}")

    def _broadcast(self, command: Command) -> None:
        for rank, process in enumerate(self.procs, start=1):
            if not process.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} died (exit code {process.exitcode})")
        self.ring.put(_ENCODER.encode(command), timeout=COLLECTIVE_TIMEOUT_S)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._broadcast(Command("execute", sched))
        return self.worker.execute_model(sched)

    def set_idle(self, idle: bool) -> None:
        self._broadcast(Command("idle", idle=idle))
        self.worker.set_idle(idle)

    def set_asleep(self, asleep: bool, level: int = 1) -> None:
        self._broadcast(Command("sleep", asleep=asleep, level=level))
        self.worker.set_asleep(asleep, level)

    def update_weights(self, model: str | None) -> None:
        self.worker.weights_source(model)  # a bad checkpoint is refused before any rank loads it
        self._broadcast(Command("update", model=model))
        self.worker.update_weights(model)

    def collective_rpc(self, method: Any, args: tuple = (), kwargs: dict[str, Any] | None = None,
                       timeout: float | None = None) -> list[Any]:
        payload = rpc_payload(method, args, kwargs)
        call = next(self._calls)
        self._broadcast(Command("rpc", payload=payload, call=call))
        answers = [run_rpc(self.worker, payload)]
        deadline = time.monotonic() + (COLLECTIVE_TIMEOUT_S if timeout is None else timeout)
        for rank, (pipe, process) in enumerate(zip(self.pipes, self.procs), start=1):
            while True:  # an answer to an earlier call that timed out is dropped
                if not pipe.poll(max(0.0, deadline - time.monotonic())):
                    raise RuntimeError(f"collective_rpc: tensor-parallel rank {rank} did not answer in time"
                                       + ("" if process.is_alive() else f" (it died, exit code {process.exitcode})"))
                number, answer = pipe.recv()
                if number == call:
                    answers.append(answer)
                    break
        return rpc_results(answers)

    def _stop_ranks(self) -> None:
        if any(p.is_alive() for p in self.procs):
            try:
                self.ring.put(_ENCODER.encode(Command("stop")), timeout=5)
            except TimeoutError:
                pass
        for process in self.procs:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()
        self.ring.close()

"""What every tensor-parallel executor does with its ranks, wherever they run (worker processes of this machine,
``multiproc.py``, or Ray actors, ``ray.py``): the commands a rank follows, its share of the threads, joining and
leaving the ``torch.distributed`` group, and building the rank's ``Worker`` with its collectives.

Contract:
- ``Command``: what ranks 1..N-1 are told each time rank 0 acts (msgpack; ``SchedulerOutput`` deltas as they are).
- ``open_store(size, host)``: rank 0's rendezvous store, already listening on a port the system chose when its
  address (``store_address``) goes to the other ranks, so no other process can take that port in between.
- ``join_group(rank, size, address)`` joins the gloo group (CPU collectives) that every rank's layers meet in (rank 0
  through ``join_watching`` with its store); a collective waiting on a rank that never comes gives up after
  ``COLLECTIVE_TIMEOUT_S``.
- ``build_worker(config, rank, size, shm, threads)`` builds rank's ``Worker``: its shard of every layer and a KV
  cache for its heads (tensor parallel; with the shared-memory collectives when ``shm``, every rank on this machine,
  else gloo alone), or its stage's layers and their KV cache (pipeline parallel; stages send over gloo).
- ``collective_rpc``: rank 0 sends a pickled ``(method, args, kwargs)`` (``rpc_payload``) as a numbered "rpc"
  command; each rank runs it (``run_rpc``) and answers ``("ok", result)`` or ``("error", why)``; ``rpc_results``
  gathers every rank's answer before raising the first failure, so no answer is left behind for the next call (and
  a late answer to a call that timed out carries that call's number, so the next call drops it).
"""

from __future__ import annotations

import atexit
import datetime
import os
import pickle
import threading
from typing import Any, Callable, Optional

import msgspec

from pagellm import envs
from pagellm.config import EngineConfig
from pagellm.sched.output import SchedulerOutput

COLLECTIVE_TIMEOUT_S = 120


class Command(msgspec.Struct, array_like=True, omit_defaults=True):
    """What the workers are told to do, in order."""

    kind: str                               # "execute", "idle", "sleep", "update" or "stop"
    sched: Optional[SchedulerOutput] = None
    idle: bool = False
    asleep: bool = False
    level: int = 1                          # "sleep": 2 drops the weights too
    model: Optional[str] = None             # "update": the checkpoint (None: the served model's own)
    payload: bytes = b""                    # "rpc": the pickled (method, args, kwargs) ...
    call: int = 0                           # ... and the call's number, which its answers carry


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)


def open_store(size: int, host: str = "127.0.0.1") -> Any:
    """Rank 0's rendezvous store, bound to a port of the system's choosing and listening from now on (a port found
    free, closed and handed out could be bound by another process before the group's store binds it)."""
    import torch.distributed as dist

    return dist.TCPStore(host, 0, world_size=size, is_master=True, wait_for_workers=False, timeout=_timeout())


def store_address(store: Any) -> str:
    return f"{store.host}:{store.port}"


def threads_per_rank(size: int) -> int:
    """Each rank's share of the threads (``PAGELLM_NUM_THREADS``, else the CPUs this process may use)."""
    total = envs.num_threads() or len(os.sched_getaffinity(0))
    return max(1, total // size)


def join_group(rank: int, size: int, address: str) -> None:
    """Join the group whose rendezvous store listens at ``address`` ("host:port", ``store_address``)."""
    import torch.distributed as dist

    host, port = address.rsplit(":", 1)
    _join_store(dist.TCPStore(host, int(port), world_size=size, is_master=False, timeout=_timeout()), rank, size)


def _join_store(store: Any, rank: int, size: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=_timeout())


def join_watching(size: int, store: Any, check: Callable[[], None]) -> None:
    """Join as rank 0 (``store`` from ``open_store``), calling ``check`` every 0.1 s meanwhile: it raises when a rank
    has failed before joining, so the start fails at once rather than after the rendezvous timeout."""
    joined: list[Optional[BaseException]] = []

    def join() -> None:
        try:
            _join_store(store, 0, size)
            joined.append(None)
        except BaseException as exc:  # handed to the waiting thread
            joined.append(exc)

    thread = threading.Thread(target=join, daemon=True, name="pagellm-rank0-join")
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
        check()
    if joined and joined[0] is not None:
        raise joined[0]


def leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def rpc_payload(method: Any, args: tuple, kwargs: dict[str, Any] | None, to: str = "the ranks") -> bytes:
    """``collective_rpc``'s call as the ranks (or, from ``AsyncLLM``, the engine core) receive it (ValueError when it
    cannot be pickled)."""
    try:
        return pickle.dumps((method, tuple(args), dict(kwargs or {})))
    except Exception as exc:  # pickle raises several kinds
        raise ValueError(f"collective_rpc: the method and its arguments must pickle to reach {to} (a worker "
                         f"method's name, or a module-level function): {type(exc).__name__}: {exc}") from None


def run_rpc(worker: Any, payload: bytes) -> tuple[str, Any]:
    """One rank's answer to an "rpc" command: ``("ok", result)`` or ``("error", why)``."""
    try:
        method, args, kwargs = pickle.loads(payload)
        return "ok", worker.rpc(method, args, kwargs)
    except Exception as exc:  # the caller's error, reported with the rank
        return "error", f"{type(exc).__name__}: {exc}"


def rpc_results(answers: list[tuple[str, Any]]) -> list[Any]:
    """Every rank's result, in rank order; the first rank's failure as a RuntimeError that names it."""
    for rank, (kind, value) in enumerate(answers):
        if kind != "ok":
            raise RuntimeError(f"collective_rpc failed on rank {rank}: {value}")
    return [value for _, value in answers]


def build_worker(config: EngineConfig, rank: int, size: int, shm: bool, threads: int) -> Any:
    from pagellm.distributed.groups import ParallelState
    from pagellm.distributed.shm_comm import ShmComm
    from pagellm.worker.worker import worker_class

    tp, pp = config.parallel_config.tensor_parallel_size, config.parallel_config.pipeline_parallel_size
    group = _stage_group(rank, tp, pp)
    comm = ShmComm.create(rank % tp, tp, group) if shm and tp > 1 else None  # stages send to each other over gloo
    parallel = ParallelState(rank % tp, tp, comm, rank // tp, pp, group, config.parallel_config.enable_expert_parallel)
    try:
        return worker_class(config.model_config.worker_extension_cls)(
            config.model_config, config.cache_config, config.speculative_config, parallel=parallel,
            profiler_config=config.profiler_config, num_threads=threads)
    except BaseException:
        if comm is not None:
            comm.close()
        raise


def _stage_group(rank: int, tp: int, pp: int) -> Any:
    """The tensor-parallel group of rank's pipeline stage (None when there is one stage: the whole world). Every rank
    creates every stage's group, in the same order, as ``torch.distributed`` requires."""
    import torch.distributed as dist

    if pp == 1:
        return None
    groups = [dist.new_group(list(range(stage * tp, (stage + 1) * tp))) for stage in range(pp)]
    return groups[rank // tp]


def close_comm(worker: Any) -> None:
    comm = worker.parallel.comm
    if comm is not None:
        comm.close()


class RankZeroExecutor:
    """What every multi-rank executor does with rank 0, the engine core's own ``Worker`` (``self.worker``):
    profiling (rank 0 records), and a shutdown that stops the other ranks first (``_stop_ranks``), then rank 0 and
    the group, once, also at interpreter exit for an engine dropped without ``shutdown``."""

    worker: Any

    def _register_exit(self) -> None:
        self._closed = False
        atexit.register(self.shutdown)

    def start_profile(self) -> bool:
        return self.worker.start_profile()

    def stop_profile(self) -> list[str]:
        return self.worker.stop_profile()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        self._stop_ranks()
        self.worker.shutdown()
        close_comm(self.worker)
        leave_group()
        self._after_shutdown()

    def _stop_ranks(self) -> None:
        raise NotImplementedError

    def _after_shutdown(self) -> None:
        """What the executor releases last (nothing by default)."""

"""Clients of the engine core, one interface (``EngineCoreClient``) with two implementations.

Both take tokenized ``EngineCoreRequest``s with ``add_requests``, abort with ``abort_requests``, report the core's
``runtime`` and stop with ``shutdown``. They differ only in how outputs come back: ``InprocClient`` runs the core in
the caller's process and hands out one step's outputs per ``get_output()`` call (pull; used by ``LLM``), while
``MPClient`` pushes each step's outputs to an ``on_outputs`` callback from its reader thread (used by ``AsyncLLM``).

``MPClient`` runs the core in its own process (``core_proc.run_engine_core``, spawn start method) and talks to it
over two ZMQ ``ipc://`` sockets in a private temp directory. Contract:
- The constructor blocks until the core's handshake: it sets ``runtime``, or re-raises the core's start-up error
  (``ValueError`` keeps its class and message; anything else becomes ``RuntimeError``). ``while_starting``, if
  given, runs in the caller's thread once the core process is started and before the wait (the frontend loads its
  tokenizer there, beside the core's imports and model load); when it raises, the core is stopped and the error
  re-raised.
- Sends (``add_requests``, ``abort_requests``, ``call_utility*``) never block and may come from any thread; they
  are cheap enough to call from a ``finally`` of a cancelled coroutine.
- One output thread reads the core's messages in order and hands each ``EngineCoreOutputs`` to ``on_outputs``;
  utility replies resolve their futures after every earlier output was handed over. The same thread watches the
  process sentinel: when the core dies (crash, kill, or shutdown) ``on_dead`` gets one ``EngineDeadError``,
  pending utility calls fail with it, ``is_healthy`` turns False and every later send raises it. A crash is
  logged as an ERROR; a core that exits cleanly on SIGTERM not sent by ``shutdown()`` only at INFO.
- ``shutdown()`` sends SIGTERM, kills after a timeout, and removes the socket files; it also runs at interpreter
  exit. The child exits by itself if this process dies.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
from typing import TYPE_CHECKING, Any, Callable, Protocol

import msgspec
import zmq

from pagellm.config import EngineConfig
from pagellm.engine.core_proc import Placement, run_engine_core
from pagellm.engine.exceptions import EngineDeadError
from pagellm.engine.wire import (UTILITY_RESULT_TYPES, AbortRequests, AddRequests, EngineCoreHandshake,
                                 EngineCoreInput, EngineCoreOutputs, EngineCoreRequest, UtilityCall,
                                 UtilityMethod, UtilityResult)
from pagellm.worker.runtime import RuntimeInfo

if TYPE_CHECKING:  # InprocClient only: the server's frontend never imports torch
    from pagellm.engine.core import EngineCore

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 5.0  # SIGTERM, then SIGKILL after this long
_POLL_MS = 1000           # the output thread re-checks for shutdown this often even when nothing arrives


class EngineCoreClient(Protocol):
    runtime: RuntimeInfo

    def add_requests(self, requests: list[EngineCoreRequest]) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def shutdown(self) -> None: ...


class InprocClient:
    def __init__(self, config: EngineConfig) -> None:
        from pagellm.engine.core import EngineCore

        self.core: EngineCore = EngineCore(config)

    @property
    def runtime(self) -> RuntimeInfo:
        return self.core.runtime

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        for request in requests:
            self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        step, stats = self.core.step()
        return EngineCoreOutputs(step, stats)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def update_weights(self, model: str | None = None) -> bool:
        return self.core.update_weights(model)

    def collective_rpc(self, method: Any, args: tuple = (), kwargs: dict[str, Any] | None = None,
                       timeout: float | None = None) -> list[Any]:
        return self.core.executor.collective_rpc(method, args, kwargs, timeout)

    def sleep(self, level: int = 1) -> bool:
        return self.core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        return self.core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.core.is_sleeping()

    def start_profile(self) -> bool:
        return self.core.start_profile()

    def stop_profile(self) -> list[str]:
        return self.core.stop_profile()

    def shutdown(self) -> None:
        self.core.shutdown()


class UtilityCalls:
    """``call_utility`` (awaitable) and ``call_utility_sync`` over a client's ``call_utility_future``, and its
    health over ``_dead`` (why its core is gone, once it is): ``MPClient``'s and ``dp_client.DPClient``'s."""

    _dead: str | None

    def call_utility_future(self, method: UtilityMethod, *args: Any) -> concurrent.futures.Future:
        raise NotImplementedError

    async def call_utility(self, method: UtilityMethod, *args: Any) -> Any:
        return await asyncio.wrap_future(self.call_utility_future(method, *args))

    def call_utility_sync(self, method: UtilityMethod, timeout: float | None = None, args: tuple = ()) -> Any:
        return self.call_utility_future(method, *args).result(timeout)

    @property
    def is_healthy(self) -> bool:
        return self._dead is None

    @property
    def dead_reason(self) -> str | None:
        return self._dead


class MPClient(UtilityCalls):
    """The engine core in a child process (see the module docstring for the contract)."""

    def __init__(self, config: EngineConfig, on_outputs: Callable[[EngineCoreOutputs], None],
                 on_dead: Callable[[EngineDeadError], None], startup_timeout_s: float = 600.0,
                 while_starting: Callable[[], None] | None = None, placement: Placement | None = None,
                 name: str = "pagellm-engine-core") -> None:
        self._on_outputs = on_outputs
        self._on_dead = on_dead
        self._dead: str | None = None          # why the core is gone, once it is
        self._closing = False
        self._send_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._calls: dict[int, tuple[str, concurrent.futures.Future]] = {}
        self._call_ids = itertools.count()
        self.ipc_dir = tempfile.mkdtemp(prefix="pagellm-")
        self._ctx = zmq.Context()
        self._input, input_addr = self._bind(zmq.PUSH, "input")
        self._output, output_addr = self._bind(zmq.PULL, "output")
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name=name,
            args=(config, input_addr, output_addr, os.getpid(), self.ipc_dir, placement))
        try:
            self.process.start()
        except BaseException:
            self._input.close(linger=0)
            self._output.close(linger=0)
            self._ctx.term()
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            raise
        # Before multiprocessing's own exit hook (which would wait forever for a live non-daemon child).
        self._atexit = functools.partial(_stop_process, self.process, self.ipc_dir)
        atexit.register(self._atexit)
        try:
            if while_starting is not None:
                while_starting()
            self.runtime: RuntimeInfo = self._handshake(startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self._reader = threading.Thread(target=self._output_loop, daemon=True, name="engine-core-outputs")
        self._reader.start()

    # ------------------------------------------------------------------------------------------- sends
    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._send(AddRequests(requests))

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort in the core; a no-op when there is nothing to abort or the core is gone already."""
        if request_ids and self._dead is None:
            try:
                self._send(AbortRequests(list(request_ids)))
            except EngineDeadError:  # died meanwhile: its requests are gone with it
                pass

    def call_utility_future(self, method: UtilityMethod, *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = (method, future)
        try:
            self._send(UtilityCall(call_id, method, list(args)))
        except BaseException:
            self._calls.pop(call_id, None)
            raise
        if self._dead is not None:  # died between the registration and the send: nobody will answer
            _set_exception(future, EngineDeadError(self._dead))
        return future

    def _send(self, message: EngineCoreInput) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        data = self._encoder.encode(message)
        with self._send_lock:
            self._input.send(data, zmq.NOBLOCK, copy=False)  # SNDHWM=0: queued, never EAGAIN

    # ------------------------------------------------------------------------------------------- lifecycle
    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Stop the core (SIGTERM, SIGKILL after ``timeout``), fail what is pending, remove the socket files."""
        if self._closing:
            return
        self._closing = True
        _stop_process(self.process, self.ipc_dir, timeout)
        atexit.unregister(self._atexit)
        reader = getattr(self, "_reader", None)
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout)
        self._mark_dead("the engine was shut down")
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._ctx.term()

    def _bind(self, kind: int, name: str) -> tuple[zmq.Socket, str]:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.PUSH:
            sock.setsockopt(zmq.SNDHWM, 0)
        addr = f"ipc://{os.path.join(self.ipc_dir, name)}"
        sock.bind(addr)
        return sock, addr

    def _handshake(self, timeout_s: float) -> RuntimeInfo:
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(self.process.sentinel, zmq.POLLIN)
        events = dict(poller.poll(int(timeout_s * 1000)))
        if self._output not in events:  # died silently, or too slow
            self.process.join(0.1)
            if self.process.exitcode is None:
                raise RuntimeError(f"the engine core did not start within {timeout_s:.0f}s")
            raise RuntimeError(f"the engine core exited with code {self.process.exitcode} during start-up "
                               "(see its log above)")
        reply = msgspec.msgpack.decode(self._output.recv(), type=EngineCoreHandshake)
        if reply.runtime is not None:
            return reply.runtime
        if reply.error_type == "ValueError":
            raise ValueError(reply.error)
        raise RuntimeError(f"the engine core failed to start: {reply.error_type}: {reply.error}")

    # ------------------------------------------------------------------------------------------- outputs
    def _output_loop(self) -> None:
        decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(self.process.sentinel, zmq.POLLIN)
        engine_error: str | None = None
        while True:
            events = dict(poller.poll(_POLL_MS))
            if self._output in events:  # outputs first: a crash report arrives before the sentinel fires
                try:
                    outputs = decoder.decode(self._output.recv(copy=False).buffer)
                except msgspec.DecodeError:
                    logger.exception("dropped an undecodable message from the engine core")
                    continue
                engine_error = outputs.engine_error or engine_error
                self._dispatch(outputs)
            elif self.process.sentinel in events or self._closing:
                break
        self.process.join(SHUTDOWN_TIMEOUT_S)
        if self._closing:
            self._mark_dead("the engine was shut down")
        elif self.process.exitcode == 0 and engine_error is None:  # SIGTERM, e.g. to the whole process group
            self._mark_dead("the engine core process was stopped (SIGTERM, exit code 0)", logging.INFO)
        else:
            reason = f"the engine core process died (exit code {self.process.exitcode})"
            self._mark_dead(f"{reason}: {engine_error}" if engine_error else reason)

    def _dispatch(self, outputs: EngineCoreOutputs) -> None:
        try:
            self._on_outputs(outputs)
        except Exception:  # a frontend bug must not stop the output thread (every request would hang)
            logger.exception("handling engine core outputs failed")
        for result in outputs.utility_results:
            self._resolve(result)

    def _resolve(self, result: UtilityResult) -> None:
        method, future = self._calls.pop(result.call_id, (None, None))
        if future is None or method is None:
            return
        if result.error is not None:  # the caller's mistake (a ValueError in the core) stays a ValueError
            kind, _, message = result.error.partition(": ")
            _set_exception(future, ValueError(message) if kind == "ValueError" else
                           RuntimeError(f"utility {method} failed in the engine core: {result.error}"))
            return
        value = msgspec.msgpack.decode(result.result, type=UTILITY_RESULT_TYPES[method])
        if not future.done():
            try:
                future.set_result(value)
            except concurrent.futures.InvalidStateError:  # cancelled meanwhile
                pass

    def _mark_dead(self, reason: str, level: int = logging.ERROR) -> None:
        with self._send_lock:
            if self._dead is not None:
                return
            self._dead = reason
        if not self._closing:
            logger.log(level, "%s", reason)
        calls, self._calls = self._calls, {}
        for _, future in calls.values():
            _set_exception(future, EngineDeadError(reason))
        try:
            self._on_dead(EngineDeadError(reason))
        except Exception:
            logger.exception("failing the pending requests failed")


def _set_exception(future: concurrent.futures.Future, exc: BaseException) -> None:
    try:
        future.set_exception(exc)
    except concurrent.futures.InvalidStateError:  # done or cancelled already
        pass


def _stop_process(process: multiprocessing.process.BaseProcess, ipc_dir: str,
                  timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
    """SIGTERM, SIGKILL after ``timeout``, reap; then remove the socket directory. Whether the child is gone is read
    from its sentinel, not from ``waitpid``: the output thread may reap it first, and then ``is_alive()`` (whose
    ``waitpid`` fails) reports a dead child as alive."""
    if not _gone(process, 0):
        process.terminate()
        if not _gone(process, timeout):
            logger.warning("the engine core ignored SIGTERM for %.0fs; killing it", timeout)
            process.kill()
            _gone(process, None)
    # Reap, unless another thread did. Not join(0): the sentinel reads closed while the child is still on its way
    # out, before waitpid can collect it (seen under load), and a non-blocking join would leave it behind.
    process.join(timeout)
    shutil.rmtree(ipc_dir, ignore_errors=True)


def _gone(process: multiprocessing.process.BaseProcess, timeout: float | None) -> bool:
    """Whether ``process`` has exited, waiting up to ``timeout`` seconds (None: for as long as it takes)."""
    return bool(multiprocessing.connection.wait([process.sentinel], timeout))

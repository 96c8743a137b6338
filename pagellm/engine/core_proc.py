"""The engine core in its own process: a busy loop that sends its own outputs, fed by an input thread.

Contract (``run_engine_core`` is the child's entry point; ``client.MPClient`` starts it with the spawn method):
- The child builds ``EngineCore(config)`` itself. Its first message on the output socket is an
  ``EngineCoreHandshake``: the ``RuntimeInfo``, or the start-up error (class name and message), after which it
  exits with code 1.
- The input thread decodes ``EngineCoreInput`` messages (ZMQ PULL) onto a queue; the main thread encodes and
  sends its own outputs (ZMQ PUSH, no send limit, so a send never blocks): no thread hop per step, which on a
  machine whose cores the model's threads fill costs a preemption each time. Sockets never cross threads.
- The main thread loops: apply every queued input (adds, aborts, utility calls; blocking on the queue while no
  request is unfinished, so an idle core sleeps) → ``step()`` while requests are unfinished → queue the
  ``EngineCoreOutputs`` (token-id deltas and the step's ``SchedulerStats``).
- A request the core refuses (``add_request`` raises) is answered by a ``RequestError``; the core lives on.
- An error in the loop is sent as ``EngineCoreOutputs.engine_error`` before the process exits with code 1.
- A ``Placement`` (a data-parallel core's, ``dp_client.py``) is applied before anything else: the process keeps to
  its CPUs and its thread count (``PAGELLM_NUM_THREADS``, which its tensor-parallel ranks inherit and split).
- SIGTERM exits cleanly (code 0); SIGINT is ignored (the parent owns shutdown). A watchdog thread polls the
  parent pid: when the parent is gone the child removes the ipc directory and exits, so no core outlives it.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import shutil
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Protocol

import msgspec
import zmq

from pagellm import logging_config, native_build
from pagellm.config import EngineConfig
from pagellm.engine.wire import (AbortRequests, AddRequests, EngineCoreHandshake, EngineCoreInput,
                                 EngineCoreOutputs, RequestError, UtilityCall, UtilityResult)

if TYPE_CHECKING:  # the frontend imports this module to name the child's entry point: torch loads in the child
    from pagellm.engine.core import EngineCore

logger = logging.getLogger(__name__)

PARENT_POLL_S = 1.0      # how often the watchdog checks that the parent still lives
OUTPUT_LINGER_MS = 2000  # how long queued outputs (a crash report) may take to leave after the loop ends
EXIT_TIMEOUT_S = 5.0     # bound on each step of the exit sequence; past it the process exits hard

_Message = Any  # EngineCoreHandshake | EngineCoreOutputs


class Placement(NamedTuple):
    """Where one engine core runs: its CPUs (``None``: wherever the parent may) and its threads."""

    cpus: tuple[int, ...] | None
    threads: int


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int,
                    ipc_dir: str, placement: Placement | None = None) -> None:
    """Process entry point: start up, handshake, run the busy loop, exit (never returns)."""
    if placement is not None:  # before torch starts its thread pool
        if placement.cpus:
            os.sched_setaffinity(0, placement.cpus)
        os.environ["PAGELLM_NUM_THREADS"] = str(placement.threads)
    wake_fd = _setup_process(parent_pid, ipc_dir)
    ctx = zmq.Context()
    inputs: queue.Queue[EngineCoreInput | None] = queue.Queue()
    threading.Thread(target=_input_loop, args=(ctx, input_addr, wake_fd, inputs), daemon=True,
                     name="core-input").start()
    outputs = _Sender(ctx, output_addr)
    code = 1
    try:
        code = _serve(config, inputs, outputs)
    except SystemExit as exc:  # SIGTERM (clean stop), also during start-up
        code = exc.code if isinstance(exc.code, int) else 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not interrupt the exit
        _exit(ctx, outputs, code)


class _Outputs(Protocol):
    def put(self, message: _Message) -> None: ...


def _serve(config: EngineConfig, inputs: queue.Queue[EngineCoreInput | None], outputs: _Outputs) -> int:
    try:
        from pagellm.engine.core import EngineCore

        core = EngineCore(config)
    except Exception as exc:  # reported to the parent, which re-raises it (ValueError stays ValueError)
        logger.error("engine core failed to start: %s: %s", type(exc).__name__, exc)
        outputs.put(EngineCoreHandshake(error_type=type(exc).__name__, error=str(exc)))
        return 1
    # The start-up heap (torch's modules, the model, every KV block) leaves the collector's view: a full collection
    # would otherwise walk its few hundred thousand objects (~0.1 s on this machine) in the middle of serving.
    gc.collect()
    gc.freeze()
    outputs.put(EngineCoreHandshake(runtime=core.runtime))
    try:
        EngineCoreLoop(core, inputs, outputs.put).run()
    except SystemExit:
        raise
    except BaseException as exc:
        logger.exception("engine core died")
        outputs.put(EngineCoreOutputs(engine_error=f"{type(exc).__name__}: {exc}"))
        return 1
    finally:
        core.shutdown()
        gc.unfreeze()  # the heap is the collector's again (``_serve`` also runs in-process, in tests)
    return 0


# How long the core waits on an empty queue before its workers start their idle-time work: the gaps of a steady
# stream of requests stay clear of it, and so does the frontend's own start-up after the handshake (the KV prefault's
# page faults are also the VM host's work, which slows every process here, whatever their priorities).
IDLE_GRACE_S = 2.0


class EngineCoreLoop:
    """The busy loop: apply inputs → step → emit outputs. ``emit`` takes each outgoing message."""

    def __init__(self, core: EngineCore, inputs: queue.Queue[EngineCoreInput | None],
                 emit: Callable[[EngineCoreOutputs], None], idle_grace_s: float = IDLE_GRACE_S) -> None:
        self.core = core
        self.inputs = inputs
        self.emit = emit
        self.idle_grace_s = idle_grace_s
        self._utilities: dict[str, Callable[[], Any]] = {
            "get_stats": core.scheduler.make_stats,
            "reset_prefix_cache": core.reset_prefix_cache,
            "num_free_blocks": lambda: core.scheduler.kv.num_free_blocks,
            "start_profile": core.start_profile,
            "stop_profile": core.stop_profile,
            "sleep": core.sleep,
            "wake_up": core.wake_up,
            "is_sleeping": core.is_sleeping,
            "update_weights": core.update_weights,
            "collective_rpc": core.collective_rpc_pickled,
            "pause": core.pause,
            "resume": core.resume,
        }

    def run(self) -> None:
        while True:
            if self._has_work():
                self.apply_inputs(block=False)
            elif not self.apply_inputs(block=True, timeout=self.idle_grace_s):
                self.core.set_idle(True)  # idle a while: the workers' idle-time work runs until an input comes
                self.apply_inputs(block=True)
                self.core.set_idle(False)
            if self._has_work():
                step, stats = self.core.step()
                self.emit(EngineCoreOutputs(step, stats))

    def _has_work(self) -> bool:
        """Requests to step (a paused core holds its requests and waits for inputs)."""
        return not self.core.paused and self.core.has_unfinished_requests()

    def apply_inputs(self, block: bool, timeout: float | None = None) -> bool:
        """Apply every queued input; when ``block``, first wait for one (an idle core sleeps here), at most
        ``timeout`` seconds if given. Returns whether any came."""
        applied = False
        while True:
            try:
                message = self.inputs.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                return applied
            block, applied = False, True
            self.apply(message)

    def apply(self, message: EngineCoreInput | None) -> None:
        if message is None:  # a wake-up: a signal arrived; its handler has run by now
            return
        if isinstance(message, AddRequests):
            self._add(message)
        elif isinstance(message, AbortRequests):
            self.core.abort_requests(message.request_ids)
        else:
            self.emit(EngineCoreOutputs(utility_results=[self._call(message)]))

    def _add(self, message: AddRequests) -> None:
        errors = []
        for request in message.requests:
            try:
                self.core.add_request(request)
            except Exception as exc:  # one bad request must not take the core down
                logger.warning("refused request %s: %s", request.request_id, exc)
                errors.append(RequestError(request.request_id, type(exc).__name__, str(exc)))
        if errors:
            self.emit(EngineCoreOutputs(errors=errors))

    def _call(self, call: UtilityCall) -> UtilityResult:
        try:
            return UtilityResult(call.call_id, msgspec.msgpack.encode(self._utilities[call.method](*call.args)))
        except Exception as exc:
            logger.exception("utility %s failed", call.method)
            return UtilityResult(call.call_id, error=f"{type(exc).__name__}: {exc}")


# ------------------------------------------------------------------------------------------------ IO threads


def _input_loop(ctx: zmq.Context, addr: str, wake_fd: int, inputs: queue.Queue[EngineCoreInput | None]) -> None:
    """Decode inputs onto the queue; a byte on ``wake_fd`` (a signal) queues None to wake the main thread."""
    decoder = msgspec.msgpack.Decoder(EngineCoreInput)
    sock = ctx.socket(zmq.PULL)
    sock.connect(addr)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(wake_fd, zmq.POLLIN)
    try:
        while True:
            events = dict(poller.poll())
            if wake_fd in events:
                os.read(wake_fd, 512)
                inputs.put(None)
            if sock in events:
                try:
                    inputs.put(decoder.decode(sock.recv(copy=False).buffer))
                except (msgspec.DecodeError, ValueError) as exc:  # the frontend validates: a bug there
                    logger.error("dropped an undecodable input message: %s", exc)
    except zmq.ContextTerminated:
        pass
    finally:
        sock.close(linger=0)


class _Sender:
    """The main thread's output socket: ``put`` encodes and sends one message (ZMQ queues it; never blocks)."""

    def __init__(self, ctx: zmq.Context, addr: str) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.connect(addr)

    def put(self, message: _Message) -> None:
        self._sock.send(self._encoder.encode(message), copy=False)

    def close(self) -> None:
        """Close, leaving queued outputs (a crash report) up to ``OUTPUT_LINGER_MS`` to leave."""
        self._sock.close(linger=OUTPUT_LINGER_MS)


# ------------------------------------------------------------------------------------------------ process


def _setup_process(parent_pid: int, ipc_dir: str) -> int:
    """Logging, signals and the parent watchdog; returns the read end of the signal wake-up pipe.

    Python runs signal handlers only in the main thread, between bytecodes; a main thread blocked on the input
    queue would never run the SIGTERM handler when the kernel delivers the signal to another thread. So signals
    also write to a pipe the input thread polls, and it wakes the main thread with a None input.
    """
    if not logging.getLogger().handlers:
        logging_config.configure("EngineCore")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _raise_system_exit)
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_watch_parent, args=(parent_pid, ipc_dir), daemon=True, name="core-watchdog").start()
    return read_fd


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def _watch_parent(parent_pid: int, ipc_dir: str) -> None:
    """Exit when the parent is gone (reparented), so a killed frontend never leaves an orphan core."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    logger.warning("the frontend process %d is gone; the engine core exits", parent_pid)
    shutil.rmtree(ipc_dir, ignore_errors=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(EXIT_TIMEOUT_S * 3)
    os._exit(1)


def _exit(ctx: zmq.Context, outputs: _Sender, code: int) -> None:
    """Flush queued outputs, close the sockets, and leave without running interpreter teardown (and without the
    background kernel compiles of a start-up cut short)."""
    native_build.stop_compiles()
    outputs.close()
    term = threading.Thread(target=ctx.term, daemon=True)  # waits out the linger; the input thread sees ETERM
    term.start()
    term.join(EXIT_TIMEOUT_S)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

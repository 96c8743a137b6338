"""``pagellm serve``: start the engine, then the OpenAI-compatible HTTP server over it (uvicorn, uvloop, httptools).

Contract:
- The port is bound before the model loads, so a taken port fails at once, not after a long load.
- One INFO line says when the server is ready, with its URL.
- Stats (``server/observability.py``): ``/metrics``, ``/dashboard`` and an INFO stats line every few seconds while
  busy, unless ``log_stats`` is False; one OTLP span per request when ``otlp_traces_endpoint`` is set.
- SIGTERM or SIGINT: uvicorn stops accepting, lets open requests finish (a few seconds at most), then the engine
  core is shut down and ``run_server`` returns 0. A second SIGINT forces the exit.
- The engine core dying on its own (crash, OOM kill): requests keep failing fast with 503 for a short grace, then
  one ERROR line names the cause, the server stops and ``run_server`` returns 1, so a supervisor restarts it. A core
  that stops because the whole process group got the stop signal is a clean shutdown (returns 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Coroutine
from typing import Any, Optional

import uvicorn
from fastapi import FastAPI

from pagellm.config import EngineConfig
from pagellm.engine.exceptions import EngineDeadError
from pagellm.lora import LoRARequest
from pagellm.server.observability import build_observability
from pagellm.server.options import ServeOptions
from pagellm.server.openai import reasoning
from pagellm.server.openai.routes import build_app
from pagellm.server.openai.serving_engine import EngineClient
from pagellm.server.openai.tool_parsers import load_plugin

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEAD_ENGINE_GRACE_S = 2.0  # after the core dies, keep answering 503 this long (a stop signal may still come)
_HEALTH_POLL_S = 0.1


def lora_requests(engine: EngineClient, names: list[str], options: ServeOptions) -> dict[str, LoRARequest]:
    """The --lora-modules adapters by served name (ids from 1), each checked against the model now."""
    loras = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(options.lora_modules)}
    if set(loras) & set(names):
        raise ValueError("--lora-modules names must differ from the served model names")
    for lora in loras.values():
        engine.check_lora(lora)
    return loras


def served_names(config: EngineConfig, options: ServeOptions) -> list[str]:
    """The model names the server answers to: ``--served-model-name``, else the model argument, else the default."""
    return list(options.served_model_names or [config.model_config.model or DEFAULT_MODEL_NAME])


def build_frontend(engine: EngineClient, config: EngineConfig, names: list[str],
                   options: ServeOptions) -> tuple[FastAPI, dict[str, LoRARequest]]:
    """The HTTP app over a started engine (the chat template, stats and LoRA adapters of ``options`` applied) and
    the served adapters by name (one dict: adapters loaded at run time reach the gRPC API too)."""
    if options.chat_template is not None:
        engine.tokenizer.chat_template = options.chat_template
    engine.tokenizer.content_format = options.chat_template_content_format
    if options.tool_parser_plugin is not None:  # in this process too (a Ray Serve replica builds its own app)
        load_plugin(options.tool_parser_plugin)
    if options.reasoning_parser_plugin is not None:
        reasoning.load_plugin(options.reasoning_parser_plugin)
    obs = build_observability(names[0], config, engine.runtime, options.log_stats, options.otlp_traces_endpoint,
                              buckets=options.histogram_buckets)
    engine.stats_sink = obs.sink
    loras = lora_requests(engine, names, options)
    app = build_app(engine, names, options.api_key, model_root=config.model_config.model, observability=obs,
                    cors=options.cors, tool_parser=options.tool_call_parser,
                    reasoning_parser=options.reasoning_parser, loras=loras,
                    runtime_lora_updating=options.runtime_lora_updating, defaults=options.request_defaults,
                    request_id_headers=options.request_id_headers, server_load_tracking=options.server_load_tracking,
                    fastapi_docs=options.fastapi_docs, middleware=options.middleware,
                    tokenizer_info=options.tokenizer_info, tokens_only=options.tokens_only,
                    scale_out=options.scale_out)
    if options.log_requests:
        engine.log_requests(options.max_log_len, options.log_outputs)
    return app, loras


def run_server(config: EngineConfig, options: ServeOptions = ServeOptions()) -> int:
    """Serve until SIGTERM/SIGINT (returns 0) or until the engine core dies on its own (returns 1)."""
    sock = _bind_unix(options.uds) if options.uds else _bind(options.host, options.port)
    names = served_names(config, options)
    try:
        return _run(_serve(config, sock, names, options))
    finally:
        sock.close()
        if options.uds:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(options.uds)


class _Grpc:
    """The gRPC API beside HTTP (``--grpc-port``): bound before the model loads, started with the app."""

    def __init__(self, options: ServeOptions) -> None:
        from pagellm.server.grpc.service import bind_grpc

        self.options = options
        self.server = bind_grpc(options.host, options.grpc_port or 0, options.api_key)
        self.health_task: Optional[asyncio.Task] = None

    async def start(self, engine: EngineClient, names: list[str], loras: dict[str, LoRARequest],
                    model_root: Optional[str]) -> None:
        from pagellm.server.grpc.service import add_services, watch_health

        traced = self.options.otlp_traces_endpoint is not None
        health = add_services(self.server, engine, names, loras, model_root, traced)
        await self.server.start()
        self.health_task = asyncio.create_task(watch_health(engine, health))
        logger.info("gRPC API (pagellm.v1.Engine) on %s:%d", self.options.host, self.options.grpc_port)

    async def stop(self) -> None:
        if self.health_task is not None:
            self.health_task.cancel()
        await self.server.stop(self.options.shutdown_timeout)


def _run(main: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:  # uvicorn[standard] brings it; plain asyncio still works
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port or --host") from exc
    sock.set_inheritable(True)
    return sock


def _bind_unix(path: str) -> socket.socket:
    """A Unix domain socket at ``path`` (``--uds``), readable and writable by every local user as uvicorn makes it; a
    stale socket file that no server answers on is replaced, a live one refused."""
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody listens: a server that stopped without cleaning up
        else:
            raise ValueError(f"a server already listens on {path}; stop it or pick another --uds")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {path} ({exc.strerror}); pick another --uds") from exc
    os.chmod(path, 0o666)
    sock.set_inheritable(True)
    return sock


def _open_access_log(skip: tuple[str, ...], root_path: str) -> None:
    """uvicorn gives its access log the level of ``--uvicorn-log-level`` (warning by default), which would drop every
    line of it: its lines are INFO. ``skip``: paths it leaves out."""
    access = logging.getLogger("uvicorn.access")
    access.setLevel(min(access.getEffectiveLevel(), logging.INFO))
    if skip:
        access.addFilter(_SkipPaths(skip, root_path))


class _SkipPaths(logging.Filter):
    """Leaves out of uvicorn's access log the requests to these paths (the query string aside; with a root path, as
    the app's routes name them or with the prefix). Its records carry (client, method, path with query, HTTP
    version, status) as their arguments."""

    def __init__(self, paths: tuple[str, ...], root_path: str) -> None:
        super().__init__()
        self.paths = frozenset(paths)
        self.root_path = root_path.rstrip("/")

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not (isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str)):
            return True
        path = args[2].split("?", 1)[0]
        routed = path[len(self.root_path):] if self.root_path and path.startswith(self.root_path + "/") else path
        return path not in self.paths and routed not in self.paths


async def _serve(config: EngineConfig, sock: socket.socket, names: list[str], options: ServeOptions) -> int:
    from pagellm.engine.async_engine import AsyncLLM

    grpc_api = _Grpc(options) if options.grpc_port is not None else None
    engine = AsyncLLM.from_config(config)
    try:
        app, loras = build_frontend(engine, config, names, options)
        if grpc_api is not None:
            await grpc_api.start(engine, names, loras, config.model_config.model)
        server = uvicorn.Server(uvicorn.Config(
            app, http="httptools", log_level=options.uvicorn_log_level, access_log=options.access_log, lifespan="off",
            root_path=options.root_path,
            timeout_graceful_shutdown=options.shutdown_timeout,  # type: ignore[arg-type]  # a float works
            **(options.tls.uvicorn_kwargs() if options.tls else {})))
        if options.access_log:  # after uvicorn's Config, which sets its loggers up
            _open_access_log(options.access_log_skip, options.root_path)
        # uvicorn re-raises the signal that stopped it once it is done; a quiet handler turns that into a return,
        # so the engine below is shut down rather than the process killed with its child left behind.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _note_signal)
        ready = asyncio.create_task(_announce_when_ready(server, sock, names, options))
        watchdog = asyncio.create_task(_stop_when_engine_dies(engine, server))
        await server.serve(sockets=[sock])
        ready.cancel()
        watchdog.cancel()
        (crashed,) = await asyncio.gather(watchdog, return_exceptions=True)
        return 1 if crashed is True else 0  # else cancelled (CancelledError) or False: a clean stop
    finally:
        if grpc_api is not None:
            await grpc_api.stop()
        logger.info("shutting down the engine")
        engine.shutdown()


async def _stop_when_engine_dies(engine: EngineClient, server: uvicorn.Server) -> bool:
    """Stop the server once the engine core is dead; True when that was a crash rather than a stop signal.

    Meanwhile every request gets a 503. A core stopped by the signal that also reaches this process (SIGTERM to
    the process group, Ctrl+C) is not a crash: uvicorn's handler sets ``should_exit`` within the grace.
    """
    reason = await _wait_for_death(engine)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _DEAD_ENGINE_GRACE_S
    while not server.should_exit and loop.time() < deadline:
        await asyncio.sleep(_HEALTH_POLL_S / 2)
    if server.should_exit:
        return False
    logger.error("the engine core died (%s); stopping the server with exit code 1", reason)
    server.should_exit = True
    return True


async def _wait_for_death(engine: EngineClient) -> str:
    while True:
        try:
            await engine.check_health()
        except EngineDeadError as exc:
            return str(exc)
        await asyncio.sleep(_HEALTH_POLL_S)


def _note_signal(sig: int, _frame: object) -> None:
    logger.info("received %s after the server stopped", signal.Signals(sig).name)


async def _announce_when_ready(server: uvicorn.Server, sock: socket.socket, names: list[str],
                               options: ServeOptions) -> None:
    while not server.started:
        await asyncio.sleep(0.02)
    scheme = "https" if options.tls else "http"
    if sock.family == socket.AF_UNIX:
        where = f"{scheme}+unix://{sock.getsockname()} (/v1)"
    else:
        host, port = sock.getsockname()[:2]
        where = f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}/v1"
    logger.info("pagellm is serving %s at %s (OpenAI-compatible%s); Ctrl+C or SIGTERM stops it", ", ".join(names),
                where, ", API key required" if options.api_key is not None else "")

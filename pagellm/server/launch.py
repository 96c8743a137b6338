"""``pagellm serve``: start the engine, then the OpenAI-compatible HTTP server over it (uvicorn, uvloop, httptools).

Contract:
- The port is bound before the model loads, so a taken port fails at once, not after a long load.
- One INFO line says when the server is ready, with its URL.
- SIGTERM or SIGINT: uvicorn stops accepting, lets open requests finish (a few seconds at most), then the engine
  core is shut down and ``run_server`` returns 0. A second SIGINT forces the exit.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Coroutine, Sequence
from typing import Any, Optional

import uvicorn

from pagellm.config import EngineConfig
from pagellm.server.openai.routes import build_app

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GRACEFUL_SHUTDOWN_S = 5


def run_server(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000,
               served_model_names: Optional[Sequence[str]] = None, api_key: Optional[str] = None,
               access_log: bool = False) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit code."""
    sock = _bind(host, port)
    model = config.model_config.model
    names = list(served_model_names or [model or DEFAULT_MODEL_NAME])
    try:
        _run(_serve(config, sock, names, api_key, access_log))
    finally:
        sock.close()
    return 0


def _run(main: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop
    except ImportError:  # uvicorn[standard] brings it; plain asyncio still works
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)


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


async def _serve(config: EngineConfig, sock: socket.socket, names: list[str], api_key: Optional[str],
                 access_log: bool) -> None:
    from pagellm.engine.async_engine import AsyncLLM

    engine = AsyncLLM.from_config(config)
    try:
        app = build_app(engine, names, api_key, model_root=config.model_config.model)
        server = uvicorn.Server(uvicorn.Config(
            app, http="httptools", log_level="warning", access_log=access_log, lifespan="off",
            timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S))
        # uvicorn re-raises the signal that stopped it once it is done; a quiet handler turns that into a return,
        # so the engine below is shut down rather than the process killed with its child left behind.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _note_signal)
        ready = asyncio.create_task(_announce_when_ready(server, sock, names, api_key is not None))
        await server.serve(sockets=[sock])
        ready.cancel()
    finally:
        logger.info("shutting down the engine")
        engine.shutdown()


def _note_signal(sig: int, _frame: object) -> None:
    logger.info("received %s after the server stopped", signal.Signals(sig).name)


async def _announce_when_ready(server: uvicorn.Server, sock: socket.socket, names: list[str],
                               auth: bool) -> None:
    while not server.started:
        await asyncio.sleep(0.02)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    logger.info("pagellm is serving %s at http://%s:%d/v1 (OpenAI-compatible%s); Ctrl+C or SIGTERM stops it",
                ", ".join(names), shown, port, ", API key required" if auth else "")

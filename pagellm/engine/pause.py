"""vLLM's ``pause_generation`` / ``resume_generation`` for ``AsyncLLM`` (an RL loop pauses serving, syncs weights,
resumes).

While paused, a new ``generate`` call waits at the ``PauseGate`` before anything reaches the engine core (its
prompt is checked first, so a bad one still fails at once), and goes on when generation resumes. What happens to the
requests already in flight is the pause's mode (``PAUSE_MODES``):

- ``abort``: they end at once, with finish reason ``"abort"``, and give their KV blocks back;
- ``wait``: they run to their end, and the pause returns once none is left;
- ``keep``: they stay in the core, frozen (``EngineCore.pause``: no step runs), and go on where they were.

The gate is shared by every event loop that calls the engine: each waiter's future is woken on its own loop.
"""

from __future__ import annotations

import asyncio
import threading

PAUSE_MODES = ("abort", "wait", "keep")


def check_pause_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)} (what becomes of the requests in "
                         f"flight), got {mode!r}")


class PauseGate:
    """Holds new ``generate`` calls while generation is paused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.mode: str | None = None  # the pause's mode while paused
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def paused(self) -> bool:
        return self.mode is not None

    def close(self, mode: str) -> None:
        check_pause_mode(mode)
        with self._lock:
            self.mode = mode

    def open(self) -> None:
        with self._lock:
            self.mode, waiters, self._waiters = None, self._waiters, []
        for waiter in waiters:
            try:
                waiter.get_loop().call_soon_threadsafe(_release, waiter)
            except RuntimeError:  # its loop is closed: nobody waits any more
                pass

    async def passage(self) -> None:
        """Return at once unless paused; else when generation resumes."""
        with self._lock:
            if self.mode is None:
                return
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
        await waiter


def _release(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():  # a caller that left while waiting has cancelled it
        waiter.set_result(None)

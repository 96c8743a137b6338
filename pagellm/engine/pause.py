"""vLLM's ``pause_generation`` / ``resume_generation`` for ``AsyncLLM`` (an RL loop pauses serving, syncs weights,
resumes).

While paused, a new ``generate`` call waits at the ``PauseGate`` before anything reaches the engine core (its
prompt is checked first, so a bad one still fails at once), and goes on when generation resumes. What happens to the
requests already in flight is the pause's mode (``PAUSE_MODES``):

- ``abort``: they end at once, with finish reason ``"abort"``, and give their KV blocks back;
- ``wait``: they run to their end, and the pause returns once none is left;
- ``keep``: they stay in the core, frozen (``EngineCore.pause``: no step runs), and go on where they were.

The gate is shared by every event loop that calls the engine: each waiter's future is woken on its own loop.

The gate also counts the core requests in flight (waiting at it, or sent) against vLLM's ``max_num_queued_reqs``: a
call that would go past it is refused at once with ``EngineOverloadedError`` (a 503: retry later, or on another
instance). And it counts the prompt tokens of those still waiting for their first output against vLLM's
``max_num_queued_tokens`` (a TTFT guard): while that backlog is at the limit, a new call is refused alike. As vLLM's,
a prompt counts whole until its first output (prefix-cache hits and chunks done are not known here): the guard errs
on the side of refusing.
"""

from __future__ import annotations

import asyncio
import threading

from pagellm.engine.exceptions import EngineOverloadedError

PAUSE_MODES = ("abort", "wait", "keep")


def check_pause_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)} (what becomes of the requests in "
                         f"flight), got {mode!r}")


class PauseGate:
    """Holds new ``generate`` calls while generation is paused."""

    def __init__(self, max_in_flight: int | None = None, max_queued_tokens: int | None = None) -> None:
        self._lock = threading.Lock()
        self.mode: str | None = None  # the pause's mode while paused
        self.core_frozen = False  # a keep pause has frozen the engine core (its "pause" utility), until "resume"
        self._waiters: list[asyncio.Future[None]] = []
        self.max_in_flight = max_in_flight
        self.in_flight = 0  # core requests past ``enter`` and not yet ``leave``
        self.max_queued_tokens = max_queued_tokens
        self.queued_tokens = 0  # prompt tokens of the requests in ``_prefilling``
        self._prefilling: dict[str, int] = {}  # core request id → its prompt tokens, until its first output

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

    async def enter(self, request_ids: list[str], prompt_tokens: int = 0) -> None:
        """Count the core requests ``request_ids`` of ``prompt_tokens`` each in (``EngineOverloadedError`` past a
        limit); return at once unless paused, else when generation resumes. Each ``enter`` that returns is matched by
        a ``leave``; ``prefilled`` takes a request out of the backlog (at its first output, or when it ends)."""
        count = len(request_ids)
        with self._lock:
            if self.max_in_flight is not None and self.in_flight + count > self.max_in_flight:
                raise EngineOverloadedError(
                    f"the engine holds its limit of {self.max_in_flight} requests in flight (max_num_queued_reqs, "
                    f"--max-num-queued-reqs); retry later or on another instance")
            if self.max_queued_tokens is not None and self.queued_tokens >= self.max_queued_tokens:
                raise EngineOverloadedError(
                    f"the engine's prefill backlog is at its limit of {self.max_queued_tokens} prompt tokens "
                    "(max_num_queued_tokens, --max-num-queued-tokens); retry later or on another instance",
                    "max_num_queued_tokens")
            self.in_flight += count
            if self.max_queued_tokens is not None:  # the backlog is followed only where it is limited
                self.queued_tokens += count * prompt_tokens
                self._prefilling.update(dict.fromkeys(request_ids, prompt_tokens))
            if self.mode is None:
                return
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
        try:
            await waiter
        except BaseException:  # the caller left while waiting
            with self._lock:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
            self.leave(count)
            self.prefilled(request_ids)
            raise

    def leave(self, count: int) -> None:
        with self._lock:
            self.in_flight -= count

    def prefilled(self, request_ids: list[str]) -> None:
        """These requests have their first output, or ended: their prompts leave the backlog (once)."""
        if self.max_queued_tokens is None:
            return
        with self._lock:
            for request_id in request_ids:
                self.queued_tokens -= self._prefilling.pop(request_id, 0)


def _release(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():  # a caller that left while waiting has cancelled it
        waiter.set_result(None)

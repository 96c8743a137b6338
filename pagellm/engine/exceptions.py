"""Errors the frontend engine raises about the engine core itself (bad user input stays ``ValueError``).

Contract: every failure caused by the engine core being gone (crashed, killed, shut down) surfaces as the one
``EngineDeadError``; the server maps it to HTTP 503. Once raised, the engine stays dead: every pending and every
new request fails fast with it.
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core process is gone; no request can be served until a new engine is started."""


class EngineSleepingError(ValueError):
    """The engine is asleep (sleep mode): no request runs until it wakes up; the server maps it to HTTP 503."""


class EngineOverloadedError(ValueError):
    """The engine holds its limit of requests in flight (``max_num_queued_reqs``) or of prompt tokens waiting for
    their first output (``max_num_queued_tokens``, ``reason``); the server maps it to HTTP 503."""

    def __init__(self, message: str, reason: str = "max_num_queued_reqs") -> None:
        super().__init__(message)
        self.reason = reason


ASLEEP = "the engine is asleep (sleep mode): wake it up first (POST /wake_up, LLM.wake_up())"
SLEEP_MODE_OFF = "this engine was started without sleep mode: start it with enable_sleep_mode (--enable-sleep-mode)"


WAKE_TAGS = ("weights", "kv_cache")


def wake_tags(tags: object) -> tuple[str, ...]:
    """vLLM's ``wake_up(tags=...)``: what to wake, "weights" (those a level-2 sleep dropped load again; the engine
    stays asleep) and "kv_cache" (the engine takes requests again); None wakes both."""
    if tags is None:
        return WAKE_TAGS
    if isinstance(tags, str) or not isinstance(tags, (list, tuple)) or not tags \
            or any(tag not in WAKE_TAGS for tag in tags):
        raise ValueError(f"wake_up tags {tags!r}: give a list of 'weights' and/or 'kv_cache' (or none: both)")
    return tuple(tags)


def check_sleep_level(level: int) -> None:
    """Sleep levels this engine takes (vLLM's): 1, the KV cache's memory released and the weights kept; 2, the weights
    dropped too (``wake_up`` loads them again)."""
    if level not in (1, 2):
        raise ValueError(f"sleep level {level!r}: use 1 (the KV cache's memory goes back to the OS, the weights stay) "
                         "or 2 (the weights go too; waking up loads them again from their checkpoint)")

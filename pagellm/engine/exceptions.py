"""Errors the frontend engine raises about the engine core itself (bad user input stays ``ValueError``).

Contract: every failure caused by the engine core being gone (crashed, killed, shut down) surfaces as the one
``EngineDeadError``; the server maps it to HTTP 503. Once raised, the engine stays dead: every pending and every
new request fails fast with it.
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core process is gone; no request can be served until a new engine is started."""

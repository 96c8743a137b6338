"""Server-sent event responses: ``EventStream`` always closes its generator (which aborts the engine request), and
``with_keep_alive`` sends comment lines on a stream with nothing to send (vLLM's ``--sse-keep-alive-interval``)."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Optional

import anyio
from fastapi.responses import StreamingResponse

from pagellm.server.openai.protocol import RequestDefaults

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStream(StreamingResponse):
    """Server-sent events whose generator is always closed, at once, when the response ends or the client leaves.

    Starlette cancels the send loop on disconnect but leaves the generator to the garbage collector; closing it
    here (shielded from that cancellation) is what aborts the engine request deterministically.
    """

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=_SSE_HEADERS)
        self._events = events

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()  # type: ignore[attr-defined]


def sse_response(events: AsyncIterator[str], defaults: Optional[RequestDefaults]) -> EventStream:
    """A completion's or chat's stream, with keep-alive comments where the server sends them."""
    interval = defaults.sse_keep_alive_interval if defaults is not None else 0.0
    return EventStream(with_keep_alive(events, interval) if interval > 0 else events)


KEEP_ALIVE = ": keep-alive\n\n"  # an SSE comment line: clients skip it, proxies see traffic


async def with_keep_alive(events: AsyncIterator[str], interval: float) -> AsyncIterator[str]:
    """``events`` with ``KEEP_ALIVE`` sent each ``interval`` seconds in which they have nothing new (vLLM's
    ``--sse-keep-alive-interval``, above 0). Closing this closes ``events``; an item being awaited then is cancelled
    first, which ends ``events`` (and aborts its request) as a client's disconnect does."""
    pending: asyncio.Future[str] | None = None
    try:
        while True:
            pending = pending or asyncio.ensure_future(events.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield KEEP_ALIVE
                continue
            finished, pending = pending, None
            try:
                event = finished.result()
            except StopAsyncIteration:
                return
            yield event
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.wait({pending})  # its end, whatever it was; a cancellation of this close still propagates
            if not pending.cancelled():
                pending.exception()  # retrieved: an event that raised as the client left is not logged as lost
        await events.aclose()  # type: ignore[attr-defined]

"""The engine core's KV event publisher (``kv/events.py`` has the events and their config).

Contract:
- ``KVEventPublisher.publish(batch)`` never blocks the engine: it queues the batch for a thread that owns the ZMQ
  sockets (``max_queue_size`` batches; past that the oldest waiting one is dropped, with a warning).
- The thread sends each batch as vLLM's three frames on the PUB socket: the topic, an 8-byte big-endian sequence
  number (from 0, one per batch), the msgpack of the ``KVEventBatch``. A subscriber that sees a gap in the numbers
  asks the replay socket (``replay_endpoint``, a ROUTER) for everything from a number on (a DEALER sends ``[b"",
  seq]``): it gets ``[b"", topic, seq, payload]`` for each of the last ``buffer_steps`` batches from that number,
  then ``[b"", b"", -1 as 8 signed bytes, b""]`` (vLLM 0.32's frames).
- The PUB socket binds where the endpoint has a wildcard (``*``, ``::``) or is ``ipc://``/``inproc://``, and
  connects otherwise (a collector that binds), as vLLM's does; the replay socket always binds.
- ``close()`` sends what is queued, then closes the sockets.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading

import msgspec
import zmq

from pagellm.kv.events import KVEventBatch, KVEventsConfig

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_POLL_MS = 50


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(config.max_queue_size)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        binds = any(mark in config.endpoint for mark in ("*", "::")) or \
            config.endpoint.startswith(("ipc://", "inproc://"))
        try:
            (self._pub.bind if binds else self._pub.connect)(config.endpoint)
            self._replay = None
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            raise ValueError(f"kv_events_config: cannot open {config.endpoint} / {config.replay_endpoint}: {exc}") \
                from None
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._topic = config.topic.encode()
        self._encoder = msgspec.msgpack.Encoder()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info("KV cache events: publishing on %s%s", config.endpoint,
                    f", replays on {config.replay_endpoint}" if config.replay_endpoint else "")

    def publish(self, batch: KVEventBatch) -> None:
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            try:
                self._queue.get_nowait()
                logger.warning("KV cache events: the queue is full (%d batches); dropped the oldest",
                               self.config.max_queue_size)
            except queue.Empty:
                pass
            self._queue.put_nowait(batch)

    def close(self) -> None:
        self.publish(None)  # type: ignore[arg-type]  # the end, behind what is queued (the oldest dropped if full)
        self._thread.join(timeout=10)
        self._ctx.destroy(linger=1000)

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._answer_replay()
            try:
                batch = self._queue.get(timeout=_POLL_MS / 1000 if self._replay is not None else None)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = self._encoder.encode(batch)
            seq = self._seq.to_bytes(8, "big")
            self._pub.send_multipart((self._topic, seq, payload), copy=False)
            self._buffer.append((self._seq, payload))
            self._seq += 1

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        client, start = frames[0], frames[-1]
        if len(start) != 8:
            logger.warning("KV cache events: a replay request of %d bytes; expected an 8-byte sequence number",
                           len(start))
        else:
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_OF_REPLAY, b""))

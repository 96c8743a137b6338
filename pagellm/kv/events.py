"""KV cache events: what enters and leaves the prefix cache's table, for routers that send a request to the engine
already holding its prompt's blocks (vLLM's ``--kv-events-config``; llm-d's and NVIDIA Dynamo's KV-aware routers
read this stream from vLLM).

Contract:
- ``KVEventsConfig`` is vLLM's JSON: ``{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
  "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "buffer_steps": 10000, "hwm": 100000, "topic": "kv-events"}``.
- The events and their batch are vLLM's msgpack layout (array-like structs, events tagged by class name):
  ``KVEventBatch(ts, events, data_parallel_rank)`` with ``BlockStored(block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium)``, ``BlockRemoved(block_hashes, medium)`` and ``AllBlocksCleared()``.
- They describe the table a lookup reads (``BlockPool.cached``): a block is *stored* when its hash becomes findable
  (a duplicate of a hash already there is not: lookups never find it) and *removed* when that entry goes (its block
  handed out again); a prefix-cache reset clears it. A stored run carries its tokens and its parent's hash, so a
  consumer can follow the chain; block hashes go out as unsigned 64-bit integers (the first 8 bytes of our 16-byte
  SHA-256 hashes, big-endian), ``medium`` is ``"CPU"``.
- ``KVEventRecorder`` gathers one step's events in order (consecutive removals in one event); the engine core takes
  them after each step and publishes them (``engine/kv_events.py``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence, Union

import msgspec

MEDIUM = "CPU"
PUBLISHERS = ("null", "zmq")


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One change to the prefix cache's table."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


def external_hash(block_hash: bytes) -> int:
    """A block hash as the events carry it: its first 8 bytes as an unsigned big-endian integer."""
    return int.from_bytes(block_hash[:8], "big")


class KVEventRecorder:
    """One step's events, in the order the table changed."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVCacheEvent] = []

    def stored(self, hashes: Sequence[bytes], parent: bytes | None, token_ids: Sequence[int],
               lora_id: int | None) -> None:
        self._events.append(BlockStored([external_hash(h) for h in hashes],
                                        None if parent is None else external_hash(parent), list(token_ids),
                                        self.block_size, lora_id, MEDIUM))

    def removed(self, block_hash: bytes) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(external_hash(block_hash))
        else:
            self._events.append(BlockRemoved([external_hash(block_hash)], MEDIUM))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self, data_parallel_rank: int | None = None) -> KVEventBatch | None:
        """The events since the last call as one batch, or None when there were none."""
        if not self._events:
            return None
        events, self._events = self._events, []
        return KVEventBatch(time.time(), events, data_parallel_rank)  # type: ignore[arg-type]


@dataclass(frozen=True)
class KVEventsConfig:
    """Where the engine publishes its KV cache events (vLLM's ``--kv-events-config``)."""

    enable_kv_cache_events: bool = False
    publisher: Optional[str] = None  # default: "zmq" when events are on, else "null"
    endpoint: str = "tcp://*:5557"   # the PUB socket (bound; "tcp://host:port" connects instead, as vLLM's does)
    replay_endpoint: Optional[str] = None  # a ROUTER socket answering replays of the last buffer_steps batches
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    data_parallel_rank: Optional[int] = None  # set per engine core with --data-parallel-size

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher must be one of {', '.join(PUBLISHERS)}, got "
                             f"{self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv_events_config.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def for_rank(self, rank: int) -> KVEventsConfig:
        """This config for data-parallel engine core ``rank``: its batches say so, and its TCP endpoints take the
        port ``rank`` above the given one (each core binds its own)."""
        return replace(self, endpoint=_offset(self.endpoint, rank), data_parallel_rank=rank,
                       replay_endpoint=_offset(self.replay_endpoint, rank) if self.replay_endpoint else None)

    @classmethod
    def parse(cls, value: KVEventsConfig | dict[str, Any] | str | None) -> KVEventsConfig:
        if value is None or isinstance(value, KVEventsConfig):
            return value or cls()
        spec = value
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"kv_events_config is not valid JSON ({exc})") from None
        if not isinstance(spec, dict):
            raise ValueError(f"kv_events_config must be a JSON object, got {spec!r}")
        known = {f for f in cls.__dataclass_fields__ if f != "data_parallel_rank"}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unknown keys {unknown}; valid ones: {', '.join(sorted(known))}")
        return cls(**spec)


def _offset(endpoint: str, rank: int) -> str:
    head, _, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not port.isdigit():
        raise ValueError(f"kv_events_config endpoint {endpoint!r}: with data_parallel_size > 1 give a tcp://HOST:PORT "
                         "endpoint (engine core i publishes on PORT + i)")
    return f"{head}:{int(port) + rank}"

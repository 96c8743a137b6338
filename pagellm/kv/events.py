"""KV cache events: what enters and leaves the prefix cache's table, for routers that send a request to the engine
already holding its prompt's blocks (vLLM's ``--kv-events-config``; llm-d's and NVIDIA Dynamo's KV-aware routers
read this stream from vLLM).

Contract:
- ``KVEventsConfig`` is vLLM's JSON: ``{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
  "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "buffer_steps": 10000, "hwm": 100000, "topic": "kv-events"}``.
- The events and their batch are vLLM 0.32's msgpack layout: ``KVEventBatch(ts, events, data_parallel_rank)`` an
  array; each event a map tagged with its class name (``"type"``), fields at their defaults left out:
  ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys,
  group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window, locality, ownership, session_id)``,
  ``BlockRemoved(block_hashes, medium, group_idx, locality, ownership)``, ``AllBlocksCleared()``.
- A request's ``session_id`` (its ``extra_args``', where the server puts the API's field or header) is in each
  ``BlockStored`` it causes; with ``extra_args["kv_cache_report_mode"] == "full"`` the prefix-cache hits of its
  admission are reported too, as one ``BlockStored`` from its first block (``reused``), as vLLM 0.32 reports them.
- They describe the table a lookup reads (``BlockPool.cached``): a block is *stored* when its hash becomes findable
  (a duplicate of a hash already there is not: lookups never find it) and *removed* when that entry goes (its block
  handed out again); a prefix-cache reset clears it. A stored run carries its tokens and its parent's hash, so a
  consumer can follow the chain, and each block's extra keys as vLLM publishes them (``kv/hash_algos.py``'s keys
  untagged: the adapter's name, the caller's salt on a first block, an embeddings block's digest; None for a block
  without any). Block hashes go out as vLLM's do, as unsigned 64-bit integers: the last 8 bytes of each hash,
  big-endian (``--prefix-caching-hash-algo`` makes them vLLM's hashes too). ``medium`` is ``"CPU"``, ``group_idx``
  0, the kind ``"full_attention"``, or ``"sliding_window"`` with its window when every layer slides.
- ``KVEventRecorder`` gathers one step's events in order (consecutive removals in one event); the engine core takes
  them after each step and publishes them (``engine/kv_events.py``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import msgspec

from pagellm.kv.hash_algos import block_keys
from pagellm.request import Request

MEDIUM = "CPU"
GROUP = 0  # the one KV cache group (vLLM numbers its groups; a model of one attention kind has group 0)
PUBLISHERS = ("null", "zmq")


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One change to the prefix cache's table."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None  # per block, untagged (module docstring)
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None  # "full_attention", or "sliding_window" (of that many positions)
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None   # vLLM's LOCAL / REMOTE and offloading tier: never set here
    ownership: Optional[str] = None
    session_id: Optional[str] = None  # the session of the request that stored (or reused) the blocks


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


def session_of(request: Request) -> Optional[str]:
    """The request's session (vLLM's ``session_id``, which the server puts in its ``extra_args``)."""
    session = (request.sampling_params.extra_args or {}).get("session_id")
    return session if isinstance(session, str) and session else None


def report_mode(request: Request) -> str:
    """vLLM's ``kv_cache_report_mode`` (``extra_args``): "full" reports the cached blocks a request reuses too."""
    return (request.sampling_params.extra_args or {}).get("kv_cache_report_mode", "incremental")


def external_hash(block_hash: bytes) -> int:
    """A block hash as the events carry it, as vLLM's do: its last 8 bytes as an unsigned big-endian integer."""
    return int.from_bytes(block_hash[-8:], "big")


class KVEventRecorder:
    """One step's events, in the order the table changed."""

    def __init__(self, block_size: int, sliding_window: int = 0) -> None:
        """``sliding_window``: every layer attends over this many positions (0: the whole context)."""
        self.block_size = block_size
        self._kind = ("sliding_window", sliding_window) if sliding_window else ("full_attention", None)
        self._events: list[KVCacheEvent] = []

    def stored(self, request: Request, first: int, end: int) -> None:
        """Blocks ``first .. end - 1`` of ``request`` became findable."""
        hashes, bs, lora = request.block_hashes, self.block_size, request.sampling_params.lora_request
        keys = [block_keys(request, index, bs) for index in range(first, end)]
        self._events.append(BlockStored(
            [external_hash(h) for h in hashes[first:end]], external_hash(hashes[first - 1]) if first else None,
            request.all_token_ids[first * bs:end * bs], bs, lora.lora_int_id if lora is not None else None, MEDIUM,
            lora.lora_name if lora is not None else None,
            [tuple(key[1] for key in k) if k else None for k in keys], GROUP, *self._kind,
            session_id=session_of(request)))

    def reused(self, request: Request, num_blocks: int) -> None:
        """A request found its first ``num_blocks`` blocks in the prefix cache and asked for them to be reported
        (``kv_cache_report_mode`` "full"): one ``BlockStored`` of them, its parent None, as vLLM 0.32 sends."""
        if num_blocks and report_mode(request) == "full":
            self.stored(request, 0, num_blocks)

    def removed(self, block_hash: bytes) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(external_hash(block_hash))
        else:
            self._events.append(BlockRemoved([external_hash(block_hash)], MEDIUM, GROUP))

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

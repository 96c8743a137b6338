"""KV cache events (``--kv-events-config``) through a real ZMQ subscriber: the stream, applied in order, rebuilds
the engine's prefix-cache table exactly, evictions and resets included; each stored run's tokens and parent give
its hashes; sequence numbers run on, and the replay socket sends a missed range again."""

from __future__ import annotations

import dataclasses
import socket
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import msgspec
import pytest
import torch
import zmq

from pagellm import LLM, SamplingParams
from pagellm.config import EngineConfig
from pagellm.engine.async_engine import AsyncLLM
from pagellm.engine.dp_client import core_config
from pagellm.engine.kv_events import END_OF_REPLAY
from pagellm.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, external_hash
from pagellm.kv.hash_algos import VllmBlockHasher
from pagellm.kv.hashing import hash_block_tokens

BLOCK = 4


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _receive(sub: zmq.Socket, timeout_ms: int = 2000) -> list[tuple[int, bytes]]:
    """Every (sequence number, payload) the subscriber has, waiting ``timeout_ms`` for the first."""
    got = []
    while sub.poll(timeout_ms if not got else 300):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv-events"
        got.append((int.from_bytes(seq, "big"), payload))
    return got


def _apply(table: set[int], batch: KVEventBatch, full: dict[int, bytes]) -> None:
    """Apply one batch to ``table``, checking that every stored run's hashes are its tokens' chained on its parent's
    (``full``: each hash ever stored, whole)."""
    for event in batch.events:
        if isinstance(event, BlockStored):
            assert event.block_size == BLOCK and len(event.token_ids) == BLOCK * len(event.block_hashes)
            parent = None if event.parent_block_hash is None else full[event.parent_block_hash]
            for i, ext in enumerate(event.block_hashes):
                parent = hash_block_tokens(parent, event.token_ids[i * BLOCK:(i + 1) * BLOCK])
                assert external_hash(parent) == ext
                full[ext] = parent
            table.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert set(event.block_hashes) <= table
            table.difference_update(event.block_hashes)
        else:
            assert isinstance(event, AllBlocksCleared)
            table.clear()


@pytest.fixture(scope="module")
def sockets() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _engine(model: Path, sockets: zmq.Context, kv_cache_memory: int, **kwargs: object) -> tuple[LLM, zmq.Socket, int]:
    """An engine publishing its events, a subscriber that receives them from now on (synchronised: the engine
    publishes prefix-cache resets until one arrives, then those are drained), and the replay port."""
    pub, replay = _port(), _port()
    sub = sockets.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{pub}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    llm = LLM(str(model), dtype="float32", block_size=BLOCK, max_model_len=128, kv_cache_memory=kv_cache_memory,
              kv_events_config={"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}",
                                "replay_endpoint": f"tcp://*:{replay}", "topic": "kv-events"}, **kwargs)
    deadline = time.monotonic() + 30
    while not sub.poll(50):
        assert time.monotonic() < deadline, "no KV event reached the subscriber"
        assert llm.reset_prefix_cache()
    _receive(sub, 0)
    return llm, sub, replay


def _replay(sockets: zmq.Context, port: int, first: int) -> list[tuple[int, bytes]]:
    dealer = sockets.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send_multipart([b"", first.to_bytes(8, "big")])
    replayed = []
    while True:
        assert dealer.poll(5000), "the replay socket did not answer"
        _, topic, seq, payload = dealer.recv_multipart()
        assert topic == (b"" if seq == END_OF_REPLAY else b"kv-events")  # vLLM 0.32's replay frames
        if seq == END_OF_REPLAY:
            dealer.close()
            return replayed
        replayed.append((int.from_bytes(seq, "big"), payload))


def test_the_stream_rebuilds_the_prefix_cache_table(tiny_llama: Path, sockets: zmq.Context) -> None:
    llm, sub, replay = _engine(tiny_llama, sockets, 70_000)
    pool = llm.engine.core.scheduler.kv.pool
    assert pool.num_blocks < 40  # the prompts below overflow it, so blocks are evicted
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 256, (24,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, 256, (int(n),), generator=gen).tolist() for n in (9, 30, 41, 17, 50, 33)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for prompt in prompts:
        llm.generate([prompt], params, use_tqdm=False)
    llm.generate(prompts[:3], params, use_tqdm=False)
    assert pool.num_evictions > 0
    live = _receive(sub)
    history = _replay(sockets, replay, 0)  # the resets that synchronised the subscriber, then the same as live
    assert [seq for seq, _ in history] == list(range(len(history))) and live == history[-len(live):]
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    table: set[int] = set()
    full: dict[int, bytes] = {}
    for _, payload in live:
        _apply(table, decoder.decode(payload), full)
    assert table == {external_hash(h) for h in pool.cached}
    assert any(isinstance(e, BlockRemoved) for _, p in live for e in decoder.decode(p).events)
    assert _replay(sockets, replay, history[-3][0]) == history[-3:]

    assert llm.reset_prefix_cache()
    (seq, payload), = _receive(sub)
    assert seq == len(history) and decoder.decode(payload).events == [AllBlocksCleared()]
    llm.engine.core.shutdown()


def test_a_run_after_cached_blocks_names_the_last_of_them_as_parent(tiny_llama: Path,
                                                                    sockets: zmq.Context) -> None:
    llm, sub, _ = _engine(tiny_llama, sockets, 400_000)
    base, more = list(range(40, 56)), list(range(60, 68))  # four blocks, then two
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([base], params, use_tqdm=False)
    llm.generate([base + more], params, use_tqdm=False)  # its first four blocks are cache hits
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    events = [e for _, p in _receive(sub) for e in decoder.decode(p).events]
    hashes = []
    for i in range(0, len(base + more), BLOCK):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, (base + more)[i:i + BLOCK]))
    ext = [external_hash(h) for h in hashes]
    assert events == [BlockStored(ext[:4], None, base, BLOCK, None, "CPU", None, [None] * 4, 0, "full_attention"),
                      BlockStored(ext[4:], ext[3], more, BLOCK, None, "CPU", None, [None] * 2, 0, "full_attention")]
    llm.engine.core.shutdown()


def test_sessions_and_reused_blocks_are_reported_as_vllm_does(tiny_llama: Path, sockets: zmq.Context) -> None:
    """vLLM 0.32's ``session_id`` (in ``extra_args``, where the server puts it) names the session in each
    ``BlockStored`` a request causes, and ``kv_cache_report_mode`` "full" reports the cached blocks a request reuses
    as one ``BlockStored`` from the first block (parent None); plain requests report only what they store."""
    llm, sub, _ = _engine(tiny_llama, sockets, 400_000)
    base, more = list(range(40, 56)), list(range(60, 68))
    ext = []
    for i in range(0, len(base + more), BLOCK):
        ext.append(hash_block_tokens(ext[-1] if ext else None, (base + more)[i:i + BLOCK]))
    ext = [external_hash(h) for h in ext]

    def events_of(prompt: list[int], **extra: object) -> list[BlockStored]:
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, extra_args=extra or None), use_tqdm=False)
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        return [e for _, p in _receive(sub) for e in decoder.decode(p).events]

    def stored(first: int, end: int, parent: int | None, session: str | None) -> BlockStored:
        return BlockStored(ext[first:end], parent, (base + more)[first * BLOCK:end * BLOCK], BLOCK, None, "CPU", None,
                           [None] * (end - first), 0, "full_attention", session_id=session)

    assert events_of(base, session_id="chat-1") == [stored(0, 4, None, "chat-1")]
    assert events_of(base + more, session_id="chat-2", kv_cache_report_mode="full") == [
        stored(0, 4, None, "chat-2"), stored(4, 6, ext[3], "chat-2")]  # the reused four, then the two it stored
    assert events_of(base + more) == []  # all cached (but the last token): nothing stored, nothing reported
    assert b"session_id" not in msgspec.msgpack.encode(stored(0, 4, None, None))  # absent when unset, as vLLM's
    llm.engine.core.shutdown()


def test_vllm_hashes_go_out_in_vllms_layout_and_still_hit(tiny_llama: Path, sockets: zmq.Context,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``prefix_caching_hash_algo`` the events carry vLLM's hashes of the blocks (outputs included: pickle
    would tell a numpy integer from an int), as vLLM 0.32's wire layout, and the cache finds them again."""
    monkeypatch.setenv("PYTHONHASHSEED", "7")  # the engine core's process inherits it
    llm, sub, _ = _engine(tiny_llama, sockets, 400_000, prefix_caching_hash_algo="sha256")
    prompt = list(range(40, 54))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    tokens = prompt + list(first.outputs[0].token_ids)
    payloads = [p for _, p in _receive(sub)]
    stored = [e for p in payloads for e in msgspec.msgpack.Decoder(KVEventBatch).decode(p).events]
    expected = [external_hash(h) for h in VllmBlockHasher("sha256").token_hashes(tokens, BLOCK)]
    assert [h for e in stored for h in e.block_hashes] == expected[:(len(tokens) - 1) // BLOCK]
    raw = msgspec.msgpack.decode(payloads[0])[1][0]  # the batch is an array, its events maps tagged "type"
    assert raw == {"type": "BlockStored", "block_hashes": stored[0].block_hashes, "parent_block_hash": None,
                   "token_ids": tokens[:len(stored[0].block_hashes) * BLOCK], "block_size": BLOCK, "lora_id": None,
                   "medium": "CPU", "lora_name": None, "extra_keys": [None] * len(stored[0].block_hashes),
                   "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK and again.outputs[0].token_ids == \
        first.outputs[0].token_ids
    llm.engine.core.shutdown()


def test_config_is_checked_by_name() -> None:
    on = {"enable_kv_cache_events": True}
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        EngineConfig.from_kwargs(kv_events_config=on, enable_prefix_caching=False)
    with pytest.raises(ValueError, match=r"unknown keys \['port'\]"):
        EngineConfig.from_kwargs(kv_events_config={**on, "port": 5557})
    with pytest.raises(ValueError, match="publisher must be one of null, zmq"):
        EngineConfig.from_kwargs(kv_events_config={**on, "publisher": "nats"})
    with pytest.raises(ValueError, match="not valid JSON"):
        EngineConfig.from_kwargs(kv_events_config="{on}")
    with pytest.raises(ValueError, match="give a tcp://HOST:PORT endpoint"):
        EngineConfig.from_kwargs(kv_events_config={**on, "endpoint": "ipc:///tmp/kv"}, data_parallel_size=2)
    config = EngineConfig.from_kwargs(kv_events_config={**on, "endpoint": "tcp://*:5557",
                                                        "replay_endpoint": "tcp://*:6000"}, data_parallel_size=2)
    second = core_config(config, 1).kv_events_config
    assert (second.endpoint, second.replay_endpoint, second.data_parallel_rank) == ("tcp://*:5558", "tcp://*:6001", 1)
    off = EngineConfig.from_kwargs(data_parallel_size=2)
    assert core_config(off, 1) is off and dataclasses.asdict(off.kv_events_config)["publisher"] == "null"
    # /kv_event_sources lists what each core binds
    sources = AsyncLLM.kv_event_sources(SimpleNamespace(config=config))  # type: ignore[arg-type]
    assert sources == {rank: core_config(config, rank).kv_events_config for rank in (0, 1)}
    assert [s.endpoint for s in sources.values()] == ["tcp://*:5557", "tcp://*:5558"]
    assert AsyncLLM.kv_event_sources(SimpleNamespace(config=off)) == {}  # type: ignore[arg-type]


def test_a_sliding_window_models_blocks_say_so() -> None:
    from pagellm.kv.events import KVEventRecorder
    from pagellm.request import Request

    recorder = KVEventRecorder(BLOCK, sliding_window=64)
    request = Request("r", list(range(2 * BLOCK)), SamplingParams(max_tokens=1))
    request.block_hashes[:] = [bytes([1]) * 16, bytes([2]) * 16]
    recorder.stored(request, 1, 2)
    (event,) = recorder.take().events  # type: ignore[union-attr]
    assert (event.parent_block_hash, event.block_hashes, event.token_ids) == \
        (external_hash(bytes([1]) * 16), [external_hash(bytes([2]) * 16)], list(range(BLOCK, 2 * BLOCK)))
    assert (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window) == ("sliding_window", 64)

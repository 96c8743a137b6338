"""``pagellm serve --kv-events-config``: the served engine core publishes its KV cache events, which a router reads
back (here through the replay socket, which holds every batch from the first)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Callable

import httpx
import msgspec
import openai
import zmq
from server_utils import ServerProcess

from lora_utils import build_lora_adapter
from pagellm.engine.kv_events import END_OF_REPLAY
from pagellm.kv.events import BlockStored, KVEventBatch, external_hash
from pagellm.kv.hash_algos import VllmBlockHasher


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _events_config() -> tuple[dict, int]:
    replay = _port()
    return {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{_port()}", "replay_endpoint": f"tcp://*:{replay}",
            "topic": "kv"}, replay


def _stored(replay: int) -> list[BlockStored]:
    """Every ``BlockStored`` the server has published, asked of its replay socket (vLLM 0.32's frames)."""
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        stored: list[BlockStored] = []
        while True:
            assert dealer.poll(10_000), "the replay socket did not answer"
            _, topic, seq, payload = dealer.recv_multipart()
            assert topic == (b"" if seq == END_OF_REPLAY else b"kv")
            if seq == END_OF_REPLAY:
                return stored
            stored += [e for e in decoder.decode(payload).events if isinstance(e, BlockStored)]
    finally:
        ctx.destroy(linger=0)


def test_a_served_prompt_is_published_as_stored_blocks(start_server: Callable[..., ServerProcess],
                                                        tiny_llama: Path) -> None:
    config, replay = _events_config()
    server = start_server(tiny_llama, "--served-model-name", "tiny", "--block-size", "16",
                          "--kv-events-config", json.dumps(config))
    sources = httpx.get(f"{server.base_url}/kv_event_sources").json()  # vLLM's: where a router subscribes
    assert sources == {"0": {**config, "publisher": "zmq", "buffer_steps": 10_000, "hwm": 100_000,
                             "max_queue_size": 100_000}}
    prompt = "The prefix cache keeps every full block of this prompt for the next request. " * 3
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    ids = httpx.post(f"{server.base_url}/tokenize", json={"model": "tiny", "prompt": prompt}).json()["tokens"]
    stored = _stored(replay)
    full = len(ids) // 16
    assert [t for event in stored for t in event.token_ids][:full * 16] == ids[:full * 16]
    assert stored[0].parent_block_hash is None and stored[0].block_size == 16
    assert {event.session_id for event in stored} == {None}
    # vLLM's sessions: the body's session_id, else the X-Session-ID header, else vllm_xargs' (the body's wins)
    for extra, headers, session in (({"session_id": "s-body", "vllm_xargs": {"session_id": "s-xargs"}},
                                     {"X-Session-ID": "s-header"}, "s-body"),
                                    ({"vllm_xargs": {"session_id": "s-xargs"}}, {"X-Session-ID": "s-header"},
                                     "s-header"),
                                    ({"vllm_xargs": {"session_id": "s-xargs"}}, {}, "s-xargs")):
        reply = httpx.post(f"{server.base_url}/v1/completions", headers=headers, timeout=60, json={
            "model": "tiny", "prompt": f"{session}: {prompt}", "max_tokens": 1, **extra})
        assert reply.status_code == 200, reply.text
        assert {event.session_id for event in _stored(replay)[len(stored):]} == {session}
        stored = _stored(replay)
    chat = [{"role": "user", "content": prompt}]
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", headers={"X-Session-ID": "s-chat"}, timeout=60,
                       json={"model": "tiny", "messages": chat, "max_tokens": 1,
                             "vllm_xargs": {"kv_cache_report_mode": "full"}})
    assert reply.status_code == 200, reply.text
    assert {event.session_id for event in _stored(replay)[len(stored):]} == {"s-chat"}


def test_an_adapters_salted_prompt_is_published_with_vllms_hashes(start_server: Callable[..., ServerProcess],
                                                                  tiny_llama: Path, tmp_path: Path) -> None:
    """``--prefix-caching-hash-algo sha256_cbor``: the blocks of a request naming an adapter and a cache salt go out
    hashed as vLLM hashes them (the adapter's name and path on every block, the salt on the first), with the
    adapter's name and each block's extra keys beside them, so a router hashing the prompt itself finds them."""
    adapter = build_lora_adapter(tiny_llama, tmp_path / "ad", 5, ["q_proj"], 4)
    config, replay = _events_config()
    server = start_server(tiny_llama, "--served-model-name", "tiny", "--block-size", "16", "--kv-events-config",
                          json.dumps(config), "--prefix-caching-hash-algo", "sha256_cbor", "--enable-lora",
                          "--lora-modules", f"ad={adapter}", env={"PYTHONHASHSEED": "7"})
    prompt = list(range(100, 140))
    reply = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
        "model": "ad", "prompt": prompt, "max_tokens": 1, "temperature": 0, "cache_salt": "s1"})
    assert reply.status_code == 200, reply.text
    stored = _stored(replay)
    hasher, lora = VllmBlockHasher("sha256_cbor", seed="7"), ("lora", "ad", str(adapter))
    first = hasher.block(None, prompt[:16], (lora, ("cache_salt", "s1")))
    expected = [external_hash(first), external_hash(hasher.block(first, prompt[16:32], (lora,)))]
    assert [h for event in stored for h in event.block_hashes] == expected
    assert {(e.lora_id, e.lora_name) for e in stored} == {(1, "ad")}
    assert [k for event in stored for k in event.extra_keys or []] == [("ad", "s1"), ("ad",)]

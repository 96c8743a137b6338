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

from pagellm.engine.kv_events import END_OF_REPLAY
from pagellm.kv.events import BlockStored, KVEventBatch


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_served_prompt_is_published_as_stored_blocks(start_server: Callable[..., ServerProcess],
                                                        tiny_llama: Path) -> None:
    pub, replay = _port(), _port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": "kv"}
    server = start_server(tiny_llama, "--served-model-name", "tiny", "--block-size", "16",
                          "--kv-events-config", json.dumps(config))
    prompt = "The prefix cache keeps every full block of this prompt for the next request. " * 3
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    ids = httpx.post(f"{server.base_url}/tokenize", json={"model": "tiny", "prompt": prompt}).json()["tokens"]

    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        stored: list[BlockStored] = []
        while True:
            assert dealer.poll(10_000), "the replay socket did not answer"
            _, seq, payload = dealer.recv_multipart()
            if seq == END_OF_REPLAY:
                break
            stored += [e for e in decoder.decode(payload).events if isinstance(e, BlockStored)]
    finally:
        ctx.destroy(linger=0)
    full = len(ids) // 16
    assert [t for event in stored for t in event.token_ids][:full * 16] == ids[:full * 16]
    assert stored[0].parent_block_hash is None and stored[0].block_size == 16

"""pagellm's KV cache events beside vLLM's, on the same prompts: the same block hashes in the same wire layout.

A KV-aware router (llm-d's precise prefix-cache scorer, for one) indexes the blocks an engine publishes and hashes
new prompts itself to look them up, so an engine that stands in for vLLM must publish vLLM's hashes in vLLM's layout.
This starts vLLM (``make peers``) and then pagellm on the built-in model, each with ``--kv-events-config`` on a free
port, ``--block-size 32`` (vLLM's CPU attention takes multiples of 32) and ``--prefix-caching-hash-algo ALGO``
(``PYTHONHASHSEED`` the same for both), sends each the same completions (token-id prompts: plain, with a
``cache_salt``, one that extends the first, one with a ``session_id`` and one extending it that asks for its reused
blocks to be reported), receives their events on a ZMQ SUB socket, and compares every
``BlockStored`` field by field (the medium aside: vLLM names its cache "GPU" whatever the device), and what
``GET /kv_event_sources`` says of the publisher. Then vLLM's own
decoder (``vllm.distributed.kv_events.KVEventBatch``, in vLLM's venv) reads pagellm's payloads. Prints what differs;
exits 1 if anything does.

    .venv/bin/python benchmarks/kv_events_vs_vllm.py --algo sha256_cbor
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import zmq

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from compare import free_port, stop, wait_ready  # noqa: E402
from peers import systems  # noqa: E402

PROMPTS: list[dict[str, Any]] = [
    {"prompt": list(range(1000, 1070))},
    {"prompt": list(range(1000, 1070)), "cache_salt": "tenant-a"},
    {"prompt": list(range(1000, 1070)) + list(range(2000, 2060))},  # two cached blocks, then new ones
    # vLLM 0.32's sessions: named in what a request stores, and with "full" reporting its reused blocks too
    {"prompt": list(range(3000, 3070)), "session_id": "chat-7"},
    {"prompt": list(range(3000, 3070)) + list(range(4000, 4040)), "session_id": "chat-8",
     "vllm_xargs": {"kv_cache_report_mode": "full"}},
]
COMPARED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "lora_name", "extra_keys",
            "group_idx", "session_id")
VLLM_DECODE = """
import sys, msgspec
from vllm.distributed.kv_events import KVEventBatch
decoder = msgspec.msgpack.Decoder(KVEventBatch)
for payload in msgspec.msgpack.decode(open(sys.argv[1], "rb").read()):
    print(len(decoder.decode(payload).events))
"""


def collect(system: systems.System, pub: int, seed: str) -> tuple[list[bytes], Any]:
    """Start ``system``, send ``PROMPTS`` one after another, return every event payload it published and what its
    ``GET /kv_event_sources`` says (its publisher's port written as PORT: each side has its own)."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{pub}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    base_url = f"http://127.0.0.1:{system.argv[system.argv.index('--port') + 1]}"
    log = tempfile.NamedTemporaryFile("w+", prefix=f"{system.name}-", suffix=".log", delete=False)
    proc = subprocess.Popen(system.argv, env={**os.environ, **system.env, "PYTHONHASHSEED": seed}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    payloads: list[bytes] = []
    try:
        try:
            print(f"{system.name}: ready in {wait_ready(base_url, proc, 600):.1f} s", flush=True)
        except (RuntimeError, TimeoutError) as exc:
            sys.exit(f"{system.name} {exc}; its log ({log.name}) ends:\n" + "".join(open(log.name).readlines()[-15:]))
        sources = json.loads(httpx.get(f"{base_url}/kv_event_sources", timeout=30).text.replace(str(pub), "PORT"))
        for body in PROMPTS:
            reply = httpx.post(f"{base_url}/v1/completions", timeout=120,
                               json={"model": "smollm2", "max_tokens": 1, "temperature": 0, **body})
            reply.raise_for_status()
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                if sub.poll(200):
                    payloads.append(sub.recv_multipart()[-1])
    finally:
        stop(proc)
        ctx.destroy(linger=0)
    return payloads, sources


def stored(payloads: list[bytes]) -> list[dict[str, Any]]:
    return [event for payload in payloads for event in msgspec.msgpack.decode(payload)[1]
            if event.get("type") == "BlockStored"]


def differences(theirs: list[dict[str, Any]], ours: list[dict[str, Any]]) -> list[str]:
    found = [] if len(theirs) == len(ours) else [f"{len(theirs)} BlockStored from vLLM, {len(ours)} from pagellm"]
    for i, (a, b) in enumerate(zip(theirs, ours)):
        found += [f"event {i} {name}: vLLM {a.get(name)!r}, pagellm {b.get(name)!r}"
                  for name in COMPARED if a.get(name) != b.get(name)]
        if set(a) - {"medium"} != set(b) - {"medium"}:
            found.append(f"event {i} fields: vLLM {sorted(a)}, pagellm {sorted(b)}")
    return found


def main() -> None:
    from pagellm.model.loader import default_model_path, hf_model_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algo", default="sha256_cbor", choices=("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"))
    parser.add_argument("--seed", default="0", help="PYTHONHASHSEED of both servers")
    args = parser.parse_args()
    gguf = Path(default_model_path())
    ctx = systems.Context(hf_model_dir(gguf), gguf)
    events: dict[str, list[bytes]] = {}
    sources: dict[str, Any] = {}
    for name in ("vllm", "pagellm"):
        pub = free_port()
        flags = ("--block-size", "32", "--prefix-caching-hash-algo", args.algo, "--kv-events-config",
                 json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}"}))
        system = systems.BUILDERS[name](systems.Context(**{**vars(ctx), f"{name}_flags": flags}), free_port())
        if system.missing_reason:
            sys.exit(f"{system.name}: {system.missing_reason}")
        events[name], sources[name] = collect(system, pub, args.seed)
    theirs, ours = stored(events["vllm"]), stored(events["pagellm"])
    print(f"BlockStored events: vLLM {len(theirs)} ({sum(len(e['block_hashes']) for e in theirs)} blocks), "
          f"pagellm {len(ours)} ({sum(len(e['block_hashes']) for e in ours)} blocks)")
    media = [sorted({str(e.get("medium")) for e in side}) for side in (theirs, ours)]
    print(f"medium: vLLM {media[0]}, pagellm {media[1]}")
    found = differences(theirs, ours)
    if sources["vllm"] != sources["pagellm"]:
        found.append(f"/kv_event_sources: vLLM {sources['vllm']}, pagellm {sources['pagellm']}")
    else:
        print(f"/kv_event_sources: the same, {sources['pagellm']}")
    with tempfile.NamedTemporaryFile(suffix=".msgpack") as dump:
        dump.write(msgspec.msgpack.encode(events["pagellm"]))
        dump.flush()
        decoded = subprocess.run([str(systems.PEERS / "vllm" / "bin" / "python"), "-c", VLLM_DECODE, dump.name],
                                 capture_output=True, text=True)
    if decoded.returncode:
        found.append(f"vLLM's decoder refused pagellm's payloads: {decoded.stderr.strip().splitlines()[-1]}")
    else:
        print(f"vLLM's decoder read pagellm's {len(events['pagellm'])} batches")
    for line in found:
        print("DIFFERS:", line)
    print("identical" if not found else f"{len(found)} differences")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()

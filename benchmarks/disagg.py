"""Disaggregated prefill and decode: what loading a prompt's stored KV blocks costs the decode server against
computing them. A producer server stores the blocks of N long prompts (one-token requests); then the consumer server
and a plain server (no connector) each get the same N prompts one at a time (greedy, a few tokens out), and the
script prints each one's mean TTFT, its ratio, and the store's size.

    .venv/bin/python benchmarks/disagg.py [--model PATH] [--num-prompts 8] [--input-len 1024] [--output-len 8]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import free_port, wait_ready  # noqa: E402  (the side-by-side harness's server helpers)


def _serve(model: list[str], extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "pagellm.cli", "serve", *model, "--port", str(port),
                                "--disable-log-stats", "--no-kv-cache-prefault", *extra],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, process, 300)
    return process, base


def _ttft(base: str, prompt: list[int], output_len: int) -> tuple[float, int]:
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, first, cached = time.perf_counter(), None, 0
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if first is None and chunk["choices"]:
                    first = time.perf_counter() - start
                if chunk.get("usage"):
                    cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return first or 0.0, cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=8)
    args = parser.parse_args()
    model = [args.model] if args.model else []
    store = Path(tempfile.mkdtemp())
    spec = {"kv_connector": "SharedStorageConnector", "kv_connector_extra_config": {"shared_storage_path": str(store)}}
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 10_000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    warm = [rng.randrange(100, 10_000) for _ in range(args.input_len)]
    try:
        producer, base = _serve(model, ["--kv-transfer-config", json.dumps({**spec, "kv_role": "kv_producer"})])
        for prompt in prompts:
            httpx.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=600)
        producer.terminate()
        producer.wait(30)
        stored = list(store.rglob("*.safetensors"))
        for name, extra in (("plain", []), ("consumer", ["--kv-transfer-config",
                                                         json.dumps({**spec, "kv_role": "kv_consumer"})])):
            server, base = _serve(model, extra)
            _ttft(base, warm, args.output_len)  # warm-up: kernels, first touches
            results = [_ttft(base, prompt, args.output_len) for prompt in prompts]
            server.terminate()
            server.wait(30)
            mean = sum(t for t, _ in results) / len(results)
            print(f"{name:9s} mean TTFT {mean * 1000:8.1f} ms   cached tokens per prompt "
                  f"{sum(c for _, c in results) / len(results):7.1f}")
            if name == "plain":
                plain = mean
        print(f"consumer / plain TTFT: {mean / plain:.2f}x; store: {len(stored)} blocks, "
              f"{sum(p.stat().st_size for p in stored) / 2**20:.1f} MiB")
    finally:
        shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    main()

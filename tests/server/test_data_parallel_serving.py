"""``pagellm serve --data-parallel-size 2``: two engine cores behind one server, each on its own CPU. Through the
OpenAI SDK it answers as the one-core server does, its metrics read as one engine's, and stopping it, or killing
one of its cores, leaves no process behind."""

from __future__ import annotations

import concurrent.futures
import os
import signal
from pathlib import Path
from typing import Callable

import openai
from metrics_utils import scrape, value
from proc_utils import alive, descendants
from server_utils import ServerProcess, engine_cores, engine_idle, wait_until

PROMPTS = [f"Tell me about the number {i}" for i in range(8)]
TWO_CORES = ("--served-model-name", "tiny", "--data-parallel-size", "2")
TWO_THREADS = {"PAGELLM_NUM_THREADS": "2"}  # one for each core


def _ask(base_url: str, prompt: str) -> tuple[str, int, int]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=60)
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                           max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    return reply.choices[0].message.content or "", reply.usage.prompt_tokens, reply.usage.completion_tokens


def test_two_cores_serve_what_one_serves_and_stop_cleanly(start_server: Callable[..., ServerProcess],
                                                          server: ServerProcess, tiny_llama: Path) -> None:
    dp = start_server(tiny_llama, *TWO_CORES, env=TWO_THREADS)
    family = descendants(dp.proc.pid)
    cores = engine_cores(dp)
    assert len(cores) == 2
    first, second = (os.sched_getaffinity(pid) for pid in cores)
    assert first and second and not first & second
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = list(pool.map(lambda p: _ask(dp.base_url, p), PROMPTS))
    assert replies == [_ask(server.base_url, p) for p in PROMPTS]
    wait_until(lambda: engine_idle(dp.base_url), 30, "both cores to be idle")
    samples = scrape(dp.base_url)
    assert value(samples, "pagellm:generation_tokens_total") == sum(r[2] for r in replies) == 12 * len(PROMPTS)
    assert value(samples, "pagellm:prompt_tokens_total") == sum(r[1] for r in replies)
    assert value(samples, "pagellm:num_requests_running") == 0
    per_core = {dict(labels)["engine"]: v for (name, labels), v in samples.items()
                if name == "pagellm:engine_core_num_requests_running"}
    assert per_core == {"0": 0.0, "1": 0.0}  # each core's own gauge, labelled by its index
    assert dp.stop() == 0
    wait_until(lambda: not alive(family), 30, "every process of the server to exit")


def test_killing_one_core_stops_the_server_and_the_other(start_server: Callable[..., ServerProcess],
                                                         tiny_llama: Path) -> None:
    dp = start_server(tiny_llama, *TWO_CORES, env=TWO_THREADS)
    family = descendants(dp.proc.pid)
    doomed, survivor = sorted(engine_cores(dp))
    os.kill(doomed, signal.SIGKILL)
    wait_until(lambda: dp.proc.poll() is not None, 30, "the server to exit")
    assert dp.proc.returncode == 1
    assert "data-parallel engine core" in dp.log()
    wait_until(lambda: not alive(family | {survivor}), 30, "the other core to exit")

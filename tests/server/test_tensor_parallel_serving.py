"""``pagellm serve --tensor-parallel-size 2`` (or ``--pipeline-parallel-size 2``): the engine core (its own process)
runs rank 0 and spawns rank 1; the server answers as the single-rank one does, and stopping it, or killing its
engine core, leaves no process behind."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Callable

import openai
import pytest
from proc_utils import alive, descendants, without_trackers
from server_utils import ServerProcess, engine_cores, wait_until

USES_RAY = True  # one such module at a time across make test's workers (tests/conftest.py: Ray takes one local
# instance, and some of these tests check that none runs)

CHAT = [{"role": "user", "content": "Hello"}]


def _core(server: ServerProcess) -> int:
    (core,) = engine_cores(server)
    return core


def _workers(server: ServerProcess) -> set[int]:
    return without_trackers(descendants(_core(server)))


@pytest.mark.parametrize("flags", [["--tensor-parallel-size", "2"], ["--pipeline-parallel-size", "2"],
                                   ["--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"]],
                         ids=["tensor", "pipeline", "tensor-on-ray"])
def test_two_ranks_serve_what_one_serves_and_stop_cleanly(start_server: Callable[..., ServerProcess],
                                                          server: ServerProcess, tiny_llama: Path,
                                                          flags: list[str]) -> None:
    """On Ray without a cluster, the engine core starts a local Ray instance (rank 1 in its actor), and stopping the
    server ends the instance too."""
    sharded = start_server(tiny_llama, "--served-model-name", "tiny", *flags)
    family = descendants(sharded.proc.pid)
    if "ray" in flags:
        titles = {Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] for pid in alive(family)}
        assert b"ray::RankActor" in titles
    else:
        assert len(_workers(sharded)) == 1  # rank 1, beside the engine core's rank 0
    replies = []
    for base in (sharded.base_url, server.base_url):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=16, temperature=0,
                                               extra_body={"ignore_eos": True})
        replies.append(reply.choices[0].message.content)
    assert replies[0] == replies[1]
    assert sharded.stop() == 0
    wait_until(lambda: not alive(family), 30, "every process of the sharded server to exit")


def test_killing_the_engine_core_takes_its_worker_with_it(start_server: Callable[..., ServerProcess],
                                                          tiny_llama: Path) -> None:
    sharded = start_server(tiny_llama, "--served-model-name", "tiny", "--tensor-parallel-size", "2")
    family = descendants(sharded.proc.pid)
    workers = _workers(sharded)
    assert len(workers) == 1
    os.kill(_core(sharded), signal.SIGKILL)
    wait_until(lambda: sharded.proc.poll() is not None, 30, "the server to exit")
    assert sharded.proc.returncode == 1
    wait_until(lambda: not alive(family | workers), 30, "the orphaned worker to exit")


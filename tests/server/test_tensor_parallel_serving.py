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
from server_utils import ServerProcess, wait_until

CHAT = [{"role": "user", "content": "Hello"}]


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        current = todo.pop()
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                children = [int(p) for p in (task / "children").read_text().split()]
            except OSError:
                continue
            found.update(children)
            todo.extend(children)
    return found


def _plain(pids: set[int]) -> set[int]:
    """Without multiprocessing's resource trackers."""
    return {p for p in pids if b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()}


def _core(server: ServerProcess) -> int:
    (core,) = _plain(set(server.child_pids()))
    return core


def _workers(server: ServerProcess) -> set[int]:
    return _plain(_descendants(_core(server)))


def _alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if Path(f"/proc/{pid}").exists()
            and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]}


@pytest.mark.parametrize("flags", [["--tensor-parallel-size", "2"], ["--pipeline-parallel-size", "2"],
                                   ["--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"]],
                         ids=["tensor", "pipeline", "tensor-on-ray"])
def test_two_ranks_serve_what_one_serves_and_stop_cleanly(start_server: Callable[..., ServerProcess],
                                                          server: ServerProcess, tiny_llama: Path,
                                                          flags: list[str]) -> None:
    """On Ray without a cluster, the engine core starts a local Ray instance (rank 1 in its actor), and stopping the
    server ends the instance too."""
    sharded = start_server(tiny_llama, "--served-model-name", "tiny", *flags)
    family = _descendants(sharded.proc.pid)
    if "ray" in flags:
        titles = {Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] for pid in _alive(family)}
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
    wait_until(lambda: not _alive(family), 30, "every process of the sharded server to exit")


def test_killing_the_engine_core_takes_its_worker_with_it(start_server: Callable[..., ServerProcess],
                                                          tiny_llama: Path) -> None:
    sharded = start_server(tiny_llama, "--served-model-name", "tiny", "--tensor-parallel-size", "2")
    family = _descendants(sharded.proc.pid)
    workers = _workers(sharded)
    assert len(workers) == 1
    os.kill(_core(sharded), signal.SIGKILL)
    wait_until(lambda: sharded.proc.poll() is not None, 30, "the server to exit")
    assert sharded.proc.returncode == 1
    wait_until(lambda: not _alive(family | workers), 30, "the orphaned worker to exit")


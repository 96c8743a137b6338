"""The Ray Serve app (``pagellm.server.ray_serve:build_app``, what ``serve run`` and ``pagellm ray-serve`` deploy) on a
real local Ray instance with Serve's HTTP proxy: it answers the OpenAI SDK as ``pagellm serve`` does (whole and
streamed); under load it scales from one replica to two and back; a replica whose engine core dies is replaced; bad
arguments are refused before any replica starts, naming the flag."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Iterator

import openai
import pytest
import ray
from ray import serve
from server_utils import ServerProcess, _free_port, wait_until

from pagellm.server.ray_serve import APP_NAME, build_app

USES_RAY = True  # one such module at a time across make test's workers (tests/conftest.py: Ray takes one local
# instance, and some of these tests check that none runs)

CHAT = [{"role": "user", "content": "Hello"}]
# The plain test server's engine settings (server_utils.ENGINE_FLAGS; one replica CPU: one thread, as it runs).
ARGS = dict(served_model_name="tiny", dtype="float32", kv_cache_memory="16000000", max_model_len=512,
            min_replicas=1, max_replicas=2, target_ongoing_requests=2, upscale_delay_s=0, downscale_delay_s=2,
            replica_cpus=1)


@pytest.fixture(scope="module")
def serve_url(tiny_llama: Path) -> Iterator[str]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"model": str(tiny_llama), **ARGS}), name=APP_NAME, route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def _replicas() -> list[str]:
    deployment = serve.status().applications[APP_NAME].deployments["PagellmReplica"]
    return [state for state, count in deployment.replica_states.items() for _ in range(count)]


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)


def test_replies_equal_pagellm_serves(serve_url: str, server: ServerProcess) -> None:
    replies = []
    for base in (serve_url, server.base_url):
        client = _client(base)
        whole = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=16, temperature=0,
                                               extra_body={"ignore_eos": True})
        stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=16, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        replies.append((whole.choices[0].message.content, streamed, whole.usage.completion_tokens))
    assert replies[0] == replies[1] and replies[0][2] == 16
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # the app's own 400, through Serve's proxy
        _client(serve_url).completions.create(model="tiny", prompt="Hi", max_tokens=-1)


def test_load_adds_a_replica_and_idleness_removes_it(serve_url: str) -> None:
    assert _replicas() == ["RUNNING"]
    stop = threading.Event()
    failures: list[BaseException] = []

    def load() -> None:
        client = _client(serve_url)
        while not stop.is_set():
            try:
                client.completions.create(model="tiny", prompt="Hello", max_tokens=64, extra_body={"ignore_eos": True})
            except BaseException as exc:  # reported by the test
                failures.append(exc)
                return

    threads = [threading.Thread(target=load, daemon=True) for _ in range(8)]  # 8 in flight, target 2 per replica
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: _replicas().count("RUNNING") == 2, 90, "Serve to add a second replica under load")
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert not failures
    wait_until(lambda: _replicas() == ["RUNNING"], 90, "Serve to remove the idle replica")


def _engine_cores() -> list[int]:
    """The engine core processes of the replicas (each replica actor's child)."""
    replicas = {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p).startswith(
        b"ray::ServeReplica:pagellm:PagellmReplica")}
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(p) in replicas
            and b"multiprocessing" in _cmdline(p) and b"resource_tracker" not in _cmdline(p)]


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def _ppid(proc: Path) -> int:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError):
        return -1


def _one_core_other_than(old: int) -> bool:
    cores = _engine_cores()  # one read of /proc: the old core may vanish between two
    return len(cores) == 1 and cores[0] != old


def test_a_replica_whose_engine_core_died_is_replaced(serve_url: str) -> None:
    # A replica Serve has just removed (the test before) may still be exiting, its engine core with it.
    wait_until(lambda: len(_engine_cores()) == 1, 60, "one replica's engine core")
    (core,) = _engine_cores()
    os.kill(core, signal.SIGKILL)
    wait_until(lambda: _one_core_other_than(core), 90, "Serve to replace the replica whose engine core died")
    wait_until(lambda: _replicas() == ["RUNNING"], 60, "the new replica to run")
    reply = _client(serve_url).completions.create(model="tiny", prompt="Hello", max_tokens=4)
    assert reply.usage.completion_tokens == 4


@pytest.mark.parametrize(("args", "message"), [
    (dict(max_replicas=0), r"need 0 <= --min-replicas \(1\) <= --max-replicas \(0\)"),
    (dict(grpc_port=9000), "--grpc-port is not served under Ray Serve"),
    (dict(dtype="float33"), "dtype"),
    (dict(max_num_seqs="many"), "argument --max-num-seqs: invalid int value: 'many'"),
    (dict(colour="blue", max_replicas=2), "unknown ray-serve arguments: colour;"),
])
def test_bad_arguments_are_refused_by_name(tiny_llama: Path, args: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_app({"model": str(tiny_llama), **args})


def test_the_shipped_serve_config_deploys_this_app() -> None:
    """deploy/ray-serve.yaml is a valid Serve config whose import path and arguments build the app."""
    import yaml
    from ray.serve.schema import ServeDeploySchema

    path = Path(__file__).parents[2] / "deploy" / "ray-serve.yaml"
    config = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    (app,) = config.applications
    assert app.import_path == "pagellm.server.ray_serve:build_app"
    bound = build_app(app.args)
    options = bound._bound_deployment._deployment_config
    assert options.autoscaling_config.max_replicas == app.args["max_replicas"]
    assert options.max_ongoing_requests == app.args["max_ongoing_requests"]



@pytest.mark.parametrize(("scaling", "cpus"), [({"num_replicas": 2}, 4), ({"max_replicas": 4}, 2), ({}, 8),
                                               ({"num_replicas": 2, "replica_cpus": 3}, 3)])
def test_replicas_share_the_clusters_cpus(tiny_llama: Path, scaling: dict, cpus: int) -> None:
    """Without --replica-cpus each replica reserves the cluster's CPUs over the replicas there may be: a fixed
    --num-replicas, else --max-replicas (so all of them fit)."""
    from pagellm.config import EngineConfig
    from pagellm.server.options import ServeOptions
    from pagellm.server.ray_serve import ScalingOptions, deployment

    bound = deployment(EngineConfig.from_kwargs(model=str(tiny_llama)), ServeOptions(), ScalingOptions(**scaling),
                       cluster_cpus=8.0)
    assert bound._bound_deployment.ray_actor_options["num_cpus"] == cpus

"""Tensor parallelism on Ray (``distributed_executor_backend="ray"``: rank 0 in the engine's process, ranks 1..N-1
in Ray actors of a placement group, here on a local Ray instance): greedy tokens equal transformers' with chunked
prefill and prefix hits, over shared memory and over gloo alike; the engine's ``PAGELLM_*`` settings reach the
actors; a cluster too small, a rank that cannot start and a rank that dies each fail with an error that names them,
and leave no actor or placement group behind."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import pytest
import ray
from test_parity import _prompts, assert_greedy_parity, run
from worker_extensions import fail_on, ranks

from pagellm import LLM, SamplingParams
from pagellm.distributed.shm_comm import ShmComm

USES_RAY = True  # one such module at a time across make test's workers (tests/conftest.py: Ray takes one local
# instance, and some of these tests check that none runs)

RAY = dict(dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray")


@pytest.fixture(scope="module", autouse=True)
def ray_instance() -> Iterator[None]:
    # Logical CPUs: a placement group of three one-CPU ranks fits on a two-core machine (they time-share).
    # The rank actors import the tests' own modules (worker_extensions) as a job ships its code: its runtime_env.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}})
    yield
    ray.shutdown()


def _rank_processes(timeout: float = 15.0) -> list[int]:
    """The processes still titled as rank actors once Ray has had ``timeout`` seconds to end them."""
    deadline = time.monotonic() + timeout
    while True:
        pids = []
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and (proc / "cmdline").read_bytes().startswith(b"ray::RankActor"):
                    pids.append(int(proc.name))
            except OSError:  # a process that ended meanwhile
                pass
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.1)


def _live_groups() -> list:
    return [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]


def test_greedy_parity_over_shared_memory_and_gloo(tiny_model_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = tiny_model_factory("qwen2")
    prompts = _prompts(seed=21, shared_prefix=19)
    outputs = []
    for shm in ("1", "0"):
        monkeypatch.setenv("PAGELLM_TP_SHM_COMM", shm)  # read by rank 0 here and, through the actor's env, rank 1
        llm = LLM(str(model_dir), max_num_batched_tokens=40, **RAY)
        try:
            executor = llm.engine.core.executor
            assert [node for node, _ in executor.where] == [ray.get_runtime_context().get_node_id()]
            assert isinstance(executor.worker.parallel.comm, ShmComm) == (shm == "1")
            assert llm.collective_rpc(ranks) == [(0, 2, 0), (1, 2, 0)]  # collective_rpc reaches the actor's rank
            with pytest.raises(RuntimeError, match="collective_rpc failed on rank 1: ValueError: rank 1 was told"):
                llm.collective_rpc(fail_on, args=(1,))
            first = run(llm, prompts)
            assert run(llm, prompts) == first and sum(s.prefix_cache_hits for s in llm.last_stats) > 0
            outputs.append(first)
        finally:
            llm.shutdown()
    assert_greedy_parity(model_dir, prompts, outputs[0])
    assert outputs[1] == outputs[0]
    assert not _rank_processes() and not _live_groups()


def test_a_cluster_too_small_is_refused_by_its_sizes(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGELLM_NUM_THREADS", "6")  # two ranks of three threads: six CPUs, the cluster has four
    with pytest.raises(RuntimeError, match=r"the Ray cluster has 4 CPUs; 2 tensor-parallel ranks of 3 threads "
                                           r"need 6"):
        LLM(str(tiny_llama), **RAY)
    assert not _live_groups()


def test_a_rank_that_cannot_start_fails_the_start_and_cleans_up(tiny_llama: Path) -> None:
    with pytest.raises((ValueError, RuntimeError),
                       match=r"attention heads \(4\) is not divisible by tensor_parallel_size \(3\)"):
        LLM(str(tiny_llama), **{**RAY, "tensor_parallel_size": 3})
    assert not _rank_processes() and not _live_groups()


def test_a_dead_rank_fails_the_next_step_by_name(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), **RAY)
    try:
        (actor,) = llm.engine.core.executor.actors
        ray.kill(actor)
        with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 \(Ray actor\) died"):
            llm.generate(["Hi"], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        llm.shutdown()
    assert not _rank_processes() and not _live_groups()


def test_an_unknown_backend_is_refused(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="distributed_executor_backend='slurm'; use mp or ray"):
        LLM(str(tiny_llama), tensor_parallel_size=2, distributed_executor_backend="slurm")



def test_pipeline_stages_on_ray(tiny_model_factory) -> None:
    """Stage 1 in a Ray actor: hidden states cross over gloo, greedy tokens equal transformers'."""
    model_dir = tiny_model_factory("llama", num_hidden_layers=3, seed=5)
    llm = LLM(str(model_dir), dtype="float32", pipeline_parallel_size=2, distributed_executor_backend="ray")
    try:
        prompts = _prompts(seed=24)
        assert_greedy_parity(model_dir, prompts, run(llm, prompts))
    finally:
        llm.shutdown()
    assert not _rank_processes() and not _live_groups()

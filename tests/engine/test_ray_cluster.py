"""Ranks on two nodes of a Ray cluster (``ray.cluster_utils.Cluster``: a head and a worker node, each with its own
raylet, on this machine): tensor-parallel rank 1's actor lands on the other node, so the ranks meet over gloo at the
node's address rather than in shared memory; two pipeline stages of two tensor-parallel ranks take a node each (the
layout of a model too large for one machine); greedy tokens equal transformers' in both."""

from __future__ import annotations

from typing import Iterator

import pytest
import ray
from ray.cluster_utils import Cluster
from test_parity import _prompts, assert_greedy_parity, run

from pagellm import LLM

USES_RAY = True  # one such module at a time across make test's workers (tests/conftest.py: Ray takes one local
# instance, and some of these tests check that none runs)


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Cluster]:
    cluster = Cluster(initialize_head=True, connect=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_ranks_on_two_nodes_meet_over_gloo(two_nodes: Cluster, tiny_model_factory,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGELLM_NUM_THREADS", "4")  # two ranks of two CPUs: one node cannot hold both
    model_dir = tiny_model_factory("llama", seed=4)
    llm = LLM(str(model_dir), dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray",
              max_num_batched_tokens=48)
    try:
        executor = llm.engine.core.executor
        (rank1_node, _), = executor.where
        assert rank1_node != ray.get_runtime_context().get_node_id()  # the head's two CPUs are rank 0's bundle
        assert executor.worker.parallel.comm is None  # not one machine's shared memory: gloo
        prompts = _prompts(seed=23, shared_prefix=17)
        assert_greedy_parity(model_dir, prompts, run(llm, prompts))
    finally:
        llm.shutdown()


def test_pipeline_stages_of_tensor_parallel_ranks_on_two_nodes(two_nodes: Cluster, tiny_model_factory) -> None:
    model_dir = tiny_model_factory("qwen2", num_hidden_layers=3, seed=7)
    llm = LLM(str(model_dir), dtype="float32", tensor_parallel_size=2, pipeline_parallel_size=2,
              distributed_executor_backend="ray", max_num_batched_tokens=48)
    try:
        executor = llm.engine.core.executor
        head = ray.get_runtime_context().get_node_id()
        assert [node == head for node, _ in executor.where] == [True, False, False]  # stage 0 here, stage 1 there
        prompts = _prompts(seed=25, shared_prefix=17)
        assert_greedy_parity(model_dir, prompts, run(llm, prompts))
    finally:
        llm.shutdown()

"""Tensor-parallel ranks on two nodes of a Ray cluster (``ray.cluster_utils.Cluster``: a head and a worker node, each
with its own raylet, on this machine): rank 1's actor lands on the other node, so the ranks meet over gloo at the
node's address rather than in shared memory, and greedy tokens still equal transformers'."""

from __future__ import annotations

from typing import Iterator

import pytest
import ray
from ray.cluster_utils import Cluster
from test_parity import _prompts, assert_greedy_parity, run

from pagellm import LLM


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Cluster]:
    cluster = Cluster(initialize_head=True, connect=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_ranks_on_two_nodes_meet_over_gloo(two_nodes: Cluster, tiny_model_factory) -> None:
    model_dir = tiny_model_factory("llama", seed=4)
    llm = LLM(str(model_dir), dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray",
              max_num_batched_tokens=48)
    try:
        executor = llm.engine.core.executor
        (rank1_node, _), = executor.where
        assert rank1_node != ray.get_runtime_context().get_node_id()  # the head's one CPU is rank 0's bundle
        assert executor.worker.parallel.comm is None  # not one machine's shared memory: gloo
        prompts = _prompts(seed=23, shared_prefix=17)
        assert_greedy_parity(model_dir, prompts, run(llm, prompts))
    finally:
        llm.shutdown()

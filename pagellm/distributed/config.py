"""How the engine's ranks are laid out (``EngineConfig.parallel_config``; the ranks themselves are ``executor/``,
their collectives ``groups.py``). No torch here: the frontend reads it before anything starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _help(text: str, **kwargs: Any) -> Any:
    return field(metadata={"help": text}, **kwargs)  # the CLI's flag help (``engine_args.py``)


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (every layer split over ranks) or pipeline parallelism (the layers split into stages), each
    rank a process with its share of the threads: worker processes of this machine (``executor/multiproc.py``) or
    Ray actors, on any node of a Ray cluster (``executor/ray.py``)."""

    tensor_parallel_size: int = _help("Number of tensor-parallel ranks (worker processes); the attention heads, "
                                      "key/value heads, MLP width and vocabulary must divide by it.", default=1)
    pipeline_parallel_size: int = _help(
        "Number of pipeline stages (worker processes), each holding consecutive decoder layers and their KV cache; "
        "for a model larger than one machine's memory (stages run one after another within a step).", default=1)
    enable_expert_parallel: bool = _help(
        "Mixtures of experts: give each tensor-parallel rank whole experts (a 1/N share of them) instead of a 1/N "
        "slice of every expert; no effect on dense models.", default=False)
    distributed_executor_backend: str = _help(
        "Where ranks 1..N-1 run: 'mp' (worker processes of this machine, fed through shared memory) or 'ray' (Ray "
        "actors placed by a placement group on the cluster RAY_ADDRESS names, else on a local Ray instance; needs "
        "pip install 'pagellm[ray]').", default="mp")
    data_parallel_size: int = _help(
        "Number of engine cores behind one server, each a whole copy of the model (times its tensor/pipeline ranks) "
        "with its own scheduler and KV cache (kv_cache_memory each); a request goes to the core with the fewest "
        "unfinished requests, or to the one that was given its prompt's leading blocks while that one is not much "
        "busier. The CPUs this process may use (and PAGELLM_NUM_THREADS) are split among them. Serving only "
        "(pagellm serve, AsyncLLM).", default=1)

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(f"distributed_executor_backend={self.distributed_executor_backend!r}; use mp or ray")
        if self.data_parallel_size > 1 and self.world_size > 1 and self.distributed_executor_backend == "ray":
            raise ValueError("data_parallel_size > 1 runs each core's ranks as worker processes of this machine "
                             "(distributed_executor_backend mp); across a Ray cluster, serve replicas with "
                             "pagellm ray-serve")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def describe(self) -> str:
        """The parallel sizes that are set, as their flags read (for errors)."""
        sizes = [f"{name}={getattr(self, name)}" for name in ("tensor_parallel_size", "pipeline_parallel_size")
                 if getattr(self, name) > 1]
        return " and ".join(sizes) or "tensor_parallel_size=1"

    def check_engine(self, self_drafting: bool) -> None:
        """What parallel ranks do not split yet is refused, naming the way out (``self_drafting``: a draft model
        made of the target's first layers)."""
        if self.world_size == 1:
            return
        size = self.describe()
        if self_drafting and self.pipeline_parallel_size > 1:
            raise ValueError(f"draft_model with draft_layers (the target's first layers) does not run with {size}; "
                             "give a draft 'model', or use ngram, medusa or eagle")

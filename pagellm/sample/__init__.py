"""Token selection on the worker: the batched sampler and its per-step tensors.

Only the stable entry points are re-exported here; helpers stay importable from their modules.
"""

from pagellm.sample.sampler import Sampler, SamplingTensors

__all__ = ["Sampler", "SamplingTensors"]

"""Typed messages between the frontend and the engine core: tokenized requests in, token-id deltas out."""

from __future__ import annotations

import msgspec

from pagellm.metrics.stats import SchedulerStats
from pagellm.sampling_params import SamplingParams
from pagellm.sched.output import EngineCoreOutput

__all__ = ["EngineCoreRequest", "EngineCoreOutput", "EngineCoreOutputs"]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats | None = None

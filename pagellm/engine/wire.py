"""Typed messages between the frontend and the engine core: tokenized requests in, token-id deltas out.

In process (``InprocClient``) these structs are passed as objects. Across processes (``core_proc`` ↔
``MPClient``) each ZMQ message is one msgpack-encoded struct:

- frontend → core: one ``EngineCoreInput`` (``AddRequests``, ``AbortRequests`` or ``UtilityCall``), tagged so the
  core decodes the union in one step; messages are applied in the order they were sent.
- core → frontend: first one ``EngineCoreHandshake`` (the ``RuntimeInfo``, or the start-up error), then only
  ``EngineCoreOutputs``: one per step (its ``StepOutput``: every request's token-id deltas as parallel lists, see
  ``sched/output.py``), plus one per utility reply or refused request, plus a last one carrying ``engine_error``
  when the core is about to exit because of an error.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

from pagellm.metrics.stats import SchedulerStats
from pagellm.multimodal import MultiModalInputs
from pagellm.prompt_embeds import PromptEmbeds
from pagellm.sampling_params import SamplingParams
from pagellm.sched.output import StepOutput
from pagellm.worker.runtime import RuntimeInfo

__all__ = ["EngineCoreRequest", "StepOutput", "EngineCoreOutputs", "AddRequests", "AbortRequests",
           "UtilityCall", "UtilityMethod", "UtilityResult", "RequestError", "EngineCoreInput",
           "EngineCoreHandshake", "UTILITY_RESULT_TYPES"]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    prompt_embeds: PromptEmbeds | None = None  # an embeddings prompt: its rows (prompt_token_ids: placeholders)
    mm_inputs: MultiModalInputs | None = None  # a vision-language model's images (``multimodal.py``)


class RequestError(msgspec.Struct, array_like=True):
    """The core refused one request (it was never queued); ``error_type`` is the exception's class name."""

    request_id: str
    error_type: str
    message: str


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):
    """The reply to one ``UtilityCall``: ``result`` is the msgpack of a ``UTILITY_RESULT_TYPES[method]`` value."""

    call_id: int
    result: bytes = b""
    error: str | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    step: StepOutput = msgspec.field(default_factory=StepOutput)   # empty unless the message reports a step
    stats: SchedulerStats | None = None
    errors: list[RequestError] = []
    utility_results: list[UtilityResult] = []
    engine_error: str | None = None  # the core hit this error and is exiting; every request is lost


class AddRequests(msgspec.Struct, tag="add", array_like=True):
    requests: list[EngineCoreRequest]


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


UtilityMethod = Literal["get_stats", "reset_prefix_cache", "num_free_blocks", "start_profile", "stop_profile",
                        "sleep", "wake_up", "is_sleeping", "update_weights", "collective_rpc", "pause", "resume"]
# What each utility returns (the frontend decodes ``UtilityResult.result`` with it).
UTILITY_RESULT_TYPES: dict[str, type] = {"get_stats": SchedulerStats, "reset_prefix_cache": bool,
                                         "num_free_blocks": int, "start_profile": bool, "stop_profile": list[str],
                                         "sleep": bool, "wake_up": bool, "is_sleeping": bool, "update_weights": bool,
                                         "collective_rpc": bytes,  # the pickled list of the ranks' results
                                         "pause": bool, "resume": bool}


class UtilityCall(msgspec.Struct, tag="utility", array_like=True):
    call_id: int
    method: UtilityMethod
    args: list[Any] = []  # the method's arguments (msgpack values)


EngineCoreInput = Union[AddRequests, AbortRequests, UtilityCall]


class EngineCoreHandshake(msgspec.Struct, array_like=True, omit_defaults=True):
    """The core's first message: its ``RuntimeInfo`` when it started, else why it could not."""

    runtime: RuntimeInfo | None = None
    error_type: str | None = None
    error: str | None = None

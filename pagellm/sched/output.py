"""Plain data passed between the scheduler and the workers each step.

The scheduler sends deltas: a request's full data once (``NewRequestData``, also when it resumes after
preemption), then only its new block ids and counts (``CachedRequestData``). Workers answer with the tokens they
sampled and any draft tokens for the next step (``ModelRunnerOutput``).
"""

from __future__ import annotations

import msgspec

from pagellm.request import FinishReason
from pagellm.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    req_id: str
    token_ids: list[int]          # prompt + outputs so far (outputs exist when resuming after preemption)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int      # tokens already in the KV cache (prefix hits) before this step
    stop_token_ids: list[int] = []  # tokens to suppress while fewer than min_tokens were generated


class CachedRequestData(msgspec.Struct, array_like=True):
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int      # before this step; lower than the worker thinks after rejected drafts


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]   # per request, in batch order (new requests after running ones)
    total_num_scheduled_tokens: int
    spec_token_ids: dict[str, list[int]] = {}   # draft tokens scheduled for verification this step
    finished_req_ids: list[str] = []            # finished, aborted or preempted since the last step: drop state

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    req_ids: list[str]
    sampled_token_ids: list[list[int]]      # per request: [] mid-prompt, 1 token, or accepted drafts + 1
    draft_token_ids: dict[str, list[int]] = {}  # proposals to verify next step


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's news from one step: token-id deltas and, at the end, why it finished."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

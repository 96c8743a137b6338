"""Plain data passed between the scheduler and the workers each step.

The scheduler sends deltas: a request's full data once (``NewRequestData``, also when it resumes after
preemption), then only its counts and any new block ids (``CachedRequestData``: one struct of parallel lists
for all running requests of the step, not one object per request, so a step costs no per-request allocations).
Workers answer with the tokens they sampled and any draft tokens for the next step (``ModelRunnerOutput``).
"""

from __future__ import annotations

import msgspec

from pagellm.metrics.stats import RequestTimes
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


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """The running (already known) requests scheduled this step, in batch order, as parallel lists."""

    req_ids: list[str] = msgspec.field(default_factory=list)
    # Before this step, per request; lower than the worker thinks after rejected drafts.
    num_computed_tokens: list[int] = msgspec.field(default_factory=list)
    new_block_ids: dict[str, list[int]] = msgspec.field(default_factory=dict)  # only requests that got blocks

    def __len__(self) -> int:
        return len(self.req_ids)


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    new_reqs: list[NewRequestData]
    cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]   # per request, in batch order (new requests after running ones)
    total_num_scheduled_tokens: int
    spec_token_ids: dict[str, list[int]] = {}   # draft tokens scheduled for verification this step
    finished_req_ids: list[str] = []            # finished, aborted or preempted since the last step: drop state

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of one request's new tokens: parallel lists with one entry per token, in output order.

    Values are ``log_softmax`` of the raw logits (before temperature, top-k/top-p/min-p and min_tokens bans).
    ``top_ids[i]`` / ``top_logprobs[i]`` are the request's top-``logprobs`` tokens at position i, most likely
    first (so their ranks are 1..k); ``sampled_ranks[i]`` is 1 + the number of tokens strictly more likely.
    """

    sampled_logprobs: list[float]
    sampled_ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    # Prompt logprobs only: the prompt index of the first entry's token (a request recomputed after preemption
    # sends its prompt again from the start, and the frontend overwrites from here).
    start: int = 0

    def __len__(self) -> int:
        return len(self.sampled_logprobs)

    def head(self, n: int) -> TokenLogprobs:
        """The first ``n`` tokens' entries (all of them when ``n`` >= the length)."""
        if n >= len(self):
            return self
        return TokenLogprobs(self.sampled_logprobs[:n], self.sampled_ranks[:n], self.top_ids[:n],
                             self.top_logprobs[:n])


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    req_ids: list[str]
    sampled_token_ids: list[list[int]]      # per request: [] mid-prompt, 1 token, or accepted drafts + 1
    draft_token_ids: dict[str, list[int]] = {}  # proposals to verify next step
    logprobs: dict[str, TokenLogprobs] = {}     # for requests that asked: one entry per sampled token
    prompt_logprobs: dict[str, TokenLogprobs] = {}  # prompt_logprobs requests: one entry per prompt token scored


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's news from one step: token-id deltas and, at the end, why it finished."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    new_logprobs: TokenLogprobs | None = None   # one entry per new token when the request asked for logprobs
    times: RequestTimes | None = None           # core-side timings, on the request's first output tokens only
    # prompt_logprobs: entries for the next prompt tokens (from the second on), in prompt order, chunk by chunk
    new_prompt_logprobs: TokenLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

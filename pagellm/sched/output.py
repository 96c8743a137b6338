"""Plain data passed between the scheduler, the workers and the frontend each step.

The scheduler sends deltas: a request's full data once (``NewRequestData``, also when it resumes after
preemption), then only its counts and any new block ids (``CachedRequestData``: one struct of parallel lists
for all running requests of the step, not one object per request, so a step costs no per-request allocations).
``SchedulerOutput.req_ids`` / ``num_scheduled_tokens`` give the step's batch order (running requests, then new
ones). Workers answer with the tokens they sampled, back to back in batch order with one count per request, and
any draft tokens for the next step (``ModelRunnerOutput``). The scheduler reports the step to the frontend the same
way (``StepOutput``): parallel lists for the requests with news, their new tokens back to back, and sparse maps
for what only some requests have (a finish, logprobs, first-output times).
"""

from __future__ import annotations

import msgspec

from pagellm.metrics.stats import RequestTimes
from pagellm.multimodal import MultiModalInputs
from pagellm.prompt_embeds import PromptEmbeds
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
    kv_load_block_ids: list[int] = []  # blocks to fill from the KV connector's store before this step runs
    kv_load_hashes: list[bytes] = []    # their prefix-cache hashes (the stored blocks' names)
    prompt_embeds: PromptEmbeds | None = None  # an embeddings prompt's rows (its token ids are placeholders)
    mm_inputs: MultiModalInputs | None = None  # its images, for the vision encoder


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
    req_ids: list[str]                     # the batch order: cached_reqs.req_ids, then the new requests
    num_scheduled_tokens: list[int]        # parallel to req_ids
    total_num_scheduled_tokens: int
    spec_token_ids: dict[str, list[int]] = {}   # draft tokens scheduled for verification this step
    finished_req_ids: list[str] = []            # finished, aborted or preempted since the last step: drop state

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    def scheduled(self) -> dict[str, int]:
        """``{request id: tokens scheduled}`` in batch order (for inspection; the hot paths use the lists)."""
        return dict(zip(self.req_ids, self.num_scheduled_tokens))


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of one request's new tokens: parallel lists with one entry per token, in output order.

    Values are ``log_softmax`` of the raw logits (before temperature, top-k/top-p/min-p and min_tokens bans).
    ``top_ids[i]`` / ``top_logprobs[i]`` are the request's top-``logprobs`` tokens at position i, most likely
    first (so their ranks are 1..k); ``sampled_ranks[i]`` is 1 + the number of tokens strictly more likely.
    With ``logprob_token_ids`` the ``top_*`` lists hold those tokens instead, in the order asked, and ``top_ranks``
    their ranks (None: the top-k's 1..k).
    """

    sampled_logprobs: list[float]
    sampled_ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    # Prompt logprobs only: the prompt index of the first entry's token (a request recomputed after preemption
    # sends its prompt again from the start, and the frontend overwrites from here).
    start: int = 0
    top_ranks: list[list[int]] | None = None

    def __len__(self) -> int:
        return len(self.sampled_logprobs)

    def head(self, n: int) -> TokenLogprobs:
        """The first ``n`` tokens' entries (all of them when ``n`` >= the length)."""
        if n >= len(self):
            return self
        return TokenLogprobs(self.sampled_logprobs[:n], self.sampled_ranks[:n], self.top_ids[:n],
                             self.top_logprobs[:n], self.start,
                             self.top_ranks[:n] if self.top_ranks is not None else None)


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What the workers sampled, in the batch order of the ``SchedulerOutput`` they ran.

    Request ``req_ids[i]`` sampled ``num_sampled[i]`` tokens (0 mid-prompt, 1, or accepted drafts + 1); the tokens
    of all requests sit back to back in ``sampled_token_ids``.
    """

    req_ids: list[str]
    num_sampled: list[int]
    sampled_token_ids: list[int]
    draft_token_ids: dict[str, list[int]] = {}  # proposals to verify next step
    logprobs: dict[str, TokenLogprobs] = {}     # for requests that asked: one entry per sampled token
    prompt_logprobs: dict[str, TokenLogprobs] = {}  # prompt_logprobs requests: one entry per prompt token scored
    pooled: dict[str, bytes] = {}  # pooling requests: the last prompt token's final hidden state, float32 bytes

    @classmethod
    def from_rows(cls, req_ids: list[str], rows: list[list[int]], draft_token_ids: dict[str, list[int]] | None = None,
                  logprobs: dict[str, TokenLogprobs] | None = None,
                  prompt_logprobs: dict[str, TokenLogprobs] | None = None,
                  pooled: dict[str, bytes] | None = None) -> ModelRunnerOutput:
        """Built from one token list per request."""
        return cls(req_ids, [len(row) for row in rows], [token for row in rows for token in row],
                   draft_token_ids or {}, logprobs or {}, prompt_logprobs or {}, pooled or {})

    def rows(self) -> list[list[int]]:
        """One token list per request (for inspection; the hot paths use the flat list)."""
        return _split(self.sampled_token_ids, self.num_sampled)


class FirstOutput(msgspec.Struct, array_like=True):
    """Sent once per request, with its first output tokens."""

    num_cached_tokens: int    # prefix-cache hit length of its first schedule
    times: RequestTimes       # core-side timings


class StepOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """Every request's news from one step: token-id deltas and, at the end, why it finished.

    Request ``req_ids[i]`` got ``num_new_tokens[i]`` tokens (0 only for a prompt chunk scored for
    prompt_logprobs); the tokens of all requests sit back to back in ``new_token_ids``. The maps hold only the
    requests they concern.
    """

    req_ids: list[str] = []
    num_new_tokens: list[int] = []
    new_token_ids: list[int] = []
    finish_reasons: dict[str, FinishReason] = {}
    stop_reasons: dict[str, int] = {}              # requests ended by one of their stop_token_ids
    logprobs: dict[str, TokenLogprobs] = {}        # one entry per new token, for requests that asked
    # prompt_logprobs: entries for the next prompt tokens (from the second on), in prompt order, chunk by chunk
    prompt_logprobs: dict[str, TokenLogprobs] = {}
    first: dict[str, FirstOutput] = {}             # requests whose first output tokens are in this step
    pooled: dict[str, bytes] = {}                  # pooling requests: float32 bytes of the last prompt hidden state
    spec_counts: dict[str, tuple[int, int]] = {}   # requests that verified drafts this step: (drafted, accepted)

    def __len__(self) -> int:
        return len(self.req_ids)

    def rows(self) -> list[list[int]]:
        """One token list per request (for inspection; the frontend walks the flat list)."""
        return _split(self.new_token_ids, self.num_new_tokens)


def _split(flat: list[int], counts: list[int]) -> list[list[int]]:
    rows, start = [], 0
    for count in counts:
        rows.append(flat[start:start + count])
        start += count
    return rows

"""Request state inside the engine core: tokens, progress, status and finish reasons.

A request's ``num_computed_tokens`` chases ``num_tokens`` (prompt + output) plus any draft tokens; that single
counter is the whole scheduling state (no prefill/decode phases). It exists only while the request runs, so it
lives with the other per-step counters in the scheduler's ``sched.running.RunningBatch``; a request that is not
running has computed nothing. No torch here.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, NamedTuple, NewType

if TYPE_CHECKING:
    from pagellm.multimodal import MultiModalInputs
    from pagellm.prompt_embeds import PromptEmbeds
    from pagellm.sampling_params import SamplingParams

RequestId = NewType("RequestId", str)
BlockHash = NewType("BlockHash", bytes)


class FinishReason(enum.IntEnum):
    """Why a request ended; ``str()`` gives the OpenAI spelling."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    REPETITION = 4  # the output repeated a pattern (``repetition.py``; vLLM's number for it)

    def __str__(self) -> str:
        return self.name.lower()


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}

# A request's ``cache_salt`` joins with "/" the parts that keep its KV blocks apart (the input processor's): first the
# caller's salt, length-prefixed so that no other part can pass for it or for another caller's, then pagellm's own.
_CALLER = "caller-"


class ImageSpan(NamedTuple):
    """One image's (or, where the frontend could not count each image's tokens, all images') tokens in a prompt:
    the first one's position, one past the last one's, and the image's digest."""

    start: int
    end: int
    digest: str


def image_spans(prompt: list[int], image_token: int, images: MultiModalInputs) -> list[ImageSpan]:
    """The spans of a prompt's images: each image's own where ``images.items`` counts each one's tokens (the
    prompt's image tokens in order; ValueError where they are not the prompt's), else one span over all of them,
    keyed by the whole digest."""
    positions = [i for i, token in enumerate(prompt) if token == image_token]
    counts = [count for _, count in images.items]
    if not counts:
        return [ImageSpan(positions[0], positions[-1] + 1, images.digest)]
    if min(counts) < 1 or sum(counts) != len(positions):
        raise ValueError(f"the images' token counts {counts} are not the prompt's {len(positions)} image tokens; "
                         "let the frontend's InputProcessor expand the prompt's placeholders")
    spans, first = [], 0
    for digest, count in images.items:
        spans.append(ImageSpan(positions[first], positions[first + count - 1] + 1, digest))
        first += count
    return spans


def caller_salt_part(salt: str) -> str:
    return f"{_CALLER}{len(salt)}:{salt}"


def caller_salt(cache_salt: str | None) -> str | None:
    """The caller's salt inside a request's ``cache_salt`` (``caller_salt_part``'s inverse), None when it has none."""
    if not cache_salt or not cache_salt.startswith(_CALLER):
        return None
    colon = cache_salt.index(":")
    start = colon + 1
    return cache_salt[start:start + int(cache_salt[len(_CALLER):colon])]


class Request:
    """One generation request as the scheduler and KV manager see it."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float = 0.0,
        priority: int = 0,
        cache_salt: str | None = None,
        max_tokens: int | None = None,
        prompt_embeds: PromptEmbeds | None = None,
        mm_inputs: MultiModalInputs | None = None,
        image_spans: list[ImageSpan] | None = None,
        image_runs: Any = None,
    ) -> None:
        self.request_id = RequestId(request_id)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.prompt_embeds = prompt_embeds  # an embeddings prompt's rows (then the prompt's ids are placeholders)
        self.mm_inputs = mm_inputs  # its images (``multimodal.py``), encoded where its image tokens are computed
        # its images' token spans (``image_spans``): its blocks hash as its text's and the images begun before
        # each block's end (``kv/manager.py``)
        self.image_spans = image_spans
        # [runs, 2] its runs of image tokens, where no step may end inside one (``sched/whole_images.py``), else None
        self.image_runs = image_runs
        # The engine resolves max_tokens=None to what max_model_len leaves.
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        self.status = RequestStatus.WAITING
        # Prompt + outputs; only ever appended to (outputs may be cut back by a stop rule, never the prompt). The
        # prompt is not kept in a list of its own: freeing a finished request then drops each token once.
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.all_token_ids)
        self.spec_token_ids: list[int] = []
        self.num_cached_tokens = -1  # prefix-cache hit length of the first schedule; -1 until scheduled
        self.num_preemptions = 0
        self.num_draft_tokens = 0           # speculative drafts verified for it, and how many of them held
        self.num_accepted_draft_tokens = 0
        self.block_hashes: list[BlockHash] = []
        self.stop_reason: int | None = None
        self.queued_time = 0.0      # wall clock, set by the scheduler (metrics: queue and prefill time)
        # Set by the scheduler on arrival so the per-step stop test is one set look-up and one comparison:
        self.stop_ids: frozenset[int] = frozenset()  # tokens that may end the request (EOS unless ignored, stops)
        self.length_limit = 0                        # num_tokens at which max_tokens / max_model_len is reached
        self.scheduled_time = 0.0   # first admission into the running batch

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens})"

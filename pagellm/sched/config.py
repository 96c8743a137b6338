"""The token-budget scheduler's settings (``EngineConfig.scheduler_config``; the scheduler itself is
``scheduler.py``). No torch here: the frontend reads them before anything starts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def _help(text: str, **kwargs: Any) -> Any:
    return field(metadata={"help": text}, **kwargs)  # the CLI's flag help (``engine_args.py``)


OFFLINE_TOKEN_BUDGET = 4096
SERVING_TOKEN_BUDGET = 2048


@dataclass(frozen=True)
class SchedulerConfig:
    """The token-budget scheduler."""

    max_num_seqs: int = _help("Most requests running in one step.", default=256)
    max_num_batched_tokens: int | None = _help(
        "Token budget of one step (default 4096 offline, 2048 in the servers; with chunked prefill off, at least "
        "max_model_len).", default=None
    )
    enable_chunked_prefill: bool = _help("Split long prompts across steps to fill the token budget.",
                                         default=True)
    scheduling_policy: str = _help("fcfs (first come, first served) or priority (lower value first).",
                                   default="fcfs")
    long_prefill_token_threshold: int = _help(
        "The most tokens one request computes in a step (vLLM's flag): a long prompt's chunks then leave room in "
        "each step for other requests' prompts and tokens. 0: no limit but the step's budget.", default=0)
    max_num_queued_reqs: int | None = _help(
        "Most requests in flight (waiting or running) in a server (vLLM's flag); past it a new request is refused "
        "with HTTP 503, for a load balancer to retry elsewhere. Default: no limit.", default=None)
    max_num_queued_tokens: int | None = _help(
        "Most prompt tokens of requests still waiting for their first token, in a server (vLLM's flag, a TTFT "
        "guard: about the TTFT target times the prefill rate); while the backlog is at it, a new request is refused "
        "with HTTP 503. Default: no limit.", default=None)
    max_num_active_seqs: int | None = _help(
        "Most requests running at once, at most max_num_seqs (vLLM's flag): smaller decode batches. Default: "
        "max_num_seqs.", default=None)
    max_num_scheduled_tokens: int | None = _help(
        "Most tokens the scheduler hands out in one step, at most max_num_batched_tokens (vLLM's flag; drafts "
        "count in it). Default: max_num_batched_tokens.", default=None)
    scheduler_reserve_full_isl: bool = _help(
        "Admit a request only when the KV cache has room for its whole prompt (vLLM's flag), not its first chunk "
        "alone: no long prompt starts into a cache that cannot hold it, to be preempted half way.", default=True)
    watermark: float = _help(
        "The fraction of KV cache blocks an admission leaves free while other requests run (vLLM's flag), headroom "
        "against preempting them as they grow. 0: none.", default=0.0)
    disable_chunked_mm_input: bool = _help(
        "Never end a step inside a prompt's image (vLLM's flag): each run of image tokens (an image, or a tile of "
        "one) is computed in one step, a chunk cut back to before it where the step has no room for all of it. "
        "Always on for a model whose image tokens attend both ways (Gemma 3).", default=False)
    enable_logging_iteration_details: bool = _help(
        "Log a line per engine step (vLLM's flag): its requests and tokens in the context (prompt) and generation "
        "phases, its elapsed time and the KV cache's usage.", default=False)
    stream_interval: int = _help(
        "New tokens per streamed output (vLLM's flag): each stream sends its first token at once, then every N "
        "tokens and its last; larger values send fewer, larger chunks. A request's own stream_interval may raise "
        "it.", default=1)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0 (0 = no limit), got "
                             f"{self.long_prefill_token_threshold}")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold splits prompts into chunks: it needs enable_chunked_prefill")
        for name in ("max_num_queued_reqs", "max_num_queued_tokens", "max_num_active_seqs",
                     "max_num_scheduled_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (or unset: no limit), got {getattr(self, name)}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1) (a fraction of the KV cache's blocks), got {self.watermark}")
        if self.max_num_active_seqs is not None and self.max_num_active_seqs > self.max_num_seqs:
            raise ValueError(f"max_num_active_seqs ({self.max_num_active_seqs}) must be at most max_num_seqs "
                             f"({self.max_num_seqs})")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1 (new tokens per streamed output), got "
                             f"{self.stream_interval}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r}; use 'fcfs' or 'priority'")

    @property
    def active_limit(self) -> int:
        """The most requests running at once (``max_num_active_seqs``, else ``max_num_seqs``)."""
        return self.max_num_active_seqs or self.max_num_seqs

    def token_budget(self, max_model_len: int) -> int:
        """The per-step token budget once the model's context length is known (``max_num_scheduled_tokens`` where
        set)."""
        if self.max_num_batched_tokens is not None:
            budget = self.max_num_batched_tokens
        else:
            budget = OFFLINE_TOKEN_BUDGET if self.enable_chunked_prefill else max(OFFLINE_TOKEN_BUDGET, max_model_len)
        if not self.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"with chunked prefill off, max_num_batched_tokens ({budget}) must be >= max_model_len "
                f"({max_model_len}): raise it, lower max_model_len, or enable chunked prefill"
            )
        scheduled = self.max_num_scheduled_tokens
        if scheduled is not None and scheduled > budget:
            raise ValueError(f"max_num_scheduled_tokens ({scheduled}) must be at most max_num_batched_tokens "
                             f"({budget})")
        if scheduled is not None and not self.enable_chunked_prefill and scheduled < max_model_len:
            raise ValueError(f"with chunked prefill off, max_num_scheduled_tokens ({scheduled}) must be >= "
                             f"max_model_len ({max_model_len})")
        return scheduled or budget

    def for_serving(self) -> SchedulerConfig:
        """This config with the servers' default budget where none was given (chunked prefill on)."""
        if self.max_num_batched_tokens is not None or not self.enable_chunked_prefill:
            return self
        return dataclasses.replace(self, max_num_batched_tokens=SERVING_TOKEN_BUDGET)

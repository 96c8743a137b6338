"""Per-request metrics in the responses themselves (vLLM's ``--enable-per-request-metrics`` and
``--per-request-spec-decode-metrics``): a client that benchmarks or bills by request reads them off each reply
instead of joining Prometheus series.

Contract:
- ``metrics`` sits beside ``usage`` in completion and chat responses, and in a stream's final usage chunk (sent with
  ``stream_options.include_usage`` or ``--enable-force-include-usage``), as vLLM 0.32 sends them; only for a
  request of one prompt and one sample (``n`` 1): the figures describe one generation.
- Timing (``--enable-per-request-metrics``), vLLM's definitions: ``queue_time_ms`` from entering the engine's queue
  to first being scheduled, ``time_to_first_token_ms`` from first scheduled to the first token (the queue not in
  it), ``generation_time_ms`` from the first token to the last, ``mean_itl_ms`` that over the tokens after the first,
  ``tokens_per_second`` every output token over first scheduled to the last token. A figure whose times are
  unknown is null.
- ``speculative_decoding`` (``--per-request-spec-decode-metrics summary|detailed``, with speculative decoding on
  and drafts verified): the histogram of drafts accepted per verify step (index j: the steps that accepted j,
  ``num_spec_tokens`` + 1 long), the mean acceptance length (the bonus token included), the draft acceptance rate,
  the step and token counts; ``detailed`` adds each step's accepted and drafted counts, in order.
"""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel

from pagellm.outputs import RequestMetrics
from pagellm.server.openai.protocol import omitted_when_none

SPEC_LEVELS = ("none", "summary", "detailed")


class SpeculativeDecodingMetrics(BaseModel):
    mean_acceptance_length: float
    draft_acceptance_rate: float
    acceptance_histogram: list[int]
    num_spec_steps: int
    num_accepted_draft_tokens: int
    num_draft_tokens: int
    num_spec_tokens: int
    per_step_accepted: Optional[list[int]] = omitted_when_none()  # ``detailed`` only
    per_step_drafted: Optional[list[int]] = omitted_when_none()


class PerRequestMetrics(BaseModel):
    time_to_first_token_ms: Optional[float] = None
    generation_time_ms: Optional[float] = None
    queue_time_ms: Optional[float] = None
    mean_itl_ms: Optional[float] = None
    tokens_per_second: Optional[float] = None
    speculative_decoding: Optional[SpeculativeDecodingMetrics] = omitted_when_none()


def _ms(start: Optional[float], end: Optional[float]) -> Optional[float]:
    return None if start is None or end is None else (end - start) * 1000


def timing(metrics: RequestMetrics, num_tokens: int) -> PerRequestMetrics:
    """The timing figures of one finished generation of ``num_tokens`` tokens."""
    generation = _ms(metrics.first_token_time, metrics.last_token_time)
    inference = _ms(metrics.scheduled_time, metrics.last_token_time)
    return PerRequestMetrics(
        time_to_first_token_ms=_ms(metrics.scheduled_time, metrics.first_token_time),
        generation_time_ms=generation,
        queue_time_ms=_ms(metrics.queued_time, metrics.scheduled_time),
        mean_itl_ms=generation / (num_tokens - 1) if generation is not None and num_tokens > 1 else None,
        tokens_per_second=num_tokens / inference * 1000 if inference else None)


def speculative(metrics: RequestMetrics, num_spec_tokens: int, detailed: bool) -> Optional[SpeculativeDecodingMetrics]:
    """The acceptance figures of one generation's verify steps (None when it verified none)."""
    steps = metrics.spec_steps
    if not steps:
        return None
    histogram = metrics.spec_histogram + [0] * (num_spec_tokens + 1 - len(metrics.spec_histogram))
    accepted = metrics.num_accepted_draft_tokens
    return SpeculativeDecodingMetrics(
        mean_acceptance_length=1.0 + accepted / len(steps),
        draft_acceptance_rate=accepted / metrics.num_draft_tokens if metrics.num_draft_tokens else 0.0,
        acceptance_histogram=histogram, num_spec_steps=len(steps), num_accepted_draft_tokens=accepted,
        num_draft_tokens=metrics.num_draft_tokens, num_spec_tokens=num_spec_tokens,
        per_step_accepted=[a for _, a in steps] if detailed else None,
        per_step_drafted=[d for d, _ in steps] if detailed else None)


def response_metrics(metrics: Optional[RequestMetrics], num_tokens: int, single: bool, with_timing: bool,
                     spec_level: str, num_spec_tokens: int) -> Optional[PerRequestMetrics]:
    """A response's ``metrics`` (None when none is asked for, or the request was not one generation)."""
    if metrics is None or not single:
        return None
    out = timing(metrics, num_tokens) if with_timing else None
    spec = speculative(metrics, num_spec_tokens, spec_level == "detailed") if spec_level != "none" else None
    if spec is not None:
        out = out or PerRequestMetrics()
        out.speculative_decoding = spec
    return out

"""Plain stats objects produced by the engine core each step; exporters (logs, Prometheus) read them.

No exporter library is imported here, so the core stays free of metrics dependencies.
"""

from __future__ import annotations

import msgspec


class SpecDecodingStats(msgspec.Struct, omit_defaults=True):
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        while len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos.append(0)
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step: the accepted drafts plus the corrected or bonus token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """Per draft position (tree depth), the share of drafts whose token there was accepted."""
        return [n / self.num_drafts for n in self.num_accepted_tokens_per_pos] if self.num_drafts else []


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    """One step's view: gauges are current values, the rest count events during the step."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0          # tokens looked up
    prefix_cache_hits: int = 0             # tokens found
    num_preemptions: int = 0
    num_prompt_tokens: int = 0             # prompt tokens computed (prefix hits excluded)
    num_generation_tokens: int = 0         # tokens sampled and kept
    num_scheduled_tokens: int = 0
    kv_cache_evictions: int = 0
    spec_decoding: SpecDecodingStats | None = None

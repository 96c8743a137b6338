"""Custom logits processors for the tests of ``--logits-processors`` (importable by name: tests/ is on the path)."""

from __future__ import annotations

import torch

from pagellm.sample.custom import AdapterLogitsProcessor
from pagellm.sampling_params import SamplingParams


class TargetToken(AdapterLogitsProcessor):
    """vLLM's example: a request with ``extra_args={"target_token": t}`` can only produce token t."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        target = (params.extra_args or {}).get("target_token")
        if target is not None and (not isinstance(target, int) or isinstance(target, bool) or target < 0):
            raise ValueError(f"target_token must be a token id (an integer >= 0), got {target!r}")

    def new_req_logits_processor(self, params: SamplingParams):
        target = (params.extra_args or {}).get("target_token")
        if target is None:
            return None

        def only_target(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            kept = logits[target].clone()
            logits.fill_(float("-inf"))
            logits[target] = kept
            return logits

        return only_target


class NoPromptTokens(AdapterLogitsProcessor):
    """``extra_args={"no_prompt_tokens": True}``: no token of the prompt may be produced (the three-argument form)."""

    def new_req_logits_processor(self, params: SamplingParams):
        if not (params.extra_args or {}).get("no_prompt_tokens"):
            return None

        def ban_prompt(prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            result = logits.clone()  # a new row, returned (not changed in place)
            result[torch.tensor(sorted(set(prompt_ids)), dtype=torch.int64)] = float("-inf")
            return result

        return ban_prompt


class NoRepeats(AdapterLogitsProcessor):
    """``extra_args={"no_repeats": True}``: no token is produced twice (depends on the output so far)."""

    def new_req_logits_processor(self, params: SamplingParams):
        if not (params.extra_args or {}).get("no_repeats"):
            return None

        def ban_seen(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            if output_ids:
                logits[torch.tensor(output_ids, dtype=torch.int64)] = float("-inf")
            return logits

        return ban_seen


class Sharpen(AdapterLogitsProcessor):
    """Doubles every logit: it never changes the argmax, so greedy requests skip it."""

    def is_argmax_invariant(self) -> bool:
        return True

    def new_req_logits_processor(self, params: SamplingParams):
        return lambda output_ids, logits: logits * 2


class NotAProcessor:
    pass

"""``repetition_detection`` offline: a request whose output starts repeating ends with the token that made it repeat
(finish reason "repetition", as vLLM 0.32's), after ``min_tokens``, also when speculation brings several tokens a
step, and its KV blocks come back."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagellm import LLM, SamplingParams

LOOP = {"max_pattern_size": 2, "min_count": 3}


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}])
def test_a_repeating_output_ends_where_it_repeats(tiny_llama: Path, spec: dict | None) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", speculative_config=spec)
    only_five = dict(temperature=0, max_tokens=40, allowed_token_ids=[5], ignore_eos=True)  # 5 5 5 ...
    params = [SamplingParams(**only_five, repetition_detection=LOOP),
              SamplingParams(**only_five, repetition_detection=LOOP, min_tokens=7),
              SamplingParams(**only_five)]
    results = llm.generate([[1, 2, 3]] * 3, params, use_tqdm=False)
    outs = [out.outputs[0] for out in results]
    assert [(o.token_ids, o.finish_reason, o.stop_reason) for o in outs[:2]] == [
        ([5] * 3, "repetition", "repetition_detected"), ([5] * 7, "repetition", "repetition_detected")]
    assert outs[2].token_ids == [5] * 40 and outs[2].finish_reason == "length"
    assert not llm.llm_engine.has_unfinished_requests()
    kv = llm.engine.core.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    if spec is not None:  # the same tokens get drafts from the third on: the cuts fall inside multi-token steps
        assert results[2].metrics.num_accepted_draft_tokens > 0
        # the frontend ended the second (its repeat): its drafts are counted all the same
        assert results[1].metrics.num_draft_tokens >= results[1].metrics.num_accepted_draft_tokens > 0

"""vLLM's ``LLM.get_metrics()`` with ``disable_log_stats=False``: the offline engine keeps the Prometheus series a
server exposes, read back as Python values (counters, gauges, histograms, and the per-position vector of accepted
draft tokens) that add up to what ran."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from pagellm import LLM, SamplingParams
from pagellm.metrics.reader import Counter, Gauge, Histogram, Vector

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2, 3], [5, 6, 5, 6, 5, 6]]  # repeats, for the n-gram proposer to draft from
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}


def test_get_metrics_adds_up_to_what_ran(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=128, disable_log_stats=False, speculative_config=NGRAM)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    metrics = {(m.name, tuple(sorted(m.labels.items()))): m for m in llm.get_metrics()}

    def one(name: str, kind: type, **labels: str):
        key = (f"pagellm:{name}", tuple(sorted({"model_name": str(tiny_llama), **labels}.items())))
        assert isinstance(metrics[key], kind), metrics[key]
        return metrics[key]

    assert one("prompt_tokens", Counter).value == sum(map(len, PROMPTS))
    assert one("generation_tokens", Counter).value == 10
    assert one("request_success", Counter, finished_reason="length").value == 2
    assert one("num_requests_running", Gauge).value == 0
    e2e = one("e2e_request_latency_seconds", Histogram)
    assert e2e.count == 2 and e2e.sum > 0 and e2e.buckets["+Inf"] == 2
    assert list(e2e.buckets.values()) == sorted(e2e.buckets.values())  # cumulative
    prompt_tokens = one("request_prompt_tokens", Histogram)
    assert prompt_tokens.sum == sum(map(len, PROMPTS)) and prompt_tokens.buckets["5.0"] == 0
    per_position = one("spec_decode_num_accepted_tokens_per_pos", Vector)
    assert len(per_position.values) == 2
    assert sum(per_position.values) == one("spec_decode_num_accepted_tokens", Counter).value
    assert one("spec_decode_num_draft_tokens", Counter).value > 0
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert {(m.name, m.value) for m in llm.get_metrics() if m.name == "pagellm:generation_tokens"} == {
        ("pagellm:generation_tokens", 13)}  # the series go on across calls


def test_without_stats_get_metrics_says_how_to_turn_them_on(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="disable_log_stats=False"):
        llm.get_metrics()


def test_iteration_details_log_a_line_per_step(tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's ``enable_logging_iteration_details``: each step's requests and tokens by phase (a prompt chunk is the
    context phase, a request with output tokens the generation phase), its time and the KV cache's usage."""
    llm = LLM(str(tiny_llama), dtype="float32", enable_logging_iteration_details=True, max_num_batched_tokens=16)
    with caplog.at_level(logging.INFO, logger="pagellm.engine.core"):
        llm.generate([[5] * 20, [6] * 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                     use_tqdm=False)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Iteration(")]
    pattern = re.compile(r"Iteration\((\d+)\): (\d+) context requests, (\d+) context tokens, (\d+) generation "
                         r"requests, (\d+) generation tokens, iteration elapsed time: [\d.]+ ms, KV cache usage: "
                         r"[\d.]+%")
    steps = [tuple(int(g) for g in pattern.fullmatch(line).groups()) for line in lines]
    # 16 tokens a step: the long prompt's first chunk; its rest beside the short prompt; then both generate
    assert steps == [(0, 1, 16, 0, 0), (1, 2, 7, 0, 0), (2, 0, 0, 2, 2), (3, 0, 0, 2, 2)]
    quiet = LLM(str(tiny_llama), dtype="float32")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagellm.engine.core"):
        quiet.generate([[5] * 4], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not [r for r in caplog.records if r.getMessage().startswith("Iteration(")]

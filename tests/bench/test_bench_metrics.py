"""Percentile, TPOT, throughput and goodput math on synthetic timings (exact expectations)."""

from __future__ import annotations

import pytest

from pagellm.bench.client import RequestResult
from pagellm.bench.metrics import compute_metrics, meets_slos, parse_slos, percentile, summarize


def _result(ttft: float, latency: float, out: int, prompt: int = 10, ok: bool = True) -> RequestResult:
    gaps = [(latency - ttft) / (out - 1)] * (out - 1) if out > 1 else []
    return RequestResult(success=ok, prompt_len=prompt, output_len=out, ttft=ttft, latency=latency, itl=gaps)


def test_percentile_interpolates_linearly_between_order_statistics() -> None:
    values = [10.0, 20.0, 30.0, 40.0, 50.0]
    assert percentile(values, 50) == 30.0
    assert percentile(values, 0) == 10.0 and percentile(values, 100) == 50.0
    assert percentile(values, 95) == pytest.approx(48.0)  # rank 0.95 * 4 = 3.8: 40 + 0.8 * 10
    assert percentile([7.0], 99) == 7.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 25) == pytest.approx(1.75)  # unsorted input is sorted first


def test_percentile_rejects_empty_and_out_of_range() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


def test_summarize_converts_seconds_to_milliseconds() -> None:
    stats = summarize("ttft", [0.1, 0.2, 0.3, 0.4], pcts=(50, 99.9))
    assert stats["mean_ttft_ms"] == pytest.approx(250.0)
    assert stats["median_ttft_ms"] == pytest.approx(250.0)
    assert stats["p50_ttft_ms"] == pytest.approx(250.0)
    assert stats["p99.9_ttft_ms"] == pytest.approx(399.7)
    assert stats["std_ttft_ms"] == pytest.approx(111.80339887)
    assert summarize("itl", [])["p95_itl_ms"] == 0.0


def test_tpot_excludes_the_first_token() -> None:
    assert _result(ttft=0.5, latency=1.5, out=11).tpot == pytest.approx(0.1)
    assert _result(ttft=0.5, latency=0.5, out=1).tpot == 0.0


def test_compute_metrics_counts_throughput_over_wall_time() -> None:
    results = [_result(0.1, 1.1, 11, prompt=5), _result(0.3, 2.3, 21, prompt=7), _result(0.0, 0.2, 0, ok=False)]
    m = compute_metrics(results, duration_s=4.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (12, 32)
    assert m["request_throughput"] == 0.5
    assert m["output_throughput"] == 8.0
    assert m["total_token_throughput"] == 11.0
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_tpot_ms"] == pytest.approx(100.0)  # both requests decode at 100 ms per token
    assert m["median_itl_ms"] == pytest.approx(100.0)
    assert m["p99_e2el_ms"] == pytest.approx(1100 + 0.99 * 1200)
    assert "request_goodput" not in m


def test_goodput_counts_only_requests_within_every_slo() -> None:
    results = [_result(0.1, 1.1, 11), _result(0.6, 1.6, 11), _result(0.1, 3.1, 11), _result(0.1, 0.2, 2, ok=False)]
    slos = parse_slos(["ttft:500", "tpot:150"])
    assert slos == {"ttft": 500.0, "tpot": 150.0}
    assert [meets_slos(r, slos) for r in results] == [True, False, False, False]  # TTFT too slow; TPOT 300 ms
    m = compute_metrics(results, duration_s=2.0, slos=slos)
    assert m["goodput_requests"] == 1
    assert m["request_goodput"] == 0.5
    assert compute_metrics(results, 2.0, parse_slos(["e2el:2000"]))["goodput_requests"] == 2


@pytest.mark.parametrize("bad", ["ttft", "latency:5", "tpot:abc", "ttft:-1"])
def test_parse_slos_rejects_malformed(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_slos([bad])


def test_compute_metrics_rejects_zero_duration() -> None:
    with pytest.raises(ValueError, match="positive"):
        compute_metrics([], 0.0)

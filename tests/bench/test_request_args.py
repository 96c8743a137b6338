"""``bench serve``'s load shape and request flags without a server: rate ramps, sampling and extra-body fields,
headers, and the usage errors of each."""

from __future__ import annotations

import argparse
import math

import pytest

from pagellm.bench import request_args, serve
from pagellm.bench.arrivals import Ramp, arrival_gaps, offered_rates, trace_gaps
from pagellm.bench.client import RequestResult
from pagellm.bench.metrics import first_slo_miss


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    return parser.parse_args(list(argv))


def test_a_linear_ramp_steps_evenly_and_an_exponential_one_by_a_constant_factor() -> None:
    assert Ramp("linear", 2.0, 10.0).rates(5) == pytest.approx([2.0, 4.0, 6.0, 8.0, 10.0])
    rates = Ramp("exponential", 1.0, 16.0).rates(5)
    assert rates == pytest.approx([1.0, 2.0, 4.0, 8.0, 16.0])
    assert Ramp("linear", 8.0, 2.0).rates(3) == pytest.approx([8.0, 5.0, 2.0])  # a ramp down is allowed
    assert Ramp("exponential", 3.0, 9.0).rates(1) == [3.0]
    assert offered_rates(3, 5.0, None) == [5.0] * 3


def test_ramp_gaps_follow_the_rate_of_each_requests_place() -> None:
    ramp = Ramp("linear", 1.0, 50.0)
    gaps = arrival_gaps(4000, math.inf, 1.0, 7, ramp)  # the ramp, not the (default, infinite) rate, sets them
    assert gaps == arrival_gaps(4000, math.inf, 1.0, 7, ramp) and all(g > 0 for g in gaps)
    rates = ramp.rates(4000)
    for part in (slice(0, 1000), slice(3000, 4000)):  # each stretch's gaps add up to its expected time
        assert sum(gaps[part]) == pytest.approx(sum(1 / r for r in rates[part]), rel=0.1)
    assert sum(gaps[:1000]) > 5 * sum(gaps[3000:])


@pytest.mark.parametrize("ramp, message", [
    (("steps", 1.0, 2.0), "must be one of linear, exponential"),
    (("linear", 0.0, 2.0), "--ramp-up-start-rps must be a positive"),
    (("exponential", 1.0, math.inf), "--ramp-up-end-rps must be a positive, finite"),
])
def test_bad_ramps_say_which_flag(ramp: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Ramp(*ramp)


@pytest.mark.parametrize("argv, message", [
    (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1"], "needs --ramp-up-start-rps and --ramp-up-end-rps"),
    (["--ramp-up-end-rps", "4"], "need --ramp-up-strategy"),
    (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1", "--ramp-up-end-rps", "4", "--request-rate", "2"],
     "leave --request-rate out"),
])
def test_half_given_ramps_are_usage_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        serve.ramp_of(_args(*argv))


def test_ramp_flags_make_a_ramp() -> None:
    args = _args("--ramp-up-strategy", "exponential", "--ramp-up-start-rps", "0.5", "--ramp-up-end-rps", "8")
    assert serve.ramp_of(args) == Ramp("exponential", 0.5, 8.0)
    assert serve.ramp_of(_args()) is None


def test_sampling_flags_are_sent_only_when_given_and_extra_body_goes_last() -> None:
    assert request_args.extra_body(_args()) == {}
    args = _args("--top-p", "0.9", "--top-k", "20", "--repetition-penalty", "1.1",
                 "--extra-body", '{"top_k": 5, "logprobs": 2, "max_tokens": 3}')
    assert request_args.extra_body(args) == {"top_p": 0.9, "top_k": 5, "repetition_penalty": 1.1, "logprobs": 2,
                                             "max_tokens": 3}


@pytest.mark.parametrize("body, message", [
    ("{'single': 1}", "--extra-body is not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"messages": [], "stream": false}', "may not set stream, messages"),
])
def test_bad_extra_bodies_are_usage_errors(body: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        request_args.extra_body(_args("--extra-body", body))


def test_headers_and_metadata_are_name_value_pairs() -> None:
    args = _args("--header", "X-Tenant=blue", "X-Trace= a=b ", "--header", "X-Empty=", "--metadata", "commit=abc")
    assert request_args.headers(args) == {"X-Tenant": "blue", "X-Trace": " a=b ", "X-Empty": ""}
    assert request_args.pairs(args.metadata, "--metadata") == {"commit": "abc"}
    for bad, message in (("NoValue", "must be NAME=VALUE"), ("=v", "must be NAME=VALUE"),
                         ("X Bad=1", "no spaces or colons"), ("X-Ok=a\r\nEvil: 1", "line break")):
        with pytest.raises(ValueError, match=message):
            request_args.headers(_args("--header", bad))


def test_the_first_slo_miss_is_the_rate_the_first_late_request_was_sent_at() -> None:
    def result(ttft_s: float, success: bool = True) -> RequestResult:
        return RequestResult(success=success, output_len=2, ttft=ttft_s, latency=ttft_s + 0.01)

    rates = [1.0, 2.0, 3.0, 4.0]
    on_time = [result(0.1), result(0.2), result(0.1), result(0.2)]
    assert first_slo_miss(on_time, rates, {"ttft": 500}) is None
    late = [result(0.1), result(0.2), result(0.9), result(0.1)]
    assert first_slo_miss(late, rates, {"ttft": 500}) == 3.0
    failed = [result(0.1), result(0.0, success=False), result(0.9), result(0.1)]
    assert first_slo_miss(failed, rates, {"ttft": 500}) == 2.0  # a failure misses every SLO


def test_a_trace_replays_its_send_times_at_its_speed() -> None:
    assert trace_gaps([0.0, 0.5, 0.5, 2.0], 1.0) == [0.0, 0.5, 0.0, 1.5]
    assert trace_gaps([0.0, 0.5, 0.5, 2.0], 2.0) == [0.0, 0.25, 0.0, 0.75]
    for speed in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="--trace-speed must be a positive number"):
            trace_gaps([0.0], speed)


def test_a_timed_trace_refuses_a_rate_of_its_own(tmp_path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text('{"prompt": "a", "timestamp": 0}\n{"prompt": "b", "timestamp": 1}\n')
    trace = ["--dataset", "custom", "--dataset-path", str(path), "--num-prompts", "2"]
    for extra in (["--request-rate", "4"], ["--burstiness", "0.5"],
                  ["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1", "--ramp-up-end-rps", "2"]):
        with pytest.raises(ValueError, match="a timed trace sends each request when its timestamp says"):
            serve._plan(_args(*trace, *extra))
    with pytest.raises(ValueError, match="--trace-speed must be a positive number"):
        serve._plan(_args(*trace, "--trace-speed", "0"))
    assert serve._plan(_args(*trace, "--trace-speed", "4")).timed

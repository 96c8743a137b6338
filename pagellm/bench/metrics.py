"""Benchmark math on plain timings: percentiles, per-request TPOT, throughput and goodput.

Definitions (all latencies in milliseconds in the output):
- TTFT: send → first content chunk. TPOT (per request): (latency − TTFT) / (output tokens − 1), requests with
  one output token excluded. ITL: every gap between consecutive content chunks, pooled over requests.
  E2EL: send → last byte. Unstreamed requests (``--no-stream``): TTFT = E2EL, and they have no TPOT or ITL.
- Percentiles interpolate linearly between order statistics (numpy's default, as vLLM reports them).
- Throughput divides by the benchmark's wall time (first send → last response). Goodput counts only requests that
  meet every given SLO (``ttft``, ``tpot``, ``e2el`` in ms), per second; under a ramp of the request rate,
  ``first_slo_miss`` is the rate at which the first request missed one.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from pagellm.bench.client import RequestResult

DEFAULT_PERCENTILES = (50.0, 95.0, 99.0)
SLO_NAMES = ("ttft", "tpot", "e2el")


def percentile(values: Sequence[float], pct: float) -> float:
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= pct <= 100.0:
        raise ValueError(f"percentile {pct} must be in [0, 100]")
    return float(np.percentile(np.asarray(values, dtype=np.float64), pct))


def summarize(name: str, values_s: Sequence[float], pcts: Iterable[float] = DEFAULT_PERCENTILES) -> dict[str, float]:
    """``mean_<name>_ms``, ``median_<name>_ms``, ``std_<name>_ms`` and ``p<P>_<name>_ms`` of values in seconds."""
    ms = [v * 1e3 for v in values_s]
    if not ms:
        out = {f"mean_{name}_ms": 0.0, f"median_{name}_ms": 0.0, f"std_{name}_ms": 0.0}
        out.update({f"p{_pct_label(p)}_{name}_ms": 0.0 for p in pcts})
        return out
    out = {f"mean_{name}_ms": float(np.mean(ms)), f"median_{name}_ms": percentile(ms, 50.0),
           f"std_{name}_ms": float(np.std(ms))}
    out.update({f"p{_pct_label(p)}_{name}_ms": percentile(ms, p) for p in pcts})
    return out


def _pct_label(pct: float) -> str:
    return str(int(pct)) if float(pct).is_integer() else str(pct)


def parse_slos(items: Iterable[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` → ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_NAMES:
            raise ValueError(f"SLO {item!r} must be NAME:MS with NAME one of {', '.join(SLO_NAMES)}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"SLO {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] <= 0:
            raise ValueError(f"SLO {item!r} must be positive")
    return slos


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    measured = {"ttft": result.ttft * 1e3, "tpot": result.tpot * 1e3, "e2el": result.latency * 1e3}
    return result.success and all(measured[name] <= limit for name, limit in slos.items())


def first_slo_miss(results: Sequence[RequestResult], offered_rps: Sequence[float],
                   slos: dict[str, float]) -> float | None:
    """The offered rate (requests/s) of the first request, in the order sent, that failed or missed an SLO: under a
    ramp, where the server stops keeping up. None when every request met them."""
    for result, rate in zip(results, offered_rps, strict=True):
        if not meets_slos(result, slos):
            return rate
    return None


def compute_metrics(results: Sequence[RequestResult], duration_s: float, slos: dict[str, float] | None = None,
                    pcts: Iterable[float] = DEFAULT_PERCENTILES) -> dict[str, float | int]:
    """The whole run's figures as a flat dict (the JSON result's ``metrics``)."""
    if duration_s <= 0:
        raise ValueError("duration must be positive")
    pcts = tuple(pcts)
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    metrics: dict[str, float | int] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration_s,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s, "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
    }
    metrics.update(summarize("ttft", [r.ttft for r in ok], pcts))
    metrics.update(summarize("tpot", [r.tpot for r in ok if r.output_len > 1 and r.streamed], pcts))
    metrics.update(summarize("itl", [gap for r in ok for gap in r.itl], pcts))
    metrics.update(summarize("e2el", [r.latency for r in ok], pcts))
    if slos:
        good = sum(1 for r in ok if meets_slos(r, slos))
        metrics["goodput_requests"] = good
        metrics["request_goodput"] = good / duration_s
    return metrics

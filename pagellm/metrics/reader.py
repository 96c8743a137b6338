"""The Prometheus series of an offline engine as Python values (vLLM's ``LLM.get_metrics()``).

``snapshot(registry)`` reads every series of a ``PrometheusSink``'s registry, with its name and labels:
- ``Counter`` (a counter's total, a whole number) and ``Gauge`` (its value);
- ``Histogram``: its observation count, their sum, and the cumulative count per bucket upper bound (``"+Inf"`` last);
- ``Vector``: a counter labelled by ``position`` (the draft tokens accepted at each speculative position), its
  values in position order.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int] = field(default_factory=dict)  # upper bound → observations at or below it


def snapshot(registry: Any) -> list[Metric]:
    """Every series of ``registry`` (a prometheus_client ``CollectorRegistry``), family by family."""
    metrics: list[Metric] = []
    for family in registry.collect():
        if family.type == "counter":
            metrics += _counters(family)
        elif family.type == "gauge":
            metrics += [Gauge(family.name, dict(s.labels), s.value) for s in family.samples]
        elif family.type == "histogram":
            metrics += _histograms(family)
    return metrics


def _counters(family: Any) -> list[Metric]:
    totals = [s for s in family.samples if s.name.endswith("_total")]
    if not any("position" in s.labels for s in totals):
        return [Counter(family.name, dict(s.labels), int(s.value)) for s in totals]
    by_rest: dict[tuple, dict[int, int]] = defaultdict(dict)
    for sample in totals:
        rest = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "position"))
        by_rest[rest][int(sample.labels["position"])] = int(sample.value)
    return [Vector(family.name, dict(rest), [counts[i] for i in sorted(counts)]) for rest, counts in by_rest.items()]


def _histograms(family: Any) -> list[Metric]:
    series: dict[tuple, Histogram] = {}
    for sample in family.samples:
        rest = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
        one = series.setdefault(rest, Histogram(family.name, dict(rest), 0, 0.0))
        if sample.name.endswith("_bucket"):
            one.buckets[sample.labels["le"]] = int(sample.value)
        elif sample.name.endswith("_count"):
            one.count = int(sample.value)
        elif sample.name.endswith("_sum"):
            one.sum = sample.value
    return list(series.values())

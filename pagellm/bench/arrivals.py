"""When ``bench serve`` sends each request: a steady Poisson (or gamma) process, or one whose rate ramps up.

A steady run draws every gap before a request from gamma(shape=burstiness, mean=1/rate): shape 1 is a Poisson
process, below 1 burstier, above 1 more regular; an infinite rate sends everything at once. A ramp (``Ramp``)
moves the offered rate from ``start_rps`` to ``end_rps`` over the run's requests, linearly or geometrically
(``exponential``: the same factor per request), and draws request i's gap at the rate of its place in the run:
how a latency SLO holds as the load grows shows in one run, where a rate sweep needs one run per rate. A timed
trace (``trace_gaps``) replays recorded send times instead, as fast as recorded or ``speed`` times faster.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

RAMP_STRATEGIES = ("linear", "exponential")


@dataclass(frozen=True)
class Ramp:
    strategy: str
    start_rps: float
    end_rps: float

    def __post_init__(self) -> None:
        if self.strategy not in RAMP_STRATEGIES:
            raise ValueError(f"--ramp-up-strategy must be one of {', '.join(RAMP_STRATEGIES)}, not "
                             f"{self.strategy!r}")
        for name, value in (("start", self.start_rps), ("end", self.end_rps)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"--ramp-up-{name}-rps must be a positive, finite number of requests per second "
                                 f"(got {value})")

    def rates(self, num: int) -> list[float]:
        """The offered rate (requests/s) in effect for each of ``num`` requests, from start to end."""
        if num == 1:
            return [self.start_rps]
        steps = [i / (num - 1) for i in range(num)]
        if self.strategy == "linear":
            return [self.start_rps + (self.end_rps - self.start_rps) * t for t in steps]
        return [self.start_rps * (self.end_rps / self.start_rps) ** t for t in steps]

    def as_dict(self) -> dict[str, float | str]:
        return {"strategy": self.strategy, "start_rps": self.start_rps, "end_rps": self.end_rps}


def offered_rates(num: int, rate: float, ramp: Ramp | None) -> list[float]:
    """The rate each request is sent at: the ramp's at its place in the run, else ``rate`` for all."""
    if rate <= 0:
        raise ValueError("--request-rate must be positive (inf for all at once)")
    return ramp.rates(num) if ramp is not None else [rate] * num


def trace_gaps(arrivals: Sequence[float], speed: float) -> list[float]:
    """The gaps that replay a timed trace (send times in seconds after its first request), ``speed`` times as fast."""
    if not (math.isfinite(speed) and speed > 0):
        raise ValueError(f"--trace-speed must be a positive number (1: as recorded), not {speed}")
    return [(now - before) / speed for before, now in zip([0.0, *arrivals], arrivals)]


def arrival_gaps(num: int, rate: float, burstiness: float, seed: int, ramp: Ramp | None = None) -> list[float]:
    """Seconds to wait before each request: gamma(shape=burstiness, mean=1/r) at each request's offered rate r
    (``offered_rates``); zeros at an infinite rate."""
    if burstiness <= 0:
        raise ValueError("--burstiness must be positive")
    rates = offered_rates(num, rate, ramp)
    rng = random.Random(seed)
    return [0.0 if math.isinf(r) else rng.gammavariate(burstiness, 1.0 / (r * burstiness)) for r in rates]

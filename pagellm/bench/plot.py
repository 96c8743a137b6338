"""PNG charts of ``bench serve`` results (one result per system): latency CDFs and sweeps.

- ``latency_cdf[_c<N>|_r<R>].png``: cumulative distributions of TTFT, TPOT and end-to-end latency, one line per
  system, one chart per run of the sweep (concurrency ``N`` or request rate ``R``).
- ``sweep.png`` (when a result has more than one run): output tok/s, TTFT p95 and TPOT p95 against concurrency
  (or request rate), one line per system.
- ``ramp.png`` (runs whose request rate ramped up): each request's TTFT and end-to-end latency against the rate
  offered when it was sent, one series per system and run: where the latency takes off is the rate the server
  stops keeping up with.
Uses matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.ticker  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402


def _run_key(run: dict[str, Any]) -> str:
    if run["max_concurrency"]:
        return f"c{run['max_concurrency']}"
    return f"r{run['request_rate']}"


def _cdf(ax: Any, values_ms: Sequence[float], label: str) -> None:
    if not values_ms:
        return
    xs = np.sort(np.asarray(values_ms))
    ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label, drawstyle="steps-post")


def plot_latency_cdfs(results: Sequence[dict[str, Any]], out_dir: str) -> list[str]:
    keys: list[str] = []
    for result in results:
        keys += [k for k in map(_run_key, result["runs"]) if k not in keys]
    paths = []
    for key in keys:
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        for result in results:
            for run in (r for r in result["runs"] if _run_key(r) == key):
                ok = [r for r in run["requests"] if r["success"]]
                _cdf(axes[0], [r["ttft"] * 1e3 for r in ok], result["label"])
                _cdf(axes[1], [(r["latency"] - r["ttft"]) / (r["output_len"] - 1) * 1e3
                               for r in ok if r["output_len"] > 1 and r.get("streamed", True)], result["label"])
                _cdf(axes[2], [r["latency"] * 1e3 for r in ok], result["label"])
        for ax, title in zip(axes, ("TTFT", "TPOT", "end-to-end latency")):
            ax.set_xlabel(f"{title} (ms)")
            ax.set_ylabel("fraction of requests")
            _finish(ax, f"{title}, {key.replace('c', 'concurrency ', 1) if key[0] == 'c' else 'rate ' + key[1:]}")
        suffix = "" if len(keys) == 1 else f"_{key}"
        paths.append(_save(fig, os.path.join(out_dir, f"latency_cdf{suffix}.png")))
    return paths


def plot_sweep(results: Sequence[dict[str, Any]], out_dir: str) -> str | None:
    if not any(len(r["runs"]) > 1 for r in results):
        return None
    by_concurrency = all(run["max_concurrency"] for r in results for run in r["runs"])
    if not by_concurrency and any(run["request_rate"] in ("ramp", "trace") for r in results for run in r["runs"]):
        return None  # ramps and traces have no one rate to draw them at (ramp.png shows ramps)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for result in results:
        runs = result["runs"]
        xs = _xs(result, by_concurrency)
        for ax, metric in zip(axes, ("output_throughput", "p95_ttft_ms", "p95_tpot_ms")):
            ax.plot(xs, [run["metrics"].get(metric, np.nan) for run in runs], marker="o", label=result["label"])
    for ax, title in zip(axes, ("output tokens/s", "TTFT p95 (ms)", "TPOT p95 (ms)")):
        ax.set_xlabel("max concurrency" if by_concurrency else "request rate (req/s)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({x for r in results for x in _xs(r, by_concurrency)}))
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        _finish(ax, title)
    return _save(fig, os.path.join(out_dir, "sweep.png"))


def plot_ramp(results: Sequence[dict[str, Any]], out_dir: str) -> str | None:
    series = [(result["label"] + (f", concurrency {run['max_concurrency']}" if run["max_concurrency"] else ""), run)
              for result in results for run in result["runs"] if "ramp_up" in run]
    if not series:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, run in series:
        ok = [r for r in run["requests"] if r["success"]]
        rates = [r["offered_rps"] for r in ok]
        axes[0].plot(rates, [r["ttft"] * 1e3 for r in ok], ".", label=label)
        axes[1].plot(rates, [r["latency"] * 1e3 for r in ok], ".", label=label)
    for ax, title in zip(axes, ("TTFT (ms)", "end-to-end latency (ms)")):
        ax.set_xlabel("offered request rate when sent (req/s)")
        _finish(ax, f"{title} as the rate ramps")
    return _save(fig, os.path.join(out_dir, "ramp.png"))


def _finish(ax: Any, title: str) -> None:
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _save(fig: Any, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _xs(result: dict[str, Any], by_concurrency: bool) -> list[float]:
    return [run["max_concurrency"] if by_concurrency else float(run["request_rate"]) for run in result["runs"]]


def plot_serve(results: Sequence[dict[str, Any]], out_dir: str) -> list[str]:
    """Every chart for these results into ``out_dir`` (created); returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = plot_latency_cdfs(results, out_dir)
    return paths + [path for path in (plot_sweep(results, out_dir), plot_ramp(results, out_dir)) if path]


def plot_bars(values: dict[str, float], title: str, ylabel: str, path: str) -> str:
    """A bar per system (e.g. offline throughput)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(values)
    ax.bar(names, [values[n] for n in names], color="tab:blue")
    for i, name in enumerate(names):
        ax.annotate(f"{values[name]:.0f}", (i, values[name]), ha="center", va="bottom")
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    return _save(fig, path)

"""The markdown report and charts of benchmarks/compare.py (tables, targets against vLLM, commands, flags)."""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

from pagellm.bench import plot


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _tidy(command: str, ctx: Any) -> str:
    """Commands as a reader would type them: repository-relative paths, `$MODEL_DIR` for the converted model."""
    repo = str(Path(__file__).resolve().parents[1]) + "/"
    return (command.replace(str(ctx.model_dir), "$MODEL_DIR").replace(sys.executable, ".venv/bin/python")
            .replace(repo, ""))


def _serve_rows(served: list[dict[str, Any]]) -> list[str]:
    rows = ["| system | concurrency | requests ok / failed | output tok/s | TTFT p50 (ms) | TTFT p95 (ms) | "
            "TPOT p50 (ms) | TPOT p95 (ms) | server CPU % | peak RSS (MB) | time to ready (s) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for rec in served:
        if not rec["runs"]:
            rows.append(f"| {rec['system']} | – | – | failed: {rec.get('error', 'no runs')} | | | | | | "
                        f"{rec.get('peak_rss_mb', 0):.0f} | {rec.get('ready_s', float('nan')):.1f} |")
        for run in rec["runs"]:
            m, cpu = run["metrics"], run["cpu"] or {}
            rows.append(
                f"| {rec['system']} | {run['max_concurrency']} | {m['completed']} / {m['failed']} | "
                f"{m['output_throughput']:.1f} | {m['median_ttft_ms']:.0f} | {m['p95_ttft_ms']:.0f} | "
                f"{m['median_tpot_ms']:.1f} | {m['p95_tpot_ms']:.1f} | {cpu.get('mean_cpu_percent', 0):.0f} | "
                f"{rec.get('peak_rss_mb', 0):.0f} | {rec.get('ready_s', float('nan')):.1f} |")
    return rows


def _run_at(served: list[dict[str, Any]], name: str, concurrency: int) -> dict[str, Any] | None:
    for rec in served:
        if rec["system"].startswith(name):
            for run in rec["runs"]:
                if run["max_concurrency"] == concurrency:
                    return run["metrics"]
    return None


def _target_rows(served: list[dict[str, Any]], offline: dict[str, dict[str, Any]], conc: int) -> list[str]:
    rows = ["| target | pagellm | peer | ratio | met |", "|---|---:|---:|---:|---|"]

    def add(what: str, ours: float | None, theirs: float | None, goal: float, higher_better: bool) -> None:
        if ours is None or theirs is None or theirs == 0:
            rows.append(f"| {what} | {ours if ours is not None else 'n/a'} | {theirs if theirs is not None else 'n/a'}"
                        f" | – | not measured |")
            return
        ratio = ours / theirs
        met = ratio >= goal if higher_better else ratio <= goal
        rows.append(f"| {what} | {ours:.1f} | {theirs:.1f} | {ratio:.2f}× | {'yes' if met else 'NO'} |")

    off_ours = offline.get("pagellm", {}).get("output_throughput")
    add("offline output tok/s ≥ 2× vLLM", off_ours, offline.get("vLLM", {}).get("output_throughput"), 2.0, True)
    ours, theirs = _run_at(served, "pagellm", conc), _run_at(served, "vLLM", conc)
    for key, what, goal, higher in (("output_throughput", f"c={conc} output tok/s ≥ 1.5× vLLM", 1.5, True),
                                    ("p95_ttft_ms", f"c={conc} TTFT p95 ≤ 0.5× vLLM", 0.5, False),
                                    ("p95_tpot_ms", f"c={conc} TPOT p95 ≤ 0.7× vLLM", 0.7, False)):
        add(what, ours and ours[key], theirs and theirs[key], goal, higher)
    ours1, llama1 = _run_at(served, "pagellm", 1), _run_at(served, "llama.cpp", 1)
    llama_name = next((r["system"] for r in served if r["system"].startswith("llama.cpp")), "llama.cpp")
    add(f"c=1 TPOT p50 ≤ {llama_name}", ours1 and ours1["median_tpot_ms"], llama1 and llama1["median_tpot_ms"], 1.0,
        False)
    return rows


def write_report(md_path: Path, out: Path, args: argparse.Namespace, ctx: Any, served: list[dict[str, Any]],
                 offline: dict[str, dict[str, Any]], skipped: dict[str, str], command: str | None = None) -> Path:
    charts = plot.plot_serve([{"label": r["system"], "runs": r["runs"]} for r in served if r["runs"]], str(out))
    measured = {k: v["output_throughput"] for k, v in offline.items() if "output_throughput" in v}
    if measured:
        charts.append(plot.plot_bars(measured, f"offline, {args.offline_num_prompts} prompts "
                                               f"{args.input_len} in / {args.output_len} out", "output tokens/s",
                                     str(out / "offline.png")))
    target_c = 32 if 32 in args.concurrency else max(args.concurrency)
    lines = [f"# pagellm vs peers, {md_path.stem}", "",
             f"Machine: {_cpu_name()}, {os.cpu_count()} cores. Model: SmolLM2-135M-Instruct ({ctx.model_dir.name}),"
             f" dtype {ctx.dtype}, {ctx.threads} threads for every system. Workload: random token-id prompts, "
             f"{args.input_len} in / {args.output_len} out, EOS ignored, temperature 1.0, streamed completions.",
             "", "The machine is shared with other engineers' test runs: figures are noisy (10–40 % between runs "
             "here); compare systems within this file only." + (f" {args.notes}" if args.notes else ""), "",
             f"Command: `{command or shlex.join(['python', 'benchmarks/compare.py', *sys.argv[1:]])}`", "",
             "## Serving (`pagellm bench serve`, same sweep for every system)", "", *_serve_rows(served), "",
             "Server CPU % is the mean over the run of the whole process tree (100 = one core); peak RSS is over the "
             "server's whole life (tree sum).", "", "## Offline throughput", "",
             "| system | output tok/s | command |", "|---|---:|---|"]
    for name, rec in offline.items():
        value = f"{rec['output_throughput']:.1f}" if "output_throughput" in rec else f"failed: {rec.get('error')}"
        lines.append(f"| {name} | {value} | `{_tidy(rec['command'], ctx)}` |")
    lines += ["", "llama.cpp has no offline batch mode in this harness.", "", f"## Targets (issue 4; c={target_c})",
              "", *_target_rows(served, offline, target_c), "", "## Flags each system got", ""]
    lines += [f"- **{r['system']}**: {_tidy(r['note'], ctx)}" for r in served]
    lines += [f"- **{name}**: skipped, {why}" for name, why in skipped.items()]
    lines += ["", "## Charts", ""] + [f"![{Path(c).stem}]({out.name}/{Path(c).name})" for c in charts]
    md_path.write_text("\n".join(lines) + "\n")
    return md_path

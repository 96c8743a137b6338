"""The markdown report and charts of benchmarks/compare.py (tables, targets against vLLM, commands, flags)."""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
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


def _rounds(served: list[dict[str, Any]]) -> list[int]:
    return sorted({rec.get("round", 1) for rec in served}) or [1]


def _label(rec: dict[str, Any], served: list[dict[str, Any]]) -> str:
    return f"{rec['system']} r{rec.get('round', 1)}" if len(_rounds(served)) > 1 else rec["system"]


def _serve_rows(served: list[dict[str, Any]]) -> list[str]:
    rows = ["| system | concurrency | requests ok / failed | output tok/s | TTFT p50 (ms) | TTFT p95 (ms) | "
            "TPOT p50 (ms) | TPOT p95 (ms) | server CPU % | peak RSS (MB) | time to ready (s) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for rec in served:
        label = _label(rec, served)
        if not rec["runs"]:
            rows.append(f"| {label} | – | – | failed: {rec.get('error', 'no runs')} | | | | | | "
                        f"{rec.get('peak_rss_mb', 0):.0f} | {rec.get('ready_s', float('nan')):.1f} |")
        for run in rec["runs"]:
            m, cpu = run["metrics"], run["cpu"] or {}
            rows.append(
                f"| {label} | {run['max_concurrency']} | {m['completed']} / {m['failed']} | "
                f"{m['output_throughput']:.1f} | {m['median_ttft_ms']:.0f} | {m['p95_ttft_ms']:.0f} | "
                f"{m['median_tpot_ms']:.1f} | {m['p95_tpot_ms']:.1f} | {cpu.get('mean_cpu_percent', 0):.0f} | "
                f"{rec.get('peak_rss_mb', 0):.0f} | {rec.get('ready_s', float('nan')):.1f} |")
    return rows


def _run_at(served: list[dict[str, Any]], name: str, concurrency: int, round_: int = 1) -> dict[str, Any] | None:
    for rec in served:
        if rec["system"].startswith(name) and rec.get("round", 1) == round_:
            for run in rec["runs"]:
                if run["max_concurrency"] == concurrency:
                    return run["metrics"]
    return None


def _paired(served: list[dict[str, Any]], name: str, peer: str, conc: int, key: str) -> list[tuple[float, float]]:
    """(ours, theirs) for ``key`` in every round where both systems measured it: ratios are taken within a round,
    because the machine drifts between rounds."""
    pairs = []
    for round_ in _rounds(served):
        ours, theirs = _run_at(served, name, conc, round_), _run_at(served, peer, conc, round_)
        if ours and theirs and theirs[key]:
            pairs.append((ours[key], theirs[key]))
    return pairs


def _offline_pairs(offline: dict[str, dict[str, Any]], name: str, peer: str) -> list[tuple[float, float]]:
    """(ours, theirs) offline tok/s in every round where both systems measured it (``rounds``: one figure or None
    per round; a record without rounds is one round of ``output_throughput``)."""
    def per_round(rec: dict[str, Any]) -> list[float | None]:
        return rec.get("rounds") or [rec.get("output_throughput")]

    ours, theirs = per_round(offline.get(name, {})), per_round(offline.get(peer, {}))
    return [(a, b) for a, b in zip(ours, theirs) if a and b]


# The workload issue 4 states its targets for: random prompts, 128 in / 128 out, in bfloat16.
TARGET_WORKLOAD = {"input_len": 128, "output_len": 128, "dtype": "bfloat16"}


def _dataset(args: argparse.Namespace) -> str:
    return getattr(args, "dataset", "random")  # results.json of runs before --dataset existed lack it


def _other_workload(args: argparse.Namespace, ctx: Any) -> str | None:
    """How this run's workload differs from the one the targets are stated for (None: it is that one)."""
    ours = {"input_len": args.input_len, "output_len": args.output_len, "dtype": ctx.dtype}
    diff = [f"{k.replace('_', ' ')} {ours[k]}" for k, v in TARGET_WORKLOAD.items() if ours[k] != v]
    if _dataset(args) != "random":  # its lengths are the dataset's: only the dtype still compares
        diff = [f"the {_dataset(args)} dataset"] + [d for d in diff if d.startswith("dtype")]
    return ", ".join(diff) or None


def _workload(args: argparse.Namespace) -> str:
    """The serving workload in words."""
    dataset, path = _dataset(args), getattr(args, "dataset_path", None)
    what = {
        "random": f"random token-id prompts, {args.input_len} in / {args.output_len} out",
        "prefix": f"random token-id prompts sharing a few {getattr(args, 'prefix_len', 256)}-token prefixes, "
                  f"{args.input_len}-token suffixes, {args.output_len} out",
        "chat": f"chitchat-dataset conversations on the chat endpoint, {args.output_len} out",
        "code": f"the HumanEval prompts, {args.output_len} out",
        "sharegpt": f"the first user turns of the ShareGPT conversations in `{path}` as completion prompts, each "
                    "asking for its reply's length in tokens (vLLM's ShareGPT filter)",
        "custom": f"the JSON Lines requests in `{path}` (their `max_tokens`, else {args.output_len} out)",
    }[dataset]
    return f"{what}, EOS ignored, temperature 1.0, streamed"


def _target_rows(served: list[dict[str, Any]], offline: dict[str, dict[str, Any]], conc: int = 32,
                 other_workload: str | None = None) -> list[str]:
    """The issue's targets: offline and at concurrency ``conc`` (32) against vLLM, at concurrency 1 against
    llama.cpp; a target whose concurrency the sweep did not run reads "not measured", never another level's ratio.
    On another workload than the targets' (``other_workload`` says how it differs) the ratios are shown, but no
    verdict: the targets say nothing about it."""
    rows = ["| target | pagellm | peer | ratio | met |", "|---|---:|---:|---:|---|"]

    def add(what: str, pairs: list[tuple[float, float]], goal: float, higher_better: bool) -> None:
        if not pairs:
            rows.append(f"| {what} | n/a | n/a | – | not measured |")
            return
        ratios = [ours / theirs for ours, theirs in pairs]
        ratio = statistics.median(ratios)
        met = ratio >= goal if higher_better else ratio <= goal
        verdict = "n/a (other workload)" if other_workload else ("yes" if met else "NO")
        ours, theirs = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        each = f" (rounds: {', '.join(f'{r:.2f}' for r in ratios)})" if len(ratios) > 1 else ""
        rows.append(f"| {what} | {ours:.1f} | {theirs:.1f} | {ratio:.2f}×{each} | {verdict} |")

    add("offline output tok/s ≥ 2× vLLM", _offline_pairs(offline, "pagellm", "vLLM"), 2.0, True)
    for key, what, goal, higher in (("output_throughput", f"c={conc} output tok/s ≥ 1.5× vLLM", 1.5, True),
                                    ("p95_ttft_ms", f"c={conc} TTFT p95 ≤ 0.5× vLLM", 0.5, False),
                                    ("p95_tpot_ms", f"c={conc} TPOT p95 ≤ 0.7× vLLM", 0.7, False)):
        add(what, _paired(served, "pagellm", "vLLM", conc, key), goal, higher)
    llama_name = next((r["system"] for r in served if r["system"].startswith("llama.cpp")), "llama.cpp")
    add(f"c=1 TPOT p50 ≤ {llama_name}", _paired(served, "pagellm", "llama.cpp", 1, "median_tpot_ms"), 1.0, False)
    if len(_rounds(served)) > 1 or any(len(rec.get("rounds", ())) > 1 for rec in offline.values()):
        rows += ["", "Each ratio is the median of the rounds' ratios (pagellm and the peer measured in the same "
                 "round); the pagellm and peer columns are the medians of their rounds."]
    if other_workload:
        stated = TARGET_WORKLOAD
        rows += ["", f"The targets are stated for random prompts of {stated['input_len']} in / {stated['output_len']} "
                 f"out in {stated['dtype']}; this run's workload differs ({other_workload}), so its ratios are shown "
                 "without a verdict."]
    return rows


def _offline_rows(offline: dict[str, dict[str, Any]], ctx: Any, args: argparse.Namespace) -> list[str]:
    """The offline table (each system's figure, command and environment), or a line saying why it was not run."""
    if not offline:
        why = "none of the chosen systems has an offline mode here" if args.offline_num_prompts else \
            "`--offline-num-prompts 0`"
        if _dataset(args) != "random":
            why = f"the offline runs take random prompts only, and this run serves `--dataset {_dataset(args)}`"
        return [f"Not run in this invocation ({why})."]
    rows = ["| system | output tok/s | command | environment |", "|---|---:|---|---|"]
    for name, rec in offline.items():
        value = f"{rec['output_throughput']:.1f}" if "output_throughput" in rec else f"failed: {rec.get('error')}"
        if len(rec.get("rounds", ())) > 1:  # the median, then each round's figure
            value += " (rounds: " + ", ".join("failed" if v is None else f"{v:.1f}" for v in rec["rounds"]) + ")"
        env = " ".join(f"{k}={v}" for k, v in rec.get("env", {}).items())
        env = f"`{_tidy(env, ctx)}`" if env else "–"
        rows.append(f"| {name} | {value} | `{_tidy(rec['command'], ctx)}` | {env} |")
    return rows


def _settled(args: argparse.Namespace) -> str:
    settle = getattr(args, "settle", 0.0)  # results.json of runs before --settle existed lack it
    return (f" Every server idled {settle:g} s after it was ready before its load (`--settle`); time to ready does "
            "not include it.") if settle else ""


def _model_name(args: argparse.Namespace) -> str:
    gguf = getattr(args, "gguf", None)  # compare.py --gguf: another 4-bit file
    return Path(gguf).name if gguf else "SmolLM2-135M-Instruct"


def _weights_note(quantization: str | None) -> str:
    if quantization in ("w4a8_int4", "w4a16_int4"):
        return (f", weights {quantization} (pagellm keeps the GGUF's Q4_0, Q4_1 and Q4_K blocks as they are, groups "
                "of 32 with a scale and minimum each, and quantizes its other matrices to them at load; llama.cpp "
                "serves the same GGUF)")
    if quantization:
        return (f", weights {quantization} (a compressed-tensors checkpoint: the same int8 weights and scales for "
                "pagellm and vLLM)")
    return ""


def write_report(md_path: Path, out: Path, args: argparse.Namespace, ctx: Any, served: list[dict[str, Any]],
                 offline: dict[str, dict[str, Any]], skipped: dict[str, str], command: str | None = None) -> Path:
    charts = plot.plot_serve([{"label": _label(r, served), "runs": r["runs"]} for r in served if r["runs"]], str(out))
    measured = {k: v["output_throughput"] for k, v in offline.items() if "output_throughput" in v}
    if measured:
        charts.append(plot.plot_bars(measured, f"offline, {args.offline_num_prompts} prompts "
                                               f"{args.input_len} in / {args.output_len} out", "output tokens/s",
                                     str(out / "offline.png")))
    lines = [f"# pagellm vs peers, {md_path.stem}", "",
             f"Machine: {_cpu_name()}, {os.cpu_count()} cores. Model: {_model_name(args)} ({ctx.model_dir.name}),"
             f" dtype {ctx.dtype}" + (f", KV cache {ctx.kv_cache_dtype}" if ctx.kv_cache_dtype != "auto" else "") +
             _weights_note(getattr(ctx, "quantization", None)) +
             f", {ctx.threads} threads for every system. Workload: {_workload(args)}.",
             "", "The machine is shared with other engineers' test runs: figures are noisy (10–40 % between runs "
             "here); compare systems within this file only." + (f" {args.notes}" if args.notes else ""), "",
             f"Command: `{command or shlex.join(['python', 'benchmarks/compare.py', *sys.argv[1:]])}`", "",
             "## Serving (`pagellm bench serve`, same sweep for every system)", "",
             *(_serve_rows(served) + ["", "Server CPU % is the mean over the run of the whole process tree (100 = one "
                                      "core); peak RSS is over the server's whole life (tree sum)." + _settled(args)]
               if served else ["Not run in this invocation (`--offline-only`)."]),
             "", "## Offline throughput", "", *_offline_rows(offline, ctx, args)]
    lines += ["", "llama.cpp has no offline batch mode in this harness.", "", "## Targets (issue 4)",
              "", *_target_rows(served, offline, other_workload=_other_workload(args, ctx)), "",
              "## Flags each system got", ""]
    if not served:
        lines.append("The offline table's command and environment columns are each system's flags.")
    notes = {r["system"]: r["note"] for r in served}  # one line per system, whatever the rounds
    lines += [f"- **{name}**: {_tidy(note, ctx)}" for name, note in notes.items()]
    lines += [f"- **{name}**: skipped, {why}" for name, why in skipped.items()]
    lines += ["", "## Charts", ""] + [f"![{Path(c).stem}]({out.name}/{Path(c).name})" for c in charts]
    md_path.write_text("\n".join(lines) + "\n")
    return md_path

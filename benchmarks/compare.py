"""pagellm side by side with vLLM, llama.cpp and transformers: same model, workload, dtype, threads and machine, one run.

For each available system (benchmarks/peers/systems.py; `make peers` installs the peers into .peers/, and what is
missing is skipped with the reason): start it on a free loopback port, time it to ready (``/health`` and
``/v1/models`` answer), run the same ``pagellm bench serve`` sweep (random prompts by default, or ``--dataset``'s,
EOS ignored; one concurrency level after another, each with its own request count), sample its process tree's CPU
and memory all along, stop it. Then offline throughput in-process (pagellm ``bench throughput``, ``vllm bench
throughput``, transformers static batches; llama.cpp has no offline mode here; random prompts only). Writes
``benchmarks/results/<date>-<machine>.md`` (tables, the commands, the flags each system got), the raw JSON and PNG
charts beside it.

    .venv/bin/python benchmarks/compare.py                       # the issue's workload (long: ~1 h here)
    .venv/bin/python benchmarks/compare.py --concurrency 1 8 32 --num-prompts 16 64 100 --offline-num-prompts 256
    .venv/bin/python benchmarks/compare.py --dataset sharegpt --dataset-path sharegpt.json --concurrency 8 32
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import httpx

# This checkout's pagellm and the benchmarks/ helpers, whatever the installed pagellm is.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from peers import systems  # noqa: E402
from report import write_report  # noqa: E402

from pagellm.bench import serve as bench_serve  # noqa: E402
from pagellm.bench.cpu import TreeSampler  # noqa: E402

RESULTS = systems.REPO / "benchmarks" / "results"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(base_url: str, proc: subprocess.Popen, timeout: float) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200 and \
                    httpx.get(f"{base_url}/v1/models", timeout=2).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"not ready after {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    import os

    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def serve_args(base_url: str, args: argparse.Namespace, concurrency: int, count: int, pid: int,
               system: systems.System, ctx: systems.Context) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_cli_args(parser)
    argv = ["--base-url", base_url, "--max-concurrency", str(concurrency), "--num-prompts", str(count),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--seed", str(concurrency),
            "--server-pid", str(pid), "--no-progress", "--label", system.name]
    dataset = getattr(args, "dataset", "random")  # callers without the dataset flags (kv_prefault.py): random
    argv += ["--dataset", dataset]
    if getattr(args, "range_ratio", 0):  # random lengths spread by ± this fraction (flags_ab.py)
        argv += ["--range-ratio", str(args.range_ratio)]
    if getattr(args, "dataset_path", None):
        argv += ["--dataset-path", args.dataset_path]
    if system.close_connections:
        argv.append("--close-connections")
    if system.count_with_tokenizer or dataset == "sharegpt":  # sharegpt: the replies' lengths
        argv += ["--tokenizer", str(ctx.model_dir)]
    return parser.parse_args(argv)


def context_per_stream(args: argparse.Namespace, model_dir: Path) -> int:
    """Tokens one stream needs (llama.cpp's server splits its context evenly over its slots): the longest prompt
    plus its output of every request the sweep will send, plus 64 spare; ``input_len + output_len + 64`` for random
    prompts."""
    if args.dataset == "random":
        return args.input_len + args.output_len + 64
    longest = 0
    for concurrency, count in zip(args.concurrency, args.num_prompts):
        bench_args = serve_args("http://127.0.0.1:1", args, concurrency, count, 0, systems.System("sizing", []),
                                systems.Context(model_dir, model_dir, args.dtype, args.threads, 1))
        for req in bench_serve.requests_for(bench_args, 0):
            longest = max(longest, _prompt_tokens(req, model_dir) + req.output_len)
    return longest + 64


@functools.lru_cache(maxsize=2)
def _tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _prompt_tokens(req: Any, model_dir: Path) -> int:
    """A request's prompt tokens: its own count where the dataset knows it, else the model's tokenizer's (through
    its chat template for messages)."""
    if req.prompt_len is not None:
        return req.prompt_len
    if req.is_chat:
        return len(_tokenizer(model_dir).apply_chat_template(req.messages, add_generation_prompt=True, tokenize=True,
                                                             return_dict=False))
    return len(_tokenizer(model_dir).encode(req.prompt))


def bench_system(system: systems.System, port: int, args: argparse.Namespace, ctx: systems.Context,
                 log_dir: Path, round_: int = 1) -> dict[str, Any]:
    base_url = f"http://127.0.0.1:{port}"
    label = f"{system.name} r{round_}" if args.rounds > 1 else system.name
    record: dict[str, Any] = {"system": system.name, "command": shlex.join(system.argv), "env": system.env,
                              "note": system.note, "runs": []}
    suffix = f"-r{round_}" if args.rounds > 1 else ""
    with open(log_dir / f"{system.name.split()[0]}{suffix}.log", "wb") as log:
        proc = subprocess.Popen(system.argv, env=systems.environment(system), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=systems.REPO)
        sampler = TreeSampler(proc.pid, interval=1.0).start()
        try:
            record["ready_s"] = wait_ready(base_url, proc, args.ready_timeout)
            print(f"[{label}] ready in {record['ready_s']:.1f} s", flush=True)
            time.sleep(args.settle)
            for concurrency, count in zip(args.concurrency, args.num_prompts):
                result = bench_serve.run(serve_args(base_url, args, concurrency, count, proc.pid, system, ctx))
                record["runs"] += result["runs"]
                m = result["runs"][0]["metrics"]
                print(f"[{label}] c={concurrency}: {m['completed']} ok, {m['failed']} failed, "
                      f"{m['output_throughput']:.1f} out tok/s, TTFT p95 {m['p95_ttft_ms']:.0f} ms, "
                      f"TPOT p95 {m['p95_tpot_ms']:.1f} ms", flush=True)
        except Exception as exc:  # a peer that fails is reported, the comparison goes on
            record["error"] = f"{type(exc).__name__}: {exc}"
            print(f"[{label}] FAILED: {record['error']}", flush=True)
        finally:
            stop(proc)
            record["peak_rss_mb"] = sampler.stop().peak_rss_mb
    return record


def pagellm_offline(args: argparse.Namespace, ctx: systems.Context, result: Path,
                    flags: Sequence[str] = ()) -> tuple[list, dict]:
    """pagellm's offline command and environment (``bench throughput`` with the KV memory every system gets, plus
    ``flags``), writing its result to ``result``."""
    argv = [ctx.pagellm_python, "-m", "pagellm.cli", "bench", "throughput", "--dtype", ctx.dtype, "--num-prompts",
            str(args.offline_num_prompts), "--kv-cache-memory", str(systems.KV_GIB << 30), "--result-json",
            str(result), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            *systems.kv_flags(ctx), *(["--model", str(ctx.model_dir)] if ctx.quantization == "w8a8_int8" else []),
            *(["--model", str(ctx.gguf_original)] if ctx.quantization in systems.FOUR_BIT or ctx.gguf_only else []),
            *systems.quantize_flags(ctx),
            *ctx.pagellm_flags, *flags]
    return argv, {"PAGELLM_NUM_THREADS": str(ctx.threads)}


def offline_commands(args: argparse.Namespace, ctx: systems.Context, out: Path,
                     suffix: str = "") -> dict[str, tuple[list, dict]]:
    """Each system's offline command, writing its result to ``out/offline-<name><suffix>.json``."""
    shape = ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    py = [ctx.pagellm_python, "-m", "pagellm.cli", "bench", "throughput", "--dtype", ctx.dtype]
    kv = systems.kv_flags(ctx)
    cmds = {
        "pagellm": pagellm_offline(args, ctx, out / f"offline-pagellm{suffix}.json"),
        "transformers": (py + ["--backend", "transformers", "--num-prompts", str(args.hf_offline_num_prompts),
                               "--hf-batch-size", "32", "--result-json",
                               str(out / f"offline-transformers{suffix}.json"), *shape],
                         {"PAGELLM_NUM_THREADS": str(ctx.threads)}),
    }
    vllm = systems.PEERS / "vllm" / "bin" / "vllm"
    if vllm.exists() and ctx.quantization not in systems.FOUR_BIT and not ctx.gguf_only:
        cmds["vLLM"] = ([str(vllm), "bench", "throughput", "--model", str(ctx.model_dir), "--dtype", ctx.dtype,
                         "--dataset-name", "random", "--random-input-len", str(args.input_len),
                         "--random-output-len", str(args.output_len), "--num-prompts", str(args.offline_num_prompts),
                         "--output-json", str(out / f"offline-vLLM{suffix}.json"), *kv, *ctx.vllm_flags],
                        systems.vllm_env(ctx))
    if kv or ctx.quantization or ctx.gguf_only:  # the transformers baseline: no float8 cache, quantized weights, GGUF
        del cmds["transformers"]
    return cmds


def offline_throughput(name: str, path: Path, args: argparse.Namespace) -> float:
    data = json.loads(path.read_text())
    if name == "vLLM":  # vLLM reports requests/s; every request generates exactly output_len tokens
        return data["requests_per_second"] * args.output_len
    return data["results"][0]["output_throughput"]


def run_offline(args: argparse.Namespace, ctx: systems.Context, out: Path) -> dict[str, dict[str, Any]]:
    """Every chosen system's offline run, ``args.offline_rounds`` times, alternating systems within each round.
    A system's record holds its per-round figures (``rounds``: tok/s, or None for a failed round) and their median
    (``output_throughput``); the report pairs pagellm and vLLM round by round."""
    results: dict[str, dict[str, Any]] = {}
    num_rounds = args.offline_rounds
    for round_ in range(1, num_rounds + 1):
        suffix = f"-r{round_}" if num_rounds > 1 else ""
        for name, (argv, env) in offline_commands(args, ctx, out, suffix).items():
            if name.lower() not in [s.lower() for s in args.systems]:
                continue
            label = f"offline {name} r{round_}" if num_rounds > 1 else f"offline {name}"
            print(f"[{label}] {shlex.join(argv)}", flush=True)
            record = results.setdefault(name, {"command": shlex.join(argv), "env": env, "rounds": []})
            with open(out / "logs" / f"offline-{name}{suffix}.log", "wb") as log:
                proc = subprocess.run(argv, env=systems.environment(systems.System(name, argv, env)), stdout=log,
                                      stderr=subprocess.STDOUT, timeout=args.offline_timeout, cwd=systems.REPO)
            try:
                if proc.returncode != 0:
                    raise RuntimeError(f"exit code {proc.returncode} (see logs/offline-{name}{suffix}.log)")
                value = offline_throughput(name, out / f"offline-{name}{suffix}.json", args)
                print(f"[{label}] {value:.1f} out tok/s", flush=True)
            except (RuntimeError, OSError, KeyError, ValueError) as exc:
                value = None
                record["error"] = str(exc)
                print(f"[{label}] FAILED: {exc}", flush=True)
            record["rounds"].append(value)
    for record in results.values():
        measured = [v for v in record["rounds"] if v is not None]
        if measured:
            record["output_throughput"] = statistics.median(measured)
    return results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", nargs="+", default=list(systems.BUILDERS), help="subset, in order")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--num-prompts", type=int, nargs="+", default=[32, 100, 200, 200],
                        help="requests per concurrency level (one per level, or one for all)")
    parser.add_argument("--dataset", choices=bench_serve.datasets.DATASETS, default="random",
                        help="the serving sweep's dataset (pagellm bench serve's; default random). Offline runs take "
                             "random prompts only, so they are skipped for another one")
    parser.add_argument("--dataset-path", default=None, metavar="FILE", help="the file of --dataset sharegpt|custom")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--offline-num-prompts", type=int, default=256, help="0 skips offline throughput")
    parser.add_argument("--hf-offline-num-prompts", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                        help="pagellm's and vLLM's KV cache element type (llama.cpp and transformers are skipped)")
    parser.add_argument("--quantization", default=None, choices=["w8a8_int8", "w4a8_int4", "w4a16_int4"],
                        help="w8a8_int8: pagellm and vLLM serve a W8A8 int8 compressed-tensors checkpoint of the "
                             "model, written once into .peers/, llama.cpp its Q8_0 GGUF; w4a8_int4: pagellm "
                             "keeps a 4-bit GGUF (--gguf) in 4 bits, llama.cpp serves the same file, vLLM sits out "
                             "(transformers is skipped for both); w4a16_int4: the same with pagellm's activations "
                             "in bfloat16")
    parser.add_argument("--gguf", default=None, metavar="FILE",
                        help="with --quantization w4a8_int4 or w4a16_int4: the 4-bit GGUF that pagellm (its Q4_0, "
                             "Q4_1 and Q4_K blocks as they are) and llama.cpp both serve (default: the built-in "
                             "model's Q4_1 file); alone: a GGUF that pagellm and llama.cpp both serve as it is "
                             "(vLLM and transformers sit out; e.g. a gpt-oss file, benchmarks/gpt_oss_mxfp4.py --gguf)")
    parser.add_argument("--pagellm-flags", default="", metavar="FLAGS",
                        help="pagellm's own engine flags on top of the shared ones, served and offline (e.g. "
                             "'--max-num-batched-tokens 768'); the report lists them with the others")
    parser.add_argument("--vllm-flags", default="", metavar="FLAGS",
                        help="vLLM's own engine flags on top of the shared ones, served and offline (e.g. the same "
                             "'--max-num-batched-tokens 512' pagellm gets); the report lists them with the others")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ready-timeout", type=float, default=600)
    parser.add_argument("--settle", type=float, default=0.0, metavar="S",
                        help="seconds each server idles after it is ready, before its load (the same for every "
                             "system): a deployed server idles before its traffic, and pagellm populates its KV "
                             "cache's memory then, which vLLM does before it is ready (default 0: load at once)")
    parser.add_argument("--offline-timeout", type=float, default=1800)
    parser.add_argument("--rounds", type=int, default=1,
                        help="serve every system this many times, alternating (pagellm, peers, pagellm, ...); the "
                             "targets then take each round's ratio and report their median (the machine drifts)")
    parser.add_argument("--offline-only", action="store_true", help="skip the serving runs")
    parser.add_argument("--offline-rounds", type=int, default=None,
                        help="offline runs per system, alternating within each round (default: --rounds); the "
                             "offline target then takes each round's ratio and reports their median")
    parser.add_argument("--machine", default=platform.node() or "machine", help="name in the results file")
    parser.add_argument("--notes", default="", help="a line for the results file (e.g. machine load)")
    parser.add_argument("--from-json", default=None, metavar="RESULTS_JSON",
                        help="only redraw the report and charts from an earlier run's results.json")
    args = parser.parse_args()
    if args.offline_rounds is None:
        args.offline_rounds = args.rounds
    if len(args.num_prompts) == 1:
        args.num_prompts *= len(args.concurrency)
    if len(args.num_prompts) != len(args.concurrency):
        parser.error("give one --num-prompts, or one per --concurrency level")
    unknown = set(args.systems) - set(systems.BUILDERS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {list(systems.BUILDERS)}")
    if args.dataset != "random" and args.offline_num_prompts:
        print(f"offline throughput skipped: it takes random prompts only (--dataset {args.dataset})", flush=True)
        args.offline_num_prompts = 0
    if args.dataset == "random" and args.dataset_path:
        parser.error("--dataset-path goes with --dataset sharegpt or custom")
    if args.gguf and args.quantization == "w8a8_int8":
        parser.error(f"--gguf goes with --quantization {' or '.join(systems.FOUR_BIT)}, or alone")
    if not args.machine or any(sep in args.machine for sep in "/\\") or args.machine.startswith("."):
        parser.error(f"--machine {args.machine!r} names the results file benchmarks/results/DATE-MACHINE.md: give a "
                     "name, not a path")
    return args


def quantized_dir(model_dir: Path, quantization: str | None) -> Path:
    """``model_dir``, or its W8A8 int8 compressed-tensors copy in .peers/ (written on first use) for pagellm and vLLM
    to serve alike."""
    if quantization != "w8a8_int8":
        return model_dir
    from pagellm.model.compressed_tensors import write_w8a8

    target = systems.PEERS / "w8a8" / f"{model_dir.name}-w8a8-int8"
    if not (target / "config.json").exists():
        print(f"writing the W8A8 int8 checkpoint {target}", flush=True)
        write_w8a8(model_dir, target.with_name(target.name + ".partial"))
        target.with_name(target.name + ".partial").rename(target)
    return target


def redraw(results_json: Path) -> None:
    """Rewrite the markdown and charts of an earlier run (its arguments, results and machine name)."""
    from pagellm.model.loader import default_model_path

    data = json.loads(results_json.read_text())
    args = argparse.Namespace(**{"rounds": 1, "offline_rounds": 1, **data["args"]})
    quantization = getattr(args, "quantization", None)
    gguf = Path(getattr(args, "gguf", None) or default_model_path())
    gguf_only = bool(getattr(args, "gguf", None)) and not quantization
    ctx = systems.Context(quantized_dir(model_dir_of(gguf, gguf_only), quantization), gguf, args.dtype,
                          args.threads, max(args.concurrency), kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                          quantization=quantization,
                          pagellm_flags=tuple(shlex.split(getattr(args, "pagellm_flags", ""))),
                          vllm_flags=tuple(shlex.split(getattr(args, "vllm_flags", ""))), gguf_only=gguf_only)
    out = results_json.parent
    md = write_report(out.parent / f"{out.name}.md", out, args, ctx, data["served"], data["offline"],
                      data["skipped"], command=data.get("command"))
    print(f"wrote {md}")


def model_dir_of(gguf: Path, gguf_only: bool) -> Path:
    """The model's directory: with float copies of its matrices for vLLM and transformers, or for a comparison on the
    GGUF file alone (which they sit out) without them."""
    from pagellm.model.loader import hf_model_dir, resolve_model_dir

    return resolve_model_dir(gguf) if gguf_only else hf_model_dir(gguf)


def main() -> None:
    from pagellm.model.loader import default_model_path

    args = parse_args()
    if args.from_json:
        return redraw(Path(args.from_json))
    gguf = Path(args.gguf or default_model_path())
    gguf_only = bool(args.gguf) and not args.quantization
    model_dir = model_dir_of(gguf, gguf_only)
    try:
        per_stream = context_per_stream(args, model_dir)  # also checks the dataset before any server starts
    except ValueError as exc:
        sys.exit(f"compare.py: {exc}")
    ctx = systems.Context(quantized_dir(model_dir, args.quantization), gguf, args.dtype,
                          args.threads, max(args.concurrency), context_per_stream=per_stream,
                          kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
                          pagellm_flags=tuple(shlex.split(args.pagellm_flags)),
                          vllm_flags=tuple(shlex.split(args.vllm_flags)), gguf_only=gguf_only)
    stem = f"{datetime.date.today().isoformat()}-{args.machine}"
    out = RESULTS / stem
    (out / "logs").mkdir(parents=True, exist_ok=True)
    served, skipped = [], {}
    for round_ in range(1, 0 if args.offline_only else args.rounds + 1):
        for name in args.systems:
            port = free_port()
            system = systems.BUILDERS[name](ctx, port)
            if system.missing_reason:
                if round_ == 1:
                    skipped[system.name] = system.missing_reason
                    print(f"[{system.name}] skipped: {system.missing_reason}", flush=True)
                continue
            served.append({**bench_system(system, port, args, ctx, out / "logs", round_), "round": round_})
    offline = run_offline(args, ctx, out) if args.offline_num_prompts else {}
    command = shlex.join(["python", "benchmarks/compare.py", *sys.argv[1:]])
    (out / "results.json").write_text(json.dumps({"args": vars(args), "served": served, "offline": offline,
                                                  "skipped": skipped, "command": command}, indent=1, default=str))
    md = write_report(RESULTS / f"{stem}.md", out, args, ctx, served, offline, skipped, command)
    print(f"wrote {md}")


if __name__ == "__main__":
    main()

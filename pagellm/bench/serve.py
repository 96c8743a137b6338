"""``pagellm bench serve``: load any OpenAI-compatible server with a dataset and report its latency and throughput.

Requests arrive as a Poisson process at ``--request-rate`` per second (``inf``: all at once); ``--burstiness``
below 1 makes arrivals burstier, above 1 more regular (gamma-distributed gaps with that shape, same mean).
``--ramp-up-strategy linear|exponential`` instead moves the rate from ``--ramp-up-start-rps`` to
``--ramp-up-end-rps`` over the run (arrivals.py), and a timed trace (``--dataset custom`` with a ``timestamp`` on
every line) is replayed as recorded (``--trace-speed`` times as fast). ``--max-concurrency`` caps the requests in
flight. Several rates or concurrencies make a sweep: one run per (rate, concurrency) pair, the same requests each
time. Warm-up requests run first and are not counted. What each request carries besides its prompt (sampling
flags, ``--extra-body``, ``--header``) is request_args.py's.

While a run lasts, the server's process tree is sampled for CPU utilisation and memory (``--server-pid``, or found
by the port of a local ``--base-url``). The JSON result is ``{"config": ..., "runs": [{"request_rate",
"max_concurrency", "metrics", "cpu", "requests"}], "metadata": {...}}`` (see ``metrics.compute_metrics`` for the
metric names); a ramp's runs add ``ramp_up`` and each request's ``offered_rps``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import logging
import math
import os
import time
from dataclasses import asdict
from typing import Any, Callable, Coroutine, Sequence
from urllib.parse import urlparse

from tqdm import tqdm

from pagellm.bench import datasets, mm_datasets, request_args, vllm_flags
from pagellm.bench.arrivals import RAMP_STRATEGIES, Ramp, arrival_gaps, trace_gaps
from pagellm.bench.client import (ClientOptions, RequestResult, Server, connect, first_listed, profile, send,
                                  wait_ready)
from pagellm.bench.cpu import TreeSampler, find_listening_pid
from pagellm.bench.metrics import compute_metrics, first_slo_miss, parse_slos

logger = logging.getLogger(__name__)

ENDPOINTS = ("auto", "completions", "chat")


def add_dataset_args(parser: argparse.ArgumentParser, seed_flag: str = "--seed") -> None:
    """Dataset flags (and vLLM's names for them); in-process commands pass ``--dataset-seed`` (their ``--seed`` is
    the engine's)."""
    group = parser.add_argument_group("dataset")

    def add(flag: str, **kwargs: Any) -> None:
        group.add_argument(*vllm_flags.names(flag), dest=flag[2:].replace("-", "_"), **kwargs)

    add("--dataset", type=vllm_flags.dataset_name, choices=datasets.DATASETS, default="random")
    group.add_argument("--dataset-path", default=None, metavar="FILE",
                       help="the file of --dataset sharegpt (a JSON list) or custom (JSON Lines)")
    group.add_argument("--num-prompts", type=int, default=100)
    add("--input-len", type=int, default=128, help="prompt tokens (random; suffix for prefix)")
    add("--output-len", type=int, default=128, help="output tokens per request (max_tokens)")
    add("--range-ratio", type=float, default=0.0, help="lengths vary uniformly by ± this fraction")
    add("--num-prefixes", type=int, default=4, help="shared prefixes (prefix dataset)")
    add("--prefix-len", type=int, default=256, help="tokens per shared prefix (prefix dataset)")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="random token ids are drawn below this (default: the model's vocabulary where the "
                            "benchmark runs it, else 49152, the built-in model's)")
    group.add_argument(seed_flag, dest="dataset_seed", type=int, default=0, help="dataset and arrival seed")
    mm_datasets.add_args(group)


def dataset_options(args: argparse.Namespace, tokenizer: str | None = None) -> datasets.DatasetOptions:
    """The dataset flags as options; ``tokenizer`` (an HF directory) counts the sharegpt replies' tokens."""
    count = token_counter(tokenizer) if tokenizer and args.dataset == "sharegpt" else None
    return datasets.DatasetOptions(args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                                   args.num_prefixes, args.prefix_len, args.vocab_size or datasets.DEFAULT_VOCAB_SIZE,
                                   args.dataset_seed, args.dataset_path, count, mm_datasets.options(args))


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=vllm_flags.DEFAULT_BASE_URL, help="the server (default: %(default)s)")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    parser.add_argument("--endpoint", type=vllm_flags.endpoint, choices=ENDPOINTS, default="auto",
                        help="where requests go: auto (chat for messages, completions for prompts), completions, "
                             "or chat (text prompts sent as one user message)")
    add_dataset_args(parser)
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                      help="requests per second, Poisson (default: inf, all at once); several values sweep")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1: Poisson)")
    load.add_argument("--ramp-up-strategy", choices=RAMP_STRATEGIES, default=None,
                      help="raise the request rate over each run instead of a fixed --request-rate")
    load.add_argument("--ramp-up-start-rps", type=float, default=None, help="the ramp's first rate (requests/s)")
    load.add_argument("--ramp-up-end-rps", type=float, default=None, help="the ramp's last rate (requests/s)")
    load.add_argument("--trace-speed", type=float, default=1.0,
                      help="a timed trace (a custom file with timestamps) replays this many times as fast")
    load.add_argument("--max-concurrency", type=int, nargs="+", default=[0],
                      help="requests in flight at most (0: no cap); several values sweep")
    load.add_argument("--num-warmups", type=int, default=1, help="uncounted requests sent first")
    load.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    load.add_argument("--close-connections", action="store_true",
                      help="send 'Connection: close' (servers that drop reused connections under load)")
    load.add_argument("--tokenizer", default=None,
                      help="tokenizer (HF directory) to count output tokens when the server streams no usage, "
                           "and the sharegpt replies' lengths")
    request_args.add_request_args(parser)
    report = parser.add_argument_group("report")
    report.add_argument("--goodput", nargs="*", default=[], metavar="NAME:MS",
                        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000")
    report.add_argument("--percentiles", type=float, nargs="+", default=[50.0, 95.0, 99.0])
    report.add_argument("--server-pid", type=int, default=None,
                        help="pid of the server's root process for CPU sampling (default: found by port)")
    report.add_argument("--label", default=None, help="a name for this system in the result and plots")
    report.add_argument("--result-json", default=None, help="write the result here")
    report.add_argument("--plot", default=None, metavar="DIR", help="write PNG charts into this folder")
    report.add_argument(*vllm_flags.names("--no-progress"), dest="no_progress", action="store_true",
                        help="no progress bar")
    report.add_argument("--profile", action="store_true",
                        help="record a torch profile on the server across the runs (POST /start_profile, then "
                             "/stop_profile: a pagellm server with --profiler-dir, or vLLM's)")
    vllm_flags.add_args(parser)


def ramp_of(args: argparse.Namespace) -> Ramp | None:
    """The ``--ramp-up-*`` flags as a ``Ramp`` (None without a strategy); a ValueError for a half-given ramp."""
    given = [f for f in ("ramp_up_start_rps", "ramp_up_end_rps") if getattr(args, f) is not None]
    if args.ramp_up_strategy is None:
        if given:
            raise ValueError("--ramp-up-start-rps and --ramp-up-end-rps need --ramp-up-strategy")
        return None
    if len(given) < 2:
        raise ValueError("--ramp-up-strategy needs --ramp-up-start-rps and --ramp-up-end-rps")
    if args.request_rate != [math.inf]:
        raise ValueError("--ramp-up-strategy sets the request rate: leave --request-rate out")
    return Ramp(args.ramp_up_strategy, args.ramp_up_start_rps, args.ramp_up_end_rps)


async def run_once(http: Server, requests: Sequence[datasets.BenchRequest], opts: ClientOptions,
                   gaps: Sequence[float], max_concurrency: int, progress: bool = True
                   ) -> tuple[list[RequestResult], float]:
    """Send every request after its gap (seconds after the one before); returns the results (request order) and
    the wall time in seconds."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency > 0 else None
    bar = tqdm(total=len(requests), disable=not progress, leave=False, unit="req")

    async def one(req: datasets.BenchRequest) -> RequestResult:
        if limit is None:
            result = await send(http, req, opts)
        else:
            async with limit:
                result = await send(http, req, opts)
        bar.update(1)
        return result

    tasks = []
    start = time.perf_counter()
    for req, gap in zip(requests, gaps):
        if gap > 0:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(req)))
    results = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    bar.close()
    return results, duration


def _server_pid(args: argparse.Namespace) -> int | None:
    if args.server_pid:
        return args.server_pid
    url = urlparse(args.base_url)
    if url.hostname not in ("127.0.0.1", "localhost", "::1"):
        return None
    try:
        return find_listening_pid(url.port or 80)
    except Exception as exc:  # psutil may be denied the connection table; CPU is then simply not reported
        logger.warning("cannot find the server's pid by port (%s); pass --server-pid for CPU figures", exc)
        return None


@functools.lru_cache(maxsize=4)
def token_counter(path: str | None) -> Callable[[str], int] | None:
    """A function counting a text's tokens with the HF tokenizer at ``path`` (loaded once), or None."""
    if path is None:
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def to_endpoint(requests: list[datasets.BenchRequest], endpoint: str) -> list[datasets.BenchRequest]:
    """The requests as ``endpoint`` takes them (``--endpoint``): ``chat`` sends a text prompt as one user message;
    token-id prompts go to completions only and messages to chat only (ValueError saying so)."""
    if endpoint == "auto":
        return requests
    if endpoint == "completions":
        if any(req.is_chat for req in requests):
            raise ValueError("this dataset's requests are chat messages: they go to the chat endpoint "
                             "(--endpoint chat or auto)")
        return requests
    out = []
    for req in requests:
        if not req.is_chat:
            if not isinstance(req.prompt, str):
                raise ValueError("token-id prompts (the random and prefix datasets, or id lists in a custom file) "
                                 "go to the completions endpoint only (--endpoint completions or auto)")
            req = dataclasses.replace(req, prompt=None, messages=[{"role": "user", "content": req.prompt}])
        out.append(req)
    return out


def requests_for(args: argparse.Namespace, index: int) -> list[datasets.BenchRequest]:
    """Run ``index``'s requests: a fresh seed per run, so a sweep's later runs miss the prefix cache as the first
    did (except for what the dataset shares on purpose); index -1 is the warm-up."""
    opts = dataset_options(args, args.tokenizer)
    opts.seed = args.dataset_seed + 7919 * (index + 1)
    requests = to_endpoint(datasets.load(args.dataset, opts), args.endpoint)
    for req in requests:
        req.ignore_eos = args.ignore_eos
    return requests


@dataclasses.dataclass
class _Plan:
    """The flags checked and parsed once, before the server is touched."""
    slos: dict[str, float]
    ramp: Ramp | None
    timed: bool  # the dataset is a timed trace: its requests carry their send times
    body: dict[str, Any]
    headers: dict[str, str]
    metadata: dict[str, str]


def _plan(args: argparse.Namespace) -> _Plan:
    requests = requests_for(args, 0)  # the dataset's errors too
    if args.ready_check_timeout < 0:
        raise ValueError("--ready-check-timeout must be 0 or more seconds")
    if min(args.max_concurrency) < 0 or args.num_warmups < 0:
        raise ValueError("--max-concurrency (0: no cap) and --num-warmups must be 0 or more")
    ramp, timed = ramp_of(args), requests[0].arrival is not None
    if timed:
        trace_gaps([0.0], args.trace_speed)  # its error, before any run
        if ramp is not None or args.request_rate != [math.inf] or args.burstiness != 1.0:
            raise ValueError("a timed trace sends each request when its timestamp says: leave --request-rate, "
                             "--burstiness and --ramp-up-* out (--trace-speed replays it faster)")
    return _Plan(parse_slos(args.goodput), ramp, timed, request_args.extra_body(args), request_args.headers(args),
                 request_args.pairs(args.metadata, "--metadata"))


async def _run_all(args: argparse.Namespace, plan: _Plan) -> dict[str, Any]:
    max_connections = max(max(args.max_concurrency), 1) + 8 if min(args.max_concurrency) > 0 \
        else args.num_prompts + 8
    async with connect(args.base_url, max_connections, args.close_connections, args.api_key, plan.headers) as http:
        listing = await wait_ready(http, args.ready_check_timeout)
        model = args.model or first_listed(listing)
        opts = ClientOptions(model=model, temperature=args.temperature, close_connections=args.close_connections,
                             extra_body=plan.body, count_tokens=token_counter(args.tokenizer),
                             stream=not args.no_stream)
        for req in requests_for(args, -1)[:args.num_warmups]:
            warm = datasets.BenchRequest(req.prompt, min(req.output_len, 8), req.prompt_len, req.messages)
            result = await send(http, warm, opts)
            if not result.success:  # the server refuses what every request will carry: stop before the runs
                raise ValueError(f"the warm-up request failed, so no run started: {result.error}; fix what the "
                                 "server names, or count such failures with --num-warmups 0")
        pid = _server_pid(args)
        runs: list[dict[str, Any]] = []
        files = await _profiled(http, args.profile, _runs(http, opts, pid, plan, args, runs))
    result = {"label": args.label or model, "config": _config(args, model), "metadata": plan.metadata, "runs": runs}
    if args.profile:
        result["profile_files"] = files
    return result


async def _runs(http: Server, opts: ClientOptions, pid: int | None, plan: _Plan, args: argparse.Namespace,
                runs: list[dict[str, Any]]) -> None:
    pairs = [(rate, conc) for rate in args.request_rate for conc in args.max_concurrency]
    for index, (rate, concurrency) in enumerate(pairs):
        requests = requests_for(args, index)
        runs.append(await _one_run(http, opts, requests, rate, concurrency, pid, plan, args))


async def _profiled(http: Server, on: bool, work: Coroutine[Any, Any, None]) -> list[str]:
    """Await ``work``, inside a server-side torch profile when ``on`` (``--profile``): the files the server wrote.
    The profile stops even when the work fails, so the server does not record on."""
    if not on:
        await work
        return []
    try:
        await profile(http, "start_profile")
    except BaseException:
        work.close()  # never started
        raise
    try:
        await work
    finally:
        files = (await profile(http, "stop_profile")).get("files", [])
    return files


def _config(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """The flags as run, without secrets: no API key, and only the names of ``--header``s."""
    config = {k: v for k, v in vars(args).items() if k not in ("func", "bench_main", "api_key")}
    config["header"] = [item.partition("=")[0].strip() for item in args.header]
    config["request_rate"] = [r if math.isfinite(r) else "inf" for r in args.request_rate]
    config["model"] = model
    return config


async def _one_run(http: Server, opts: ClientOptions, requests: list[datasets.BenchRequest], rate: float,
                   concurrency: int, pid: int | None, plan: _Plan, args: argparse.Namespace) -> dict[str, Any]:
    gaps = trace_gaps([r.arrival or 0.0 for r in requests], args.trace_speed) if plan.timed \
        else arrival_gaps(len(requests), rate, args.burstiness, args.dataset_seed, plan.ramp)
    sampler = TreeSampler(pid).start() if pid else None
    results, duration = await run_once(http, requests, opts, gaps, concurrency, not args.no_progress)
    cpu = sampler.stop().as_dict() if sampler else None
    metrics = compute_metrics(results, duration, plan.slos, args.percentiles)
    records = [_request_record(r) for r in results]
    run_ = {"request_rate": rate if math.isfinite(rate) else "inf", "max_concurrency": concurrency,
            "metrics": metrics, "cpu": cpu, "requests": records}
    if plan.timed:
        run_.update(request_rate="trace", trace_speed=args.trace_speed)
    if plan.ramp is not None:
        rates = plan.ramp.rates(len(requests))
        for record, offered in zip(records, rates):
            record["offered_rps"] = offered
        run_.update(request_rate="ramp", ramp_up=plan.ramp.as_dict())
        if plan.slos:
            metrics["first_slo_miss_rps"] = first_slo_miss(results, rates, plan.slos)
    logger.info("rate %s concurrency %s: %.1f output tok/s", run_["request_rate"], concurrency,
                metrics["output_throughput"])
    failures = [r.error for r in results if not r.success]
    if failures:
        logger.warning("%d requests failed; first error: %s", len(failures), failures[0])
    return run_


def _request_record(result: RequestResult) -> dict[str, Any]:
    record = asdict(result)
    record.pop("text")
    record.pop("start")
    return record


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run every (rate, concurrency) pair on its own copy of the dataset and return the JSON-able result."""
    vllm_flags.resolve(args)
    plan = _plan(args)  # fail on bad options before touching the server
    if args.dataset == "sharegpt" and not args.tokenizer:
        logger.warning("sharegpt without --tokenizer: every request asks for --output-len %d tokens and no "
                       "conversation is filtered (pass --tokenizer DIR for the replies' lengths and vLLM's filter)",
                       args.output_len)
    return _run_loop(_run_all(args, plan))


def _run_loop(main: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    """``asyncio.run`` on uvloop where installed (it is with uvicorn[standard]): less client CPU per chunk."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'rate':>6} {'conc':>5} {'ok':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>9} "
             f"{'TTFT p95':>9} {'TPOT p50':>9} {'TPOT p95':>9} {'ITL p95':>8} {'E2EL p95':>9} {'CPU %':>6}"]
    for run_ in result["runs"]:
        m, cpu = run_["metrics"], run_["cpu"] or {}
        lines.append(
            f"{run_['request_rate']!s:>6} {run_['max_concurrency'] or '-':>5} {m['completed']:>5} {m['failed']:>4} "
            f"{m['request_throughput']:>7.2f} {m['output_throughput']:>9.1f} {m['median_ttft_ms']:>9.1f} "
            f"{m.get('p95_ttft_ms', 0):>9.1f} {m['median_tpot_ms']:>9.1f} {m.get('p95_tpot_ms', 0):>9.1f} "
            f"{m.get('p95_itl_ms', 0):>8.1f} {m.get('p95_e2el_ms', 0):>9.1f} "
            f"{cpu.get('mean_cpu_percent', float('nan')):>6.0f}")
        if "request_goodput" in m:
            lines.append(f"       goodput {m['request_goodput']:.2f} req/s ({m['goodput_requests']} requests in SLO)")
        if "ramp_up" in run_:
            ramp, miss = run_["ramp_up"], m.get("first_slo_miss_rps")
            slo = "" if "first_slo_miss_rps" not in m else \
                "; every request met the SLOs" if miss is None else f"; first SLO miss at {miss:.2f} req/s"
            lines.append(f"       ramp {ramp['strategy']} {ramp['start_rps']:g} → {ramp['end_rps']:g} req/s{slo}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    result = run(args)
    print(format_table(result))
    for path in result.get("profile_files", []):
        print(f"the server wrote {path}")
    if args.result_json:
        os.makedirs(os.path.dirname(args.result_json) or ".", exist_ok=True)
        with open(args.result_json, "w") as fh:
            json.dump(result, fh, indent=1)
    if args.plot:
        from pagellm.bench import plot

        for path in plot.plot_serve([result], args.plot):
            print(f"wrote {path}")
    return 0 if all(r["metrics"]["failed"] == 0 for r in result["runs"]) else 1

"""``pagellm generate`` and ``pagellm chat`` (offline generation), ``pagellm serve`` (the OpenAI-compatible
HTTP server), ``pagellm ray-serve`` (the same app as an autoscaled Ray Serve deployment), ``pagellm run-batch``,
``pagellm disagg-proxy``, ``pagellm bench serve|throughput|latency`` (benchmarks, see pagellm/bench/) and
``pagellm train-draft`` (Medusa heads, ``spec/train.py``) from the command line.

Engine flags are generated from the config fields (``engine_args.py``), so every engine option is a flag without
being listed twice.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from pagellm import logging_config
from pagellm.engine_args import add_engine_args, engine_kwargs
from pagellm.server import vllm_cli
from pagellm.server.options import add_serve_args, serve_options
from pagellm.spec import train_cli as train_draft


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagellm", description="pagellm: paged-KV LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("generate", "complete prompts"), ("chat", "answer chat messages via the template")):
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument("prompts", nargs="*", help="prompts (or user messages for chat)")
        cmd.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
        cmd.add_argument("--chat", action="store_true", help="apply the chat template (generate only)")
        cmd.add_argument("--model", default=None, help="HF directory or .gguf file (default: built-in SmolLM2)")
        _add_sampling_args(cmd)
        add_engine_args(cmd)
    _add_serve_parser(sub)
    _add_run_batch_parser(sub)
    from pagellm.server import ray_serve

    ray_serve.add_args(sub.add_parser("ray-serve", help="serve the OpenAI-compatible API as a Ray Serve deployment "
                                                        "(replicas on a Ray cluster, autoscaled)"))
    proxy = sub.add_parser("disagg-proxy", help="one OpenAI endpoint over a prefill and a decode server that share a "
                                                "KV store (disaggregated prefill and decode)")
    proxy.add_argument("--prefill", required=True, metavar="URL", help="the prefill server (kv_producer)")
    proxy.add_argument("--decode", required=True, metavar="URL", help="the decode server (kv_consumer)")
    proxy.add_argument("--host", default="127.0.0.1")
    proxy.add_argument("--port", type=int, default=8000)
    _add_bench_parser(sub)
    train_draft.add_parser(sub)
    return parser


def _add_bench_parser(sub: argparse._SubParsersAction) -> None:
    import importlib

    bench = sub.add_parser("bench", help="benchmark a server (serve) or the engine in-process (throughput, latency)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    for name, help_text in (("serve", "load an OpenAI-compatible server and report latency and throughput"),
                            ("throughput", "offline throughput in-process (optionally vs transformers)"),
                            ("latency", "per-batch and per-token latency in-process"),
                            ("soak", "a random mix of requests against a server; checks nothing is lost")):
        module = importlib.import_module(f"pagellm.bench.{name}")
        cmd = kinds.add_parser(name, help=help_text, description=module.__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_cli_args(cmd)
        cmd.set_defaults(bench_main=module.main)


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    cmd = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    cmd.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                     help="HF directory or .gguf file (default: built-in SmolLM2)")
    cmd.add_argument("--model", default=None, help="same as the positional MODEL")
    add_serve_args(cmd)
    add_engine_args(cmd)
    vllm_cli.add_args(cmd)


def _add_run_batch_parser(sub: argparse._SubParsersAction) -> None:
    cmd = sub.add_parser("run-batch", help="answer a file of OpenAI Batch API requests (JSON Lines) in-process",
                         description="Each input line {custom_id, method, url, body} (url /v1/chat/completions, "
                                     "/v1/completions, /v1/embeddings or /v1/responses) gets one output line "
                                     "{id, custom_id, response: {status_code, request_id, body}, error}, in order.")
    cmd.add_argument("-i", "--input-file", required=True, help="the requests, one JSON object per line")
    cmd.add_argument("-o", "--output-file", required=True, help="where the answers go (replaced when complete)")
    cmd.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                     help="HF directory or .gguf file (default: built-in SmolLM2)")
    cmd.add_argument("--model", default=None, help="same as the positional MODEL")
    add_serve_args(cmd)
    add_engine_args(cmd)
    vllm_cli.add_args(cmd)


def _serve(args: argparse.Namespace) -> int:
    from pagellm.config import EngineConfig

    if args.model and args.model_path and args.model != args.model_path:
        print("pagellm: give the model once (positional MODEL or --model)", file=sys.stderr)
        return 2
    try:
        config = EngineConfig.from_kwargs(model=args.model or args.model_path, **engine_kwargs(args))
        if args.command == "run-batch":
            from pagellm.server.batch import run_batch

            return run_batch(config, serve_options(args), args.input_file, args.output_file)
        from pagellm.server.launch import run_server

        return run_server(config, serve_options(args))
    except ValueError as exc:
        print(f"pagellm: {exc}", file=sys.stderr)
        return 2


def _ray_serve(args: argparse.Namespace) -> int:
    from pagellm.server import ray_serve

    try:
        parsed = ray_serve.parse(args)
    except ValueError as exc:
        print(f"pagellm: {exc}", file=sys.stderr)
        return 2
    return ray_serve.run_ray_serve(*parsed)


def main(argv: Sequence[str] | None = None) -> int:
    logging_config.configure()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("serve", "run-batch"):
        try:
            args = vllm_cli.reparse(parser, args, argv)
        except ValueError as exc:
            print(f"pagellm: {exc}", file=sys.stderr)
            return 2
        try:  # this process's logging, and (through the env) its engine cores'
            logging_config.LoggingConfig.parse(args.logging_config, args.log_level, args.log_config_file).export()
        except ValueError as exc:
            print(f"pagellm: {exc}", file=sys.stderr)
            return 2
        logging_config.configure()
        return _serve(args)
    if args.command == "ray-serve":
        return _ray_serve(args)
    if args.command == "disagg-proxy":
        from pagellm.disagg.proxy import run_proxy

        return run_proxy(args.prefill, args.decode, args.host, args.port)
    if args.command == "bench":
        try:
            return args.bench_main(args)
        except ValueError as exc:
            print(f"pagellm: {exc}", file=sys.stderr)
            return 2
    if args.command == "train-draft":
        return train_draft.main(args)
    from pagellm import LLM, SamplingParams

    prompts = list(args.prompt) + list(args.prompts)
    if not prompts:
        print("pagellm: give at least one prompt (positional or --prompt)", file=sys.stderr)
        return 2
    try:
        llm = LLM(args.model, **engine_kwargs(args))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.sample_seed, stop=args.stop)
        if args.command == "chat" or args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
    except ValueError as exc:
        print(f"pagellm: {exc}", file=sys.stderr)
        return 2
    for prompt, out in zip(prompts, outputs):
        print(f"### {prompt}\n{out.outputs[0].text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

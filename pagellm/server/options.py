"""``pagellm serve``'s own flags (everything but the engine's): where to listen, which names to answer to, auth, the
chat template, logging, tracing and CORS, as one ``ServeOptions``.

CORS follows vLLM's flags and defaults: ``--allowed-origins``, ``--allowed-methods`` and ``--allowed-headers`` take
JSON lists (default ``["*"]``: a browser page from any origin may call the API, as vLLM's and llama.cpp's servers
allow), ``--allow-credentials`` lets such calls carry cookies and HTTP auth. ``--api-key`` is enforced either way.
``--ssl-keyfile`` with ``--ssl-certfile`` serves HTTPS (``--ssl-ca-certs`` adds the CAs whose client certificates
are accepted; ``--ssl-cert-reqs 2`` requires one; ``--ssl-ciphers`` picks TLS 1.2's cipher suites), as vLLM's flags
do; the files and the cipher list are checked before anything starts.
No torch here: the frontend imports this before the engine core starts.
"""

from __future__ import annotations

import argparse
import json
import ssl
from dataclasses import dataclass, field
from typing import Any, Optional

from pagellm import envs
from pagellm.chat_content import CONTENT_FORMATS
from pagellm.server.openai import reasoning
from pagellm.server.openai.protocol import RequestDefaults
from pagellm.server.openai.request_metrics import SPEC_LEVELS
from pagellm.server.openai.tool_parsers import PARSERS, get_parser, load_plugin


@dataclass(frozen=True)
class Cors:
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


@dataclass(frozen=True)
class Tls:
    keyfile: str
    certfile: str
    ca_certs: Optional[str] = None
    cert_reqs: int = 0  # ssl.CERT_NONE; 2 = CERT_REQUIRED (client certificates)
    ciphers: Optional[str] = None  # OpenSSL's cipher list for TLS 1.2 and below (None: uvicorn's default)

    def uvicorn_kwargs(self) -> dict[str, Any]:
        return {"ssl_keyfile": self.keyfile, "ssl_certfile": self.certfile, "ssl_ca_certs": self.ca_certs,
                "ssl_cert_reqs": self.cert_reqs, **({"ssl_ciphers": self.ciphers} if self.ciphers else {})}


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: Optional[list[str]] = None
    api_key: Optional[str] = None
    chat_template: Optional[str] = None  # Jinja text (tokenizer.load_chat_template), replacing the model's
    access_log: bool = False
    log_stats: bool = True
    otlp_traces_endpoint: Optional[str] = None
    cors: Cors = field(default_factory=Cors)
    tls: Optional[Tls] = None
    tool_call_parser: Optional[str] = None  # set: tool_choice 'auto' is served, calls parsed with this parser
    reasoning_parser: Optional[str] = None  # set: chat replies carry the thinking as reasoning_content
    lora_modules: tuple[tuple[str, str], ...] = ()  # (served name, PEFT adapter directory), with --enable-lora
    runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter answer
    grpc_port: Optional[int] = None  # set: the gRPC API (server/grpc/) listens on host:grpc_port too
    root_path: str = ""  # the path prefix a reverse proxy serves the app under (ASGI root_path)
    uvicorn_log_level: str = "warning"
    request_defaults: RequestDefaults = field(default_factory=RequestDefaults)  # for what requests leave unset
    request_id_headers: bool = False  # every response carries X-Request-Id
    log_requests: bool = False  # log each request as it arrives (its prompt, parameters and token ids) ...
    max_log_len: Optional[int] = None  # ... cut to this many characters and token ids
    uds: Optional[str] = None  # set: listen on this Unix domain socket instead of host:port
    server_load_tracking: bool = False  # GET /load answers the number of inference requests in flight
    chat_template_content_format: str = "auto"  # how messages' content reaches the chat template (chat_content.py)
    fastapi_docs: bool = True  # /docs, /redoc and /openapi.json (--disable-fastapi-docs turns them off)
    middleware: tuple[str, ...] = ()  # ASGI middleware classes or HTTP middleware functions to add, by import name
    log_outputs: bool = False  # with log_requests: log each request's output when it finishes
    tool_parser_plugin: Optional[str] = None  # a file registering tool-call parsers, run where the app is built
    tokenizer_info: bool = False  # GET /tokenizer_info answers the tokenizer's details
    reasoning_parser_plugin: Optional[str] = None  # a file registering reasoning parsers, run where the app is built
    shutdown_timeout: float = 5.0  # on SIGTERM/SIGINT, the seconds requests in flight get to finish (0: none)
    access_log_skip: tuple[str, ...] = ()  # paths the access log leaves out (--disable-access-log-for-endpoints)
    histogram_buckets: Optional[dict[str, list[float]]] = None  # --custom-histogram-buckets: family → bounds
    tokens_only: bool = False  # --tokens-only: only the tokens-in, tokens-out API (/inference/v1/generate)
    scale_out: bool = False  # --enable-scale-out: that API beside the OpenAI ones (else its routes answer 403)


def _json_list(value: str) -> list[str]:
    try:
        items = json.loads(value)
    except json.JSONDecodeError:
        items = None
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise argparse.ArgumentTypeError(f"{value!r}: give a JSON list of strings, e.g. '[\"https://app.example\"]'")
    return items


def add_serve_args(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    cmd.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    cmd.add_argument("--uds", default=None, metavar="PATH",
                     help="listen on this Unix domain socket instead of --host/--port (vLLM's flag), for a proxy or "
                          "sidecar on the same machine")
    cmd.add_argument("--grpc-port", type=int, default=None,
                     help="also serve the gRPC API (pagellm.v1.Engine, with grpc.health.v1 and reflection) on this "
                          "port of --host (default: off)")
    cmd.add_argument("--served-model-name", action="append", default=None,
                     help="model name clients send (repeatable: the server answers to each, and responses "
                          "carry the name asked for; default: the model argument)")
    cmd.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1 routes (default: $PAGELLM_API_KEY)")
    cmd.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                     help="the chat template for /v1/chat/completions and /tokenize instead of the model's: a Jinja "
                          "file, or the template itself")
    cmd.add_argument("--chat-template-content-format", choices=CONTENT_FORMATS, default="auto",
                     help="how a message's content reaches the chat template (vLLM's flag): string (text parts joined "
                          "into one string), openai (a list of {type: text, text} parts, for templates that loop over "
                          "content), or auto (default: openai when the template loops over a message's content)")
    _add_app_args(cmd)
    _add_cors_and_tool_args(cmd)
    _add_request_args(cmd)
    cmd.add_argument("--enable-prompt-tokens-details", action="store_true",
                     help="accepted for vLLM command lines: usage always carries prompt_tokens_details.cached_tokens "
                          "(the prompt tokens the prefix cache served), as OpenAI's does")
    cmd.add_argument("--lora-modules", nargs="+", type=_lora_module, default=[], metavar="NAME=PATH",
                     help="LoRA adapters to serve (with --enable-lora), each as name=path or JSON {\"name\": ..., "
                          "\"path\": ...}: requests naming one as their model run with it")
    cmd.add_argument("--allow-runtime-lora-updating", action="store_true",
                     help="with --enable-lora: POST /v1/load_lora_adapter {lora_name, lora_path} and "
                          "/v1/unload_lora_adapter {lora_name} add and remove served adapters (they read server paths: "
                          "set --api-key)")
    cmd.add_argument("--reasoning-parser", default=None, metavar="NAME",
                     help="take a reasoning model's <think> block out of chat replies into reasoning_content: "
                          "deepseek_r1 (DeepSeek-R1 and its distills), qwen3 (Qwen3, QwQ), olmo3 (OLMo 3 Think), "
                          "granite (Granite 3.2/3.3's 'Here is my thought process:'), openai_gptoss (gpt-oss's "
                          "harmony messages), or a plugin's")
    cmd.add_argument("--reasoning-parser-plugin", default=None, metavar="FILE",
                     help="a Python file that registers reasoning parsers of its own (vLLM's flag: "
                          "register_reasoning_parser(\"name\", start=\"[THINK]\", end=\"[/THINK]\") from "
                          "pagellm.server.openai.reasoning), then named by --reasoning-parser")
    _add_tls_args(cmd)


def _add_app_args(cmd: argparse.ArgumentParser) -> None:
    app = cmd.add_argument_group("HTTP app, logs and observability")
    app.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                     help="GET /tokenizer_info answers the tokenizer's class, special and added tokens and chat "
                          "template (vLLM's flag), for a client that tokenizes as the server does")
    app.add_argument("--disable-fastapi-docs", action="store_true",
                     help="serve no /docs, /redoc or /openapi.json (the API's interactive docs and schema)")
    app.add_argument("--middleware", action="append", default=[], metavar="MODULE:NAME",
                     help="an ASGI middleware class or an async def (request, call_next) function to add to the app "
                          "(repeatable; importable by the server)")
    app.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False,
                     help="log every HTTP request (default: off)")
    app.add_argument("--disable-access-log-for-endpoints", default=None, metavar="PATHS",
                     help="with --access-log: paths whose requests it leaves out, comma-separated (vLLM's; e.g. "
                          "/health,/metrics,/ping for probes and scrapes)")
    app.add_argument("--root-path", default="", metavar="PREFIX",
                     help="the path prefix under which a reverse proxy serves the API (e.g. /llm), as vLLM's: the "
                          "app's own routes stay where they are")
    app.add_argument("--uvicorn-log-level", default="warning",
                     choices=["critical", "error", "warning", "info", "debug", "trace"],
                     help="the HTTP server's log level (default: warning)")
    app.add_argument("--log-level", type=str.upper, default=None,
                     choices=["CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG"],
                     help="the level of the server's and its engine cores' logs (vLLM's flag; default: "
                          "PAGELLM_LOG_LEVEL, else INFO)")
    app.add_argument("--logging-config", default=None, metavar="JSON",
                     help="vLLM's logging config: {\"log_level\": \"DEBUG\", \"formatter\": \"json\" (one JSON object "
                          "per line), \"configure_logging\": false (leave logging alone), \"pylogging_config_file\": "
                          "FILE (a logging.config.dictConfig JSON file)}, for the server and its engine cores")
    app.add_argument("--log-config-file", default=None, metavar="FILE",
                     help="a logging.config.dictConfig JSON file (vLLM's older flag: --logging-config's "
                          "pylogging_config_file)")
    app.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="SECONDS",
                     help="on SIGTERM or Ctrl+C, the seconds the requests in flight get to finish while no new "
                          "connection is taken; then they are cut and the engine stops (vLLM's flag; 0: at once; "
                          "default 5)")
    app.add_argument("--enable-server-load-tracking", action="store_true",
                     help="GET /load answers {\"server_load\": N}, the inference requests being served now (vLLM's "
                          "flag), for a load balancer that picks the least loaded replica")
    app.add_argument("--disable-log-stats", action="store_true",
                     help="turn engine stats off: no Prometheus engine series, no stats log line, no dashboard data")
    app.add_argument("--tokens-only", action="store_true",
                     help="serve only the tokens-in, tokens-out API (vLLM's flag: POST /inference/v1/generate and "
                          "/inference/v1/abort_requests, also /abort_requests), with no text decoded: for a gateway "
                          "that renders prompts and reads tokens itself")
    app.add_argument("--enable-scale-out", action="store_true",
                     help="serve vLLM's scale-out API beside the OpenAI ones: POST /inference/v1/generate (tokens in, "
                          "tokens out) and /inference/v1/abort_requests (vLLM's flag; without it they answer 403)")
    app.add_argument("--custom-histogram-buckets", type=_json_object, default=None, metavar="JSON",
                     help="Prometheus histogram bounds by family (vLLM's flag), replacing its defaults, e.g. "
                          "'{\"time_to_first_token\": [0.1, 0.5, 1, 2, 5]}'; families: request_latency, "
                          "time_to_first_token, inter_token_latency, iteration_tokens, request_tokens, "
                          "kv_cache_residency")
    app.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                     help="export one OpenTelemetry span per request to this OTLP endpoint (gRPC by default, e.g. "
                          "http://127.0.0.1:4317; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf for HTTP)")


def _add_cors_and_tool_args(cmd: argparse.ArgumentParser) -> None:
    cors = cmd.add_argument_group("CORS (browser pages on other origins)")
    for name in ("origins", "methods", "headers"):
        cors.add_argument(f"--allowed-{name}", type=_json_list, default=["*"], metavar="JSON_LIST",
                          help=f"the {name} a cross-origin call may use (default: [\"*\"])")
    cors.add_argument("--allow-credentials", action="store_true", help="let cross-origin calls send credentials")
    tools = cmd.add_argument_group("tool calling")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="serve tool_choice 'auto' (OpenAI's default with tools): the model chooses between text "
                            "and calls, and --tool-call-parser takes its calls out of the text")
    tools.add_argument("--tool-parser-plugin", default=None, metavar="FILE",
                       help="a Python file that registers tool-call parsers of its own (vLLM's flag: "
                            "@register_tool_parser(\"name\") on a ToolParser subclass, pagellm.server.openai."
                            "tool_parsers), then named by --tool-call-parser")
    tools.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help="the model's call syntax: hermes (<tool_call> JSON </tool_call>: Qwen2/2.5/3, Hermes), "
                            "llama3_json (a JSON object per call: Llama 3.1/3.2), mistral ([TOOL_CALLS] and a JSON "
                            "list: Mistral 7B v0.3), pythonic ([f(a=1), g()]), qwen3_coder (<function=f> with "
                            "<parameter=a> blocks: Qwen3-Coder), phi4_mini_json (functools[...]: Phi-4-mini), "
                            "granite (<tool_call> and a JSON list: Granite 3.x), olmo3 (<function_calls>: OLMo 3)")


def _add_request_args(cmd: argparse.ArgumentParser) -> None:
    requests = cmd.add_argument_group("request defaults and logging (vLLM's flags)")
    requests.add_argument("--enable-force-include-usage", action="store_true",
                          help="streamed completions and chats end with a usage chunk even when the request's "
                               "stream_options do not ask for it")
    requests.add_argument("--return-tokens-as-token-ids", action="store_true",
                          help="logprobs name every token 'token_id:<id>' unless a request says otherwise")
    requests.add_argument("--default-chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                          help="chat template arguments for every chat request, under the request's own "
                               "chat_template_kwargs, e.g. '{\"enable_thinking\": false}'")
    requests.add_argument("--response-role", default="assistant", metavar="ROLE",
                          help="the role of chat replies (default: assistant; a request that continues its last "
                               "message, add_generation_prompt false, gets that message's role)")
    requests.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                          help="chat requests with tool_choice 'none' do not show their tools to the chat template")
    requests.add_argument("--sse-keep-alive-interval", type=float, default=0.0, metavar="SECONDS",
                          help="send an SSE comment line every SECONDS a streamed completion or chat has nothing "
                               "to send (queued, in prefill, between tokens), so proxies with read timeouts keep the "
                               "connection (default 0: never)")
    requests.add_argument("--enable-per-request-metrics", action="store_true",
                          help="completion and chat responses (a stream's usage chunk) carry the request's own "
                               "timing under metrics: queue, time to first token, generation time, mean ITL, tokens/s")
    requests.add_argument("--per-request-spec-decode-metrics", choices=SPEC_LEVELS, default="none",
                          help="with speculative decoding, responses carry metrics.speculative_decoding: summary (the "
                               "acceptance histogram, mean acceptance length, rate) or detailed (and every verify "
                               "step's counts)")
    requests.add_argument("--trust-request-chat-template", action="store_true",
                          help="let chat requests bring their own chat_template (Jinja run on the server, sandboxed)")
    requests.add_argument("--enable-request-id-headers", action="store_true",
                          help="every response carries X-Request-Id: the request's own header, else a new id")
    requests.add_argument("--enable-log-requests", action="store_true",
                          help="log each request as it arrives: its prompt, sampling parameters and token ids")
    requests.add_argument("--enable-log-outputs", action="store_true",
                          help="with --enable-log-requests: log each request's output text and token ids as it "
                               "finishes")
    requests.add_argument("--max-log-len", type=int, default=None, metavar="N",
                          help="with --enable-log-requests: the most prompt characters and token ids logged "
                               "(default: all)")


def _add_tls_args(cmd: argparse.ArgumentParser) -> None:
    tls = cmd.add_argument_group("HTTPS")
    tls.add_argument("--ssl-keyfile", default=None, help="the server's private key (PEM), with --ssl-certfile")
    tls.add_argument("--ssl-certfile", default=None, help="the server's certificate chain (PEM), with --ssl-keyfile")
    tls.add_argument("--ssl-ca-certs", default=None,
                     help="CA certificates (PEM) that client certificates must chain to")
    tls.add_argument("--ssl-cert-reqs", type=int, choices=(0, 1, 2), default=0,
                     help="client certificates: 0 none (default), 1 optional, 2 required")
    tls.add_argument("--ssl-ciphers", default=None, metavar="LIST",
                     help="the cipher suites offered over TLS 1.2 and below, in OpenSSL's list format (e.g. "
                          "ECDHE-RSA-AES256-GCM-SHA384:ECDHE-RSA-CHACHA20-POLY1305); TLS 1.3 keeps its own")


def serve_options(args: argparse.Namespace) -> ServeOptions:
    """The parsed flags as options; the chat template is read and checked here (a ValueError names the problem)."""
    from pagellm.tokenizer import load_chat_template

    template = load_chat_template(args.chat_template) if args.chat_template is not None else None
    return ServeOptions(args.host, args.port, args.served_model_name, args.api_key or envs.api_key(), template,
                        args.access_log, not args.disable_log_stats, args.otlp_traces_endpoint,
                        Cors(args.allowed_origins, args.allowed_methods, args.allowed_headers,
                             args.allow_credentials), _tls(args), _tool_call_parser(args), _reasoning_parser(args),
                        _lora_modules(args), args.allow_runtime_lora_updating, args.grpc_port, args.root_path,
                        args.uvicorn_log_level, RequestDefaults(
                            args.enable_force_include_usage,  # without a tokenizer, logprobs name tokens by id
                            args.return_tokens_as_token_ids or bool(getattr(args, "skip_tokenizer_init", False)),
                            args.default_chat_template_kwargs, args.response_role,
                            args.exclude_tools_when_tool_choice_none, args.trust_request_chat_template,
                            _seconds(args.sse_keep_alive_interval, "--sse-keep-alive-interval", "off"),
                            args.enable_per_request_metrics, args.per_request_spec_decode_metrics),
                        args.enable_request_id_headers, args.enable_log_requests, _max_log_len(args),
                        args.uds, args.enable_server_load_tracking, args.chat_template_content_format,
                        not args.disable_fastapi_docs, tuple(args.middleware), _log_outputs(args),
                        args.tool_parser_plugin, args.enable_tokenizer_info_endpoint, args.reasoning_parser_plugin,
                        _seconds(args.shutdown_timeout, "--shutdown-timeout", "at once"),
                        tuple(p.strip() for p in (args.disable_access_log_for_endpoints or "").split(",") if p.strip()),
                        _buckets(args), args.tokens_only, args.enable_scale_out)


def _buckets(args: argparse.Namespace) -> Optional[dict[str, list[float]]]:
    from pagellm.metrics.prometheus import check_buckets

    return check_buckets(args.custom_histogram_buckets) if args.custom_histogram_buckets is not None else None


def _seconds(value: float, flag: str, zero: str) -> float:
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{flag} must be a number of seconds >= 0 (0: {zero}), got {value}")
    return value


def _reasoning_parser(args: argparse.Namespace) -> Optional[str]:
    if args.reasoning_parser_plugin is not None:
        reasoning.load_plugin(args.reasoning_parser_plugin)
    if args.reasoning_parser is not None:
        reasoning.get_reasoning_parser(args.reasoning_parser)  # a name no parser has: the error lists those there are
    return args.reasoning_parser


def _log_outputs(args: argparse.Namespace) -> bool:
    if args.enable_log_outputs and not args.enable_log_requests:
        raise ValueError("--enable-log-outputs goes with --enable-log-requests")
    return args.enable_log_outputs


def _max_log_len(args: argparse.Namespace) -> Optional[int]:
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}")
    return args.max_log_len


def _json_object(value: str) -> dict[str, Any]:
    try:
        item = json.loads(value)
    except json.JSONDecodeError:
        item = None
    if not isinstance(item, dict):
        raise argparse.ArgumentTypeError(f"{value!r}: give a JSON object, e.g. '{{\"enable_thinking\": false}}'")
    return item


def _lora_module(value: str) -> tuple[str, str]:
    try:
        item = json.loads(value) if value.lstrip().startswith("{") else None
    except json.JSONDecodeError:
        item = None
    name, _, path = (item.get("name", ""), "", item.get("path", "")) if isinstance(item, dict) else \
        value.partition("=")
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise argparse.ArgumentTypeError(f"{value!r}: give name=path or '{{\"name\": ..., \"path\": ...}}'")
    return name, path


def _lora_modules(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    modules = tuple(args.lora_modules)
    if (modules or args.allow_runtime_lora_updating) and not getattr(args, "enable_lora", False):
        raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
    names = [name for name, _ in modules]
    if len(set(names)) != len(names) or set(names) & set(args.served_model_name or []):
        raise ValueError("--lora-modules names must differ from each other and from --served-model-name")
    return modules


def _tool_call_parser(args: argparse.Namespace) -> Optional[str]:
    if args.tool_parser_plugin is not None:
        load_plugin(args.tool_parser_plugin)
    if args.tool_call_parser is not None:
        get_parser(args.tool_call_parser)  # a name no parser has: the error lists those there are
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser (one of {', '.join(PARSERS)}) "
                         "for the model's call syntax")
    return args.tool_call_parser if args.enable_auto_tool_choice else None


def _tls(args: argparse.Namespace) -> Optional[Tls]:
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    if args.ssl_keyfile is None:
        if args.ssl_ca_certs is not None or args.ssl_cert_reqs or args.ssl_ciphers:
            raise ValueError("--ssl-ca-certs, --ssl-cert-reqs and --ssl-ciphers go with --ssl-keyfile and "
                             "--ssl-certfile")
        return None
    tls = Tls(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs, args.ssl_ciphers)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:  # what uvicorn will load, loaded now: a wrong path or a key that does not match fails before the model loads
        context.load_cert_chain(tls.certfile, tls.keyfile)
        if tls.ca_certs is not None:
            context.load_verify_locations(tls.ca_certs)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot use the TLS files ({exc}); check --ssl-keyfile, --ssl-certfile and "
                         "--ssl-ca-certs") from None
    try:
        if tls.ciphers:
            context.set_ciphers(tls.ciphers)
    except ssl.SSLError:
        raise ValueError(f"--ssl-ciphers {tls.ciphers!r}: OpenSSL offers none of these cipher suites; give a list "
                         "such as ECDHE-RSA-AES256-GCM-SHA384:ECDHE-RSA-CHACHA20-POLY1305") from None
    return tls

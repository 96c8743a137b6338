"""The engine's command-line flags, generated from the config fields (name, type, default and help text), so every
engine option is a flag without being listed twice: ``add_engine_args`` adds them to a parser, ``engine_kwargs``
turns the parsed flags that were given into ``EngineConfig.from_kwargs`` keywords. Used by ``pagellm`` (cli.py),
the in-process benchmarks and the Ray Serve app's arguments.

``EngineArgs`` and ``AsyncEngineArgs`` are vLLM's classes of the same names, generated from the same fields: a
dataclass with one field per engine argument (its default the config's), plus vLLM's arguments that do nothing
here (``no_effect.ENGINE``, left None) and ``disable_log_stats``. A script written for vLLM runs as it is::

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(parser.parse_args()))

``create_engine_config()`` builds the ``EngineConfig``; ``LLM(**dataclasses.asdict(args))`` works too.
``AsyncEngineArgs`` adds ``enable_log_requests`` (``AsyncLLM.from_engine_args`` logs each request)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any

from pagellm import no_effect
from pagellm.config import EngineConfig, flat_fields, parse_size

# engine arguments given as JSON
_JSON_CONFIGS = ("speculative_config", "kv_transfer_config", "kv_events_config", "reasoning_config")
_SPEC_SHORTHANDS = ("spec_method", "spec_model", "spec_tokens")  # vLLM's flags for three keys of speculative_config
# vLLM's --reasoning-parser fills reasoning_config's parser; ``pagellm serve`` has it among the server's flags (it
# also splits chat replies), so add_engine_args leaves it out and engine_kwargs takes it from either
_REASONING_PARSER = "reasoning_parser"


def _size(value: str) -> int:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_COUNT = re.compile(r"(\d+(?:\.\d+)?)([kmgKMG]?)")
_DECIMAL, _BINARY = {"k": 10**3, "m": 10**6, "g": 10**9}, {"K": 2**10, "M": 2**20, "G": 2**30}


def token_count(value: str) -> int:
    """A number of tokens as vLLM's flags take it: ``4096``, or with a suffix, lower case decimal (``32k`` = 32000,
    ``1.5k`` = 1500) and upper case binary (``32K`` = 32768, whole numbers only)."""
    match = _COUNT.fullmatch(value.strip())
    if match is None or ("." in match.group(1) and not match.group(2)):
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of tokens: write 4096, 32k (32000) or 32K (32768)")
    number, suffix = match.groups()
    if suffix in _BINARY:
        if "." in number:
            raise argparse.ArgumentTypeError(f"{value!r}: a binary suffix takes a whole number; did you mean "
                                             f"{number}{suffix.lower()}?")
        return int(number) * _BINARY[suffix]
    return int(float(number) * _DECIMAL[suffix]) if suffix else int(number)


def _flag_type(field: dataclasses.Field) -> Any:
    hint = str(field.type)
    if field.metadata.get("size"):
        return _size
    if field.name in ("max_model_len", "max_num_batched_tokens", "max_num_scheduled_tokens", "max_num_queued_tokens"):
        # vLLM's human-readable counts: 32k, 32K
        return token_count
    if "bool" in hint:
        return None
    if "int" in hint:
        return int
    if "float" in hint:
        return float
    return str


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for field in flat_fields():
        if field.name == "model":
            continue
        flags = ("--" + field.name.replace("_", "-"), *field.metadata.get("aliases", ()))
        kind = _flag_type(field)
        if kind is None:
            group.add_argument(*flags, dest=field.name, action=argparse.BooleanOptionalAction, default=None,
                               help=f"{field.metadata['help']} (default: {field.default})")
        else:
            group.add_argument(*flags, dest=field.name, type=kind, default=None, nargs=field.metadata.get("nargs"),
                               help=f"{field.metadata['help']} (default: {field.default})")
    group.add_argument("--speculative-config", "-sc", default=None,
                       help='Speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'')
    group.add_argument("--spec-method", default=None, help="speculative_config's method (vLLM's shorthand)")
    group.add_argument("--spec-model", default=None, help="speculative_config's model (vLLM's shorthand)")
    group.add_argument("--spec-tokens", type=int, default=None,
                       help="speculative_config's num_speculative_tokens (vLLM's shorthand)")
    group.add_argument("--kv-transfer-config", default=None,
                       help='Disaggregated prefill/decode as JSON, e.g. \'{"kv_connector": "SharedStorageConnector", '
                            '"kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": "/kv"}}\'')
    group.add_argument("--kv-events-config", default=None,
                       help='KV cache events for KV-aware routers, as vLLM publishes them (ZMQ, msgpack), as JSON, '
                            'e.g. \'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": '
                            '"tcp://*:5558", "topic": "kv-events"}\'')
    group.add_argument("--reasoning-config", default=None,
                       help='A reasoning model\'s thinking tags as JSON, for thinking_token_budget, e.g. '
                            '\'{"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}\' (the end string '
                            'is what a spent budget forces; --reasoning-parser fills what is left out)')


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = [f.name for f in flat_fields() if f.name != "model"] + list(_JSON_CONFIGS) + list(_SPEC_SHORTHANDS) \
        + [_REASONING_PARSER]
    return {name: getattr(args, name, None) for name in names if getattr(args, name, None) is not None}


def _create_engine_config(self: Any) -> EngineConfig:
    """The ``EngineConfig`` these arguments describe (vLLM's ``EngineArgs.create_engine_config``)."""
    kwargs = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    for name in ("disable_log_stats", "enable_log_requests"):
        kwargs.pop(name, None)
    return EngineConfig.from_kwargs(**kwargs)


def _add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every engine argument as a flag (``--model`` included; vLLM's that do nothing here are taken and logged), as
    vLLM's ``EngineArgs.add_cli_args``; returns the parser."""
    parser.add_argument("--model", default=None, help="HF directory or .gguf file (default: built-in SmolLM2)")
    add_engine_args(parser)
    parser.add_argument("--reasoning-parser", default=None, help="the reasoning model's thinking tags by parser name "
                        "(deepseek_r1, qwen3), for thinking_token_budget")
    no_effect.add_flags(parser.add_argument_group("accepted from vLLM, without effect here"), no_effect.ENGINE)
    parser.add_argument("--disable-log-stats", action="store_true", default=None,
                        help="no periodic stats log line and no Prometheus series")
    return parser


def _from_cli_args(cls: type, args: argparse.Namespace) -> Any:
    """The arguments parsed by ``add_cli_args``'s flags (the flags not given keep their defaults)."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if getattr(args, f.name, None) is not None}
    return cls(**given)


def _async_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    _add_cli_args(parser)
    parser.add_argument("--enable-log-requests", action="store_true", default=None,
                        help="log each request as it arrives (its prompt, parameters and token ids)")
    return parser


def _fields() -> list[tuple[str, Any, dataclasses.Field]]:
    fields = [(f.name, f.type, dataclasses.field(default=f.default, metadata=f.metadata)) for f in flat_fields()]
    fields += [(name, Any, dataclasses.field(default=None))
               for name in (*_JSON_CONFIGS, *_SPEC_SHORTHANDS, _REASONING_PARSER, *no_effect.ENGINE)]
    return fields + [("disable_log_stats", bool, dataclasses.field(default=False))]


EngineArgs = dataclasses.make_dataclass("EngineArgs", _fields(), namespace={
    "__module__": __name__, "__doc__": "vLLM's ``EngineArgs``: every engine argument as a field (module docstring).",
    "create_engine_config": _create_engine_config, "add_cli_args": staticmethod(_add_cli_args),
    "from_cli_args": classmethod(_from_cli_args)})
AsyncEngineArgs = dataclasses.make_dataclass(
    "AsyncEngineArgs", [("enable_log_requests", bool, dataclasses.field(default=False))], bases=(EngineArgs,),
    namespace={"__module__": __name__, "__doc__": "vLLM's ``AsyncEngineArgs`` (adds enable_log_requests).",
               "add_cli_args": staticmethod(_async_cli_args)})

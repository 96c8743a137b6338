"""The engine's command-line flags, generated from the config fields (name, type, default and help text), so every
engine option is a flag without being listed twice: ``add_engine_args`` adds them to a parser, ``engine_kwargs``
turns the parsed flags that were given into ``EngineConfig.from_kwargs`` keywords. Used by ``pagellm`` (cli.py),
the in-process benchmarks and the Ray Serve app's arguments."""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any

from pagellm.config import flat_fields, parse_size


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
    if field.name in ("max_model_len", "max_num_batched_tokens"):  # vLLM's human-readable counts: 32k, 32K
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
    group.add_argument("--speculative-config", default=None,
                       help='Speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'')
    group.add_argument("--kv-transfer-config", default=None,
                       help='Disaggregated prefill/decode as JSON, e.g. \'{"kv_connector": "SharedStorageConnector", '
                            '"kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": "/kv"}}\'')
    group.add_argument("--kv-events-config", default=None,
                       help='KV cache events for KV-aware routers, as vLLM publishes them (ZMQ, msgpack), as JSON, '
                            'e.g. \'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": '
                            '"tcp://*:5558", "topic": "kv-events"}\'')


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = [f.name for f in flat_fields() if f.name != "model"] + ["speculative_config", "kv_transfer_config",
                                                                     "kv_events_config"]
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}

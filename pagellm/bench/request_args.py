"""``bench serve``'s flags for what each request carries besides its prompt: sampling parameters, extra JSON fields,
extra HTTP headers, and the run's metadata.

Sampling flags left unset are not sent (the server's defaults apply), except ``temperature``, always sent (1.0
unless given) so that runs against different servers sample alike. ``--extra-body`` is a JSON object merged into
every request body last (it may set any field a server takes, e.g. ``{"logprobs": 5}`` or a vendor extension),
except the fields the client itself depends on: the stream and the prompt.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pagellm.bench import vllm_flags

SAMPLING_FLAGS = ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
RESERVED_BODY_FIELDS = ("stream", "prompt", "messages")


def add_request_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("request")
    group.add_argument("--temperature", type=float, default=1.0)
    group.add_argument("--top-p", type=float, default=None, help="sent only when given (so for every flag below)")
    group.add_argument("--top-k", type=int, default=None)
    group.add_argument("--min-p", type=float, default=None)
    group.add_argument("--presence-penalty", type=float, default=None)
    group.add_argument("--frequency-penalty", type=float, default=None)
    group.add_argument("--repetition-penalty", type=float, default=None)
    group.add_argument("--extra-body", default=None, metavar="JSON",
                       help="a JSON object merged into every request body, e.g. '{\"logprobs\": 5}'")
    group.add_argument("--header", nargs="+", action="extend", default=[], metavar="NAME=VALUE",
                       help="an HTTP header sent with every request (several allowed)")
    group.add_argument("--no-stream", action="store_true",
                       help="ask for whole responses instead of streams: TTFT is then the whole request, and there "
                            "is no TPOT or ITL")
    group.add_argument(*vllm_flags.names("--ready-check-timeout"), dest="ready_check_timeout", type=float,
                       default=0.0, metavar="S",
                       help="wait up to S seconds for the server to answer GET /v1/models before the run "
                            "(default 0: one try)")
    parser.add_argument("--metadata", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="recorded in the result JSON's 'metadata' (e.g. the server's version or flags)")


def extra_body(args: argparse.Namespace) -> dict[str, Any]:
    """The fields added to every request body: the given sampling flags, then ``--extra-body``."""
    body: dict[str, Any] = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    if args.extra_body is None:
        return body
    try:
        extra = json.loads(args.extra_body)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--extra-body is not valid JSON ({exc}): {args.extra_body!r}") from None
    if not isinstance(extra, dict):
        raise ValueError(f"--extra-body must be a JSON object ({{\"name\": value, ...}}), not {args.extra_body!r}")
    reserved = [name for name in RESERVED_BODY_FIELDS if name in extra]
    if reserved:
        raise ValueError(f"--extra-body may not set {', '.join(reserved)}: the benchmark streams every response "
                         "and takes its prompts from the dataset")
    return {**body, **extra}


def pairs(items: list[str], flag: str) -> dict[str, str]:
    """``["a=1", "b=x=y"]`` → ``{"a": "1", "b": "x=y"}``; a ValueError naming ``flag`` for an item without a name."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"{flag} {item!r} must be NAME=VALUE")
        out[name.strip()] = value
    return out


def headers(args: argparse.Namespace) -> dict[str, str]:
    """``--header`` as a dict (no line breaks: they would end the header)."""
    out = pairs(args.header, "--header")
    for name, value in out.items():
        if any(c in name + value for c in "\r\n") or any(c in name for c in " :"):
            raise ValueError(f"--header {name}={value!r}: a header name has no spaces or colons, and neither part "
                             "may hold a line break")
    return out

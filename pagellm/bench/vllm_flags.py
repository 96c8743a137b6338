"""``vllm bench serve``'s spellings of ``pagellm bench serve``'s flags, so that a command line written for vLLM runs
here as it is, where the two mean the same thing.

Spelled differently, same meaning (extra names on our own flags, ``ALIASES``): ``--dataset-name`` (``--dataset``;
vLLM's ``prefix_repetition`` is our ``prefix``; ``--endpoint /v1/completions`` or ``/v1/chat/completions`` is our
``completions`` or ``chat``), ``--random-input-len``, ``--random-output-len``,
``--random-range-ratio``, the four ``--prefix-repetition-*`` lengths, ``--disable-tqdm`` (``--no-progress``) and
``--ready-check-timeout-sec``. Shaped differently, folded into ours by ``resolve`` before a run: ``--host`` and
``--port`` (``--base-url``), ``--backend openai|vllm|openai-chat`` (``--endpoint``), ``--served-model-name``
(``--model``), ``--metric-percentiles 50,95,99`` (``--percentiles``) and ``--save-result`` with ``--result-dir``
and ``--result-filename`` (``--result-json``). vLLM's ``random-mm`` dataset and its ``--random-mm-*`` flags are
``bench/mm_datasets.py``'s. vLLM's other datasets and options stay unknown flags: argparse names them.
"""

from __future__ import annotations

import argparse
import os
import time

DEFAULT_BASE_URL = "http://127.0.0.1:8000"

# our flag -> vLLM's other names for it
ALIASES = {
    "--dataset": ("--dataset-name",),
    "--input-len": ("--random-input-len", "--prefix-repetition-suffix-len"),
    "--output-len": ("--random-output-len", "--prefix-repetition-output-len"),
    "--range-ratio": ("--random-range-ratio",),
    "--num-prefixes": ("--prefix-repetition-num-prefixes",),
    "--prefix-len": ("--prefix-repetition-prefix-len",),
    "--no-progress": ("--disable-tqdm",),
    "--ready-check-timeout": ("--ready-check-timeout-sec",),
}

BACKENDS = {"openai": "completions", "vllm": "completions", "openai-chat": "chat"}


def names(flag: str) -> tuple[str, ...]:
    """``flag`` and vLLM's names for it, for ``add_argument``."""
    return (flag, *ALIASES.get(flag, ()))


def dataset_name(value: str) -> str:
    return "prefix" if value == "prefix_repetition" else value


def endpoint(value: str) -> str:
    """vLLM's ``--endpoint`` is the route: ``/v1/completions`` is our ``completions``, ``/v1/chat/completions``
    our ``chat``."""
    return {"/v1/completions": "completions", "/v1/chat/completions": "chat"}.get(value, value)


def _percentiles(value: str) -> list[float]:
    try:
        return [float(p) for p in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: give percentiles separated by commas, e.g. 50,95,99") from None


def add_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM's spellings (see pagellm/bench/vllm_flags.py)")
    group.add_argument("--host", default=None, help="with --port, the server at http://HOST:PORT")
    group.add_argument("--port", type=int, default=None)
    group.add_argument("--backend", choices=tuple(BACKENDS), default=None,
                       help="openai and vllm: --endpoint completions; openai-chat: --endpoint chat")
    group.add_argument("--served-model-name", default=None, help="the model name to send (as --model)")
    group.add_argument("--metric-percentiles", type=_percentiles, dest="percentiles", default=argparse.SUPPRESS,
                       metavar="P,P,...", help="as --percentiles, separated by commas")
    group.add_argument("--save-result", action="store_true",
                       help="write the JSON result to --result-dir/--result-filename (default: ./pagellm-bench-"
                            "TIME.json)")
    group.add_argument("--result-dir", default=None)
    group.add_argument("--result-filename", default=None)


def resolve(args: argparse.Namespace) -> None:
    """Fold vLLM's spellings into our flags, in place; a ValueError where both say different things."""
    if args.host is not None or args.port is not None:
        if args.base_url != DEFAULT_BASE_URL:
            raise ValueError("give the server as --base-url or as --host/--port, not both")
        args.base_url = f"http://{args.host or '127.0.0.1'}:{args.port or 8000}"
    if args.backend is not None:
        route = BACKENDS[args.backend]
        if args.endpoint not in ("auto", route):
            raise ValueError(f"--backend {args.backend} sends to {route}, --endpoint says {args.endpoint}")
        args.endpoint = route
    if args.served_model_name is not None:
        if args.model not in (None, args.served_model_name):
            raise ValueError("--served-model-name and --model name different models: give one")
        args.model = args.served_model_name
    if args.save_result:
        if args.result_json:
            raise ValueError("give --result-json or --save-result, not both")
        name = args.result_filename or f"pagellm-bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
        args.result_json = os.path.join(args.result_dir or ".", name)
    elif args.result_dir or args.result_filename:
        raise ValueError("--result-dir and --result-filename go with --save-result")

"""vLLM command lines for ``pagellm serve`` and ``pagellm run-batch``: a YAML ``--config`` file, and the vLLM flags
that have nothing to do on a CPU server, accepted and named in the log.

- ``--config FILE`` (vLLM's): a YAML mapping of flag names (``max-model-len`` or ``max_model_len``) to values, as on
  the command line (``true`` for a switch, a list for a repeatable flag, a mapping for a JSON one); flags given on
  the command line win over the file. A name that is not a flag of the command is refused, by name.
- ``IGNORED``: vLLM flags a ported command line carries that pagellm has no use for. Each is accepted and, when
  given, logged with what to use instead.
- ``--tokenizer-mode``: ``auto`` and ``hf`` are taken (pagellm's tokenizers are Hugging Face fast tokenizers);
  ``slow``, ``mistral`` and ``custom`` are refused, by name.
- The structured-output backend (``--structured-outputs-config '{"backend": ...}'``, or the older
  ``--guided-decoding-backend``): ``auto`` and ``xgrammar`` are taken (pagellm's grammars run on xgrammar); another
  backend is refused, by name, rather than silently swapped.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any, Sequence

from pagellm import no_effect

logger = logging.getLogger(__name__)
H11 = "pagellm's HTTP server parses requests with httptools, not h11"
# the server's own vLLM flags that do nothing here (the engine's are no_effect.ENGINE, which LLM(...) takes too)
SERVER: dict[str, str] = {
    "disable_log_requests": "requests are not logged unless --enable-log-requests",
    "disable_uvicorn_access_log": "the access log is off unless --access-log",
    "disable_frontend_multiprocessing": "the engine core runs in a process of its own in every pagellm server",
    "log_error_stack": "internal errors (500) are logged with their stack trace always; a 4xx names what to fix",
    "enable_log_deltas": "--enable-log-outputs logs each request's whole output once, when it finishes",
    "h11_max_header_count": H11,
    "h11_max_incomplete_event_size": H11,
}
# name → why it does nothing here; no_effect.FLAGS (and the one below) type their flags, the rest are switches
IGNORED: dict[str, str] = {**no_effect.ENGINE, **SERVER}
_KINDS = {**no_effect.FLAGS, "enable_log_deltas": {"action": argparse.BooleanOptionalAction},
          "h11_max_header_count": {"type": int}, "h11_max_incomplete_event_size": {"type": int}}
STRUCTURED_BACKENDS = ("auto", "xgrammar")


def add_args(cmd: argparse.ArgumentParser) -> None:
    """``--config`` and the ``IGNORED`` flags."""
    cmd.add_argument("--config", default=None, metavar="FILE.yaml",
                     help="flags from a YAML file ({max-model-len: 4096, enable-prefix-caching: true, ...}); flags "
                          "on the command line win (vLLM's --config)")
    group = cmd.add_argument_group("accepted from vLLM command lines, without effect here")
    no_effect.add_flags(group, IGNORED, _KINDS)
    cmd.add_argument("--api-server-count", "-asc", type=int, default=None, metavar="N",
                     help="vLLM's: 1, pagellm's one API server process (more are refused: run more servers behind a "
                          "load balancer, or --data-parallel-size N engine cores behind this one)")
    cmd.add_argument("--tokenizer-mode", default=None, metavar="MODE",
                     help="vLLM's: auto or hf (pagellm's tokenizers are Hugging Face fast tokenizers); slow, mistral "
                          "and custom are refused")
    structured = cmd.add_argument_group("structured outputs (vLLM's flags)")
    structured.add_argument("--structured-outputs-config", default=None, metavar="JSON",
                            help='the backend, as JSON (\'{"backend": "xgrammar"}\'): auto or xgrammar, which '
                                 "pagellm's grammars run on; other backends are refused")
    structured.add_argument("--structured-outputs-config.backend", dest="structured_outputs_backend", default=None,
                            metavar="NAME", help="the same in vLLM's dotted form: auto or xgrammar")
    structured.add_argument("--guided-decoding-backend", default=None, metavar="NAME",
                            help="vLLM's older flag for the same: auto or xgrammar")
    cmd.set_defaults(config_parser=cmd)


def reparse(parser: argparse.ArgumentParser, args: argparse.Namespace,
            argv: Sequence[str] | None) -> argparse.Namespace:
    """``args`` again with ``--config``'s file as the command's defaults (ValueError for a bad file), and a log line
    for each ``IGNORED`` flag given."""
    if getattr(args, "config", None):
        command: argparse.ArgumentParser = args.config_parser
        command.set_defaults(**_file_defaults(Path(args.config), command))
        args = parser.parse_args(argv)
    for name, why in IGNORED.items():
        if getattr(args, name, None) not in (None, False):
            logger.warning("--%s has no effect in pagellm: %s", name.replace("_", "-"), why)
    _check_structured_backend(args)
    count = getattr(args, "api_server_count", None)
    if count not in (None, 1):
        raise ValueError(f"--api-server-count {count}: pagellm runs one API server process (its requests are "
                         "parsed and detokenized apart from the engine core's process); for more throughput run "
                         "several servers behind a load balancer, or --data-parallel-size N engine cores behind it")
    mode = getattr(args, "tokenizer_mode", None)
    if mode not in (None, "auto", "hf"):
        raise ValueError(f"--tokenizer-mode {mode!r}: pagellm runs Hugging Face fast tokenizers only (auto or hf); "
                         "a mistral-format tokenizer needs its tokenizer.json form")
    return args


def _check_structured_backend(args: argparse.Namespace) -> None:
    """``--structured-outputs-config`` / ``--guided-decoding-backend``: a backend but auto or xgrammar is a
    ValueError."""
    backends = {"--guided-decoding-backend": getattr(args, "guided_decoding_backend", None),
                "--structured-outputs-config.backend": getattr(args, "structured_outputs_backend", None)}
    text = getattr(args, "structured_outputs_config", None)
    if text is not None:
        try:
            config = json.loads(text)
        except json.JSONDecodeError:
            config = None
        if not isinstance(config, dict) or set(config) - {"backend"}:
            raise ValueError(f"--structured-outputs-config {text!r}: give a JSON object with the backend only, e.g. "
                             "'{\"backend\": \"xgrammar\"}'")
        backends["--structured-outputs-config"] = config.get("backend")
    for flag, backend in backends.items():
        if backend is not None and backend not in STRUCTURED_BACKENDS:
            raise ValueError(f"{flag}: backend {backend!r} is not pagellm's; its structured outputs run on xgrammar "
                             "(give auto or xgrammar, or leave the flag out)")


def _file_defaults(path: Path, command: argparse.ArgumentParser) -> dict[str, Any]:
    import yaml

    try:
        values = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--config {path}: {exc}") from None
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: give a mapping of flag names to values, e.g. 'max-model-len: 4096'")
    actions = {action.dest: action for action in command._actions if action.option_strings}
    defaults = {}
    for key, value in values.items():
        dest = str(key).lstrip("-").replace("-", "_")
        action = actions.get(dest)
        if action is None or dest == "config":
            raise ValueError(f"--config {path}: {key!r} is not a flag of this command (pagellm serve --help)")
        defaults[dest] = _as_flag_value(action, value)
    return defaults


def _as_flag_value(action: argparse.Action, value: Any) -> Any:
    """A YAML value as the flag's parsed value: strings through the flag's type (argparse converts a string default
    itself), a mapping as the JSON a JSON flag reads, each string of a list through the type."""
    if isinstance(value, dict) or (isinstance(value, list) and action.type is not None and action.nargs is None):
        return json.dumps(value)  # a JSON flag's text
    if isinstance(value, list) and action.type is not None:
        return [action.type(item) if isinstance(item, str) else item for item in value]
    return value

"""Default sampling parameters from a model's ``generation_config.json``, as vLLM applies them.

A model's creators often recommend how to sample it (Llama 3 Instruct: temperature 0.6, top_p 0.9) in
``generation_config.json``. With ``generation_config="auto"`` (the default, vLLM's too) a request that leaves one of
``SAMPLING_KEYS`` unset takes the file's value instead of the neutral OpenAI default, and ``max_new_tokens`` becomes
the default ``max_tokens``; what a request sets always wins. ``"vllm"`` keeps the neutral defaults (vLLM's name for
that), and a folder path reads the ``generation_config.json`` in it instead of the model's;
``override_generation_config`` sets keys over either (also over ``vllm``'s none, as vLLM does). ``do_sample`` is not
consulted, as vLLM does not: a file that sets a temperature makes it the default even with ``do_sample: false``.
The OpenAI server (``server/openai/protocol.py``) and ``LLM.generate`` without sampling parameters apply them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagellm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagellm.config import ModelConfig

logger = logging.getLogger(__name__)

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")
NEUTRAL = "vllm"


def for_model(model: ModelConfig, model_dir: Path) -> dict[str, Any]:
    """``sampling_defaults`` of a model config whose model resolved to ``model_dir``."""
    return sampling_defaults(model_dir, model.generation_config, model.override_generation_config)


def sampling_defaults(model_dir: Path, source: str = "auto", override: dict[str, Any] | None = None
                      ) -> dict[str, Any]:
    """The ``SamplingParams`` fields ``source`` (``ModelConfig.generation_config``, checked there) sets for requests
    that leave them unset (none for ``vllm``), with ``override`` (``override_generation_config``, generation-config
    keys) set over them."""
    path = (Path(model_dir) if source == "auto" else Path(source)) / "generation_config.json"
    config = {} if source == NEUTRAL else _read(path)
    unknown = sorted(set(override or {}) - {*SAMPLING_KEYS, "max_new_tokens"})
    if unknown:
        raise ValueError(f"override_generation_config: {', '.join(unknown)} not among its keys "
                         f"({', '.join(SAMPLING_KEYS)}, max_new_tokens)")
    config.update(override or {})
    defaults = {key: config[key] for key in SAMPLING_KEYS if config.get(key) is not None}
    if config.get("max_new_tokens") is not None:
        defaults["max_tokens"] = config["max_new_tokens"]
    _check_values(defaults, path if not override else f"{path} with override_generation_config")
    if defaults:
        logger.info("default sampling parameters: %s (from %s%s; what a request sets wins, --generation-config vllm "
                    "keeps the neutral defaults)", defaults, "nothing" if source == NEUTRAL else path,
                    " and override_generation_config" if override else "")
    return defaults


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not readable JSON ({exc}); fix it, or pass --generation-config vllm to leave "
                         "it out") from None
    return config if isinstance(config, dict) else {}


def _check_values(defaults: dict[str, Any], where: Path | str) -> None:
    try:
        SamplingParams(**defaults)  # validates in __post_init__
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where} sets sampling defaults pagellm cannot use ({exc}); fix it, or pass "
                         "--generation-config vllm to leave the file out") from None


# The sampling fields a request may leave unset: the server's default for them (``sampling_defaults``), else
# ``SamplingParams``' own (OpenAI's).
DEFAULTED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty")
_NEUTRAL = SamplingParams()


def unset_default(name: str, defaults: dict[str, Any] | None) -> Any:
    """The value of a sampling field a request left unset."""
    return (defaults or {}).get(name, getattr(_NEUTRAL, name))

"""pagellm: a high-throughput LLM inference engine (paged KV cache, prefix caching, one token-budget scheduler)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagellm.config import EngineConfig
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagellm.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineConfig"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # ``LLM`` (the in-process engine, and with it torch) loads on first use: the server's frontend process imports
    # this package but never runs a model, and starts the engine core sooner without torch's second of imports.
    if name == "LLM":
        from pagellm.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagellm' has no attribute {name!r}")

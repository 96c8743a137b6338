"""pagellm: a high-throughput LLM inference engine (paged KV cache, prefix caching, one token-budget scheduler)."""

from pagellm.config import EngineConfig
from pagellm.llm import LLM
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineConfig"]
__version__ = "0.1.0"

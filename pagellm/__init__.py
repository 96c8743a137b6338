"""pagellm: a high-throughput LLM inference engine (paged KV cache, prefix caching, one token-budget scheduler)."""

from pagellm.config import EngineConfig
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine_args import AsyncEngineArgs, EngineArgs
from pagellm.llm import LLM
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "AsyncEngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput",
           "EngineConfig"]
__version__ = "0.1.0"

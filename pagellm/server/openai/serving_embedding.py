"""``POST /v1/embeddings``: OpenAI's embeddings API over a decoder model, by last-token pooling.

Contract:
- ``input`` is a string, a list of strings, a list of token ids or a list of such lists, as OpenAI takes it; each
  becomes one engine request that runs as a one-token greedy request (``SamplingParams.pooling``) through the same
  scheduler, batches and prefix cache as generation, and returns the final hidden state of its last token,
  L2-normalised: the pooling of decoder embedding models (Qwen3-Embedding, e5-mistral, gte-Qwen2). Whether the
  served model was trained for it is the user's choice, as with vLLM's ``--convert embed``.
- ``encoding_format`` "float" (default) gives lists of floats, "base64" the little-endian float32 bytes in base64
  (what the ``openai`` SDK asks for by default and decodes). ``dimensions`` below the model's width keeps the
  first ones and normalises again (Matryoshka truncation; meaningful for models trained so); above it, a 400.
- ``usage`` counts the prompt tokens (``prompt_tokens`` = ``total_tokens``); checks and limits are those of
  completions (``truncate_prompt_tokens``, ``add_special_tokens``, ``max_model_len``), all before anything runs.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

import numpy as np
from pydantic import BaseModel, Field

from pagellm.outputs import pooled_embedding
from pagellm.server.openai.errors import APIError
from pagellm.server.openai.protocol import Count, Int64, OpenAIModel, TokenId, TruncationSide
from pagellm.server.openai.serving_engine import OpenAIServing, random_id


class EmbeddingRequest(OpenAIModel):
    model: Optional[str] = None
    input: Union[str, list[str], list[TokenId], list[list[TokenId]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[Count] = None
    user: Optional[str] = None
    # vLLM's extra fields
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1)
    truncation_side: Optional[TruncationSide] = None
    add_special_tokens: bool = True
    priority: Int64 = 0


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Union[list[float], str]


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


@dataclass
class _Job:
    request: EmbeddingRequest
    request_id: str
    model: str
    prompts: list[list[int]]
    created: int = field(default_factory=lambda: int(time.time()))


class OpenAIServingEmbedding(OpenAIServing):

    def prepare(self, request: EmbeddingRequest) -> _Job:
        """Validate and tokenize (APIError / ValueError → 4xx before anything is queued)."""
        model = self.check_model(request.model)
        self.check_embeds()
        width = self.engine.runtime.hidden_size
        if request.dimensions is not None and request.dimensions > width:
            raise APIError(f"dimensions ({request.dimensions}) must be at most the model's hidden size ({width})",
                           400, param="dimensions")
        items = self.tokenize_prompts(request.input, request.add_special_tokens, request.truncate_prompt_tokens,
                                      "input", request.truncation_side)
        return _Job(request, random_id("embd"), model, [ids for _, ids, _ in items])

    async def create(self, job: _Job) -> EmbeddingResponse:
        pooled = await self.pool(job.prompts, job.model, job.request_id, job.request.priority)
        data = [EmbeddingData(index=i, embedding=encode_floats(_vector(hidden, job.request.dimensions),
                                                              job.request.encoding_format))
                for i, hidden in enumerate(pooled)]
        tokens = sum(len(p) for p in job.prompts)
        return EmbeddingResponse(id=job.request_id, created=job.created, model=job.model, data=data,
                                 usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


def _vector(hidden: list[float], dimensions: Optional[int]) -> list[float]:
    """The normalised embedding, cut to its first ``dimensions`` and normalised again when asked."""
    return pooled_embedding(hidden[:dimensions] if dimensions else hidden)


def encode_floats(vector: list[float], encoding_format: str) -> Union[list[float], str]:
    """``vector`` as floats, or its little-endian float32 bytes in base64 (``encoding_format="base64"``)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector

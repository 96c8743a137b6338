"""``POST /classify`` (vLLM's route, also under ``/v1``): a sequence classifier's class probabilities per input; and
``POST /pooling`` (vLLM's): any pooling model's raw pooled output per input (a reward model's score).

Contract:
- The served model must be a classifier (a ``*ForSequenceClassification`` checkpoint: ``runtime.labels``), else a
  400 that says so. ``input`` takes what the embeddings API takes (a string, token ids, or a list of either); each
  becomes one pooling request through the same scheduler, batches and prefix cache as generation, whose last token's
  state goes through the model's score head in the worker (``LlamaForCausalLM.pool``).
- Each item of ``data``: its input's ``index``, ``probs`` (softmax of the class logits; a sigmoid with one class),
  ``num_classes`` and ``label``, the name of the likeliest class (the checkpoint's ``id2label``). ``usage`` counts
  the prompt tokens. Checks and limits are the embeddings API's, all before anything runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from pydantic import BaseModel, Field

from pagellm.outputs import class_probs, pooled_embedding
from pagellm.server.openai.errors import APIError
from pagellm.server.openai.protocol import Int64, OpenAIModel, TokenId, TruncationSide
from pagellm.server.openai.serving_embedding import encode_floats
from pagellm.server.openai.serving_engine import OpenAIServing, random_id


class ClassificationRequest(OpenAIModel):
    model: Optional[str] = None
    input: Union[str, list[str], list[TokenId], list[list[TokenId]]]
    user: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1)
    truncation_side: Optional[TruncationSide] = None
    add_special_tokens: bool = True
    priority: Int64 = 0


class ClassificationData(BaseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassificationUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ClassificationResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: ClassificationUsage


@dataclass
class _Job:
    request: ClassificationRequest
    request_id: str
    model: str
    prompts: list[list[int]]
    created: int = field(default_factory=lambda: int(time.time()))


class OpenAIServingClassification(OpenAIServing):

    def prepare(self, request: ClassificationRequest) -> _Job:
        """Validate and tokenize (APIError / ValueError → 4xx before anything is queued)."""
        model = self.check_model(request.model)
        if not self.engine.runtime.labels:
            raise APIError("this model has no classification head: /classify needs a *ForSequenceClassification "
                           "checkpoint (Llama, Mistral, Qwen2, Qwen3, BERT, RoBERTa, XLM-RoBERTa, ModernBERT)", 400,
                           param="model", code="model_not_supported")
        items = self.tokenize_prompts(request.input, request.add_special_tokens, request.truncate_prompt_tokens,
                                      "input", request.truncation_side)
        return _Job(request, random_id("classify"), model, [ids for _, ids, _ in items])

    async def create(self, job: _Job) -> ClassificationResponse:
        logits = await self.pool(job.prompts, job.model, job.request_id, job.request.priority)
        labels = self.engine.runtime.labels
        data = []
        for index, one in enumerate(logits):
            probs = class_probs(one)
            data.append(ClassificationData(index=index, label=labels[max(range(len(probs)), key=probs.__getitem__)],
                                           probs=probs, num_classes=len(probs)))
        tokens = sum(len(p) for p in job.prompts)
        return ClassificationResponse(id=job.request_id, created=job.created, model=job.model, data=data,
                                      usage=ClassificationUsage(prompt_tokens=tokens, total_tokens=tokens))


class PoolingRequest(ClassificationRequest):
    encoding_format: Literal["float", "base64"] = "float"


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: Union[list[float], str]


class PoolingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: ClassificationUsage


class OpenAIServingPooling(OpenAIServing):
    """``POST /pooling`` (vLLM's): each input's pooled output as it is, a reward model's score among them: a
    classifier's class logits (no softmax, no sigmoid), else the L2-normalised last hidden state (the embedding)."""

    def prepare(self, request: PoolingRequest) -> _Job:
        model = self.check_model(request.model)
        items = self.tokenize_prompts(request.input, request.add_special_tokens, request.truncate_prompt_tokens,
                                      "input", request.truncation_side)
        return _Job(request, random_id("pool"), model, [ids for _, ids, _ in items])

    async def create(self, job: _Job) -> PoolingResponse:
        pooled = await self.pool(job.prompts, job.model, job.request_id, job.request.priority)
        raw = bool(self.engine.runtime.labels)
        encoding = job.request.encoding_format  # type: ignore[attr-defined]
        data = [PoolingData(index=i, data=encode_floats(one if raw else pooled_embedding(one), encoding))
                for i, one in enumerate(pooled)]
        tokens = sum(len(p) for p in job.prompts)
        return PoolingResponse(id=job.request_id, created=job.created, model=job.model, data=data,
                               usage=ClassificationUsage(prompt_tokens=tokens, total_tokens=tokens))

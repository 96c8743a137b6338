"""``POST /generative_scoring`` (vLLM's): how likely a generative model finds each of some label tokens right after a
query joined with an item (a yes/no relevance judgement, a rating's digit), one prompt and one forward pass per item.

Contract:
- ``query`` (text or token ids) and ``items`` (texts, or token-id lists) make one prompt per item: the query's tokens
  then the item's (``item_first``: the item's, then the query's). Text is tokenized as vLLM does: the query with the
  tokenizer's special tokens (unless ``add_special_tokens: false``), each item without. A prompt longer than
  ``max_model_len - 1`` keeps its first tokens (room for the one token read).
- ``label_token_ids`` (1 to 128 ids of the vocabulary): each prompt's next-token logprobs of those tokens are read
  (one generated token, its ``logprob_token_ids``). An item's ``score`` is the first label's probability, over the
  labels alone (``apply_softmax``, the default: a softmax of their logprobs) or over the whole vocabulary.
- The reply is ``{id, object: "list", created, model, data: [{index, object: "score", score}], usage}``, items in
  order; ``usage`` counts the prompts' tokens and the one token each generated.
- Every item runs at once through the scheduler (a query they share is prefix-cached), with ``priority`` and
  ``cache_salt`` as on completions; every check (the model, the labels, the items) comes before anything runs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Literal, Optional, Union

from pydantic import BaseModel, Field

from pagellm.sampling_params import MAX_LOGPROB_TOKEN_IDS, SamplingParams
from pagellm.server.openai.errors import APIError
from pagellm.server.openai.protocol import Int64, OpenAIModel, TokenId
from pagellm.server.openai.replies import UsageInfo
from pagellm.server.openai.serving_engine import OpenAIServing, random_id


class GenerativeScoringRequest(OpenAIModel):
    model: Optional[str] = None
    query: Union[str, list[TokenId]]
    items: Union[list[str], list[list[TokenId]]] = Field(min_length=1)
    label_token_ids: list[TokenId] = Field(min_length=1, max_length=MAX_LOGPROB_TOKEN_IDS)
    apply_softmax: bool = True
    item_first: bool = False
    add_special_tokens: bool = True
    cache_salt: Optional[str] = Field(None, min_length=1)
    priority: Int64 = 0
    request_id: Optional[str] = Field(None, min_length=1, max_length=256)


class GenerativeScore(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class GenerativeScoringResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[GenerativeScore]
    usage: UsageInfo


@dataclass
class _Job:
    request: GenerativeScoringRequest
    request_id: str
    model: str
    prompts: list[list[int]]
    params: SamplingParams


class OpenAIServingGenerativeScoring(OpenAIServing):

    def prepare(self, request: GenerativeScoringRequest) -> _Job:
        """Check the request and build its prompts (APIError → 4xx before anything is queued)."""
        model = self.check_model(request.model)
        if self.engine.runtime.pooling_only:
            raise APIError("generative scoring reads a generative model's next-token logprobs; this server's model "
                           "pools (use /score)", 400, param="model", code="model_not_supported")
        outside = [t for t in request.label_token_ids if t >= self.vocab_size]
        if outside:
            raise APIError(f"label_token_ids {outside} are not in the vocabulary (ids 0 to {self.vocab_size - 1})",
                           400, param="label_token_ids")
        query = self._tokens(request.query, request.add_special_tokens)
        prompts = []
        for index, item in enumerate(request.items):
            tokens = self._tokens(item, False, index)
            prompt = tokens + query if request.item_first else query + tokens
            prompts.append(self.check_prompt(prompt[:self.max_model_len - 1], index))
        params = SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=list(request.label_token_ids))
        return _Job(request, random_id("generative-scoring", request.request_id), model, prompts,
                    self.check_params(model, params))

    def _tokens(self, text: Union[str, list[int]], special: bool, index: Optional[int] = None) -> list[int]:
        if not isinstance(text, str):
            return list(text)
        self.check_text_length(len(text), index)
        return self.tokenizer.encode(text, add_special_tokens=special)

    async def create(self, job: _Job) -> GenerativeScoringResponse:
        read: dict[int, dict[int, float]] = {}
        generated = 0
        async for index, output in self.generate(job.prompts, job.params, job.request_id, job.request.priority,
                                                 cache_salt=job.request.cache_salt):
            completion = output.outputs[0]
            generated += len(completion.token_ids)
            for logprobs in completion.logprobs or []:
                read.setdefault(index, {t: lp.logprob for t, lp in logprobs.items()})
        data = [GenerativeScore(index=i, score=score(read[i], job.request.label_token_ids,
                                                     job.request.apply_softmax)) for i in range(len(job.prompts))]
        prompt_tokens = sum(len(prompt) for prompt in job.prompts)
        return GenerativeScoringResponse(id=job.request_id, model=job.model, data=data,
                                         usage=UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=generated,
                                                         total_tokens=prompt_tokens + generated))


def score(logprobs: dict[int, float], labels: list[int], apply_softmax: bool) -> float:
    """The first label's probability: over the labels alone (a softmax of their logprobs) or the whole vocabulary."""
    first = logprobs[labels[0]]
    if not apply_softmax:
        return math.exp(first)
    distinct = [logprobs[t] for t in dict.fromkeys(labels)]
    top = max(distinct)
    return math.exp(first - top) / sum(math.exp(lp - top) for lp in distinct)

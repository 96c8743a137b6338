"""``POST /score`` and ``POST /rerank`` (also under ``/v1``, and ``/v2/rerank``): vLLM's scoring APIs over the
embeddings of ``serving_embedding.py``, for embedding models (bi-encoders): a pair's score is the cosine similarity
of its two texts' embeddings.

Contract:
- ``/score`` takes ``text_1`` and ``text_2``, each a string or a list of strings, paired by vLLM's rule
  (``scoring.pair_texts``: 1–1, 1–N, N–N index by index; other lengths are a 400).
  It answers ``data: [{index, object: "score", score}]`` in pair order.
- ``/rerank`` (Jina's and Cohere's shape, as vLLM serves it) takes ``query`` and ``documents``; it answers
  ``results: [{index, document: {text}, relevance_score}]``, most relevant first, the first ``top_n`` (all when 0 or
  unset), documents left out with ``return_documents: false``.
- Each distinct text is embedded once (a query scored against many documents runs once), all of them as one batch
  of engine requests through the scheduler, its prefix cache included; ``usage`` counts their prompt tokens. Checks
  and limits are the embeddings API's (``truncate_prompt_tokens``, ``max_model_len``), all before anything runs.
- A cross-encoder (a sequence classifier with one class: a reranker's score head) scores each pair instead as one
  prompt, the two texts joined by the tokenizer's pair template, whose class logit's sigmoid is the score (as vLLM
  serves cross-encoders); no text is deduplicated then. A classifier of several classes scores nothing (400).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from pydantic import BaseModel, Field

from pagellm.outputs import class_probs, pooled_embedding
from pagellm.scoring import cosine, distinct, pair_texts
from pagellm.server.openai.errors import APIError
from pagellm.server.openai.protocol import Int64, OpenAIModel, TruncationSide
from pagellm.server.openai.serving_engine import OpenAIServing, random_id


class ScoreRequest(OpenAIModel):
    model: Optional[str] = None
    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1)
    truncation_side: Optional[TruncationSide] = None
    add_special_tokens: bool = True
    priority: Int64 = 0
    user: Optional[str] = None


class RerankRequest(OpenAIModel):
    model: Optional[str] = None
    query: str
    documents: list[str]
    top_n: int = Field(0, ge=0)
    return_documents: bool = True
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1)
    truncation_side: Optional[TruncationSide] = None
    add_special_tokens: bool = True
    priority: Int64 = 0
    user: Optional[str] = None


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: Optional[RerankDocument] = None
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


@dataclass
class _Job:
    request: Union[ScoreRequest, RerankRequest]
    request_id: str
    model: str
    prompts: list[list[int]]          # the distinct texts' token ids, each embedded once (a cross-encoder's: each pair)
    pairs: list[tuple[int, int]]      # each pair's two texts, by position in ``texts`` (none for a cross-encoder)
    created: int = field(default_factory=lambda: int(time.time()))


class OpenAIServingScore(OpenAIServing):

    def prepare(self, request: Union[ScoreRequest, RerankRequest]) -> _Job:
        """Pair, deduplicate and tokenize (APIError / ValueError → 4xx before anything is queued)."""
        model = self.check_model(request.model)
        cross = len(self.engine.runtime.labels) == 1
        if not cross:
            self.check_embeds()
        if isinstance(request, RerankRequest):
            if not request.documents:
                raise APIError("documents must not be empty", 400, param="documents")
            pairs = [(request.query, doc) for doc in request.documents]
        else:
            pairs = pair_texts(request.text_1, request.text_2)
        if cross:
            prompts = [self.check_prompt(self.truncate(self.tokenizer.encode_pair(a, b, request.add_special_tokens),
                                                       request.truncate_prompt_tokens, request.truncation_side), i)
                       for i, (a, b) in enumerate(pairs)]
            return _Job(request, random_id("score" if isinstance(request, ScoreRequest) else "rerank"), model,
                        prompts, [])
        texts, positions = distinct(pairs)
        items = self.tokenize_prompts(texts, request.add_special_tokens, request.truncate_prompt_tokens,
                                      "documents" if isinstance(request, RerankRequest) else "text_1",
                                      request.truncation_side)
        return _Job(request, random_id("score" if isinstance(request, ScoreRequest) else "rerank"), model,
                    [ids for _, ids, _ in items], positions)

    async def scores(self, job: _Job) -> list[float]:
        """Each pair's cosine similarity (a cross-encoder's: the sigmoid of its class logit), in pair order."""
        pooled = await self.pool(job.prompts, job.model, job.request_id, job.request.priority)
        if not job.pairs:  # a cross-encoder: one prompt per pair
            return [class_probs(logits)[0] for logits in pooled]
        vectors = [pooled_embedding(hidden) for hidden in pooled]
        return [cosine(vectors[a], vectors[b]) for a, b in job.pairs]

    async def score(self, job: _Job) -> ScoreResponse:
        tokens = sum(len(p) for p in job.prompts)
        data = [ScoreData(index=i, score=s) for i, s in enumerate(await self.scores(job))]
        return ScoreResponse(id=job.request_id, created=job.created, model=job.model, data=data,
                             usage=ScoreUsage(prompt_tokens=tokens, total_tokens=tokens))

    async def rerank(self, job: _Job) -> RerankResponse:
        request = job.request
        assert isinstance(request, RerankRequest)
        scores = await self.scores(job)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:request.top_n or None]
        results = [RerankResult(index=i, relevance_score=scores[i], document=RerankDocument(
            text=request.documents[i]) if request.return_documents else None) for i in order]
        return RerankResponse(id=job.request_id, model=job.model, results=results,
                              usage=RerankUsage(total_tokens=sum(len(p) for p in job.prompts)))

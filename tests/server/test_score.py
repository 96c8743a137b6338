"""vLLM's scoring APIs on a live server: ``/score`` pairs ``text_1`` with ``text_2`` (1–1, 1–N, N–N) and scores
each pair by the cosine similarity of the texts' embeddings (equal to what ``/v1/embeddings`` returns for them);
``/rerank`` orders documents by that score, keeps ``top_n`` and can leave the documents out; each distinct text is
embedded once (usage counts it once); bad pairings are a 400 that says what to send."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
from server_utils import ServerProcess

QUERY = "Where is the Eiffel tower?"
DOCS = ["The Eiffel tower is in Paris.", "Bananas are yellow.", "Paris is the capital of France.", "x"]


def _embeddings(server: ServerProcess, texts: list[str]) -> np.ndarray:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    data = client.embeddings.create(model="tiny", input=texts, encoding_format="float").data
    return np.array([d.embedding for d in data])


def _post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json={"model": "tiny", **body}, timeout=60)


def _tokens(server: ServerProcess, texts: list[str]) -> int:
    return sum(httpx.post(f"{server.base_url}/tokenize", json={"prompt": t}).json()["count"] for t in texts)


def test_scores_are_the_cosine_similarities_of_the_embeddings(server: ServerProcess) -> None:
    vectors = _embeddings(server, [QUERY, *DOCS])
    expected = vectors[1:] @ vectors[0]
    reply = _post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCS})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3] and {d["object"] for d in body["data"]} == {"score"}
    assert np.allclose([d["score"] for d in body["data"]], expected, atol=1e-5)
    assert body["usage"]["prompt_tokens"] == _tokens(server, [QUERY, *DOCS])  # the query embedded once
    pairwise = _post(server, "/score", {"text_1": DOCS[:2], "text_2": [DOCS[2], DOCS[0]]}).json()
    assert np.allclose([d["score"] for d in pairwise["data"]], [vectors[1] @ vectors[3], vectors[2] @ vectors[1]],
                       atol=1e-5)
    one = _post(server, "/v1/score", {"text_1": DOCS[0], "text_2": DOCS[0]}).json()
    assert one["data"][0]["score"] == pytest.approx(1.0, abs=1e-5) and one["usage"]["prompt_tokens"] == \
        _tokens(server, [DOCS[0]])


def test_rerank_orders_the_documents_by_score(server: ServerProcess) -> None:
    expected = _post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCS}).json()["data"]
    ranked = sorted(expected, key=lambda d: -d["score"])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = _post(server, path, {"query": QUERY, "documents": DOCS}).json()
        assert [r["index"] for r in body["results"]] == [d["index"] for d in ranked]
        assert [r["document"]["text"] for r in body["results"]] == [DOCS[d["index"]] for d in ranked]
        assert np.allclose([r["relevance_score"] for r in body["results"]], [d["score"] for d in ranked], atol=1e-6)
    top = _post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2,
                                       "return_documents": False}).json()
    assert [r["index"] for r in top["results"]] == [d["index"] for d in ranked[:2]]
    assert all(r["document"] is None for r in top["results"])
    assert top["usage"]["total_tokens"] == _tokens(server, [QUERY, *DOCS])


@pytest.mark.parametrize(("path", "body", "message"), [
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1 has 2 texts and text_2 3"),
    ("/v1/score", {"text_1": [], "text_2": "c"}, "text_1 and text_2 must not be empty"),
    ("/v1/score", {"text_1": "a"}, "text_2"),
    ("/v1/rerank", {"query": "a", "documents": []}, "documents must not be empty"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
    ("/v1/score", {"text_1": "a", "text_2": "b", "model": "other"}, "other"),
])
def test_bad_requests_are_refused_with_what_to_fix(server: ServerProcess, path: str, body: dict,
                                                   message: str) -> None:
    reply = httpx.post(f"{server.base_url}{path}", json={"model": "tiny", **body}, timeout=30)
    assert reply.status_code in (400, 404) and message in reply.json()["error"]["message"], reply.text

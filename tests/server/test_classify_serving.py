"""``POST /classify`` (vLLM's route, also ``/v1/classify``) on a served sequence classifier: each input's class
probabilities, the likeliest class's name and the prompt tokens, as the offline ``LLM.classify`` gives them; the
other APIs and other models refuse by name."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import httpx
import numpy as np
import pytest
from classifier_utils import build_classifier
from server_utils import ServerProcess

from pagellm import LLM


@pytest.fixture(scope="module")
def classifier(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_classifier(tmp_path_factory.mktemp("classifier"), "llama", tiny_llama)


@pytest.fixture(scope="module")
def served(start_server: Callable[..., ServerProcess], classifier: Path) -> ServerProcess:
    return start_server(classifier, "--served-model-name", "clf")


def test_classify_answers_as_the_offline_engine(served: ServerProcess, classifier: Path,
                                                server: ServerProcess) -> None:
    inputs = ["I loved it", "terrible, never again", "so-so"]
    answer = httpx.post(f"{served.base_url}/classify", json={"model": "clf", "input": inputs})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    offline = LLM(str(classifier), dtype="float32", max_model_len=512, kv_cache_memory=16_000_000)
    expected = offline.classify(inputs, use_tqdm=False)
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["object"] == "list"
    for item, ref in zip(body["data"], expected):
        assert item["probs"] == pytest.approx(ref.outputs.probs, abs=1e-5) and item["num_classes"] == 3
        assert item["label"] == offline.labels[max(range(3), key=ref.outputs.probs.__getitem__)]
    assert body["usage"]["prompt_tokens"] == sum(len(r.prompt_token_ids) for r in expected)
    ids = offline.tokenizer.encode("I loved it")
    one = httpx.post(f"{served.base_url}/v1/classify", json={"input": ids}).json()  # token ids, the /v1 path
    assert one["data"][0]["probs"] == pytest.approx(body["data"][0]["probs"], abs=1e-6)
    for route, payload in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                           ("/v1/embeddings", {"input": "hi"}), ("/score", {"text_1": "a", "text_2": "b"})):
        refused = httpx.post(f"{served.base_url}{route}", json={"model": "clf", **payload})
        assert refused.status_code == 400 and "serves classify requests only" in refused.json()["error"]["message"]
    no_head = httpx.post(f"{server.base_url}/classify", json={"input": "hi"})
    assert no_head.status_code == 400 and "no classification head" in no_head.json()["error"]["message"]


def test_a_one_class_classifier_scores_and_reranks_pairs_as_a_cross_encoder(
        start_server: Callable[..., ServerProcess], tiny_llama: Path, tmp_path: Path) -> None:
    """vLLM's cross-encoders: each pair is one prompt, the two texts joined by the tokenizer's pair template, and its
    score the sigmoid of the class logit, as transformers gives it."""
    import torch
    import transformers

    reranker = build_classifier(tmp_path / "reranker", "qwen3", tiny_llama)  # one class: "reward"
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(reranker, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(reranker)
    query, documents = "where is paris", ["Paris is in France.", "Bananas are yellow.", "The capital of France."]
    with torch.no_grad():
        expected = [torch.sigmoid(hf(torch.tensor([tokenizer(query, d)["input_ids"]])).logits[0, 0]).item()
                    for d in documents]
    served = start_server(reranker, "--served-model-name", "rr")
    scored = httpx.post(f"{served.base_url}/score", json={"text_1": query, "text_2": documents}).json()
    assert [d["score"] for d in scored["data"]] == pytest.approx(expected, abs=1e-5)
    ranked = httpx.post(f"{served.base_url}/rerank", json={"query": query, "documents": documents, "top_n": 2}).json()
    order = sorted(range(3), key=lambda i: -expected[i])[:2]
    assert [r["index"] for r in ranked["results"]] == order
    assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx([expected[i] for i in order], abs=1e-5)
    offline = LLM(str(reranker), dtype="float32", max_model_len=512, kv_cache_memory=16_000_000)
    assert [o.outputs.score for o in offline.score(query, documents, use_tqdm=False)] == \
        pytest.approx(expected, abs=1e-5)


def test_pooling_returns_the_raw_pooled_output(served: ServerProcess, server: ServerProcess) -> None:
    """vLLM's ``POST /pooling``: a classifier's class logits as they are (a reward model's score), any other model's
    normalised last hidden state (its embedding)."""
    import base64
    import math

    texts = ["I loved it", "so-so"]
    pooled = httpx.post(f"{served.base_url}/pooling", json={"input": texts}).json()
    probs = httpx.post(f"{served.base_url}/classify", json={"input": texts}).json()
    assert [d["object"] for d in pooled["data"]] == ["pooling", "pooling"]
    for logits, item in zip((d["data"] for d in pooled["data"]), probs["data"]):
        weights = [math.exp(x - max(logits)) for x in logits]
        assert [w / sum(weights) for w in weights] == pytest.approx(item["probs"], abs=1e-6)
    embedded = httpx.post(f"{server.base_url}/v1/embeddings", json={"input": texts[0]}).json()["data"][0]["embedding"]
    packed = httpx.post(f"{server.base_url}/v1/pooling", json={"input": texts[0], "encoding_format": "base64"}).json()
    values = np.frombuffer(base64.b64decode(packed["data"][0]["data"]), dtype="<f4")
    np.testing.assert_allclose(values, embedded, atol=1e-6)

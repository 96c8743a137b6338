"""vLLM's ``POST /generative_scoring`` on a live server: each item's score is the first label token's next-token
probability after the query joined with the item (the same logprobs ``/v1/completions`` reads with
``logprob_token_ids`` for that prompt), over the labels or the whole vocabulary; items as text or token ids, either
order; long prompts keep their first tokens; bad requests are 400s that say what to fix."""

from __future__ import annotations

import math

import httpx
import pytest
from server_utils import ServerProcess

LABELS = [89, 78, 65]  # "Y", "N", "A" in the byte vocabulary


def _post(server: ServerProcess, **body: object) -> httpx.Response:
    return httpx.post(f"{server.base_url}/generative_scoring", json={"model": "tiny", **body}, timeout=60)


def _label_logprobs(server: ServerProcess, prompt: list[int]) -> list[float]:
    """The labels' next-token logprobs after ``prompt``, as the completions API reads them."""
    reply = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1,
        "logprob_token_ids": LABELS, "return_tokens_as_token_ids": True}).json()
    top = reply["choices"][0]["logprobs"]["top_logprobs"][0]
    return [top[f"token_id:{label}"] for label in LABELS]


def _encode(server: ServerProcess, text: str, special: bool) -> list[int]:
    reply = httpx.post(f"{server.base_url}/tokenize", json={"model": "tiny", "prompt": text,
                                                            "add_special_tokens": special}, timeout=60)
    return reply.json()["tokens"]


def test_scores_are_the_first_labels_next_token_probability(server: ServerProcess) -> None:
    items = ["Paris is in France.", "Rome is in Spain."]
    reply = _post(server, query="Is it true? ", items=items, label_token_ids=LABELS)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "list" and body["model"] == "tiny" and body["id"].startswith("generative-scoring-")
    query = _encode(server, "Is it true? ", True)
    prompts = [query + _encode(server, item, False) for item in items]
    for data, prompt in zip(body["data"], prompts):
        logprobs = _label_logprobs(server, prompt)
        expected = math.exp(logprobs[0]) / sum(math.exp(lp) for lp in logprobs)
        assert data["object"] == "score" and data["score"] == pytest.approx(expected, rel=1e-5)
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert body["usage"] == {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": 2,
                             "total_tokens": sum(map(len, prompts)) + 2, "prompt_tokens_details": None,
                             "completion_tokens_details": None}
    whole = _post(server, query="Is it true? ", items=items, label_token_ids=LABELS, apply_softmax=False).json()
    assert [d["score"] for d in whole["data"]] == pytest.approx(
        [math.exp(_label_logprobs(server, prompt)[0]) for prompt in prompts], rel=1e-5)
    assert all(w["score"] < d["score"] for w, d in zip(whole["data"], body["data"]))  # the labels hold less mass


def test_token_id_items_and_item_first_build_the_prompts_asked(server: ServerProcess) -> None:
    query, items = [72, 105, 33], [[65, 66], [67]]
    first = _post(server, query=query, items=items, label_token_ids=LABELS, item_first=True,
                  apply_softmax=False).json()
    assert [d["score"] for d in first["data"]] == pytest.approx(
        [math.exp(_label_logprobs(server, item + query)[0]) for item in items], rel=1e-5)
    after = _post(server, query=query, items=items, label_token_ids=LABELS, apply_softmax=False).json()
    assert [d["score"] for d in after["data"]] == pytest.approx(
        [math.exp(_label_logprobs(server, query + item)[0]) for item in items], rel=1e-5)
    assert first["usage"]["prompt_tokens"] == after["usage"]["prompt_tokens"] == 9


def test_a_prompt_past_the_context_keeps_its_first_tokens(server: ServerProcess) -> None:
    query, item = [72] * 300, [73] * 300
    reply = _post(server, query=query, items=[item], label_token_ids=LABELS, apply_softmax=False).json()
    assert reply["usage"]["prompt_tokens"] == 511  # max_model_len 512, less the token read
    kept = (query + item)[:511]
    assert reply["data"][0]["score"] == pytest.approx(math.exp(_label_logprobs(server, kept)[0]), rel=1e-5)


@pytest.mark.parametrize("body,says", [
    ({"query": "q", "items": ["a"], "label_token_ids": [100000]}, "label_token_ids [100000] are not in the vocabulary"),
    ({"query": "q", "items": [], "label_token_ids": [1]}, "items"),
    ({"query": "q", "items": ["a", [1, 2]], "label_token_ids": [1]}, "items"),
    ({"query": "q", "items": ["a"], "label_token_ids": []}, "label_token_ids"),
    ({"query": "q", "items": ["a"], "label_token_ids": list(range(129))}, "label_token_ids"),
    ({"query": "q", "items": ["a"], "label_token_ids": [1], "model": "nope"}, "The model `nope` does not exist"),
])
def test_bad_requests_say_what_to_fix(server: ServerProcess, body: dict, says: str) -> None:
    reply = _post(server, **body)
    assert reply.status_code in (400, 404) and says in reply.json()["error"]["message"]

"""``POST /v1/embeddings`` through the ``openai`` SDK on the float32 tiny model: each input's embedding is the
normalised last hidden state transformers computes, as floats or base64, cut to ``dimensions`` when asked, with
the prompt tokens counted; bad input is a 400 that says what to fix."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Callable

import httpx
import numpy as np
import openai
import pytest
import torch
import transformers
from encoder_utils import build_encoder
from server_utils import ServerProcess

from pagellm import LLM
from pagellm.tokenizer import Tokenizer


def _reference(model_dir: Path, ids: list[int]) -> np.ndarray:
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0, -1].numpy()
    return hidden / np.linalg.norm(hidden)


def test_embeddings_are_the_normalised_last_hidden_state(server: ServerProcess, client: openai.OpenAI) -> None:
    texts = ["The quick brown fox.", "A different, longer sentence about embeddings and caches."]
    tokenizer = Tokenizer.from_dir(server.model)
    reply = client.embeddings.create(model="tiny", input=texts, encoding_format="float")
    assert [d.index for d in reply.data] == [0, 1] and reply.model == "tiny" and reply.object == "list"
    ids = [tokenizer.encode(t) for t in texts]
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(len(i) for i in ids)
    for data, prompt in zip(reply.data, ids):
        np.testing.assert_allclose(np.array(data.embedding), _reference(server.model, prompt), atol=2e-6)
    packed = client.embeddings.create(model="tiny", input=ids[0])  # token ids; the SDK asks for base64
    np.testing.assert_allclose(np.array(packed.data[0].embedding), reply.data[0].embedding, atol=1e-7)
    raw = httpx.post(f"{server.base_url}/v1/embeddings", json={"input": texts[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    # The same prompt again as floats: a prefix-cache hit computed as the base64 one was (its last token alone; the
    # first reply computed the whole prompt, whose float32 products may round differently at another batch size).
    again = client.embeddings.create(model="tiny", input=texts[0], encoding_format="float")
    np.testing.assert_array_equal(decoded, np.float32(again.data[0].embedding))
    cut = client.embeddings.create(model="tiny", input=texts[0], dimensions=16, encoding_format="float")
    first = np.array(reply.data[0].embedding[:16])
    np.testing.assert_allclose(np.array(cut.data[0].embedding), first / np.linalg.norm(first), atol=1e-6)


@pytest.mark.parametrize(("body", "message"), [
    ({"input": []}, "input must not be empty"),
    ({"input": "x", "dimensions": 65}, "dimensions (65) must be at most the model's hidden size (64)"),
    ({"input": [[1, 2], [400]]}, "prompt 1: "),
    ({"input": "x" * 600}, "max_model_len"),
    ({"input": "x", "model": "other"}, "does not exist"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
])
def test_bad_input_is_a_4xx_that_says_what_to_fix(server: ServerProcess, body: dict, message: str) -> None:
    response = httpx.post(f"{server.base_url}/v1/embeddings", json=body)
    assert 400 <= response.status_code < 500 and message in response.json()["error"]["message"]
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_a_base_model_server_embeds_and_refuses_generation(start_server: Callable[..., ServerProcess],
                                                           tiny_llama: Path, tmp_path_factory) -> None:
    path = tmp_path_factory.mktemp("base")
    transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).model.save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(path)
    server = start_server(path, "--served-model-name", "base")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    ids = Tokenizer.from_dir(path).encode("hello")
    reply = client.embeddings.create(model="base", input="hello", encoding_format="float")
    np.testing.assert_allclose(np.array(reply.data[0].embedding), _reference(path, ids), atol=2e-6)
    for call in (lambda: client.completions.create(model="base", prompt="hello", max_tokens=2),
                 lambda: client.chat.completions.create(model="base", max_tokens=2, stream=True,
                                                        messages=[{"role": "user", "content": "hi"}])):
        with pytest.raises(openai.BadRequestError, match="no language-model head: it serves embeddings only"):
            call()
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_an_encoder_model_server_embeds_scores_and_refuses_generation(start_server: Callable[..., ServerProcess],
                                                                      tmp_path_factory) -> None:
    """A BERT embedding model (sentence-transformers' mean pooling) through the ``openai`` SDK: the embeddings are the
    offline ``LLM.embed``'s, ``/score`` is their cosine, and generation is a 400."""
    path = build_encoder(tmp_path_factory.mktemp("encoder") / "bert", "bert", "MEAN")
    texts = ["the cat sat on the mat", "a big red house", "dog"]
    offline = np.array([o.outputs.embedding for o in LLM(str(path), dtype="float32", kv_cache_memory=1 << 22)
                        .embed(texts, use_tqdm=False)])
    server = start_server(path, "--served-model-name", "bert", "--max-model-len", "64")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    served = np.array([d.embedding for d in client.embeddings.create(model="bert", input=texts).data])
    np.testing.assert_allclose(served, offline, atol=1e-5)
    score = httpx.post(f"{server.base_url}/score", json={"model": "bert", "text_1": texts[0], "text_2": texts[1:]},
                       timeout=60).json()
    np.testing.assert_allclose([d["score"] for d in score["data"]], offline[1:] @ offline[0], atol=1e-5)
    with pytest.raises(openai.BadRequestError, match="no language-model head: it serves embeddings only"):
        client.completions.create(model="bert", prompt="the cat", max_tokens=2)

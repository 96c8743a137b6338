"""vLLM's ``--tokenizer`` and ``--max-logprobs`` on a served model: a model folder without tokenizer files serves with
another folder's tokenizer (chat template, structured outputs, /tokenize), and a request may ask for up to the
server's cap of logprobs, more being a 400 that names it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import httpx
import openai
import pytest
from server_utils import ServerProcess

from pagellm import LLM, SamplingParams

CAP = 40


@pytest.fixture(scope="module")
def split_model(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny model's weights and configs in one folder, its tokenizer files in another."""
    root = tmp_path_factory.mktemp("split")
    weights, tokenizer = root / "weights", root / "tokenizer"
    weights.mkdir()
    tokenizer.mkdir()
    for path in tiny_llama.iterdir():
        target = tokenizer if path.name.startswith(("tokenizer", "chat_template")) else weights
        shutil.copy(path, target / path.name)
    return weights, tokenizer


@pytest.fixture(scope="module")
def split_server(start_server: Callable[..., ServerProcess], split_model: tuple[Path, Path]) -> ServerProcess:
    weights, tokenizer = split_model
    return start_server(weights, "--served-model-name", "tiny", "--tokenizer", str(tokenizer),
                        "--max-logprobs", str(CAP))


@pytest.fixture(scope="module")
def split_client(split_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{split_server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_model_without_tokenizer_files_is_refused_without_the_option(split_model: tuple[Path, Path]) -> None:
    with pytest.raises(ValueError, match="no tokenizer files.*--tokenizer DIR"):
        LLM(str(split_model[0]), dtype="float32")


def test_chat_and_tokenize_use_the_given_tokenizer(split_server: ServerProcess, split_client: openai.OpenAI,
                                                   offline: LLM) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    reply = split_client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                 extra_body={"ignore_eos": True})
    expected = offline.chat(messages, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert reply.choices[0].message.content == expected[0].outputs[0].text
    assert reply.usage.prompt_tokens == len(expected[0].prompt_token_ids)
    tokens = httpx.post(f"{split_server.base_url}/tokenize", json={"model": "tiny", "prompt": "héllo"}).json()
    assert tokens["tokens"] == offline.tokenizer.encode("héllo")


def test_structured_outputs_compile_with_the_given_tokenizer(split_client: openai.OpenAI) -> None:
    choices = ["alpha beta", "gamma"]
    for _ in range(2):
        out = split_client.completions.create(model="tiny", prompt="Pick:", max_tokens=8, temperature=1.0,
                                              extra_body={"structured_outputs": {"choice": choices}})
        assert out.choices[0].text in choices


def test_logprobs_up_to_the_servers_cap(split_server: ServerProcess, split_client: openai.OpenAI) -> None:
    out = split_client.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0, logprobs=CAP,
                                          extra_body={"return_tokens_as_token_ids": True})
    assert [len(top) in (CAP, CAP + 1) for top in out.choices[0].logprobs.top_logprobs] == [True] * 3
    chat = split_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=2, temperature=0, logprobs=True, top_logprobs=CAP)
    assert [len(entry.top_logprobs) for entry in chat.choices[0].logprobs.content] == [CAP, CAP]
    with pytest.raises(openai.BadRequestError, match=rf"logprobs={CAP + 1} .*max_logprobs \({CAP}\)"):
        split_client.completions.create(model="tiny", prompt="Hello", max_tokens=3, logprobs=CAP + 1)
    with pytest.raises(openai.BadRequestError, match=rf"max_logprobs \({CAP}\)"):
        split_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=2, logprobs=True, top_logprobs=CAP + 1)
    assert httpx.get(f"{split_server.base_url}/health").status_code == 200

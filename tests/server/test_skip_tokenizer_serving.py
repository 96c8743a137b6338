"""``pagellm serve --skip-tokenizer-init``: token ids in, token ids out (``return_token_ids``, whole or per streamed
chunk), logprobs naming tokens by id; text prompts, chat and stop strings are 400s that name the flag."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import httpx
import pytest
from server_utils import ServerProcess

from pagellm import LLM, SamplingParams

PROMPT = [72, 101, 108, 108, 111, 32, 119]


@pytest.fixture(scope="module")
def tokenless(start_server: Callable[..., ServerProcess], tiny_llama: Path,
              tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    folder = tmp_path_factory.mktemp("weights-only")
    for path in tiny_llama.iterdir():
        if not path.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(path, folder / path.name)
    return start_server(folder, "--served-model-name", "tiny", "--skip-tokenizer-init")


def test_token_ids_in_and_out(tokenless: ServerProcess, offline: LLM) -> None:
    ref = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    whole = httpx.post(f"{tokenless.base_url}/v1/completions", json={**body, "logprobs": 1}).json()
    (choice,) = whole["choices"]
    assert choice["token_ids"] == ref and choice["text"] == "" and choice["prompt_token_ids"] == PROMPT
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in ref]
    with httpx.stream("POST", f"{tokenless.base_url}/v1/completions", json={**body, "stream": True}) as stream:
        chunks = [line for line in stream.iter_lines() if line.startswith("data: {")]
    assert all(json.loads(line[6:])["choices"][0].get("token_ids") for line in chunks)  # each chunk carries ids
    assert [t for line in chunks for t in json.loads(line[6:])["choices"][0].get("token_ids", [])] == ref


@pytest.mark.parametrize("route,payload", [
    ("/v1/completions", {"prompt": "some text", "max_tokens": 2}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stop": ["x"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/tokenize", {"prompt": "hi"}),
])
def test_what_needs_text_is_refused(tokenless: ServerProcess, route: str, payload: dict) -> None:
    answer = httpx.post(f"{tokenless.base_url}{route}", json={"model": "tiny", **payload})
    assert answer.status_code == 400 and "--skip-tokenizer-init" in answer.json()["error"]["message"]

"""Disaggregated serving end to end: a prefill server (kv_producer) and a decode server (kv_consumer) share a KV
store, ``pagellm disagg-proxy`` sits in front; through the ``openai`` SDK the proxy's replies, whole and streamed,
equal a single server's, the decode server reports the prompt's blocks as cached (it loaded them), and a request the
prefill server refuses comes back as its 400."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import httpx
import openai
import pytest
from server_utils import ServerProcess, _free_port, wait_until

PROMPT = "Tell me a long story about a lighthouse keeper who finds a message in a bottle. " * 2
GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


def _kv(role: str, path: Path) -> str:
    return json.dumps({"kv_connector": "SharedStorageConnector", "kv_role": role,
                       "kv_connector_extra_config": {"shared_storage_path": str(path)}})


@pytest.fixture(scope="module")
def proxy(start_server: Callable[..., ServerProcess], tiny_llama: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ServerProcess]]:
    store = tmp_path_factory.mktemp("kv")
    prefill = start_server(tiny_llama, "--served-model-name", "tiny", "--kv-transfer-config", _kv("kv_producer", store))
    decode = start_server(tiny_llama, "--served-model-name", "tiny", "--kv-transfer-config", _kv("kv_consumer", store))
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "pagellm.cli", "disagg-proxy", "--prefill", prefill.base_url,
                                "--decode", decode.base_url, "--port", str(port)])
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(f"{base}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False
    try:
        wait_until(healthy, 60, "the proxy to answer")
        yield base, decode
    finally:
        process.terminate()
        process.wait(30)


def test_the_proxy_answers_as_one_server_and_decode_loads_the_prompt(proxy: tuple[str, ServerProcess],
                                                                     server: ServerProcess) -> None:
    base, _ = proxy
    split = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    single = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": PROMPT}]
    reply = split.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    expected = single.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    assert reply.choices[0].message.content == expected.choices[0].message.content
    prompt = reply.usage.prompt_tokens
    assert reply.usage.prompt_tokens_details.cached_tokens == (prompt - 1) // 16 * 16 > 0  # loaded, not computed
    streamed = split.completions.create(model="tiny", prompt=PROMPT + "!", stream=True, **GREEDY)
    text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
    assert text == single.completions.create(model="tiny", prompt=PROMPT + "!", **GREEDY).choices[0].text
    assert [m.id for m in split.models.list().data] == ["tiny"]


def test_a_request_the_prefill_server_refuses_comes_back_as_its_error(proxy: tuple[str, ServerProcess]) -> None:
    base, _ = proxy
    split = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        split.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=5)

"""Black-box server fixtures: start ``pagellm serve`` on a tiny model as a real subprocess, wait for ``/health``."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, Iterator

import openai
import pytest
from server_utils import ServerProcess

from pagellm import LLM


@pytest.fixture(scope="session")
def start_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ServerProcess]]:
    """Start a server (``start_server(model, *args, env=None)``); every server still running is stopped at the end."""
    started: list[ServerProcess] = []

    def start(model: Path, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
        server = ServerProcess(model, list(args), tmp_path_factory.mktemp("server") / "server.log", env=env)
        started.append(server)
        server.wait_healthy()
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def server(start_server: Callable[..., ServerProcess], tiny_llama: Path) -> ServerProcess:
    """The shared server (no API key) most tests talk to."""
    return start_server(tiny_llama, "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    """The OpenAI SDK on the shared server (no retries: a failure shows at once)."""
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_llama: Path) -> LLM:
    """The offline engine on the shared server's model, to hold the server's replies to."""
    return LLM(str(tiny_llama), dtype="float32", max_model_len=512, kv_cache_memory=16_000_000)


# Qwen3's template: with enable_thinking false it closes an empty think block after the generation prompt.
THINKER_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                    "{% endfor %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
                    "<think>\n\n</think>\n\n{% endif %}")


@pytest.fixture(scope="session")
def thinker(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with Qwen3's <think> and </think> as tokens of their own (ids 260 and 261) and a template
    that closes the block when thinking is off (``server_utils.think_first`` makes it think)."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("thinker")
    shutil.copytree(tiny_llama, path, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = THINKER_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def thinker_server(start_server: Callable[..., ServerProcess], thinker: Path) -> ServerProcess:
    """A server on ``thinker`` with Qwen3's parsers: thinking apart (qwen3) and calls in hermes syntax."""
    return start_server(thinker, "--served-model-name", "tiny", "--reasoning-parser", "qwen3",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes")

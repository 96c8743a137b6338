"""Sampling defaults from the model's generation_config.json, as vLLM applies them: a request that leaves a field
unset takes the file's value (``max_new_tokens`` as ``max_tokens``), one that sets it keeps its own; ``vllm`` keeps
the neutral defaults and a folder supplies another file; ``override_generation_config`` sets keys over the file's;
the server, ``LLM.generate`` without parameters and ``LLM.get_default_sampling_params`` agree; a file whose values
cannot be used stops the start with its path named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import openai
import pytest
from server_utils import ServerProcess

from pagellm import LLM, SamplingParams
from pagellm.config import EngineConfig
from pagellm.generation_config import sampling_defaults
from pagellm.server.openai.protocol import ChatCompletionRequest, CompletionRequest

CHAT = [{"role": "user", "content": "Hi"}]
RECOMMENDED = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
               "max_new_tokens": 3, "bos_token_id": 1, "eos_token_id": 2}
DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 3}


def _with_generation_config(model: Path, folder: Path, config: dict) -> Path:
    copy = folder / "model"
    shutil.copytree(model, copy)
    (copy / "generation_config.json").write_text(json.dumps(config))
    return copy


def test_the_files_sampling_fields_become_defaults(tiny_llama: Path, tmp_path: Path) -> None:
    model = _with_generation_config(tiny_llama, tmp_path, RECOMMENDED)
    assert sampling_defaults(model) == DEFAULTS
    assert sampling_defaults(model, "vllm") == {}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.2, "min_p": 0.05}))
    assert sampling_defaults(model, str(other)) == {"temperature": 0.2, "min_p": 0.05}
    assert sampling_defaults(tiny_llama) == {}  # bos/eos ids only
    with pytest.raises(ValueError, match="generation_config='nowhere': use auto .*, vllm .* or a folder"):
        EngineConfig.from_kwargs(generation_config="nowhere")


def test_overrides_set_keys_over_the_file(tiny_llama: Path, tmp_path: Path) -> None:
    model = _with_generation_config(tiny_llama, tmp_path, RECOMMENDED)
    assert sampling_defaults(model, "auto", {"temperature": 0.3, "max_new_tokens": 8}) == \
        {**DEFAULTS, "temperature": 0.3, "max_tokens": 8}
    assert sampling_defaults(model, "vllm", {"top_p": 0.5}) == {"top_p": 0.5}  # over none, as vLLM's
    with pytest.raises(ValueError, match="override_generation_config: temprature not among its keys"):
        sampling_defaults(model, "auto", {"temprature": 0.3})
    config = EngineConfig.from_kwargs(override_generation_config='{"temperature": 0.3}')
    assert config.model_config.override_generation_config == {"temperature": 0.3}
    with pytest.raises(ValueError, match="override_generation_config is not valid JSON"):
        EngineConfig.from_kwargs(override_generation_config="{temperature: 0.3}")
    with pytest.raises(ValueError, match="override_generation_config must be a JSON object"):
        EngineConfig.from_kwargs(override_generation_config="[1]")


def test_a_file_that_cannot_be_used_names_itself(tiny_llama: Path, tmp_path: Path) -> None:
    bad = _with_generation_config(tiny_llama, tmp_path, {"temperature": -1})
    with pytest.raises(ValueError, match=r"generation_config.json sets sampling defaults pagellm cannot use "
                                         r"\(temperature must be .*\); .*--generation-config vllm"):
        sampling_defaults(bad)
    (bad / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json is not readable JSON"):
        sampling_defaults(bad)


def test_requests_take_the_defaults_only_where_they_are_silent() -> None:
    silent = ChatCompletionRequest(model="m", messages=CHAT).to_sampling_params(DEFAULTS)
    assert (silent.temperature, silent.top_p, silent.top_k, silent.repetition_penalty, silent.max_tokens) == \
        (0.6, 0.9, 20, 1.1, 3)
    own = ChatCompletionRequest(model="m", messages=CHAT, temperature=0.0, top_k=0, max_tokens=9,
                                repetition_penalty=1.0).to_sampling_params(DEFAULTS)
    assert (own.temperature, own.top_p, own.top_k, own.repetition_penalty, own.max_tokens) == (0.0, 0.9, 0, 1.0, 9)
    neutral = ChatCompletionRequest(model="m", messages=CHAT).to_sampling_params()
    assert (neutral.temperature, neutral.top_p, neutral.top_k, neutral.max_tokens) == (1.0, 1.0, 0, None)
    assert CompletionRequest(model="m", prompt="a").to_sampling_params(DEFAULTS).max_tokens == 16  # OpenAI's


def test_llm_samples_with_the_defaults_when_given_no_parameters(tiny_llama: Path, tmp_path: Path) -> None:
    model = _with_generation_config(tiny_llama, tmp_path, {"temperature": 0.0, "max_new_tokens": 3})
    llm = LLM(str(model), dtype="float32", kv_cache_memory="16MiB")
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=3)
    (out,) = llm.generate("hello", use_tqdm=False)
    greedy = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == greedy.outputs[0].token_ids and len(greedy.outputs[0].token_ids) == 3
    neutral = LLM(str(model), dtype="float32", kv_cache_memory="16MiB", generation_config="vllm")
    assert neutral.get_default_sampling_params() == SamplingParams()
    overridden = LLM(str(model), dtype="float32", kv_cache_memory="16MiB",
                     override_generation_config={"max_new_tokens": 5})
    assert overridden.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)


def test_server_applies_the_models_defaults(start_server: Callable[..., ServerProcess], tiny_llama: Path,
                                            tmp_path: Path) -> None:
    model = _with_generation_config(tiny_llama, tmp_path, {"temperature": 0.0, "max_new_tokens": 3})
    server = start_server(model, "--served-model-name", "tiny", "--override-generation-config", '{"top_k": 1}')
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(model="tiny", messages=CHAT, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 3
    again = client.chat.completions.create(model="tiny", messages=CHAT, extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == reply.choices[0].message.content  # temperature 0: greedy
    longer = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5,
                                            extra_body={"ignore_eos": True})
    assert longer.usage.completion_tokens == 5
    # the request's own temperature, the override's top_k of 1: sampling that can only take the argmax
    sampled = client.chat.completions.create(model="tiny", messages=CHAT, temperature=1.0, seed=3,
                                             extra_body={"ignore_eos": True})
    assert sampled.choices[0].message.content == reply.choices[0].message.content

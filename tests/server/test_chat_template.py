"""A chat template of one's own: ``pagellm serve --chat-template`` (a file or the Jinja text) renders every chat
request (with its ``tools`` when ``tool_choice`` is 'none') and ``/tokenize`` with it, ``LLM.chat(chat_template=...)``
likewise; a template that is no file and no Jinja, or does not parse, is refused before anything starts, naming the
line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable

import httpx
import openai
import pytest
from server_utils import ENGINE_FLAGS, ServerProcess

from pagellm import LLM, SamplingParams
from pagellm.tokenizer import Tokenizer, load_chat_template

TEMPLATE = ("{% if tools %}{% for t in tools %}(tool {{ t.function.name }}){% endfor %}{% endif %}"
            "{% if reasoning_effort %}(effort {{ reasoning_effort }}){% endif %}"
            "{% for m in messages %}[{{ m.role }}: {{ m.content }}]{% endfor %}"
            "{% if add_generation_prompt %}>{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
RENDERED = "[system: Be brief.][user: Hi there]>"


def test_a_template_is_read_from_its_file_or_taken_as_text(tmp_path: Path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE == load_chat_template(TEMPLATE)
    with pytest.raises(ValueError, match="'missing.jinja': no such file, and not a Jinja template either"):
        load_chat_template("missing.jinja")
    with pytest.raises(ValueError, match="line 2: .*endfor"):
        load_chat_template("{% for m in messages %}\n{{ m.content }}{% endif %}")


def test_llm_chat_renders_with_the_given_template(tiny_llama: Path, tmp_path: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB")
    tokenizer = Tokenizer.from_dir(tiny_llama)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    (out,) = llm.chat(CHAT, params, use_tqdm=False, chat_template=TEMPLATE)
    assert out.prompt_token_ids == tokenizer.encode(RENDERED, add_special_tokens=False)
    kwargs_template = "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}"
    (out,) = llm.chat(CHAT, params, use_tqdm=False, chat_template=kwargs_template,
                      chat_template_kwargs={"greeting": "Hello! "})
    assert out.prompt_token_ids == tokenizer.encode("Hello! Be brief.Hi there", add_special_tokens=False)
    tools_template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.content }}" \
                     "{% endfor %}"
    (out,) = llm.chat(CHAT, params, use_tqdm=False, chat_template=tools_template, tools=[
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}])
    assert out.prompt_token_ids == tokenizer.encode("[get_weather]Be brief.Hi there", add_special_tokens=False)
    (plain,) = llm.chat(CHAT, params, use_tqdm=False)  # the model's own template again
    assert plain.prompt_token_ids == tokenizer.apply_chat_template(CHAT)
    opened = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The sky is"}]
    (cont,) = llm.chat(opened, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    open_turn = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nThe sky is"  # the model's template, left open
    assert cont.prompt_token_ids == tokenizer.encode(open_turn, add_special_tokens=False)


def test_server_renders_chat_and_tokenize_with_its_template(start_server: Callable[..., ServerProcess],
                                                             tiny_llama: Path, tmp_path: Path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    server = start_server(tiny_llama, "--served-model-name", "tiny", "--chat-template", str(path))
    expected = Tokenizer.from_dir(tiny_llama).encode(RENDERED, add_special_tokens=False)
    assert httpx.post(f"{server.base_url}/tokenize", json={"messages": CHAT}).json()["tokens"] == expected
    # /tokenize renders a conversation as a chat request would: its tools and template kwargs reach the template
    tokenizer = Tokenizer.from_dir(tiny_llama)
    counted = httpx.post(f"{server.base_url}/tokenize", json={
        "messages": CHAT, "tools": TOOLS, "chat_template_kwargs": {"reasoning_effort": "low"},
        "return_token_strs": True}).json()
    wanted = tokenizer.encode("(tool get_weather)(effort low)" + RENDERED, add_special_tokens=False)
    assert counted["tokens"] == wanted and counted["count"] == len(wanted)
    assert counted["token_strs"] == tokenizer.hf.convert_ids_to_tokens(wanted) and "".join(
        counted["token_strs"]).startswith("(tool")
    refused = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "x", "tools": TOOLS})
    assert refused.status_code == 400 and "go with messages" in refused.json()["error"]["message"]
    own = httpx.post(f"{server.base_url}/tokenize", json={"messages": CHAT, "chat_template": "{{ 'x' }}"})
    assert own.status_code == 400 and "--trust-request-chat-template" in own.json()["error"]["message"]
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
    assert reply.usage.prompt_tokens == len(expected)
    # tools with tool_choice 'none' reach the template (nothing calls them); a malformed tool is a 400
    with_tools = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, tools=TOOLS,
                                                tool_choice="none")
    tokenizer = Tokenizer.from_dir(tiny_llama)
    assert with_tools.usage.prompt_tokens == len(tokenizer.encode("(tool get_weather)" + RENDERED,
                                                                  add_special_tokens=False))
    assert with_tools.choices[0].message.tool_calls is None
    # reasoning_effort reaches the template (as vLLM passes it to gpt-oss's); OpenAI's platform fields are accepted
    effort = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, reasoning_effort="high",
                                            metadata={"team": "a"}, store=False, service_tier="auto",
                                            prompt_cache_key="k", safety_identifier="u1")
    assert effort.usage.prompt_tokens == len(tokenizer.encode("(effort high)" + RENDERED, add_special_tokens=False))
    with pytest.raises(openai.BadRequestError, match="store: true .* is not supported"):
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, store=True)
    responses = client.responses.create(model="tiny", input=CHAT, max_output_tokens=2, reasoning={"effort": "low"})
    assert responses.usage.input_tokens == len(tokenizer.encode("(effort low)" + RENDERED, add_special_tokens=False))
    with pytest.raises(openai.BadRequestError, match="each tool must be"):
        client.chat.completions.create(model="tiny", messages=CHAT, tools=[{"type": "function"}], tool_choice="none")
    with pytest.raises(openai.BadRequestError, match="tool_choice 'auto' .* needs a tool-call parser; start the server "
                                                     "with --enable-auto-tool-choice"):
        client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS)  # OpenAI's default: auto


@pytest.mark.parametrize(("template", "message"), [
    ("nothing.jinja", "chat template 'nothing.jinja': no such file, and not a Jinja template either"),
    ("{% for m in messages %}", "line 1: Unexpected end of template"),
])
def test_a_bad_template_stops_serve_before_it_starts(tiny_llama: Path, template: str, message: str) -> None:
    result = subprocess.run([sys.executable, "-m", "pagellm.cli", "serve", str(tiny_llama), "--port", "1",
                             "--chat-template", template, *ENGINE_FLAGS], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr


def test_a_request_brings_its_template_and_documents_when_trusted(start_server: Callable[..., ServerProcess],
                                                                  tiny_llama: Path, server: ServerProcess) -> None:
    """vLLM's request fields ``chat_template`` (with --trust-request-chat-template) and ``documents``."""
    trusting = start_server(tiny_llama, "--served-model-name", "tiny", "--trust-request-chat-template")
    own = "{% for d in documents %}<{{ d.title }}>{% endfor %}" + TEMPLATE
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 1, "chat_template": own,
            "documents": [{"title": "A", "text": "alpha"}, {"title": "B", "text": "beta"}]}
    reply = httpx.post(f"{trusting.base_url}/v1/chat/completions", json=body, timeout=60)
    tokenizer = Tokenizer.from_dir(tiny_llama)
    counted = httpx.post(f"{trusting.base_url}/tokenize", timeout=60, json={
        "messages": CHAT, "chat_template": own, "chat_template_kwargs": {"documents": body["documents"]}}).json()
    assert counted["tokens"] == tokenizer.encode("<A><B>" + RENDERED, add_special_tokens=False)
    assert reply.json()["usage"]["prompt_tokens"] == len(tokenizer.encode("<A><B>" + RENDERED,
                                                                          add_special_tokens=False))
    refused = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in refused.json()["error"]["message"]
    broken = httpx.post(f"{trusting.base_url}/v1/chat/completions", timeout=60,
                        json={**body, "chat_template": "{% for m in messages %}"})
    assert broken.status_code == 400 and "chat template" in broken.json()["error"]["message"]

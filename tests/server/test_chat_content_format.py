"""``--chat-template-content-format`` (auto, string, openai): a template that loops over a message's content gets
OpenAI's list of text parts, one that prints it gets a string, whichever form the request sent; ``auto`` tells them
apart from the template's syntax."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import httpx
import pytest
from server_utils import ServerProcess

from pagellm import LLM, SamplingParams
from pagellm.chat_content import detect, format_messages, image_urls
from pagellm.tokenizer import Tokenizer

# Llama 4's way: loop over the parts, print the text ones
PARTS = ("{% for m in messages %}[{{ m.role }}:{% for part in m['content'] %}{% if part['type'] == 'text' %}"
         "<{{ part['text'] }}>{% endif %}{% endfor %}]{% endfor %}")
STRING = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
MIXED = [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]


@pytest.mark.parametrize("template,form", [
    (PARTS, "openai"),
    (STRING, "string"),
    ("{% for m in messages %}{% for p in m.content | selectattr('type', 'equalto', 'text') %}{{ p.text }}"
     "{% endfor %}{% endfor %}", "openai"),  # through a filter
    ("{% for m in messages %}{% set c = m['content'] %}{% for p in c %}{{ p['text'] }}{% endfor %}{% endfor %}",
     "openai"),  # through a variable
    ("{% for m in messages %}{% for key in m %}{{ key }}{% endfor %}{% endfor %}", "string"),  # not the content
    ("{% for m in messages %}", "string"),  # does not parse: rendering says so
])
def test_auto_tells_the_forms_apart(template: str, form: str) -> None:
    assert detect(template) == form


def test_each_form_gets_its_content(tiny_llama: Path) -> None:
    tokenizer = Tokenizer.from_dir(tiny_llama)
    assert tokenizer.render_chat(MIXED, False, chat_template=PARTS) == "[system:<Be brief.>][user:<Hi><there>]"
    assert tokenizer.render_chat(MIXED, False, chat_template=STRING) == "[system:Be brief.][user:Hi\nthere]"
    # forced the wrong way, the template loops over a string's characters: what the flag is there to prevent
    assert tokenizer.render_chat(MIXED[:1], False, chat_template=PARTS, content_format="string") == "[system:]"
    with pytest.raises(ValueError, match=r"messages\[1\].content: only text parts are supported \(this model "
                                         r"takes no images\), got a 'image_url' part"):
        format_messages([MIXED[0], {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], STRING,
                        "auto")
    with pytest.raises(ValueError, match="use one of auto, string, openai"):
        format_messages(MIXED, STRING, "markdown")


def test_a_reply_that_only_calls_tools_gets_empty_text(tiny_llama: Path) -> None:
    # OpenAI's assistant turn with tool_calls and no content; templates such as SmolLM2's add message['content']
    # to a string, which a missing (or None) content breaks
    tokenizer = Tokenizer.from_dir(tiny_llama)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [call]},
             {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    strict = "{% for m in messages %}[{{ m.role }}:{{ m['content'] + '|' }}]{% endfor %}"
    assert tokenizer.render_chat(turns, False, chat_template=strict) == "[user:Hi|][assistant:|][tool:42|]"
    (reply,) = [m for m in format_messages(turns, PARTS, "auto") if m["role"] == "assistant"]
    assert reply["content"] == [{"type": "text", "text": ""}] and reply["tool_calls"] == [call]


def test_llm_chat_takes_the_format(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32")
    params = SamplingParams(max_tokens=1)
    auto = llm.chat(MIXED, params, chat_template=PARTS, use_tqdm=False)[0]
    forced = llm.chat(MIXED[:1], params, chat_template=PARTS, chat_template_content_format="string",
                      use_tqdm=False)[0]
    assert auto.prompt_token_ids == llm.tokenizer.encode("[system:<Be brief.>][user:<Hi><there>]",
                                                         add_special_tokens=False)
    assert forced.prompt_token_ids == llm.tokenizer.encode("[system:]", add_special_tokens=False)


@pytest.mark.parametrize("flag,rendered", [
    ((), "[system:<Be brief.>][user:<Hi><there>]"),
    (("--chat-template-content-format", "string"), "[system:][user:]"),  # the flag reaches the server
])
def test_the_server_renders_chat_in_the_templates_form(start_server: Callable[..., ServerProcess], tiny_llama: Path,
                                                       tmp_path: Path, flag: tuple, rendered: str) -> None:
    path = tmp_path / "parts.jinja"
    path.write_text(PARTS)
    server = start_server(tiny_llama, "--served-model-name", "tiny", "--chat-template", str(path), *flag)
    expected = Tokenizer.from_dir(tiny_llama).encode(rendered, add_special_tokens=False)
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"messages": MIXED}, timeout=30).json()["tokens"]
    assert tokens == expected
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                       json={"model": "tiny", "messages": MIXED, "max_tokens": 1}).json()
    assert reply["usage"]["prompt_tokens"] == len(expected)


def test_image_parts_reach_the_template_in_its_form_and_in_order() -> None:
    """A vision-language model's image parts: ``{"type": "image"}`` for a template that loops over the parts, the
    placeholder text for one that prints a string; their URLs listed in the order the messages give them."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "Compare"}, image,
                                             {**image, "image_url": {"url": "https://example.com/b.png"}}]}]
    parts = format_messages(messages, PARTS, "auto", "<image>")
    assert parts[0]["content"] == [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "image"}]
    assert format_messages(messages, STRING, "auto", "<image>")[0]["content"] == "Compare\n<image>\n<image>"
    assert image_urls(messages) == ["data:image/png;base64,AAAA", "https://example.com/b.png"]
    with pytest.raises(ValueError, match=r"messages\[0\].content: an image part is {'type': 'image_url'"):
        image_urls([{"role": "user", "content": [{"type": "image_url", "image_url": "https://x"}]}])
    with pytest.raises(ValueError, match="text, image_url and image_embeds parts are supported, got a 'input_audio'"):
        format_messages([{"role": "user", "content": [{"type": "input_audio"}]}], PARTS, "auto", "<image>")

"""How a chat template wants each message's ``content``: one string, or OpenAI's list of typed parts.

Older templates print ``message['content']`` as a string; newer ones (Llama 4, Mistral Small 3.1, Gemma 3, ...)
loop over it, ``{% for part in message['content'] %}{% if part['type'] == 'text' %}``, and given a string they
would loop over its characters. vLLM's ``--chat-template-content-format`` names the two forms:

- ``string``: a list of text parts is joined into one string (parts separated by newlines);
- ``openai``: a string becomes one part, ``[{"type": "text", "text": ...}]``;
- ``auto`` (the default): ``openai`` when the template iterates over a message's content (directly, through a
  filter, or through a variable set from it), else ``string``; found once per template by walking its Jinja syntax
  tree, never by rendering it.

Text parts are served, and for a vision-language model image parts (``{"type": "image_url", "image_url": {"url":
...}}``, ``image_placeholder`` given): the template gets ``{"type": "image"}`` in the ``openai`` form, as such
models' templates take it, and the placeholder text (``<image>``) in the ``string`` form; ``image_urls`` lists the
images in the order they appear. Another part's type is a ValueError that names the message. An assistant message
without content (one that only calls tools) gets empty text, as vLLM gives it.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

CONTENT_FORMATS = ("auto", "string", "openai")


def format_messages(messages: list[dict[str, Any]], template: str, content_format: str,
                    image_placeholder: str | None = None) -> list[dict[str, Any]]:
    """``messages`` with each content in the form ``template`` takes (``content_format``, ``auto`` detecting it);
    image parts only where ``image_placeholder`` is given (a vision-language model's)."""
    if content_format not in CONTENT_FORMATS:
        raise ValueError(f"chat template content format {content_format!r}: use one of {', '.join(CONTENT_FORMATS)}")
    form = detect(template) if content_format == "auto" else content_format
    return [_formatted(message, position, form, image_placeholder) for position, message in enumerate(messages)]


def image_urls(messages: list[dict[str, Any]]) -> list[str]:
    """The URLs of the messages' image parts, in order (each part's ``image_url.url``; a part without one is named),
    an ``image_embeds`` part's payload as an ``EmbedsSource``."""
    urls: list[str] = []
    for position, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None  # the template's checks name these
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") == "image_embeds":
                urls.append(_embeds_source(part.get("image_embeds"), position))
            if isinstance(part, dict) and part.get("type") == "image_url":
                url = (part.get("image_url") or {}).get("url") if isinstance(part.get("image_url"), dict) else None
                if not isinstance(url, str):
                    raise ValueError(f"messages[{position}].content: an image part is {{'type': 'image_url', "
                                     "'image_url': {'url': 'data:image/png;base64,...' or 'https://...'}}")
                urls.append(url)
    return urls


IMAGE_PARTS = ("image_url", "image_embeds")


class EmbedsSource(str):
    """An ``image_embeds`` part's payload among the image URLs (``images.load`` reads it as a tensor, and with a
    ``grid``, a Qwen-VL image's, as vLLM's ``{"image_embeds", "image_grid_thw"}``); a client's URL is never one."""

    grid: str | None = None


def _embeds_source(payload: Any, position: int) -> EmbedsSource:
    """An ``image_embeds`` part's payload: base64 of one tensor, or a Qwen-VL image's rows and grid."""
    if isinstance(payload, dict) and set(payload) == {"image_embeds", "image_grid_thw"} and \
            all(isinstance(value, str) for value in payload.values()):
        source = EmbedsSource(payload["image_embeds"])
        source.grid = payload["image_grid_thw"]
        return source
    if not isinstance(payload, str):
        raise ValueError(f"messages[{position}].content: an image embeddings part is {{'type': 'image_embeds', "
                         "'image_embeds': a base64 torch.save or .npy of a tensor}, or for a Qwen-VL model "
                         "{'image_embeds': {'image_embeds': base64 rows, 'image_grid_thw': base64 [1, 3] grid}}")
    return EmbedsSource(payload)


def _formatted(message: dict[str, Any], position: int, form: str, image_placeholder: str | None) -> dict[str, Any]:
    content = message.get("content")
    if content is None and message.get("role") == "assistant":
        # a reply that only calls tools: empty text, as vLLM gives it (templates read message.content)
        message, content = {**message, "content": ""}, ""
    if isinstance(content, list):
        parts = [_part(part, position, index, image_placeholder) for index, part in enumerate(content)]
        if form == "string":
            return {**message, "content": "\n".join(image_placeholder if p["type"] == "image" else p["text"]
                                                     for p in parts)}
        return {**message, "content": parts}
    if isinstance(content, str) and form == "openai":
        return {**message, "content": [{"type": "text", "text": content}]}
    return message


def _part(part: Any, position: int, index: int, image_placeholder: str | None) -> dict[str, Any]:
    """A content part as the template takes it: a text part, or an image part's ``{"type": "image"}``."""
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    if kind in IMAGE_PARTS and image_placeholder is not None:
        return {"type": "image"}
    if kind != "text":
        served = "text, image_url and image_embeds parts are supported" if image_placeholder is not None else \
            "only text parts are supported" + (" (this model takes no images)" if kind in IMAGE_PARTS else "")
        raise ValueError(f"messages[{position}].content: {served}, got a {kind!r} part")
    if not isinstance(part.get("text"), str):
        raise ValueError(f"messages[{position}].content[{index}]: a text part needs its text, a string "
                         "({\"type\": \"text\", \"text\": ...})")
    return {"type": "text", "text": part["text"]}


@lru_cache(maxsize=32)
def detect(template: str) -> str:
    """``openai`` when ``template`` loops over a message's content, else ``string`` (also for a template Jinja cannot
    parse: rendering it reports that better)."""
    from jinja2 import Environment, nodes
    from jinja2.exceptions import TemplateSyntaxError

    try:
        tree = Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except TemplateSyntaxError:
        return "string"
    holders = {target.name for assign in tree.find_all(nodes.Assign) if _is_content(assign.node)
               for target in [assign.target] if isinstance(target, nodes.Name)}
    for loop in tree.find_all(nodes.For):
        source = loop.iter
        while isinstance(source, (nodes.Filter, nodes.Test)) and source.node is not None:
            source = source.node  # message['content'] | selectattr(...)
        if _is_content(source) or (isinstance(source, nodes.Name) and source.name in holders):
            return "openai"
    return "string"


def _is_content(node: Any) -> bool:
    """``x['content']`` or ``x.content``."""
    from jinja2 import nodes

    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    return isinstance(node, nodes.Getattr) and node.attr == "content"

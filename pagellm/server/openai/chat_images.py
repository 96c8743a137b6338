"""Images in chat requests (OpenAI's ``image_url`` parts) for a vision-language model: fetched before a request is
prepared, then its conversation rendered with the model's image placeholders and run through its processor.

- ``fetch_images(request)`` (the route, on the event loop): the http(s) image URLs fetched at once and the file
  ones read (where the server's media settings allow them: ``images.fetch``), into the request, so that
  preparation (maybe on the preparing thread) never waits on the network;
- ``prompt(...)`` (preparation): the template's text, one placeholder per image part (``chat_content.py``), and the
  images (``images.load``: data URLs, and the fetched ones) through the engine's processor: token ids that carry
  the images (``InputProcessor.process_images``), which the engine takes as they are.

Every failure is a 400 naming what to send.
"""

from __future__ import annotations

from typing import Any, Optional

from pagellm import images
from pagellm.chat_content import image_urls
from pagellm.server.openai.errors import APIError
from pagellm.server.openai.protocol import ChatCompletionRequest


async def fetch_images(request: Any, engine: Any) -> None:
    """The request's http(s) and file image URLs (a chat's ``image_url`` parts; a response's ``input_image`` ones and an
    Anthropic request's image blocks, as their ``input_messages()`` give them), fetched into it (all at once) where
    ``engine``'s model takes images; a URL that fails is a 400. Messages that do not read are left to preparation,
    which names what is wrong with them."""
    if engine.image_placeholder is None:
        return
    try:
        messages = [m.to_template_dict() for m in request.messages] if isinstance(request, ChatCompletionRequest) \
            else request.input_messages()
        urls = [url for url in image_urls(messages) if images.is_fetched(url)]
    except ValueError:
        return
    if urls:
        try:
            request._fetched_images = await images.fetch(urls, engine.media)
        except ValueError as exc:
            raise APIError(str(exc), 400, param="messages") from None


def prompt(engine: Any, request: ChatCompletionRequest, messages: list[dict[str, Any]], urls: list[str],
           template_kwargs: Optional[dict[str, Any]]) -> list[int]:
    """A conversation with images as token ids that carry them (see the module doc), for a model that takes them
    (for one that does not, the messages' image parts are refused as content it cannot read: ``chat_content.py``)."""
    if request.use_beam_search:
        raise APIError("use_beam_search cannot carry a prompt's images into its beams' prompts; sample instead (n, "
                       "best_of)", 400, param="use_beam_search")
    if request.truncate_prompt_tokens is not None:
        raise APIError("truncate_prompt_tokens cannot cut a prompt with images; shorten its text instead", 400,
                       param="truncate_prompt_tokens")
    text = engine.tokenizer.render_chat(messages, request.add_generation_prompt, template_kwargs,
                                        request.chat_template, request.continue_final_message, None,
                                        engine.image_placeholder)
    try:
        return engine.process_chat_images(text, urls, request._fetched_images, request.mm_processor_kwargs)
    except ValueError as exc:
        raise APIError(str(exc), 400, param="messages") from None

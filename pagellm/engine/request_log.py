"""Request logging (vLLM's ``--enable-log-requests``, ``--max-log-len`` and ``--enable-log-outputs``): each request
as it arrives (its prompt, sampling parameters and token ids) and, with ``outputs``, each sample's text and token
ids once it finishes; prompts, texts and id lists cut to ``max_len`` (None: whole), a cache salt shown only as set.
"""

from __future__ import annotations

import logging
from typing import Any

from pagellm.engine.request_stream import Tracked
from pagellm.engine.wire import EngineCoreRequest
from pagellm.outputs import CompletionOutput

logger = logging.getLogger(__name__)


class RequestLog:
    def __init__(self, max_len: int | None = None, outputs: bool = False) -> None:
        self.max_len = max_len
        self.outputs = outputs  # a sample's output is kept (``Tracked.output``) until it finishes, then logged

    def request(self, request_id: str, prompt: Any, request: EngineCoreRequest, tokenizer: Any) -> None:
        ids = request.prompt_token_ids[:self.max_len] if request.prompt_embeds is None else []
        try:
            text = prompt if isinstance(prompt, str) else tokenizer.decode(ids, skip_special_tokens=False)
        except ValueError:  # no tokenizer (skip_tokenizer_init): the ids alone
            text = ""
        if request.prompt_embeds is not None:
            text = f"<{len(request.prompt_token_ids)} rows of prompt embeddings>"
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s (%d tokens), cache_salt: %s",
                    request_id, text[:self.max_len], request.sampling_params, ids, len(request.prompt_token_ids),
                    "set" if request.cache_salt else None)

    def output(self, tracked: Tracked, completion: CompletionOutput) -> None:
        """Add a delta to the sample's kept output; log the whole once it finished."""
        text, ids = tracked.output  # type: ignore[misc]
        text.append(completion.text)
        ids.extend(completion.token_ids)
        if completion.finish_reason is not None:
            logger.info("Generated response %s (sample %d): output: %r, output_token_ids: %s (%d tokens), "
                        "finish_reason: %s", tracked.request_id, tracked.index, "".join(text)[:self.max_len],
                        ids[:self.max_len], len(ids), completion.finish_reason)

"""Frontend input side: prompts (text or token ids) and chat messages become validated ``EngineCoreRequest``s."""

from __future__ import annotations

import time
from typing import Sequence, Union

from pagellm.engine.wire import EngineCoreRequest
from pagellm.sampling_params import SamplingParams
from pagellm.tokenizer import Tokenizer

PromptType = Union[str, Sequence[int]]


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def tokenize(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("a prompt must be a string or a list of integer token ids")
        return list(prompt)

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0,
                cache_salt: str | None = None) -> EngineCoreRequest:
        token_ids = self.tokenize(prompt)
        check_prompt(token_ids, self.max_model_len, self.vocab_size)
        return EngineCoreRequest(request_id, token_ids, params, sorted(self.tokenizer.eos_token_ids), time.time(),
                                 priority, cache_salt)


def check_prompt(token_ids: Sequence[int], max_model_len: int, vocab_size: int) -> None:
    """Raise ValueError naming the fix when a tokenized prompt cannot be served."""
    if not token_ids:
        raise ValueError("the prompt is empty; send at least one token")
    if len(token_ids) >= max_model_len:
        raise ValueError(f"the prompt has {len(token_ids)} tokens but max_model_len is {max_model_len}; "
                         f"shorten it to at most {max_model_len - 1} tokens")
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size}); got {min(token_ids)}..{max(token_ids)}")

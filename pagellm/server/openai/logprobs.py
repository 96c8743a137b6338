"""The engine's per-token logprobs (``CompletionOutput.logprobs``) in OpenAI's two response shapes.

Contract:
- Each engine entry is one generated token's ``{token_id: Logprob}``: the top-k alternatives in rank order, then
  the sampled token when it is not among them (with ``logprob_token_ids``: the sampled token, then those asked).
- Completions (``completion_logprobs``): ``tokens`` / ``token_logprobs`` are the sampled tokens' texts and
  logprobs, ``top_logprobs`` maps every entry's text to its logprob (so up to k + 1 items, the sampled token always
  there, as OpenAI documents), ``text_offset`` is each token's start in the choice's text, counted from ``offset``
  (a stream passes the length sent so far) by adding up the token texts. With ``echo`` the prompt's tokens come
  first (``prompt_completion_logprobs``), the first one with null logprob and alternatives.
- Chat (``chat_logprobs``): one item per token with its text, logprob and UTF-8 ``bytes``, and exactly the top-k
  alternatives in ``top_logprobs`` (with ``logprob_token_ids``: the sampled token, then those, as vLLM's).
- ``as_ids`` (a request's ``return_tokens_as_token_ids``, vLLM's): every token is named ``token_id:<id>`` instead of
  its text (a token that is part of a UTF-8 character decodes to U+FFFD alone), ``bytes`` those of that name;
  ``text_offset`` still counts the choice's text.
"""

from __future__ import annotations

from pagellm.outputs import Logprob
from pagellm.sampling_params import SamplingParams
from pagellm.server.openai.replies import (ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptLogprob,
                                           PromptLogprobs, TopLogprob)

Entries = list[dict[int, Logprob]]


def completion_logprobs(token_ids: list[int], entries: Entries, offset: int = 0,
                        result: CompletionLogprobs | None = None,
                        as_ids: bool = False) -> tuple[CompletionLogprobs, int]:
    """``result``: append to these (the prompt's, with ``echo``). Returns them and the text offset after the last
    token."""
    result = result if result is not None else CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries):
        sampled = entry[token_id]
        result.tokens.append(_name(token_id, sampled.decoded_token, as_ids))
        result.token_logprobs.append(sampled.logprob)
        result.top_logprobs.append({_name(t, p.decoded_token, as_ids): p.logprob for t, p in entry.items()})
        result.text_offset.append(offset)
        offset += len(sampled.decoded_token)
    return result, offset


def prompt_completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob] | None],
                               first_text: str, as_ids: bool = False) -> tuple[CompletionLogprobs, int]:
    """The prompt's part of an ``echo`` + ``logprobs`` choice: the first token (nothing predicts it) has a null
    logprob and null alternatives, as OpenAI returns; ``first_text`` is its text."""
    result = CompletionLogprobs(tokens=[_name(token_ids[0], first_text, as_ids)], token_logprobs=[None],
                                top_logprobs=[None], text_offset=[0])
    rest = [entry for entry in entries[1:] if entry is not None]
    return completion_logprobs(token_ids[1:], rest, len(first_text), result, as_ids)


def chat_logprobs(token_ids: list[int], entries: Entries, num_top: int, as_ids: bool = False) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries):
        sampled = entry[token_id]
        token = _name(token_id, sampled.decoded_token, as_ids)
        top = [_top(t, p, as_ids) for t, p in list(entry.items())[:num_top]]
        content.append(ChatTokenLogprob(token=token, logprob=sampled.logprob, bytes=list(token.encode()),
                                        top_logprobs=top))
    return ChatLogprobs(content=content)


def num_alternatives(params: SamplingParams) -> int:
    """How many of a token's entries a reply lists as its alternatives: the top-k asked for, or, with
    ``logprob_token_ids``, every entry (the sampled token, then those named)."""
    return len(params.logprob_token_ids) + 1 if params.logprob_token_ids else params.logprobs or 0


def _name(token_id: int, text: str, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else text


def _top(token_id: int, logprob: Logprob, as_ids: bool) -> TopLogprob:
    token = _name(token_id, logprob.decoded_token, as_ids)
    return TopLogprob(token=token, logprob=logprob.logprob, bytes=list(token.encode()))


def prompt_logprobs_body(entries: list[dict[int, Logprob] | None] | None) -> PromptLogprobs | None:
    """The engine's ``RequestOutput.prompt_logprobs`` in vLLM's JSON shape (token ids as string keys)."""
    if entries is None:
        return None
    return [None if entry is None else
            {str(tid): PromptLogprob(logprob=p.logprob, rank=p.rank, decoded_token=p.decoded_token)
             for tid, p in entry.items()} for entry in entries]

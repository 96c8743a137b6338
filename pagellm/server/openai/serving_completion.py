"""``POST /v1/completions``: prompts (text, token ids, or lists of either) → completions, streamed or whole.

Contract:
- Each prompt is tokenized and checked before anything is queued; choice ``index`` is ``prompt_index * n +
  sample_index`` as OpenAI numbers them. ``echo`` prepends the prompt text (in the first chunk when streaming).
- Usage: ``prompt_tokens`` counts each prompt once, ``completion_tokens`` every generated token of every choice.
- ``logprobs: k`` fills ``choices[i].logprobs`` (see ``logprobs.py``); a stream sends each token's logprobs with
  the chunk that carries its text (or the next one, when a token adds no text yet). With ``echo`` the prompt's
  tokens and their logprobs come first (the form evaluation harnesses use to score a continuation, e.g. with
  ``max_tokens: 1``); a stream sends them with the first chunk.
- ``best_of > n`` returns the ``n`` candidates with the highest cumulative logprob (not streamable: 400).
- ``use_beam_search`` returns each prompt's ``n`` best beams instead (``serving_beam.py``).
- Streaming sends ``data: {chunk}`` events and ``data: [DONE]``; with ``stream_options.include_usage`` a last
  chunk carries the usage and no choices. An engine error after the stream started is sent as an error event.
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Optional

from pagellm.beam_search import BeamSearchParams
from pagellm.outputs import RequestOutput
from pagellm.prompt_embeds import PromptEmbeds
from pagellm.sampling_params import SamplingParams
from pagellm.server.openai import serving_beam
from pagellm.server.openai.chunks import ChunkWriter
from pagellm.server.openai.errors import APIError, sse_error
from pagellm.server.openai.logprobs import (completion_logprobs, prompt_completion_logprobs,
                                            prompt_logprobs_body)
from pagellm.server.openai.protocol import CompletionRequest
from pagellm.server.openai.replies import CompletionChoice, CompletionLogprobs, CompletionResponse, UsageInfo
from pagellm.server.openai.request_metrics import PerRequestMetrics
from pagellm.server.openai.serving_engine import ChoiceState as _Choice
from pagellm.server.openai.serving_engine import OpenAIServing, random_id


@dataclass
class _Job:
    """One completion request after validation."""

    request: CompletionRequest
    request_id: str
    model: str
    prompts: list[list[int] | PromptEmbeds]  # token ids, or input embeddings (prompt_embeds)
    prompt_texts: list[str]
    params: SamplingParams
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_logprobs: dict[int, list] = field(default_factory=dict)  # prompt index → its prompt logprobs (echo)
    beam: Optional[BeamSearchParams] = None  # use_beam_search: the n best beams instead of n samples

    def note(self, prompt_index: int, output: RequestOutput) -> None:
        if output.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = output.prompt_logprobs

    def prompt_ids(self, prompt_index: int) -> list[int] | None:
        """A prompt's token ids (None for an embeddings prompt: it has none)."""
        prompt = self.prompts[prompt_index]
        return prompt if isinstance(prompt, list) else None

    def choice_index(self, prompt_index: int, output: RequestOutput) -> int:
        return prompt_index * self.request.n + output.outputs[0].index

    def usage(self, choices: dict[int, _Choice]) -> UsageInfo:
        """Each prompt counted once: its tokens, and its cached ones as its first sample's request found them (the
        other samples find the first's blocks)."""
        cached = sum(c.num_cached_tokens for i, c in choices.items() if i % self.request.n == 0)
        num_prompt = sum(len(p) if isinstance(p, list) else p.num_tokens for p in self.prompts)
        return UsageInfo.of(num_prompt, sum(c.num_tokens for c in choices.values()), cached)


class OpenAIServingCompletion(OpenAIServing):

    def prepare(self, request: CompletionRequest) -> _Job:
        """Validate and tokenize (raises APIError / ValueError → 4xx before anything is queued)."""
        model, params = self.check_request(request)
        items = [] if request.prompt is None else self.tokenize_prompts(
            request.prompt, request.add_special_tokens, request.truncate_prompt_tokens, "prompt",
            request.truncation_side)
        # embeddings prompts first, as vLLM orders them
        prompts: list[list[int] | PromptEmbeds] = [] if request.prompt_embeds is None else self.load_embeds(
            request.prompt_embeds, request.truncate_prompt_tokens, request.truncation_side)
        prompts += [ids for _, ids, _ in items]
        # with echo, each prompt as the model saw it
        texts = [item if isinstance(item, str) and not cut else self.tokenizer.decode(ids)
                 for item, ids, cut in items] if request.echo else []
        beam = serving_beam.beam_params(request, params.max_tokens, self.max_model_len)
        return _Job(request, random_id("cmpl", request.request_id), model, prompts, texts, params, beam=beam)

    async def create(self, job: _Job) -> CompletionResponse:
        choices: dict[int, _Choice] = {}
        stream = self.generate(job.prompts, job.params, job.request_id, job.request.priority, job.beam,
                               job.request.cache_salt)
        async for prompt_index, output in stream:
            job.note(prompt_index, output)
            choices.setdefault(job.choice_index(prompt_index, output),
                               _Choice(keep_ids=job.request.return_token_ids)).add(output)
        result = []
        for index in sorted(choices):
            choice = choices[index]
            prefix = job.prompt_texts[index // job.request.n] if job.request.echo else ""
            logprobs = self._logprobs(job, choice, index // job.request.n, with_prompt=True)
            prompt_lps = None
            if job.request.prompt_logprobs is not None:
                prompt_lps = prompt_logprobs_body(job.prompt_logprobs.get(index // job.request.n))
            ids = job.request.return_token_ids
            result.append(CompletionChoice(index=index, text=prefix + choice.text, logprobs=logprobs,
                                           finish_reason=choice.finish_reason, stop_reason=choice.stop_reason,
                                           prompt_logprobs=prompt_lps,
                                           prompt_token_ids=job.prompt_ids(index // job.request.n) if ids else None,
                                           token_ids=choice.output_ids if ids else None))
        return CompletionResponse(id=job.request_id, created=job.created, model=job.model, choices=result,
                                  usage=job.usage(choices), metrics=self._metrics(job, choices))

    async def stream(self, job: _Job) -> AsyncIterator[str]:
        choices: dict[int, _Choice] = {}
        writer = ChunkWriter("completion", job.request_id, job.created, job.model)
        try:
            stream = self.generate(job.prompts, job.params, job.request_id, job.request.priority,
                                   cache_salt=job.request.cache_salt)
            async for prompt_index, output in stream:
                job.note(prompt_index, output)
                index = job.choice_index(prompt_index, output)
                choice = choices.setdefault(index, _Choice(keep_ids=job.request.return_token_ids))
                text = choice.add(output)
                first = not choice.started
                if job.request.echo and first:
                    text = job.prompt_texts[prompt_index] + text
                if text or choice.finish_reason or choice.unsent_ids:
                    choice.started = True
                    usage = job.usage(choices) if job.request.continuous_usage else None
                    if job.params.logprobs is None and not job.request.return_token_ids:
                        # the common chunk: no pydantic model per token
                        yield writer.text_choice(index, text, choice.finish_reason, choice.stop_reason,
                                                 usage and usage.model_dump_json())
                        continue
                    logprobs = self._logprobs(job, choice, prompt_index, with_prompt=first)
                    ids = job.request.return_token_ids
                    yield self._chunk(job, [CompletionChoice(
                        index=index, text=text, logprobs=logprobs, finish_reason=choice.finish_reason,
                        stop_reason=choice.stop_reason, prompt_token_ids=job.prompt_ids(prompt_index) if ids and first
                        else None, token_ids=choice.take_ids() if ids else None)], usage)
            if job.request.include_usage:
                yield self._chunk(job, [], job.usage(choices), self._metrics(job, choices))
        except Exception as exc:
            yield sse_error(exc)
        yield "data: [DONE]\n\n"

    def load_embeds(self, raw: str | list[str], keep: Optional[int], side: Optional[str]) -> list[PromptEmbeds]:
        """Each ``prompt_embeds`` entry (a base64 ``torch.save`` of a [tokens, hidden] tensor), read and checked, cut
        to ``keep`` rows at ``side`` (400 naming the fix, before anything is queued)."""
        items = [raw] if isinstance(raw, str) else raw
        if not items:
            raise APIError("prompt_embeds must not be empty", 400, param="prompt_embeds")
        loaded = []
        for position, item in enumerate(items):
            where = f"prompt_embeds {position}: " if len(items) > 1 else "prompt_embeds: "
            try:
                data = base64.b64decode(item, validate=True)
            except binascii.Error as exc:
                raise APIError(f"{where}{exc} (send a base64 torch.save of a [tokens, hidden] float tensor)", 400,
                               param="prompt_embeds") from None
            loaded.append(self.load_prompt_embeds(data, where, keep, side))
        return loaded

    def _logprobs(self, job: _Job, choice: _Choice, prompt_index: int,
                  with_prompt: bool) -> CompletionLogprobs | None:
        """The logprobs of the choice's tokens not sent yet (None when the request did not ask for them); with
        ``echo`` and ``with_prompt`` (the first chunk), the prompt's tokens first."""
        if job.params.logprobs is None:
            return None
        prompt: CompletionLogprobs | None = None
        as_ids = job.request.return_tokens_as_token_ids
        if job.request.echo and with_prompt:
            ids = job.prompts[prompt_index]
            assert isinstance(ids, list)  # echo takes no embeddings prompts (CompletionRequest.unsupported)
            prompt, choice.text_offset = prompt_completion_logprobs(
                ids, job.prompt_logprobs.get(prompt_index, [None]),
                self.tokenizer.decode(ids[:1], skip_special_tokens=False), as_ids)
        result, choice.text_offset = completion_logprobs(*choice.take_logprobs(), offset=choice.text_offset,
                                                         result=prompt, as_ids=as_ids)
        return result

    def _metrics(self, job: _Job, choices: dict[int, _Choice]) -> PerRequestMetrics | None:
        return self.response_metrics(choices, len(job.prompts) == 1 and job.params.num_candidates == 1
                                     and job.beam is None)

    @staticmethod
    def _chunk(job: _Job, choices: list[CompletionChoice], usage: UsageInfo | None = None,
               metrics: PerRequestMetrics | None = None) -> str:
        body = CompletionResponse(id=job.request_id, created=job.created, model=job.model, choices=choices,
                                  usage=usage, metrics=metrics)
        return f"data: {body.model_dump_json()}\n\n"

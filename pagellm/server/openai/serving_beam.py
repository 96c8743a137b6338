"""vLLM's ``use_beam_search`` on ``/v1/completions`` and ``/v1/chat/completions``: the ``n`` best beams of a beam
search of width ``n`` (``pagellm/beam_search.py``) as the request's ``n`` choices, best first.

Contract:
- Extra fields (``extra_body`` in the OpenAI SDK): ``use_beam_search: true``, ``length_penalty`` (default 1.0),
  with ``n`` the beam width (at most 10), ``max_tokens`` / ``max_completion_tokens`` the number of steps (none:
  up to the context length), ``ignore_eos``, ``include_stop_str_in_output``; ``stop_token_ids`` end a beam as
  the model's end-of-sequence tokens do. The beams are ranked by the model's raw log-probabilities, so sampling
  settings (temperature, top_p, top_k, min_p, seed) take no part.
- What a beam search cannot honour is refused with a 400 that names it (``refusals``): streaming, logprobs,
  echo, best_of, prompt_logprobs, penalties, logit_bias, bad_words, allowed_token_ids, min_tokens, stop strings,
  structured outputs and the tool choices that constrain the reply.
- ``beam_outputs`` yields each beam as one finished ``RequestOutput`` (its ``index`` the beam's rank), so the
  handlers build choices, usage, reasoning and tool calls from them as from sampled ones. Each step's requests run
  concurrently; closing it (client gone) cancels them, which aborts them and frees their blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, Optional

from pagellm.beam_search import MAX_BEAM_WIDTH, BeamSearch, BeamSearchParams
from pagellm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagellm.server.openai.protocol import SamplingRequest

# request field → the values that mean "not set" (anything else is refused with use_beam_search)
_NONE, _OFF = (None, [], {}), (None, False)
_UNSET: dict[str, tuple] = {
    "stream": _OFF, "logprobs": _OFF, "top_logprobs": _NONE, "echo": _OFF, "best_of": _NONE,
    "prompt_logprobs": _NONE, "presence_penalty": _NONE, "frequency_penalty": _NONE, "repetition_penalty": _NONE,
    "logit_bias": _NONE, "bad_words": _NONE, "allowed_token_ids": _NONE, "min_tokens": (0,), "stop": _NONE,
    "prediction": _NONE, "logprob_token_ids": _NONE, "thinking_token_budget": _NONE,
}


def _is_set(value: Any, unset: tuple) -> bool:
    """Whether ``value`` is none of ``unset`` (None and False by identity: ``logprobs: 0`` is set)."""
    return not any(value is u if u is None or isinstance(u, bool) else value == u for u in unset)


def refusals(request: SamplingRequest) -> list[tuple[str, str]]:
    """(field, why) for every parameter a beam search cannot honour (none without ``use_beam_search``)."""
    if not getattr(request, "use_beam_search", False):
        return []
    found = [(name, f"{name} does not apply to use_beam_search (beams are ranked by the model's log-probabilities "
                    f"and returned whole); omit it")
             for name, unset in _UNSET.items() if hasattr(request, name) and _is_set(getattr(request, name), unset)]
    if request.n > MAX_BEAM_WIDTH:
        found.append(("n", f"n is the beam width with use_beam_search, at most {MAX_BEAM_WIDTH}"))
    if request.structured() is not None:
        found.append(("structured_outputs", "a structured-output constraint (response_format, guided_*, a tool "
                                            "choice) does not apply to use_beam_search; omit it"))
    return found


def beam_params(request: SamplingRequest, max_tokens: Optional[int],
                max_model_len: int) -> Optional[BeamSearchParams]:
    """The request's beam search (None without ``use_beam_search``); no max_tokens: up to the context length
    (each prompt's search stops where its context ends)."""
    if not getattr(request, "use_beam_search", False):
        return None
    return BeamSearchParams(beam_width=request.n, max_tokens=max_tokens or max_model_len,
                            ignore_eos=request.ignore_eos, length_penalty=request.length_penalty,
                            include_stop_str_in_output=request.include_stop_str_in_output)


async def beam_outputs(engine: Any, prompt: list[int], params: BeamSearchParams, eos: frozenset[int],
                       request_id: str, priority: int, max_model_len: int,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
    """The search's best beams as finished outputs, best first (see the module docstring)."""
    arrival = time.time()
    search, step = BeamSearch(prompt, params, eos, max_model_len), params.step_params()

    async def next_token(tokens: list[int], name: str) -> dict[int, float]:
        last = None
        async with contextlib.aclosing(engine.generate(tokens, step, name, priority, cache_salt)) as stream:
            async for last in stream:
                pass
        assert last is not None and last.outputs[0].logprobs
        return {token: lp.logprob for token, lp in last.outputs[0].logprobs[-1].items()}

    while not search.done:
        search.advance(await asyncio.gather(*(next_token(beam.tokens, f"{request_id}-{search.steps}-{i}")
                                              for i, beam in enumerate(search.live))))
    result = search.result(lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=False))
    for rank, beam in enumerate(result.sequences):
        stop = beam.tokens[-1] if beam.finish_reason == "stop" else None
        completion = CompletionOutput(rank, beam.text, beam.output_token_ids, beam.finish_reason, stop,
                                      cumulative_logprob=beam.cum_logprob)
        yield RequestOutput(request_id, None, prompt, [completion], True,
                            RequestMetrics(arrival, finished_time=time.time()))

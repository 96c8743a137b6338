"""Custom logits processors (vLLM's ``--logits-processors``): code of the user's own that changes a request's
next-token logits, loaded by name at start, without touching pagellm.

A processor is a subclass of ``AdapterLogitsProcessor`` (vLLM's name for its per-request form), importable as
``package.module:Class`` (or ``package.module.Class``). The engine builds one instance per worker, with the
vocabulary size. For each request it asks ``new_req_logits_processor(params)`` for a function to apply to that
request's logits, or None to leave the request alone; a request opts in through its own arguments,
``SamplingParams.extra_args`` (the API's ``vllm_xargs``). The function takes ``(output_ids, logits)`` or
``(prompt_ids, output_ids, logits)``: the request's tokens so far and its logit row for the next token (float32,
``[vocab_size]``), and returns that row changed (or changes it in place and returns it).

- ``validate_params(params)`` (a class method) runs in the frontend as each request arrives: a ``ValueError``
  there is the request's 400, before anything is queued.
- ``is_argmax_invariant()``: True for a processor that never changes which token is the most likely one; greedy
  requests then skip it.
- The functions run after pagellm's own processing (penalties, bias, bans) and before a structured-output
  grammar's mask, each on its row, in the order the processors were named; a function that fails fails the step.
- They see every sampled token, so requests they process get no speculative drafts: custom processors and
  speculative decoding do not run together (refused at start).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional

from pagellm.plugins import import_object

if TYPE_CHECKING:
    import torch

    from pagellm.sampling_params import SamplingParams

RowFunction = Callable[..., "torch.Tensor"]


class AdapterLogitsProcessor:
    """The base of a custom logits processor (see the module docstring)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Raise ValueError when ``params`` (its ``extra_args`` above all) cannot be served by this processor."""

    def is_argmax_invariant(self) -> bool:
        """True when the processor never changes a row's most likely token (greedy requests then skip it)."""
        return False

    def new_req_logits_processor(self, params: SamplingParams) -> Optional[RowFunction]:
        """The function that processes this request's logit rows, or None when the request does not use it."""
        raise NotImplementedError


def qualified_name(processor: Any) -> str:
    """A processor given as a class or a name, as the ``module:Class`` name workers import it by."""
    if isinstance(processor, str):
        return processor
    if isinstance(processor, type):
        return f"{processor.__module__}:{processor.__qualname__}"
    raise ValueError(f"logits_processors takes classes or 'module:Class' names, got {processor!r}")


def resolve(name: str) -> type[AdapterLogitsProcessor]:
    """The processor class ``name`` names (``module:Class`` or ``module.Class``); ValueError says what is wrong."""
    target = import_object(name, "logits processor")
    if not (isinstance(target, type) and issubclass(target, AdapterLogitsProcessor)):
        raise ValueError(f"logits processor {name!r} is not a subclass of "
                         "pagellm.sample.custom.AdapterLogitsProcessor")
    return target


def build(names: Sequence[str], vocab_size: int) -> list[AdapterLogitsProcessor]:
    return [resolve(name)(vocab_size) for name in names]


class RequestFunctions:
    """One request's custom functions, each called with the arguments its signature takes."""

    def __init__(self, functions: list[RowFunction], prompt_ids: Sequence[int]) -> None:
        self.calls = [(fn, _takes_prompt(fn)) for fn in functions]
        self.prompt_ids = list(prompt_ids)

    @classmethod
    def for_request(cls, processors: Sequence[AdapterLogitsProcessor], params: SamplingParams,
                    prompt_ids: Sequence[int]) -> Optional[RequestFunctions]:
        greedy = params.is_greedy
        functions = [fn for p in processors if not (greedy and p.is_argmax_invariant())
                     for fn in [p.new_req_logits_processor(params)] if fn is not None]
        return cls(functions, prompt_ids) if functions else None

    def apply(self, row: torch.Tensor, output_ids: Sequence[int]) -> torch.Tensor:
        output = output_ids if isinstance(output_ids, list) else list(output_ids)  # the runner's is a fresh slice
        for fn, takes_prompt in self.calls:
            row = fn(self.prompt_ids, output, row) if takes_prompt else fn(output, row)
        return row


def _takes_prompt(fn: RowFunction) -> bool:
    """Whether ``fn`` takes (prompt_ids, output_ids, logits) rather than (output_ids, logits)."""
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):  # a builtin without a signature: the two-argument form
        return False
    if len(params) not in (2, 3):
        raise ValueError(f"a logits processor function takes (output_ids, logits) or (prompt_ids, output_ids, "
                         f"logits); {fn!r} takes {len(params)} arguments")
    return len(params) == 3

"""Per-request logits processing before sampling: penalties, logit bias, token bans, grammar masks.

Contract (the order is part of it; ``docs/sampling.md`` repeats it):
1. ``repetition_penalty``, then ``presence_penalty`` / ``frequency_penalty`` (``penalties.py``: sparse over
   the tokens each request has seen);
2. ``logit_bias`` added;
3. bans set to -inf: tokens outside ``allowed_token_ids``, ``bad_words`` (a word's last token when the output
   ends with the rest of it), EOS and ``stop_token_ids`` while fewer than ``min_tokens`` outputs exist;
4. custom logits processors' functions (``custom.py``, ``--logits-processors``), row by row;
5. whatever the request's grammar forbids set to -inf (``structured.py``);
6. a spent thinking budget's forced token (``pagellm/thinking.py``): every other token -inf, the forced one 0.
Then the sampler applies temperature, top-k, top-p and min-p (``sampler.py``).

- ``RequestProcessing`` is one request's state (built once, rebuilt after preemption from its tokens);
  ``observe`` feeds it each accepted token. Requests that ask for none of this have no state at all.
- ``apply_processing`` works on every logit row of a step at once: each kind of processing is one batched tensor
  op over the rows that need it (one gather/scatter over all seen tokens, one ``index_put_`` for all biases, one
  for all bans, one bitmask apply; custom functions alone go row by row); a step where no row needs processing
  returns the logits untouched, without a copy.
- Rows are described by ``RowContext``; a request with draft tokens has one row per draft plus its bonus row,
  each with its own output position (min_tokens counts per position). Requests whose processing depends on the
  output so far (penalties, multi-token bad words, grammars, thinking budgets) never get drafts
  (``depends_on_history``).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from pagellm.sample.custom import AdapterLogitsProcessor, RequestFunctions, build
from pagellm.sample.penalties import TokenCounts, apply_penalties, gather_counts
from pagellm.sampling_params import SamplingParams, StructuredOutputsParams
from pagellm.thinking import ThinkingBudget

if TYPE_CHECKING:  # xgrammar (~1 s to import) loads only when a request asks for structured output
    from pagellm.sample.structured import GrammarCache, RequestGrammar

GrammarFactory = Callable[[StructuredOutputsParams, Sequence[int]], "RequestGrammar"]


@dataclass
class RequestProcessing:
    """What one request's logits processing remembers between steps."""

    params: SamplingParams
    counts: TokenCounts | None = None
    grammar: RequestGrammar | None = None
    bias_ids: torch.Tensor | None = None      # [K] int64
    bias_values: torch.Tensor | None = None   # [K] float32
    allowed: torch.Tensor | None = None       # [A] int64
    bad_words: list[list[int]] = field(default_factory=list)
    custom: RequestFunctions | None = None    # the functions of custom logits processors (sample/custom.py)
    thinking: ThinkingBudget | None = None    # thinking_token_budget's count

    @classmethod
    def create(cls, params: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int],
               vocab_size: int, grammars: GrammarFactory | None,
               custom: Sequence[AdapterLogitsProcessor] = ()) -> RequestProcessing | None:
        """The state ``params`` needs, or None when it needs none (min_tokens is handled per row)."""
        functions = RequestFunctions.for_request(custom, params, prompt_ids) if custom else None
        thinking = ThinkingBudget(params.thinking_token_budget, params.thinking_markers, prompt_ids, output_ids) \
            if params.thinking_token_budget is not None and params.thinking_markers is not None else None
        needs = (params.has_penalties or params.logit_bias or params.allowed_token_ids
                 or params.bad_words_token_ids or params.structured_outputs is not None or functions is not None
                 or thinking is not None)
        if not needs:
            return None
        state = cls(params, bad_words=[list(w) for w in params.bad_words_token_ids or [] if w], custom=functions,
                    thinking=thinking)
        if params.has_penalties:
            state.counts = TokenCounts(prompt_ids, output_ids, params.repetition_penalty != 1.0)
        if params.logit_bias:
            state.bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.int64)
            state.bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
        if params.allowed_token_ids:
            state.allowed = torch.tensor(params.allowed_token_ids, dtype=torch.int64)
        if params.structured_outputs is not None:
            if grammars is None:
                raise ValueError("structured outputs need the model's tokenizer, which this runner was not given")
            state.grammar = grammars(params.structured_outputs, output_ids)
        return state

    def observe(self, token_ids: Sequence[int]) -> None:
        """Account for tokens just appended to the output."""
        if self.counts is not None:
            self.counts.add(token_ids)
        if self.grammar is not None:
            self.grammar.accept(token_ids)
        if self.thinking is not None:
            self.thinking.observe(token_ids)


@dataclass
class RowContext:
    """One logit row: its request's state and which tokens are banned at this row's output position."""

    processing: RequestProcessing | None
    output_ids: Sequence[int]          # the request's output tokens before this row
    banned: Sequence[int] = ()         # min_tokens: EOS / stop ids while the output is still too short

    @property
    def active(self) -> bool:
        return self.processing is not None or bool(self.banned)


def apply_processing(logits: torch.Tensor, rows: Sequence[RowContext], bitmask: torch.Tensor | None = None,
                     grammar_rows: Sequence[int] = ()) -> torch.Tensor:
    """Processed logits [R, V] (float32; ``logits`` itself when no row needs anything). ``bitmask`` holds the
    grammar masks of ``grammar_rows`` at those row indices."""
    if not any(row.active for row in rows):
        return logits
    logits = logits.float() if logits.dtype != torch.float32 else logits
    logits = _penalise(logits, rows)
    _add_bias(logits, rows)
    _ban(logits, rows)
    _restrict(logits, rows)
    _run_custom(logits, rows)
    if bitmask is not None and grammar_rows:
        from pagellm.sample.structured import apply_bitmask
        apply_bitmask(logits, bitmask, list(grammar_rows))
        _end_dead_ends(logits, rows, grammar_rows)
    _force(logits, rows)
    return logits


def _force(logits: torch.Tensor, rows: Sequence[RowContext]) -> None:
    """Rows whose thinking budget is spent take the next token of its end string, whatever else allowed or banned."""
    for i, row in enumerate(rows):
        thinking = row.processing.thinking if row.processing is not None else None
        token = thinking.forced() if thinking is not None else None
        if token is not None:
            logits[i].fill_(float("-inf"))
            logits[i, token] = 0.0


def _end_dead_ends(logits: torch.Tensor, rows: Sequence[RowContext], grammar_rows: Sequence[int]) -> None:
    """A grammar row whose every token is now forbidden (``allowed_token_ids``, bad words or a custom processor that
    share no token with what the grammar allows) may only end: its stop tokens get logit 0, so the request stops
    there rather than sample from nothing (which picks some token outside every constraint). A grammar alone always
    leaves a token, so only rows with other bans are looked at."""
    which = [i for i in grammar_rows if rows[i].banned or (state := rows[i].processing) is not None
             and (state.allowed is not None or state.bad_words or state.custom is not None)]
    if not which:
        return
    index = torch.tensor(which, dtype=torch.int64)
    for i in index[logits.index_select(0, index).amax(dim=-1) == float("-inf")].tolist():
        grammar = rows[i].processing.grammar  # type: ignore[union-attr]
        logits[i, list(grammar.stop_ids)] = 0.0


def _penalise(logits: torch.Tensor, rows: Sequence[RowContext]) -> torch.Tensor:
    which = [i for i, r in enumerate(rows) if r.processing is not None and r.processing.counts is not None]
    if not which:
        return logits
    states = [rows[i].processing for i in which]
    local_rows, ids, counts, in_prompt = gather_counts([s.counts for s in states])  # type: ignore[union-attr,misc]
    params = [s.params for s in states]  # type: ignore[union-attr]
    apply_penalties(logits, torch.tensor(which, dtype=torch.int64)[local_rows], ids, counts, in_prompt,
                    _per_row(rows, which, [p.repetition_penalty for p in params], 1.0),
                    _per_row(rows, which, [p.presence_penalty for p in params], 0.0),
                    _per_row(rows, which, [p.frequency_penalty for p in params], 0.0))
    return logits


def _per_row(rows: Sequence[RowContext], which: list[int], values: list[float], default: float) -> torch.Tensor:
    out = torch.full((len(rows),), default, dtype=torch.float32)
    out[torch.tensor(which, dtype=torch.int64)] = torch.tensor(values, dtype=torch.float32)
    return out


def _add_bias(logits: torch.Tensor, rows: Sequence[RowContext]) -> None:
    row_index, token_ids, values = [], [], []
    for i, row in enumerate(rows):
        state = row.processing
        if state is not None and state.bias_ids is not None:
            row_index.append(torch.full((len(state.bias_ids),), i, dtype=torch.int64))
            token_ids.append(state.bias_ids)
            values.append(state.bias_values)
    if row_index:
        logits.index_put_((torch.cat(row_index), torch.cat(token_ids)), torch.cat(values), accumulate=True)


def _ban(logits: torch.Tensor, rows: Sequence[RowContext]) -> None:
    row_index: list[int] = []
    token_ids: list[int] = []
    for i, row in enumerate(rows):
        banned = list(row.banned)
        if row.processing is not None:
            banned.extend(banned_words(row.processing.bad_words, row.output_ids))
        row_index.extend([i] * len(banned))
        token_ids.extend(banned)
    if row_index:
        logits.index_put_((torch.tensor(row_index), torch.tensor(token_ids)), torch.tensor(float("-inf")))


def banned_words(words: Sequence[Sequence[int]], output_ids: Sequence[int]) -> list[int]:
    """The last token of each bad word whose other tokens are exactly the end of the output."""
    banned = []
    for word in words:
        prefix = len(word) - 1
        if prefix == 0 or (len(output_ids) >= prefix and list(output_ids[-prefix:]) == list(word[:-1])):
            banned.append(word[-1])
    return banned


def _restrict(logits: torch.Tensor, rows: Sequence[RowContext]) -> None:
    which = [i for i, r in enumerate(rows) if r.processing is not None and r.processing.allowed is not None]
    if not which:
        return
    mask = torch.ones(len(which), logits.shape[-1], dtype=torch.bool)
    for j, i in enumerate(which):
        mask[j].index_fill_(0, rows[i].processing.allowed, False)  # type: ignore[union-attr]
    index = torch.tensor(which, dtype=torch.int64)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(mask, float("-inf")))


def _run_custom(logits: torch.Tensor, rows: Sequence[RowContext]) -> None:
    """Each row's custom logits-processor functions, on that row (``sample/custom.py``)."""
    for i, row in enumerate(rows):
        functions = row.processing.custom if row.processing is not None else None
        if functions is not None:
            result = functions.apply(logits[i], row.output_ids)
            if result.shape != logits[i].shape:
                raise ValueError(f"a custom logits processor returned a row of shape {list(result.shape)}; it must "
                                 f"return the row it was given, [{logits.shape[-1]}]")
            logits[i] = result


class LogitsProcessing:
    """The worker's side of logits processing: builds request states (compiling grammars on first use, from the
    model's tokenizer) and fills grammar bitmasks on a helper thread while the forward pass runs."""

    def __init__(self, vocab_size: int, model_dir: Path | None, tokenizer_dir: Path | None = None,
                 custom: Sequence[str] = ()) -> None:
        self.vocab_size = vocab_size
        self.custom = build(custom, vocab_size)  # custom logits processors (--logits-processors), built once
        self._model_dir = model_dir
        self._tokenizer_dir = tokenizer_dir  # another folder's tokenizer (--tokenizer), else the model's
        self._grammars: GrammarCache | None = None
        self._pool: ThreadPoolExecutor | None = None

    def create(self, params: SamplingParams, prompt_ids: Sequence[int],
               output_ids: Sequence[int]) -> RequestProcessing | None:
        return RequestProcessing.create(params, prompt_ids, output_ids, self.vocab_size, self._matcher, self.custom)

    def _matcher(self, so: StructuredOutputsParams, output_ids: Sequence[int]) -> RequestGrammar:
        if self._grammars is None:
            if self._model_dir is None:
                raise ValueError("structured outputs need the model's tokenizer; this runner has no model_dir")
            from pagellm.sample.structured import GrammarCache
            self._grammars = GrammarCache.from_model_dir(self._model_dir, self.vocab_size, self._tokenizer_dir)
        return self._grammars.matcher(so, output_ids)

    def start_masks(self, num_rows: int, grammars: list[tuple[int, RequestGrammar]]) -> Future | None:
        """Start filling a [num_rows, V/32] bitmask for the (row, grammar) pairs; ``None`` when there are none.

        The fill runs on a helper thread so it overlaps the forward pass (xgrammar and torch ops release the GIL).
        """
        if not grammars:
            return None
        cache = self._grammars
        assert cache is not None  # a grammar exists, so the cache was built
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")

        def fill() -> tuple[torch.Tensor, list[int]]:
            bitmask = cache.allocate_bitmask(num_rows)  # on this thread: outside the runner's inference mode
            for row, grammar in grammars:
                grammar.fill(bitmask, row)
            return bitmask, [row for row, _ in grammars]

        return self._pool.submit(fill)

    @staticmethod
    def apply(logits: torch.Tensor, rows: Sequence[RowContext], masks: Future | None) -> torch.Tensor:
        bitmask, grammar_rows = masks.result() if masks is not None else (None, [])
        return apply_processing(logits, rows, bitmask, grammar_rows)

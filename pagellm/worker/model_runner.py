"""The model runner: turns a ``SchedulerOutput`` into one forward pass and the sampled tokens.

It keeps per-request state across steps (applying the scheduler's deltas), builds the flat step inputs, opens
the forward context for attention, computes logits only for the rows that sample, samples, verifies draft tokens
(greedy: the accepted prefix is where drafts equal the target's argmax, plus one corrected/bonus token), and
asks the proposer for the next drafts. For requests that ask for logprobs, it takes ``log_softmax`` of their raw
logit rows (before min_tokens bans) and reports, per sampled token, its logprob, rank and the top alternatives
(``sample/logprobs.py``); a step where no request asks does no logprob work at all.

Per-request logits processing (penalties, logit_bias, bans, min_tokens, grammars) lives in
``sample/logits_processors.py``; the runner only lays out one ``RowContext`` per logit row, starts the grammar
bitmask fill before the forward pass (it runs on a helper thread meanwhile) and feeds accepted tokens back.
Requests whose processing depends on their history (``SamplingParams.depends_on_history``: penalties,
multi-token bad words, grammars) get no draft tokens, so every draft row can be processed statelessly.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from pathlib import Path
from typing import Sequence

import torch

from pagellm.attention.base import AttentionBackend, CommonAttentionInputs, forward_context
from pagellm.model.llama import LlamaForCausalLM
from pagellm.sample.logits_processors import LogitsProcessing, RowContext
from pagellm.sample.logprobs import gather_logprobs, raw_logprobs, split_logprobs
from pagellm.sample.sampler import Sampler, SamplingTensors, processed_logprobs
from pagellm.sched.output import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from pagellm.spec.base import Proposer
from pagellm.worker.input_batch import CachedRequestState, StepInputs, build_step_inputs

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, block_size: int,
                 proposer: Proposer, seed: int, vocab_size: int = 0, model_dir: Path | None = None) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.proposer = proposer
        self.sampler = Sampler(torch.Generator().manual_seed(seed))
        self.processing = LogitsProcessing(vocab_size, model_dir)
        self.states: dict[str, CachedRequestState] = {}
        self.kv_caches: list[torch.Tensor] = []

    def bind_kv_cache(self, num_blocks: int, dtype: torch.dtype) -> None:
        """Allocate one [2, num_blocks, block_size, kv_heads, head_dim] cache per attention layer."""
        self.kv_caches = []
        for attn in self.model.attention_layers():
            cache = torch.zeros(2, num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim, dtype=dtype)
            attn.kv_cache = cache
            self.kv_caches.append(cache)

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_deltas(sched)
        if sched.is_empty:
            return ModelRunnerOutput([], [])
        inputs = build_step_inputs(self.states, sched, self.block_size)
        masks = self.processing.start_masks(len(inputs.logits_indices), self._grammar_rows(inputs))
        common = CommonAttentionInputs(inputs.query_start_loc, inputs.seq_lens, inputs.block_table,
                                       inputs.slot_mapping, self.block_size)
        with forward_context(self.backend, self.backend.build(common)):
            hidden = self.model(inputs.input_ids, inputs.positions)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])  # model dtype; samplers upcast
        wanted = self._logprob_requests(inputs)
        raw = raw_logprobs(logits, _candidate_rows(inputs, wanted)) if wanted else None  # before any ban
        sampled, processed = self._sample(inputs, logits, masks)
        if raw is not None:
            self._use_processed_logprobs(raw, processed, inputs, wanted)
        logprobs = self._logprobs(raw, inputs, wanted, sampled) if raw is not None else {}
        return ModelRunnerOutput(inputs.req_ids, sampled, self._propose(inputs.req_ids, sampled), logprobs,
                                 self._prompt_logprobs(inputs, hidden))

    def _prompt_logprobs(self, inputs: StepInputs, hidden: torch.Tensor) -> dict[str, TokenLogprobs]:
        """For requests with ``prompt_logprobs``: the logprobs of the prompt tokens this step's positions predict
        (position p scores prompt token p + 1), from their own logit rows."""
        flat: list[int] = []
        targets: list[int] = []
        counts: list[int] = []
        ks: list[int] = []
        found: list[tuple[str, int]] = []
        for j, req_id in enumerate(inputs.req_ids):
            state = self.states[req_id]
            k = state.sampling_params.prompt_logprobs
            if k is None:
                continue
            first = int(inputs.query_start_loc[j])
            count = int(inputs.query_start_loc[j + 1]) - first
            start = int(inputs.seq_lens[j]) - count
            end = min(start + count, state.num_prompt_tokens - 1)
            if end <= start:
                continue
            flat.extend(range(first, first + end - start))
            targets.extend(state.token_ids[start + 1:end + 1])
            counts.append(end - start)
            ks.append(k)
            found.append((req_id, start + 1))
        if not flat:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(flat, dtype=torch.int64)])
        values = gather_logprobs(raw_logprobs(logits, range(len(flat))), range(len(flat)), targets, max(ks))
        result = {}
        for (req_id, start), entries in zip(found, split_logprobs(values, counts, ks)):
            entries.start = start
            result[req_id] = entries
        return result

    def _logprob_requests(self, inputs: StepInputs) -> list[int]:
        """Batch indices of the requests that sample this step and asked for logprobs."""
        return [j for j, (req_id, first) in enumerate(zip(inputs.req_ids, inputs.logits_start))
                if first >= 0 and self.states[req_id].sampling_params.logprobs is not None]

    def _logprobs(self, raw: torch.Tensor, inputs: StepInputs, wanted: list[int],
                  sampled: list[list[int]]) -> dict[str, TokenLogprobs]:
        """Per asking request, the entries of its sampled tokens; ``raw`` holds each request's draft rows + 1
        (see ``_candidate_rows``), of which the accepted drafts and the bonus token use the leading ones."""
        rows: list[int] = []
        ids: list[int] = []
        counts: list[int] = []
        ks: list[int] = []
        base = 0
        for j in wanted:
            tokens = sampled[j]
            rows.extend(range(base, base + len(tokens)))
            ids.extend(tokens)
            counts.append(len(tokens))
            ks.append(self.states[inputs.req_ids[j]].sampling_params.logprobs or 0)
            base += len(inputs.drafts[j]) + 1
        values = gather_logprobs(raw, rows, ids, max(ks))
        return {inputs.req_ids[j]: lp for j, lp in zip(wanted, split_logprobs(values, counts, ks))}

    def _apply_deltas(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self.states.pop(req_id, None)
        for new in sched.new_reqs:
            state = self.states[new.req_id] = CachedRequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params, list(new.block_ids),
                new.num_computed_tokens, list(new.stop_token_ids))
            # Rebuilt from the tokens when a preempted request resumes, so its state never depends on history.
            state.processing = self.processing.create(new.sampling_params, new.token_ids[:new.num_prompt_tokens],
                                                      new.token_ids[new.num_prompt_tokens:])
        cached = sched.cached_reqs
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens):
            self.states[req_id].num_computed_tokens = num_computed
        for req_id, block_ids in cached.new_block_ids.items():
            self.states[req_id].block_ids.extend(block_ids)

    def _use_processed_logprobs(self, raw: torch.Tensor, processed: torch.Tensor, inputs: StepInputs,
                                wanted: list[int]) -> None:
        """Overwrite, in ``raw``, the rows of requests that asked for ``processed_logprobs`` with the log of the
        distribution they sample from (after processing, temperature and filters)."""
        candidate_rows = _candidate_rows(inputs, wanted)
        base, targets, sources, params = 0, [], [], []
        for j in wanted:
            width = len(inputs.drafts[j]) + 1
            state_params = self.states[inputs.req_ids[j]].sampling_params
            if state_params.processed_logprobs:
                targets.extend(range(base, base + width))
                sources.extend(candidate_rows[base:base + width])
                params.extend([state_params] * width)
            base += width
        if targets:
            tensors = SamplingTensors.from_params(params, [0] * len(params))
            values = processed_logprobs(processed[torch.tensor(sources)].float(), tensors)
            raw[torch.tensor(targets)] = values

    def _sample(self, inputs: StepInputs, logits: torch.Tensor,
                masks: Future | None) -> tuple[list[list[int]], torch.Tensor]:
        """Sample one token per sampling request (after verifying its drafts, if any); also returns the processed
        logits (``logits`` itself when no row needed processing)."""
        contexts = self._row_contexts(inputs, logits.shape[0])
        if contexts is not None:
            logits = self.processing.apply(logits, contexts, masks)
        rows, params, positions = [], [], []
        for req_id, first, drafts in zip(inputs.req_ids, inputs.logits_start, inputs.drafts):
            if first < 0:
                continue
            state = self.states[req_id]
            rows.append(first + len(drafts))  # the row after the last draft: the bonus / next token
            params.append(state.sampling_params)
            positions.append(state.num_output_tokens + len(drafts))
        bonus = self._sample_rows(logits, rows, params, positions)
        argmax = logits.argmax(dim=-1).tolist() if any(inputs.drafts) else []
        out: list[list[int]] = []
        bonus_tokens = iter(bonus)
        for req_id, first, drafts in zip(inputs.req_ids, inputs.logits_start, inputs.drafts):
            if first < 0:
                out.append([])
                continue
            bonus_token = next(bonus_tokens)
            accepted = _accept_greedy(drafts, argmax[first:first + len(drafts)])
            # A rejected draft is replaced by the target's own choice there; all accepted earns the bonus token.
            last = argmax[first + accepted] if accepted < len(drafts) else bonus_token
            tokens = drafts[:accepted] + [last]
            state = self.states[req_id]
            state.token_ids.extend(tokens)
            if state.processing is not None:
                state.processing.observe(tokens)
            out.append(tokens)
        return out, logits

    def _sample_rows(self, logits: torch.Tensor, rows: list[int], params: list, positions: list[int]) -> list[int]:
        if not rows:
            return []
        selected = logits if len(rows) == logits.shape[0] else logits[torch.tensor(rows)]
        return self.sampler(selected, SamplingTensors.from_params(params, positions)).tolist()

    def _row_contexts(self, inputs: StepInputs, num_rows: int) -> list[RowContext] | None:
        """One context per logit row (drafts + bonus of each sampling request); None when no row needs any
        processing, so such steps skip it entirely."""
        active = False
        contexts = [RowContext(None, ())] * num_rows
        for req_id, first, drafts in zip(inputs.req_ids, inputs.logits_start, inputs.drafts):
            if first < 0:
                continue
            state = self.states[req_id]
            min_tokens = state.sampling_params.min_tokens
            if state.processing is None and not (state.suppressed_token_ids
                                                 and state.num_output_tokens < min_tokens):
                continue
            active = True
            history = state.token_ids[state.num_prompt_tokens:] if state.processing is not None \
                and state.processing.bad_words else ()
            # A grammar decides alone where the output ends: banning EOS after it is complete would leave nothing.
            if state.processing is not None and state.processing.grammar is not None:
                min_tokens = 0
            for offset in range(len(drafts) + 1):
                banned = state.suppressed_token_ids if state.num_output_tokens + offset < min_tokens else ()
                contexts[first + offset] = RowContext(state.processing, history, banned)
        return contexts if active else None

    def _grammar_rows(self, inputs: StepInputs) -> list:
        """(logit row, grammar) of the requests that sample under a grammar this step (they have no drafts)."""
        rows = []
        for req_id, first in zip(inputs.req_ids, inputs.logits_start):
            processing = self.states[req_id].processing
            if first >= 0 and processing is not None and processing.grammar is not None:
                rows.append((first, processing.grammar))
        return rows

    def _propose(self, req_ids: list[str], sampled: list[list[int]]) -> dict[str, list[int]]:
        if not self.proposer.num_lookahead_tokens:
            return {}
        drafts: dict[str, list[int]] = {}
        for req_id, tokens in zip(req_ids, sampled):
            state = self.states[req_id]
            # Drafts are verified greedily only, and never for requests whose processing depends on history
            # (penalties, grammars): their draft rows could not be processed without replaying each draft.
            params = state.sampling_params
            if tokens and params.is_greedy and not params.depends_on_history:
                proposal = self.proposer.propose(state.token_ids, self.proposer.num_lookahead_tokens)
                if proposal:
                    drafts[req_id] = proposal
        return drafts


def _candidate_rows(inputs: StepInputs, wanted: list[int]) -> list[int]:
    """The logit rows of the ``wanted`` requests: for each, one per draft plus the bonus row, in batch order."""
    rows: list[int] = []
    for j in wanted:
        first = inputs.logits_start[j]
        rows.extend(range(first, first + len(inputs.drafts[j]) + 1))
    return rows


def _accept_greedy(drafts: Sequence[int], target: Sequence[int]) -> int:
    """How many leading drafts equal the target model's argmax at their positions."""
    accepted = 0
    for draft, best in zip(drafts, target):
        if draft != best:
            break
        accepted += 1
    return accepted

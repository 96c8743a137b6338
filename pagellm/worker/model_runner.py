"""The model runner: turns a ``SchedulerOutput`` into one forward pass and the sampled tokens.

It keeps per-request state across steps (applying the scheduler's deltas), builds the flat step inputs, opens
the forward context for attention, computes logits only for the rows that sample, samples, verifies draft tokens
(``spec/verify.py``: greedy requests keep the target's argmax path, sampled ones go through lossless rejection
sampling; either way one corrected or bonus token follows the accepted drafts), and asks the proposer for the next
drafts (kept per request until verified, since verification needs their distributions); draft trees get depth
positions and an ancestor mask, and their accepted path's KV is moved into place (``spec/tree.py``). For requests
that ask for logprobs, it takes ``log_softmax`` of their raw logit rows (before min_tokens bans), or what their
``logprobs_mode`` asks for, and reports each sampled token's value, rank and top alternatives
(``sample/logprobs.py``); a step where no request asks does no logprob work.

Per-request logits processing (penalties, logit_bias, bans, min_tokens, grammars) lives in
``sample/logits_processors.py``; the runner lays out one ``RowContext`` per logit row, starts the grammar bitmask
fill before the forward pass (on a helper thread) and feeds accepted tokens back. Requests whose processing depends
on their history (``depends_on_history``: penalties, multi-token bad words, grammars) get no drafts.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import torch

from pagellm.attention.base import AttentionBackend, CommonAttentionInputs, forward_context, new_kv_cache
from pagellm.attention.runs import native_attention
from pagellm.disagg.connector import KVStore
from pagellm.lora import WorkerAdapters, target_projections
from pagellm.metrics.profiler import span
from pagellm.model.llama import LlamaForCausalLM
from pagellm.prompt_embeds import to_tensor
from pagellm.sample.logits_processors import LogitsProcessing, RowContext
from pagellm.sample.logprobs import (apply_logprobs_modes, copy_raw_logits, gather_listed, gather_logprobs,
                                     raw_logprobs, split_logprobs)
from pagellm.sample.sampler import Sampler, SamplingTensors
from pagellm.sampling_params import SamplingParams
from pagellm.sched.output import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from pagellm.spec.base import Draft, ProposalRequest, Proposer
from pagellm.spec.tree import compact_kv, place_trees
from pagellm.spec.verify import DraftedRow, Verified, verify
from pagellm.worker.input_batch import (CachedRequestState, StepInputs, build_step_inputs, encode_scheduled,
                                        mrope_step_positions, plan_images)
from pagellm.worker.kv_transfer import load_stored, save_prompts

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, block_size: int,
                 proposer: Proposer, seed: int, vocab_size: int = 0, model_dir: Path | None = None,
                 disable_by_batch_size: int | None = None, tokenizer_dir: Path | None = None,
                 logits_processors: Sequence[str] = (), max_cpu_loras: int | None = None,
                 lora_target_modules: Sequence[str] | None = None) -> None:
        self.model = model
        self.backend = backend
        native_attention(model, backend.name)  # a vision tower's tiles through the backend's kernel, or its twin
        self.block_size = block_size
        self.proposer = proposer
        self.sampler = Sampler(torch.Generator().manual_seed(seed))
        self.processing = LogitsProcessing(vocab_size, model_dir, tokenizer_dir, logits_processors)
        self.states: dict[str, CachedRequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.drafts: dict[str, Draft] = {}  # proposals awaiting verification, by request
        self._last_sampling: tuple[list, SamplingTensors] | None = None  # the last step's rows and their tensors
        self.disable_by_batch_size = disable_by_batch_size  # no drafting for steps of more requests than this
        self.adapters = WorkerAdapters(model.cfg, model.model.norm.weight.dtype, model.model.parallel, max_cpu_loras,
                                       target_projections(lora_target_modules))
        self._pooling: set[str] = set()  # live pooling requests: steps without any skip looking for them
        self._embeds: set[str] = set()  # live requests with embeddings prompts: likewise
        self.kv_store: KVStore | None = None  # a KV connector's store (disaggregated prefill/decode)
        self.kv_saves = False  # a producer: each prompt's full blocks go to the store once computed

    def bind_kv_cache(self, num_blocks: int, dtype: torch.dtype) -> None:
        """Allocate one [2, num_blocks, block_size, kv_heads, head_dim] cache per attention layer."""
        self.kv_caches = []
        for attn in self.model.attention_layers():
            cache = new_kv_cache(num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim, dtype)
            attn.kv_cache = cache
            self.kv_caches.append(cache)

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        with span("prepare_inputs"):
            self._apply_deltas(sched)
            if self.kv_store is not None:
                sched = load_stored(self.kv_store, sched, self.states, self.block_size)
            if sched.is_empty:
                return ModelRunnerOutput([], [], [])
            if self._embeds:  # the images this step's chunks reach
                encode_scheduled(self.states, self.model, sched)
            inputs = build_step_inputs(self.states, sched, self.block_size, bool(self._embeds))
            masks = self.processing.start_masks(len(inputs.logits_indices), self._grammar_rows(inputs))
            trees = self._trees(inputs)
            common = CommonAttentionInputs(inputs.query_start_loc, inputs.seq_lens, inputs.block_table,
                                           inputs.slot_mapping, self.block_size,
                                           place_trees(inputs.positions, inputs.query_start_loc, trees) or None,
                                           inputs.positions.numpy(), inputs.visible_ends)
            lora = self.adapters.batch(inputs.req_ids, inputs.query_start_loc)
        with span("forward"), forward_context(self.backend, self.backend.build(common), lora):
            mrope = mrope_step_positions(self.states, inputs) if self._embeds else None  # Qwen2-VL's images
            hidden = self.model(inputs.input_ids, inputs.positions if mrope is None else mrope, embeds=inputs.embeds)
        with span("compute_logits"):
            logits = self.model.compute_logits(hidden[inputs.logits_indices])  # model dtype; samplers upcast
        with span("sample"):
            wanted = self._logprob_requests(inputs)
            candidates = _candidate_rows(inputs, wanted) if wanted else []
            modes = self._mode_requests(inputs, wanted)
            raw = raw_logprobs(logits, candidates) if wanted else None  # before any ban
            raw_logits = copy_raw_logits(logits, candidates, modes) if wanted else None
            results, processed = self._sample(inputs, logits, masks)
            if trees:
                self._compact(inputs, trees, results)
            sampled = [r.tokens if r else [] for r in results]
            if raw is not None:
                apply_logprobs_modes(raw, raw_logits, processed, candidates, modes)
            logprobs = self._logprobs(raw, inputs, wanted, sampled) if raw is not None else {}
        pooled = self._pooled(inputs, hidden)
        if self.kv_saves:
            save_prompts(self.kv_store, sched, self.states, self.block_size)  # type: ignore[arg-type]
        with span("propose"):
            drafts = self._propose(inputs, results, hidden)
        return ModelRunnerOutput.from_rows(inputs.req_ids, sampled, drafts, logprobs,
                                           self._prompt_logprobs(inputs, hidden), pooled)

    def _pooled(self, inputs: StepInputs, hidden: torch.Tensor) -> dict[str, bytes]:
        """Pooling requests whose prompt's last token ran: its final hidden state (a classifier's logits, ``pool``)."""
        pooled: dict[str, bytes] = {}
        if not self._pooling:
            return pooled
        whole, qsl = getattr(self.model, "pools_whole_prompt", False), inputs.query_start_loc
        for i, (req_id, first) in enumerate(zip(inputs.req_ids, inputs.logits_start)):
            if first >= 0 and self.states[req_id].sampling_params.pooling:  # an encoder's: its whole prompt's rows
                rows = hidden[int(qsl[i]):int(qsl[i + 1])] if whole else hidden[inputs.logits_indices[first]]
                pooled[req_id] = self.model.pool(rows).numpy().tobytes()
        return pooled

    def _trees(self, inputs: StepInputs) -> dict[int, list[int]]:
        """Rows whose drafts this step form a tree: row → parents of the drafts scheduled."""
        trees = {}
        for row, (req_id, drafts) in enumerate(zip(inputs.req_ids, inputs.drafts)):
            draft = self.drafts.get(req_id) if drafts else None
            if draft is not None and draft.parents is not None:
                trees[row] = draft.parents[:len(drafts)]
        return trees

    def _compact(self, inputs: StepInputs, trees: dict[int, list[int]], results: list[Verified | None]) -> None:
        """Move the KV of each tree's accepted path to the slots right after its root."""
        src: list[int] = []
        dst: list[int] = []
        for row, parents in trees.items():
            root = int(inputs.query_start_loc[row + 1]) - len(parents) - 1
            for j, node in enumerate(results[row].path):
                if node != j:
                    src.append(int(inputs.slot_mapping[root + 1 + node]))
                    dst.append(int(inputs.slot_mapping[root + 1 + j]))
        compact_kv(self.kv_caches, src, dst)

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
        top_k: list[int] = []
        out: dict[str, TokenLogprobs] = {}
        base = 0
        for j in wanted:
            tokens, params = sampled[j], self.states[inputs.req_ids[j]].sampling_params
            run = range(base, base + len(tokens))
            base += len(inputs.drafts[j]) + 1
            if params.logprob_token_ids and tokens:  # the tokens asked for, in place of the top-k
                out[inputs.req_ids[j]] = gather_listed(raw, run, tokens, [params.logprob_token_ids] * len(tokens))
                continue
            rows.extend(run)
            ids.extend(tokens)
            counts.append(len(tokens))
            ks.append(params.logprobs or 0)
            top_k.append(j)
        if top_k:
            values = gather_logprobs(raw, rows, ids, max(ks))
            out.update({inputs.req_ids[j]: lp for j, lp in zip(top_k, split_logprobs(values, counts, ks))})
        return out

    def _apply_deltas(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self.states.pop(req_id, None)
            self.drafts.pop(req_id, None)
            self.adapters.release(req_id)
            self._pooling.discard(req_id)
            self._embeds.discard(req_id)
        if sched.finished_req_ids:
            self.proposer.release(sched.finished_req_ids)
        for new in sched.new_reqs:
            state = self.states[new.req_id] = CachedRequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params, list(new.block_ids),
                new.num_computed_tokens, list(new.stop_token_ids))
            self.adapters.track(new.req_id, new.sampling_params.lora_request)
            if new.sampling_params.pooling:
                self._pooling.add(new.req_id)
            prompt_ids = new.token_ids[:new.num_prompt_tokens]
            if new.prompt_embeds is not None:  # its prompt ids are placeholders: penalties see no prompt tokens
                state.prompt_embeds = to_tensor(new.prompt_embeds, self.model.model.norm.weight.dtype)
                prompt_ids = []
                self._embeds.add(new.req_id)
            if new.mm_inputs is not None:  # its images, encoded as its chunks reach them (again after a preemption)
                plan_images(state, self.model, new.mm_inputs, prompt_ids)
                self._embeds.add(new.req_id)
            # Rebuilt from the tokens when a preempted request resumes, so its state never depends on history.
            state.processing = self.processing.create(new.sampling_params, prompt_ids,
                                                      new.token_ids[new.num_prompt_tokens:])
        cached = sched.cached_reqs
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens):
            self.states[req_id].num_computed_tokens = num_computed
        for req_id, block_ids in cached.new_block_ids.items():
            self.states[req_id].block_ids.extend(block_ids)

    def _mode_requests(self, inputs: StepInputs, wanted: list[int]) -> list[tuple[SamplingParams, int]]:
        """(params, logit rows) of each request that wants logprobs this step, in ``wanted`` order."""
        return [(self.states[inputs.req_ids[j]].sampling_params, len(inputs.drafts[j]) + 1) for j in wanted]

    def _sample(self, inputs: StepInputs, logits: torch.Tensor,
                masks: Future | None) -> tuple[list[Verified | None], torch.Tensor]:
        """Sample one token per request without drafts; verify the drafts of the others (``spec/verify.py``).
        None for requests that sample nothing this step (mid-prompt). Also returns the processed logits
        (``logits`` itself when no row needed processing)."""
        contexts = self._row_contexts(inputs, logits.shape[0])
        if contexts is not None:
            logits = self.processing.apply(logits, contexts, masks)
        rows, params, positions, plain, drafted = [], [], [], [], []
        for j, (req_id, first, drafts) in enumerate(zip(inputs.req_ids, inputs.logits_start, inputs.drafts)):
            if first < 0:
                continue
            state = self.states[req_id]
            if drafts:
                drafted.append((j, self._drafted_row(state, first, drafts)))
                continue
            plain.append(j)
            rows.append(first)
            params.append(state.sampling_params)
            positions.append(state.num_output_tokens)
        out: list[Verified | None] = [None] * len(inputs.req_ids)
        for j, token in zip(plain, self._sample_rows(logits, rows, params, positions)):
            out[j] = Verified([token], [])
        if drafted:
            for (j, _), result in zip(drafted, verify(logits, [row for _, row in drafted], self.sampler.generator)):
                out[j] = result
        for req_id, result in zip(inputs.req_ids, out):
            if result is not None:
                state = self.states[req_id]
                state.token_ids.extend(result.tokens)
                if state.processing is not None:
                    state.processing.observe(result.tokens)
        return out, logits

    def _drafted_row(self, state: CachedRequestState, first: int, drafts: list[int]) -> DraftedRow:
        """What verification needs about a request's drafts (the scheduler may have cut them short)."""
        draft = self.drafts.get(state.req_id)
        probs = draft.probs[:len(drafts)] if draft is not None and draft.probs is not None else None
        parents = draft.parents[:len(drafts)] if draft is not None and draft.parents is not None else None
        return DraftedRow(first, drafts, state.sampling_params, state.num_output_tokens, probs, parents)

    def _sample_rows(self, logits: torch.Tensor, rows: list[int], params: list, positions: list[int]) -> list[int]:
        if not rows:
            return []
        selected = logits if len(rows) == logits.shape[0] else logits[torch.tensor(rows)]
        return self.sampler(selected, self._sampling_tensors(params, positions)).tolist()

    def _sampling_tensors(self, params: list, positions: list[int]) -> SamplingTensors:
        """The rows' sampling tensors: the last step's again while the same requests sample in the same order (the
        same params objects: a request's never change) and none is seeded (a seeded draw depends on the position).
        A decoding batch thus builds them once, not every step, where building them cold after the forward pass
        costs ~100 µs even for one row."""
        last = self._last_sampling
        if last is not None and not last[1].seeds and len(last[0]) == len(params) \
                and all(a is b for a, b in zip(last[0], params)):
            return last[1]
        tensors = SamplingTensors.from_params(params, positions)
        self._last_sampling = (params, tensors)
        return tensors

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
            needs_history = state.processing is not None and (state.processing.bad_words
                                                              or state.processing.custom is not None)
            history = state.token_ids[state.num_prompt_tokens:] if needs_history else ()
            # A grammar decides alone where the output ends: banning EOS after it is complete would leave nothing.
            if state.processing is not None and state.processing.grammar is not None \
                    and state.processing.grammar.constraining:
                min_tokens = 0
            for offset in range(len(drafts) + 1):
                banned = state.suppressed_token_ids if state.num_output_tokens + offset < min_tokens else ()
                contexts[first + offset] = RowContext(state.processing, history, banned)
        return contexts if active else None

    def _grammar_rows(self, inputs: StepInputs) -> list:
        """(logit row, grammar) of the requests that sample under a grammar this step (they have no drafts; one that
        waits for its ``begin_after`` tokens samples freely)."""
        rows = []
        for req_id, first in zip(inputs.req_ids, inputs.logits_start):
            processing = self.states[req_id].processing
            if first >= 0 and processing is not None and processing.grammar is not None \
                    and processing.grammar.constraining:
                rows.append((first, processing.grammar))
        return rows

    def _propose(self, inputs: StepInputs, results: list[Verified | None],
                 hidden: torch.Tensor) -> dict[str, list[int]]:
        """Ask the proposer for drafts for every request that just sampled; keep what verification needs.
        Proposers that draft from the target's hidden states get every row this step accepted (``hidden`` holds
        the whole step's rows). Nothing is drafted after a step of more than ``disable_by_batch_size`` requests
        (speculation off under load)."""
        if not self.proposer.num_lookahead_tokens:
            return {}
        if self.disable_by_batch_size is not None and len(inputs.req_ids) > self.disable_by_batch_size:
            for req_id in inputs.req_ids:  # the scheduler drops these requests' drafts when none come back
                self.drafts.pop(req_id, None)
            return {}
        asks: list[ProposalRequest] = []
        for j, (req_id, result) in enumerate(zip(inputs.req_ids, results)):
            state = self.states[req_id]
            # Requests whose processing depends on their history (penalties, grammars) get no drafts: their
            # draft rows could not be processed without replaying each draft.
            if result is not None and not state.sampling_params.depends_on_history:
                asks.append(ProposalRequest(req_id, state.token_ids, state.sampling_params, state.num_output_tokens,
                                            self.proposer.num_lookahead_tokens, _accepted_hidden(hidden, inputs, j,
                                                                                                 result)))
        drafts: dict[str, list[int]] = {}
        for ask, draft in zip(asks, self.proposer.propose(asks)):
            if draft.tokens:
                drafts[ask.req_id] = draft.tokens
                self.drafts[ask.req_id] = draft  # kept until replaced: the scheduler may verify it steps later
            else:
                self.drafts.pop(ask.req_id, None)
        return drafts


def _accepted_hidden(hidden: torch.Tensor, inputs: StepInputs, j: int, result: Verified) -> torch.Tensor:
    """Request ``j``'s rows of ``hidden`` whose tokens it kept: every row of the step up to its root (the newest
    token before this step's drafts), then the accepted drafts' rows (a chain's prefix, a tree's path)."""
    start, end = int(inputs.query_start_loc[j]), int(inputs.query_start_loc[j + 1])
    root = end - len(inputs.drafts[j]) - 1
    if result.path == list(range(len(result.path))):  # a chain prefix (or no drafts): one contiguous view
        return hidden[start:root + 1 + len(result.path)]
    rows = list(range(start, root + 1)) + [root + 1 + node for node in result.path]
    return hidden[torch.tensor(rows, dtype=torch.int64)]


def _candidate_rows(inputs: StepInputs, wanted: list[int]) -> list[int]:
    """The logit rows of the ``wanted`` requests: for each, one per draft plus the bonus row, in batch order."""
    rows: list[int] = []
    for j in wanted:
        first = inputs.logits_start[j]
        rows.extend(range(first, first + len(inputs.drafts[j]) + 1))
    return rows

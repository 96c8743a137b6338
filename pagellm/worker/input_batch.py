"""Per-request state the model runner keeps across steps, and the flat inputs it builds for one step.

The scheduler sends each request in full once; afterwards only new block ids and counts arrive, and the runner
appends the tokens it samples itself. ``build_step_inputs`` lays the step's requests out as one flat token batch
(prompt chunks, decode tokens and draft tokens of many requests side by side) with positions, KV slots and a block
table, and marks which rows produce logits. Rows that replace token embeddings (an embeddings prompt's, a prompt's
images' from the vision encoder, encoded as the chunks reach them: ``plan_images``, ``encode_due``) are placed by
the positions each chunk computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pagellm.multimodal import MultiModalInputs
from pagellm.sample.logits_processors import RequestProcessing
from pagellm.sampling_params import SamplingParams
from pagellm.sched.output import SchedulerOutput
from pagellm.sched.whole_images import image_runs


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]          # prompt + every output token sampled so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    suppressed_token_ids: list[int] = field(default_factory=list)  # banned until min_tokens outputs exist
    processing: RequestProcessing | None = None  # penalties / bias / bans / grammar state; None = none asked
    prompt_embeds: torch.Tensor | None = None  # an embeddings prompt's rows, in the model's dtype
    # its images' rows (the vision encoder's, in the model's dtype, filled image by image as chunks reach them:
    # ``encode_due``) and the prompt positions they go to, in order
    image_rows: torch.Tensor | None = None
    image_positions: np.ndarray | None = None
    image_inputs: MultiModalInputs | None = None  # while some of its images are not encoded yet
    image_ends: np.ndarray | None = None  # each image's (after the cached ones) last row + 1; one entry: all of them
    image_first: int = 0  # the images the prefix cache holds (never encoded)
    images_done: int = 0  # images encoded so far (after the cached ones)
    # a model whose images attend both ways (Gemma 3): one past the last position of each image position's run
    image_run_ends: np.ndarray | None = None
    # M-RoPE's (Qwen2-VL): the prompt's [3, prompt length] positions, and the delta of every later token's
    mrope: np.ndarray | None = None
    mrope_delta: int = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class StepInputs:
    req_ids: list[str]
    input_ids: torch.Tensor       # [T]
    positions: torch.Tensor       # [T]
    slot_mapping: torch.Tensor    # [T]
    query_start_loc: np.ndarray   # [R + 1]
    seq_lens: np.ndarray          # [R]
    block_table: np.ndarray       # [R, max_blocks]
    logits_indices: torch.Tensor  # flat token indices whose logits are needed
    logits_start: list[int]       # per request: its first row in the logits (or -1 when it samples nothing)
    drafts: list[list[int]]       # per request: draft tokens verified this step
    # Embeddings prompts' rows this step: (flat token indices, their rows), put in place of the token embeddings
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    # [T] the end of each image token's image where images attend both ways (``CommonAttentionInputs``), else None
    visible_ends: np.ndarray | None = None


def build_step_inputs(states: dict[str, CachedRequestState], sched: SchedulerOutput,
                      block_size: int, any_embeds: bool = False) -> StepInputs:
    """The step's flat inputs; ``any_embeds``: some live request has an embeddings prompt or images (their rows are
    placed; where images attend both ways, their tokens' ``visible_ends`` are given)."""
    req_ids = sched.req_ids
    counts = np.array(sched.num_scheduled_tokens, dtype=np.int64)
    query_start_loc = np.zeros(len(req_ids) + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start_loc[1:])
    starts = np.fromiter((states[r].num_computed_tokens for r in req_ids), dtype=np.int64, count=len(req_ids))
    seq_lens = starts + counts
    max_blocks = int(-(-seq_lens.max() // block_size)) if len(req_ids) else 0
    block_table = np.zeros((len(req_ids), max_blocks), dtype=np.int64)
    tokens: list[int] = []
    logits_indices: list[int] = []
    logits_start: list[int] = []
    all_drafts: list[list[int]] = []
    for row, req_id in enumerate(req_ids):
        state = states[req_id]
        start, count = int(starts[row]), int(counts[row])
        drafts = sched.spec_token_ids.get(req_id, [])
        tokens.extend(state.token_ids[start:start + count - len(drafts)])
        tokens.extend(drafts)
        table = state.block_ids[:max_blocks]
        block_table[row, :len(table)] = table
        all_drafts.append(drafts)
        if start + count - len(drafts) >= len(state.token_ids):  # reaches the newest token: sample
            logits_start.append(len(logits_indices))
            last = int(query_start_loc[row + 1])
            logits_indices.extend(range(last - len(drafts) - 1, last))
        else:
            logits_start.append(-1)
    positions = _positions(starts, counts, int(query_start_loc[-1]))
    slots = block_table[np.repeat(np.arange(len(req_ids)), counts), positions // block_size] * block_size \
        + positions % block_size
    return StepInputs(req_ids, torch.tensor(tokens, dtype=torch.int64), torch.from_numpy(positions),
                      torch.from_numpy(slots), query_start_loc, seq_lens, block_table,
                      torch.tensor(logits_indices, dtype=torch.int64), logits_start, all_drafts,
                      *(_embeds_rows(states, req_ids, starts, counts, query_start_loc) if any_embeds else (None,)))


def _embeds_rows(states: dict[str, CachedRequestState], req_ids: list[str], starts: np.ndarray, counts: np.ndarray,
                 query_start_loc: np.ndarray) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, np.ndarray | None]:
    """The flat indices of the step's embeddings-prompt positions and image positions, and the rows that go there;
    the image tokens' ``visible_ends`` where images attend both ways (None where no such token is computed)."""
    indices: list[torch.Tensor] = []
    rows: list[torch.Tensor] = []
    visible_ends: np.ndarray | None = None
    for row, req_id in enumerate(req_ids):
        state = states[req_id]
        start, first = int(starts[row]), int(query_start_loc[row])
        if start >= state.num_prompt_tokens:
            continue
        count = min(int(counts[row]), state.num_prompt_tokens - start)
        if state.prompt_embeds is not None:
            indices.append(torch.arange(first, first + count))
            rows.append(state.prompt_embeds[start:start + count])
        elif state.image_positions is not None:  # the images' rows whose positions this chunk computes
            lo, hi = np.searchsorted(state.image_positions, (start, start + count))
            if hi > lo:
                flat = state.image_positions[lo:hi] - start + first
                indices.append(torch.from_numpy(flat))
                rows.append(state.image_rows[lo:hi])  # type: ignore[index]
                if state.image_run_ends is not None:
                    if visible_ends is None:
                        visible_ends = np.zeros(int(query_start_loc[-1]), dtype=np.int64)
                    visible_ends[flat] = state.image_run_ends[lo:hi]
    width = max((r.shape[1] for r in rows), default=0)  # an embeddings prompt's rows beside Qwen3-VL's image rows:
    rows = [F.pad(r, (0, width - r.shape[1])) if r.shape[1] < width else r for r in rows]  # no DeepStack rows
    return ((torch.cat(indices), torch.cat(rows)) if rows else None), visible_ends


def plan_images(state: CachedRequestState, model: Any, images: MultiModalInputs, prompt_ids: list[int]) -> None:
    """A request's image-token positions (the frontend's processor wrote one token per row), and room for their
    rows, which ``encode_due`` fills as chunks reach them. The leading images whose tokens the prefix cache already
    holds (all before ``state.num_computed_tokens``) are never encoded: no step computes their positions."""
    positions = np.flatnonzero(np.asarray(prompt_ids) == model.cfg.image_token_id).astype(np.int64)
    skip, skipped = _cached_images(images, positions, state.num_computed_tokens)
    if model.cfg.bidirectional_images:  # each image position's run end (the runs the scheduler keeps whole)
        runs = image_runs(prompt_ids, model.cfg.image_token_id)
        runs = np.zeros((0, 2), dtype=np.int64) if runs is None else runs
        state.image_run_ends = np.repeat(runs[:, 1], runs[:, 1] - runs[:, 0])[skipped:]
    if hasattr(model, "mrope_positions"):  # every image's grid places the text after it
        state.mrope, state.mrope_delta = model.mrope_positions(prompt_ids, images)
    state.image_positions = positions = positions[skipped:]
    width = getattr(model, "image_row_width", model.cfg.hidden_size)  # Qwen3-VL's: DeepStack rows beside each
    state.image_rows = torch.empty(len(positions), width, dtype=model.model.norm.weight.dtype)
    counts = [count for _, count in images.items[skip:]] if images.items else [len(positions)]
    state.image_ends = np.cumsum(counts, dtype=np.int64)
    state.image_first, state.images_done = skip, 0
    state.image_inputs = images if len(positions) else None


def encode_scheduled(states: dict[str, CachedRequestState], model: Any, sched: SchedulerOutput) -> None:
    """The images the step's prompt chunks reach that are not encoded yet (``encode_due``, each request's in one
    encoder call)."""
    for req_id, count in zip(sched.req_ids, sched.num_scheduled_tokens):
        state = states[req_id]
        if state.image_inputs is not None:
            encode_due(state, model, state.num_computed_tokens + count)


def encode_due(state: CachedRequestState, model: Any, end: int) -> None:
    """Encode the request's images whose tokens lie before position ``end`` and are not encoded yet (all of them in
    one call; every image at once where the frontend did not count each image's tokens)."""
    assert state.image_positions is not None and state.image_ends is not None and state.image_inputs is not None
    needed = int(np.searchsorted(state.image_positions, end))
    done, ends = state.images_done, state.image_ends
    start = int(ends[done - 1]) if done else 0
    if needed <= start:
        return
    last = int(np.searchsorted(ends, needed)) + 1  # the images to encode: [done, last)
    first, stop = state.image_first + done, state.image_first + last
    rows = model.image_rows(state.image_inputs, first, stop if state.image_inputs.items else None)
    if len(rows) != int(ends[last - 1]) - start:
        raise ValueError(f"request {state.req_id}: {int(ends[last - 1]) - start} image tokens in its prompt for "
                         f"images {first}..{stop - 1} but {len(rows)} image rows")
    state.image_rows[start:int(ends[last - 1])] = rows  # type: ignore[index]
    state.images_done = last
    if last == len(ends):
        state.image_inputs = None  # every image encoded: the pixels go


def _cached_images(images: MultiModalInputs, positions: np.ndarray, computed: int) -> tuple[int, int]:
    """How many leading images have all their tokens before position ``computed``, and how many tokens they have
    (none where the frontend did not count each image's tokens)."""
    skip = tokens = 0
    for _, count in images.items:
        if positions[tokens + count - 1] >= computed:
            break
        skip, tokens = skip + 1, tokens + count
    return skip, tokens


def mrope_step_positions(states: dict[str, CachedRequestState], inputs: StepInputs) -> torch.Tensor | None:
    """[3, T] M-RoPE positions of the step's tokens where some request has a table (``CachedRequestState.mrope``):
    its prompt's from the table, its later tokens' (drafts too, wherever a tree placed them) shifted by its delta,
    every other request's three alike; [T] where each token's three agree (a step of decodes: the native stack
    takes it); None where no request has one."""
    rows = [row for row, req_id in enumerate(inputs.req_ids) if states[req_id].mrope is not None]
    if not rows:
        return None
    flat = inputs.positions.numpy()
    out = np.repeat(flat[None], 3, axis=0)
    for row in rows:
        state, (lo, hi) = states[inputs.req_ids[row]], inputs.query_start_loc[row:row + 2]
        table, positions = state.mrope, flat[lo:hi]
        assert table is not None
        inside = positions < table.shape[1]
        out[:, lo:hi] = np.where(inside, table[:, np.minimum(positions, table.shape[1] - 1)],
                                 positions + state.mrope_delta)
    if (out[0] == out[1]).all() and (out[0] == out[2]).all():
        return torch.from_numpy(np.ascontiguousarray(out[0]))
    return torch.from_numpy(out)


def _positions(starts: np.ndarray, counts: np.ndarray, total: int) -> np.ndarray:
    """Concatenated ranges ``[start, start + count)`` for each request, without a Python loop."""
    offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + offsets

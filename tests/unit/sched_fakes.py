"""The fake model output the scheduler tests step with (no model, no torch), and the invariants every step must
keep. Each step: ``schedule()``, then a hand-built ``ModelRunnerOutput`` (one sampled token for every scheduled
request that reached the end of its known tokens, none mid-prompt), then ``update_from_output()``, whose
``StepOutput`` the tests read per request (``news``)."""

from __future__ import annotations

from collections import Counter
from typing import Callable, NamedTuple

from pagellm.config import CacheConfig, SchedulerConfig
from pagellm.metrics.stats import RequestTimes
from pagellm.request import FinishReason, Request, RequestStatus
from pagellm.sampling_params import SamplingParams
from pagellm.sched.output import CachedRequestData, ModelRunnerOutput, SchedulerOutput, StepOutput
from pagellm.sched.scheduler import Scheduler

TOKEN = 7  # what the fake model samples unless told otherwise


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 16,
    budget: int = 2048,
    max_num_seqs: int = 256,
    chunked: bool = True,
    policy: str = "fcfs",
    max_model_len: int = 1024,
    caching: bool = True,
    lookahead: int = 0,
    disable_by_batch_size: int | None = None,
    chunk_cap: int = 0,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                        scheduling_policy=policy, long_prefill_token_threshold=chunk_cap),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        num_blocks, max_model_len, lookahead, disable_by_batch_size,
    )


def per_request(cached: CachedRequestData) -> list[tuple[str, list[int], int]]:
    """The step's running requests as (id, new block ids, computed tokens before the step), in batch order;
    ``new_block_ids`` may only name requests of the step."""
    assert set(cached.new_block_ids) <= set(cached.req_ids) and all(cached.new_block_ids.values())
    return [(rid, cached.new_block_ids.get(rid, []), n) for rid, n in zip(cached.req_ids, cached.num_computed_tokens)]


def make_request(
    rid: str, prompt, max_tokens: int = 16, eos=(), priority: int = 0, arrival: float = 0.0,
    salt: str | None = None, **params,
) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids=frozenset(eos), arrival_time=arrival, priority=priority, cache_salt=salt)


TokenFn = Callable[[Request], int]


class News(NamedTuple):
    """One request's part of a ``StepOutput``."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    stop_reason: int | None
    num_cached_tokens: int | None   # only with its first output tokens
    times: RequestTimes | None      # likewise

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def news(out: StepOutput) -> list[News]:
    first = {rid: (f.num_cached_tokens, f.times) for rid, f in out.first.items()}
    return [News(rid, tokens, out.finish_reasons.get(rid), out.stop_reasons.get(rid), *first.get(rid, (None, None)))
            for rid, tokens in zip(out.req_ids, out.rows())]


def runner_output(req_ids: list[str], rows: list[list[int]], drafts: dict[str, list[int]] | None = None
                  ) -> ModelRunnerOutput:
    return ModelRunnerOutput.from_rows(req_ids, rows, drafts)


def fake_output(
    sched: Scheduler, out: SchedulerOutput, token: int | TokenFn = TOKEN,
    drafts: dict[str, list[int]] | None = None,
) -> ModelRunnerOutput:
    """One sampled token per request at the end of its known tokens; none mid-prompt. Scheduled drafts rejected."""
    rows = []
    for rid in out.req_ids:
        request = sched.requests[rid]
        if sched.num_computed_tokens(rid) >= request.num_tokens:
            rows.append([token(request) if callable(token) else token])
        else:
            rows.append([])
    return runner_output(list(out.req_ids), rows, drafts)


def step(
    sched: Scheduler, token: int | TokenFn = TOKEN, drafts: dict[str, list[int]] | None = None,
) -> tuple[SchedulerOutput, list[News]]:
    out = sched.schedule()
    check_invariants(sched)
    outputs = news(sched.update_from_output(out, fake_output(sched, out, token, drafts)))
    check_invariants(sched)
    return out, outputs


def run_to_completion(
    sched: Scheduler, token: int | TokenFn = TOKEN, max_steps: int = 500,
) -> list[tuple[SchedulerOutput, list[News]]]:
    """Step until every request is done, then check that every block is free again."""
    trace = []
    while sched.has_unfinished_requests():
        assert len(trace) < max_steps, "the scheduler made no progress"
        trace.append(step(sched, token))
    assert_all_free(sched)
    return trace


def assert_all_free(sched: Scheduler) -> None:
    kv = sched.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert kv.req_blocks == {}
    assert len(sched.running) == 0 and len(sched.waiting) == 0 and sched.requests == {}


def check_invariants(sched: Scheduler) -> None:
    kv, pool = sched.kv, sched.kv.pool
    holders: Counter[int] = Counter()
    for rid, blocks in kv.req_blocks.items():
        block_ids = [b.block_id for b in blocks]
        assert len(set(block_ids)) == len(block_ids), f"{rid} holds a block twice: {block_ids}"
        holders.update(block_ids)
    for block in pool.blocks:
        assert block.ref_cnt == holders[block.block_id], block
        if holders[block.block_id] > 1:  # shared only through the prefix cache
            assert block.block_hash is not None and pool.cached[block.block_hash] is block
    free = list(pool.free_queue)
    assert len(free) == pool.num_free_blocks
    assert {b.block_id for b in free} == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    assert len(free) + sum(1 for b in pool.blocks if b.ref_cnt > 0) == pool.num_blocks
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash
    running = [r.request_id for r in sched.running]
    waiting = [r.request_id for r in sched.waiting]
    assert len(running) <= sched.max_num_seqs
    assert set(kv.req_blocks) == set(running)
    assert sorted(running + waiting) == sorted(sched.requests)
    batch = sched.running
    for row, request in enumerate(batch.requests):
        assert request.status == RequestStatus.RUNNING
        blocks = kv.req_blocks[request.request_id]
        assert len(blocks) * kv.block_size >= batch.computed[row]
        for index, block in enumerate(blocks):  # a cached block holds exactly this request's tokens
            if block.block_hash is not None:
                assert block.block_hash == request.block_hashes[index]
        # the batch's columns mirror the request and the KV manager
        assert batch.token_lists[row] is request.all_token_ids and batch.req_ids[row] == request.request_id
        assert batch.num_tokens[row] == request.num_tokens and batch.num_spec[row] == len(request.spec_token_ids)
        assert (batch.kv_slots[row], batch.kv_next_full[row]) == kv.slots_and_next_full(request.request_id)
    for request in sched.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert sched.num_computed_tokens(request.request_id) == 0


def scheduled_trace(trace) -> list[dict[str, int]]:
    return [out.scheduled() for out, _ in trace]


def final_outputs(trace) -> dict[str, News]:
    return {o.request_id: o for _, outputs in trace for o in outputs if o.finished}


def tokens_by_request(trace) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _, outputs in trace:
        for o in outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens




def preemption_setup(policy: str = "fcfs", drafts: dict[str, list[int]] | None = None) -> Scheduler:
    """Six blocks of 4 tokens, three running requests filling all of them."""
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64, max_model_len=64, policy=policy)
    sched.add_request(make_request("A", range(100, 108), max_tokens=2))   # blocks 0, 1
    sched.add_request(make_request("B", range(200, 206), max_tokens=10))  # blocks 2, 3
    sched.add_request(make_request("C", range(300, 306), max_tokens=10))  # blocks 4, 5
    out, _ = step(sched, drafts=drafts)
    assert [r.block_ids for r in out.new_reqs] == [[0, 1], [2, 3], [4, 5]]
    assert sched.kv.num_free_blocks == 0
    return sched


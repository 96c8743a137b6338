"""Exact tests of the token-budget scheduler, driven by a fake model output (no model, no torch).

Each step: ``schedule()``, then a hand-built ``ModelRunnerOutput`` (one sampled token for every scheduled request
that reached the end of its known tokens, none for a request mid-prompt), then ``update_from_output()``, whose
``StepOutput`` the tests read per request (``news``).
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Callable, NamedTuple

import pytest

from pagellm.config import CacheConfig, SchedulerConfig
from pagellm.metrics.stats import RequestTimes
from pagellm.request import FinishReason, Request, RequestStatus
from pagellm.sampling_params import SamplingParams
from pagellm.sched.output import CachedRequestData, ModelRunnerOutput, SchedulerOutput, StepOutput
from pagellm.sched.scheduler import Scheduler

TOKEN = 7  # what the fake model samples unless told otherwise


# ----------------------------------------------------------------------------------------------- helpers
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
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                        scheduling_policy=policy),
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


# ------------------------------------------------------------------------------------- the token budget
@pytest.mark.parametrize(
    "budget, prompts, max_tokens, expected",
    [
        # running first (A's rest), then waiting (B fits in what is left)
        (32, {"A": 50, "B": 10}, 3,
         [{"A": 32}, {"A": 18, "B": 10}, {"A": 1, "B": 1}, {"A": 1, "B": 1}]),
        # a running prompt eats the whole budget; B only starts with what A leaves over, and is chunked
        (32, {"A": 100, "B": 40}, 2,
         [{"A": 32}, {"A": 32}, {"A": 32}, {"A": 4, "B": 28}, {"A": 1, "B": 12}, {"B": 1}]),
    ],
)
def test_budget_split_with_chunked_prefill(budget, prompts, max_tokens, expected):
    sched = make_scheduler(budget=budget)
    for i, (rid, n) in enumerate(prompts.items()):
        sched.add_request(make_request(rid, range(1000 * (i + 1), 1000 * (i + 1) + n), max_tokens=max_tokens))
    trace = run_to_completion(sched)
    assert scheduled_trace(trace) == expected
    assert all(out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens) <= budget
               for out, _ in trace)
    finals = final_outputs(trace)
    assert {rid: o.finish_reason for rid, o in finals.items()} == {rid: FinishReason.LENGTH for rid in prompts}
    assert tokens_by_request(trace) == {rid: [TOKEN] * max_tokens for rid in prompts}


def test_chunked_prefill_step_details():
    sched = make_scheduler(budget=32)
    sched.add_request(make_request("A", range(50), max_tokens=3))
    sched.add_request(make_request("B", range(100, 110), max_tokens=3))

    out, outputs = step(sched)
    assert [(r.req_id, r.block_ids, r.num_computed_tokens, r.num_prompt_tokens) for r in out.new_reqs] == [
        ("A", [0, 1], 0, 50)]
    assert per_request(out.cached_reqs) == [] and outputs == []   # mid-prompt: nothing to report
    assert sched.num_computed_tokens("A") == 32

    out, outputs = step(sched)
    assert per_request(out.cached_reqs) == [("A", [2, 3], 32)]
    assert [(r.req_id, r.block_ids, r.num_computed_tokens) for r in out.new_reqs] == [("B", [4], 0)]
    assert out.req_ids == ["A", "B"]   # running first, then new
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs] == [
        ("A", [TOKEN], None), ("B", [TOKEN], None)]

    out, _ = step(sched)
    assert per_request(out.cached_reqs) == [("A", [], 50), ("B", [], 10)]
    assert out.new_reqs == []


@pytest.mark.parametrize(
    "chunked, expected",
    [
        # B (30) does not fit the 24 tokens A leaves, and C may not jump the queue
        (False, [{"A": 40}, {"A": 1, "B": 30, "C": 5}, {"B": 1, "C": 1}]),
        (True, [{"A": 40, "B": 24}, {"A": 1, "B": 6, "C": 5}, {"B": 1, "C": 1}]),
    ],
)
def test_chunked_prefill_off_makes_long_prompts_wait(chunked, expected):
    sched = make_scheduler(budget=64, max_model_len=64, chunked=chunked)
    sched.add_request(make_request("A", range(100, 140), max_tokens=2))
    sched.add_request(make_request("B", range(200, 230), max_tokens=2))
    sched.add_request(make_request("C", range(300, 305), max_tokens=2))
    assert scheduled_trace(run_to_completion(sched)) == expected


def test_chunked_prefill_off_needs_budget_for_max_model_len():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_scheduler(budget=32, max_model_len=64, chunked=False)


def test_default_budget_offline_and_serving():
    """Without ``max_num_batched_tokens`` a step holds 4096 tokens offline and 2048 in the servers (``for_serving``,
    which AsyncLLM applies); a budget the user gave, or the chunked-prefill-off rule, is kept."""
    def budget(config: SchedulerConfig) -> int:
        return Scheduler(config, CacheConfig(block_size=16), num_blocks=1024, max_model_len=8192).budget

    assert budget(SchedulerConfig()) == 4096
    assert budget(SchedulerConfig().for_serving()) == 2048
    assert budget(SchedulerConfig(max_num_batched_tokens=512).for_serving()) == 512
    assert budget(SchedulerConfig(enable_chunked_prefill=False).for_serving()) == 8192  # max_model_len
    sched = Scheduler(SchedulerConfig(), CacheConfig(block_size=16), num_blocks=1024, max_model_len=8192)
    sched.add_request(make_request("A", [7] * 5000, max_tokens=1))
    assert sched.schedule().num_scheduled_tokens == [4096]  # the first chunk of a long prompt


def test_max_num_seqs_caps_running_requests():
    sched = make_scheduler(max_num_seqs=2)
    for rid in "ABC":
        sched.add_request(make_request(rid, range(5), max_tokens=2))
    trace = run_to_completion(sched)
    assert scheduled_trace(trace) == [{"A": 5, "B": 5}, {"A": 1, "B": 1}, {"C": 5}, {"C": 1}]
    assert [out.finished_req_ids for out, _ in trace] == [[], [], ["A", "B"], []]


# ------------------------------------------------------------------------------------------ prefix cache
def test_prefix_hit_skips_compute():
    sched = make_scheduler()
    prompt = list(range(500, 540))   # 40 tokens: 2 full blocks of 16 + 8
    sched.add_request(make_request("A", prompt, max_tokens=1))
    out, outputs = step(sched)
    assert out.scheduled() == {"A": 40}
    assert out.new_reqs[0].block_ids == [0, 1, 2]
    assert outputs[0].finish_reason == FinishReason.LENGTH and outputs[0].num_cached_tokens == 0
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_prompt_tokens) == (40, 0, 40)

    sched.add_request(make_request("B", prompt, max_tokens=1))
    out, outputs = step(sched)
    assert out.scheduled() == {"B": 8}
    new = out.new_reqs[0]
    assert (new.num_computed_tokens, new.block_ids) == (32, [0, 1, 3])  # A's blocks came back tail first
    assert out.finished_req_ids == ["A"]
    assert outputs[0].num_cached_tokens == 32
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_prompt_tokens) == (40, 32, 8)
    assert stats.num_generation_tokens == 1 and stats.num_scheduled_tokens == 8
    assert_all_free(sched)


def test_prefix_hit_within_one_step_shares_blocks():
    sched = make_scheduler()
    prompt = list(range(500, 540))
    sched.add_request(make_request("A", prompt, max_tokens=2))
    sched.add_request(make_request("B", prompt, max_tokens=2))
    out = sched.schedule()
    assert out.scheduled() == {"A": 40, "B": 8}
    assert [r.block_ids for r in out.new_reqs] == [[0, 1, 2], [0, 1, 3]]
    assert [sched.kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    check_invariants(sched)
    sched.update_from_output(out, fake_output(sched, out))
    run_to_completion(sched)


def test_prefix_caching_disabled_computes_everything():
    sched = make_scheduler(caching=False)
    prompt = list(range(500, 540))
    sched.add_request(make_request("A", prompt, max_tokens=1))
    sched.add_request(make_request("B", prompt, max_tokens=1))
    trace = run_to_completion(sched)
    assert scheduled_trace(trace) == [{"A": 40, "B": 40}]
    assert sched.make_stats().prefix_cache_hits == 0


def test_cache_salt_prevents_a_hit():
    sched = make_scheduler()
    prompt = list(range(500, 540))
    sched.add_request(make_request("A", prompt, max_tokens=1, salt="alice"))
    sched.add_request(make_request("B", prompt, max_tokens=1, salt="bob"))
    sched.add_request(make_request("C", prompt, max_tokens=1, salt="alice"))
    trace = run_to_completion(sched)
    assert scheduled_trace(trace) == [{"A": 40, "B": 40, "C": 8}]


# -------------------------------------------------------------------------------------------- preemption
def _preemption_setup(policy: str = "fcfs", drafts: dict[str, list[int]] | None = None) -> Scheduler:
    """Six blocks of 4 tokens, three running requests filling all of them."""
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64, max_model_len=64, policy=policy)
    sched.add_request(make_request("A", range(100, 108), max_tokens=2))   # blocks 0, 1
    sched.add_request(make_request("B", range(200, 206), max_tokens=10))  # blocks 2, 3
    sched.add_request(make_request("C", range(300, 306), max_tokens=10))  # blocks 4, 5
    out, _ = step(sched, drafts=drafts)
    assert [r.block_ids for r in out.new_reqs] == [[0, 1], [2, 3], [4, 5]]
    assert sched.kv.num_free_blocks == 0
    return sched


def test_fcfs_preempts_the_newest_and_resumes_it_first():
    sched = _preemption_setup()
    sched.add_request(make_request("D", range(400, 404), max_tokens=1))
    sched.make_stats()

    # A needs a third block; none is free → C (newest) is preempted; its blocks return tail first.
    out, outputs = step(sched)
    assert out.scheduled() == {"A": 1, "B": 1}
    assert per_request(out.cached_reqs) == [("A", [5], 8), ("B", [], 6)]
    assert out.new_reqs == []                       # no newcomers in a step that preempts
    assert out.finished_req_ids == ["C"]            # workers drop C's state
    c = [r for r in sched.waiting if r.request_id == "C"][0]
    assert [r.request_id for r in sched.waiting] == ["C", "D"]   # back at the FRONT
    assert (c.status, sched.num_computed_tokens("C"), c.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert c.output_token_ids == [TOKEN]            # its sampled tokens are kept
    assert sched.make_stats().num_preemptions == 1
    assert [o.request_id for o in outputs if o.finished] == ["A"]

    # A finished and freed [5, 1, 0]; C resumes first, hitting its own still-cached first block.
    assert [b.block_id for b in sched.kv.pool.free_queue] == [4, 5, 1, 0]
    out, _ = step(sched)
    assert out.scheduled() == {"B": 1, "C": 3, "D": 4}
    assert [(r.req_id, r.token_ids, r.num_prompt_tokens, r.block_ids, r.num_computed_tokens)
            for r in out.new_reqs] == [
        ("C", [300, 301, 302, 303, 304, 305, TOKEN], 6, [4, 5], 4),
        ("D", [400, 401, 402, 403], 4, [1], 0),
    ]
    assert out.finished_req_ids == ["A"]
    assert c.num_cached_tokens == 0                 # the hit length of its first schedule, not of the resume
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions) == (11, 4, 0)
    assert stats.kv_cache_evictions == 1            # D reused A's cached block 1

    # B and C both grow to 16 tokens (4 blocks each) in a 6-block pool: C, the newest, is preempted again and
    # later resumes on its two cached blocks (4, 5).
    trace = run_to_completion(sched)
    assert scheduled_trace(trace) == [{"B": 1, "C": 1}] * 4 + [{"B": 1}] * 3 + [{"C": 4}] + [{"C": 1}] * 3
    assert [(r.req_id, r.block_ids, r.num_computed_tokens) for r in trace[7][0].new_reqs] == [("C", [4, 5, 1], 8)]
    assert [out.finished_req_ids for out, _ in trace] == [["D"], [], [], [], ["C"], [], [], ["B"], [], [], []]
    assert per_request(trace[4][0].cached_reqs) == [("B", [1], 12)]
    assert len(tokens_by_request(trace)["C"]) == 8
    assert c.output_token_ids == [TOKEN] * 10      # kept across both preemptions; max_tokens in all
    assert c.num_preemptions == 2 and sched.make_stats().num_preemptions == 1


def test_no_admission_in_a_step_that_preempts():
    """Even when the victim frees more than needed, waiting requests wait for the next step."""
    sched = make_scheduler(num_blocks=5, block_size=4, budget=64, max_model_len=64, max_num_seqs=2,
                           policy="priority")
    sched.add_request(make_request("A", range(100, 108), max_tokens=3, priority=0))   # blocks 0, 1
    sched.add_request(make_request("C", range(300, 312), max_tokens=3, priority=5))   # blocks 2, 3, 4
    step(sched)
    sched.add_request(make_request("D", range(400, 403), max_tokens=1, priority=1))
    out, _ = step(sched)
    assert out.scheduled() == {"A": 1} and out.new_reqs == []
    assert per_request(out.cached_reqs) == [("A", [4], 8)] and out.finished_req_ids == ["C"]
    assert [r.request_id for r in sched.waiting] == ["D", "C"]   # priority order, not preemption order
    out, _ = step(sched)
    assert out.scheduled() == {"A": 1, "D": 3}
    assert [(r.req_id, r.block_ids) for r in out.new_reqs] == [("D", [3])]
    run_to_completion(sched)


def test_preempted_request_can_be_aborted():
    sched = _preemption_setup()
    step(sched)
    assert [r.request_id for r in sched.waiting] == ["C"]
    sched.abort_requests(["C"])
    assert len(sched.waiting) == 0 and "C" not in sched.requests
    run_to_completion(sched)


def _priority_scenario(policy: str) -> tuple[Scheduler, list[dict[str, int]], list[list[str]]]:
    """A (priority 5) runs first; B (priority 0) arrives later; the pool runs out at step 5."""
    sched = make_scheduler(num_blocks=5, block_size=4, budget=64, max_model_len=64, policy=policy)
    sched.add_request(make_request("A", range(100, 108), max_tokens=10, priority=5, arrival=0.0))
    first, _ = step(sched)
    sched.add_request(make_request("B", range(200, 206), max_tokens=10, priority=0, arrival=1.0))
    trace = [(first, [])] + [step(sched) for _ in range(4)]
    return sched, scheduled_trace(trace), [out.finished_req_ids for out, _ in trace]


def test_priority_preempts_the_lowest_priority_request():
    sched, scheduled, dropped = _priority_scenario("priority")
    assert scheduled == [{"A": 8}, {"A": 1, "B": 6}, {"B": 1, "A": 1}, {"B": 1, "A": 1}, {"B": 1}]
    assert dropped == [[], [], [], [], ["A"]]       # the older but lower-priority request goes
    assert sched.kv.block_ids("B") == [3, 4, 2]
    assert [r.request_id for r in sched.waiting] == ["A"]
    trace = run_to_completion(sched)
    assert {rid: len(t) for rid, t in tokens_by_request(trace).items()} == {"A": 6, "B": 6}


def test_fcfs_preempts_the_newest_even_with_higher_priority():
    sched, scheduled, dropped = _priority_scenario("fcfs")
    assert scheduled == [{"A": 8}, {"A": 1, "B": 6}, {"A": 1, "B": 1}, {"A": 1, "B": 1}, {"A": 1}]
    assert dropped == [[], [], [], [], ["B"]]
    run_to_completion(sched)


@pytest.mark.parametrize(
    "policy, max_num_seqs, expected",
    [
        ("priority", 4, [["W4", "W2", "W3", "W1"]]),
        ("priority", 1, [["W4"], ["W2"], ["W3"], ["W1"]]),
        ("fcfs", 4, [["W1", "W2", "W3", "W4"]]),
    ],
)
def test_waiting_requests_are_admitted_in_policy_order(policy, max_num_seqs, expected):
    sched = make_scheduler(policy=policy, max_num_seqs=max_num_seqs)
    for rid, priority, arrival in [("W1", 3, 0.0), ("W2", 1, 1.0), ("W3", 2, 2.0), ("W4", 1, 0.5)]:
        sched.add_request(make_request(rid, range(10), max_tokens=1, priority=priority, arrival=arrival))
    trace = run_to_completion(sched)
    assert [[r.req_id for r in out.new_reqs] for out, _ in trace] == expected


# ------------------------------------------------------------------------------------------------- abort
def test_abort_waiting_request():
    sched = make_scheduler()
    sched.add_request(make_request("A", range(10), max_tokens=1))
    sched.add_request(make_request("B", range(20), max_tokens=1))
    sched.abort_requests(["B", "unknown"])
    assert sched.num_unfinished_requests == 1 and [r.request_id for r in sched.waiting] == ["A"]
    out, _ = step(sched)
    assert out.scheduled() == {"A": 10}
    assert out.finished_req_ids == ["B"]
    assert_all_free(sched)


def test_abort_running_request_frees_blocks_at_once():
    sched = make_scheduler()
    a = make_request("A", range(40), max_tokens=5)
    sched.add_request(a)
    step(sched)
    assert sched.kv.block_ids("A") == [0, 1, 2] and sched.kv.num_free_blocks == 61
    sched.abort_requests(["A"])
    assert a.status == RequestStatus.FINISHED_ABORTED and a.status.finish_reason == FinishReason.ABORT
    assert sched.kv.num_free_blocks == 64
    assert [b.block_id for b in sched.kv.pool.free_queue][-3:] == [2, 1, 0]
    assert_all_free(sched)
    out = sched.schedule()
    assert out.finished_req_ids == ["A"] and out.is_empty
    # its full blocks stay cached for a later identical prompt
    sched.add_request(make_request("A2", range(40), max_tokens=1))
    out, _ = step(sched)
    assert out.scheduled() == {"A2": 8}


def test_abort_while_the_step_runs_drops_its_output():
    sched = make_scheduler()
    sched.add_request(make_request("A", range(10), max_tokens=5))
    sched.add_request(make_request("B", range(20, 30), max_tokens=5))
    out = sched.schedule()
    sched.abort_requests(["A"])
    outputs = news(sched.update_from_output(out, fake_output_unchecked(out)))
    assert [o.request_id for o in outputs] == ["B"]
    check_invariants(sched)
    run_to_completion(sched)


def fake_output_unchecked(out: SchedulerOutput) -> ModelRunnerOutput:
    """Every scheduled request sampled a token (for prompts scheduled whole)."""
    return runner_output(list(out.req_ids), [[TOKEN] for _ in out.req_ids])


# ------------------------------------------------------------------------------------------ stop rules
def sequence(*tokens: int) -> TokenFn:
    """The fake model samples ``tokens`` in order, per request."""
    return lambda request: tokens[request.num_output_tokens]


@pytest.mark.parametrize(
    "params, eos, tokens, expected_tokens, reason, stop_reason",
    [
        (dict(max_tokens=5), {2}, (5, 2, 5), [5, 2], FinishReason.STOP, None),               # EOS
        (dict(max_tokens=3, ignore_eos=True), {2}, (5, 2, 2), [5, 2, 2], FinishReason.LENGTH, None),
        (dict(max_tokens=5, stop_token_ids=[9]), {2}, (5, 9, 5), [5, 9], FinishReason.STOP, 9),
        (dict(max_tokens=5, stop_token_ids=[9], ignore_eos=True), {2}, (2, 9), [2, 9], FinishReason.STOP, 9),
        (dict(max_tokens=5, min_tokens=3), {2}, (2, 2, 2, 2), [2, 2, 2], FinishReason.STOP, None),
        (dict(max_tokens=5, min_tokens=2, stop_token_ids=[9]), {2}, (9, 9), [9, 9], FinishReason.STOP, 9),
        (dict(max_tokens=3), {2}, (5, 5, 5, 5), [5, 5, 5], FinishReason.LENGTH, None),
        (dict(max_tokens=2), {2}, (5, 2), [5, 2], FinishReason.STOP, None),  # EOS on the last allowed token
    ],
)
def test_stop_conditions(params, eos, tokens, expected_tokens, reason, stop_reason):
    sched = make_scheduler()
    sched.add_request(make_request("A", range(10), eos=eos, **params))
    trace = run_to_completion(sched, token=sequence(*tokens))
    assert tokens_by_request(trace) == {"A": expected_tokens}
    final = final_outputs(trace)["A"]
    assert (final.finish_reason, final.stop_reason) == (reason, stop_reason)


def test_max_model_len_caps_the_length():
    sched = make_scheduler(max_model_len=12)
    sched.add_request(make_request("A", range(10), max_tokens=100))
    trace = run_to_completion(sched)
    assert tokens_by_request(trace) == {"A": [TOKEN, TOKEN]}
    assert final_outputs(trace)["A"].finish_reason == FinishReason.LENGTH


@pytest.mark.parametrize(
    "params, eos, suppressed",
    [
        (dict(min_tokens=0, stop_token_ids=[9]), {2, 3}, []),
        (dict(min_tokens=2, stop_token_ids=[9]), {2, 3}, [2, 3, 9]),
        (dict(min_tokens=2, stop_token_ids=[9], ignore_eos=True), {2, 3}, [9]),
    ],
)
def test_min_tokens_sends_suppressed_stop_tokens(params, eos, suppressed):
    sched = make_scheduler()
    sched.add_request(make_request("A", range(10), max_tokens=4, eos=eos, **params))
    out = sched.schedule()
    assert out.new_reqs[0].stop_token_ids == suppressed


# ---------------------------------------------------------------------------------------- draft tokens
def test_draft_tokens_are_scheduled_and_rejections_roll_back():
    sched = make_scheduler(num_blocks=16, block_size=4)
    a = make_request("A", range(100, 107), max_tokens=20)
    sched.add_request(a)

    out = sched.schedule()
    assert out.scheduled() == {"A": 7} and out.new_reqs[0].block_ids == [0, 1]
    sched.update_from_output(out, runner_output(["A"], [[50]], {"A": [11, 12, 13]}))
    assert (a.num_tokens, sched.num_computed_tokens("A"), a.spec_token_ids) == (8, 7, [11, 12, 13])

    out = sched.schedule()
    assert out.scheduled() == {"A": 4}               # the sampled token + 3 drafts
    assert out.spec_token_ids == {"A": [11, 12, 13]}
    assert per_request(out.cached_reqs) == [("A", [2], 7)]
    blocks = sched.kv.pool.blocks
    assert blocks[1].block_hash == a.block_hashes[1]          # 104..106 + 50 are final
    assert blocks[2].block_hash is None                       # drafts are never cached
    check_invariants(sched)
    outputs = news(sched.update_from_output(out, runner_output(["A"], [[11, 60]])))   # 1 of 3 accepted
    assert outputs[0].new_token_ids == [11, 60]
    assert a.output_token_ids == [50, 11, 60]
    assert (a.num_tokens, sched.num_computed_tokens("A"), a.spec_token_ids) == (10, 9, [])
    spec = sched.make_stats().spec_decoding
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
            spec.num_accepted_tokens_per_pos) == (1, 3, 1, [1, 0, 0])

    out = sched.schedule()
    assert out.scheduled() == {"A": 1} and out.spec_token_ids == {}
    assert per_request(out.cached_reqs) == [("A", [], 9)]
    sched.update_from_output(out, runner_output(["A"], [[61]], {"A": [1, 2]}))
    assert (a.num_tokens, sched.num_computed_tokens("A")) == (11, 10)

    out = sched.schedule()
    assert out.scheduled() == {"A": 3} and out.spec_token_ids == {"A": [1, 2]}
    assert per_request(out.cached_reqs) == [("A", [3], 10)]
    sched.update_from_output(out, runner_output(["A"], [[70]]))   # all rejected
    assert (a.num_tokens, sched.num_computed_tokens("A")) == (12, 11)
    spec = sched.make_stats().spec_decoding
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (1, 2, 0)

    out = sched.schedule()
    assert per_request(out.cached_reqs) == [("A", [], 11)]
    sched.update_from_output(out, runner_output(["A"], [[71]], {"A": [1, 2, 3]}))
    out = sched.schedule()
    sched.update_from_output(out, runner_output(["A"], [[1, 2, 3, 72]]))   # all accepted
    assert (a.num_tokens, sched.num_computed_tokens("A")) == (17, 16)
    assert a.output_token_ids == [50, 11, 60, 61, 70, 71, 1, 2, 3, 72]
    run_to_completion(sched)


def test_budget_truncates_drafts():
    sched = make_scheduler(num_blocks=16, block_size=4, budget=3)
    a = make_request("A", range(100, 107), max_tokens=20)
    sched.add_request(a)
    assert scheduled_trace([step(sched) for _ in range(2)]) == [{"A": 3}, {"A": 3}]
    out = sched.schedule()
    assert out.scheduled() == {"A": 1}
    sched.update_from_output(out, runner_output(["A"], [[50]], {"A": [11, 12, 13]}))
    out = sched.schedule()
    assert out.scheduled() == {"A": 3} and out.spec_token_ids == {"A": [11, 12]}
    sched.update_from_output(out, runner_output(["A"], [[11, 12, 99]]))
    assert (a.num_tokens, sched.num_computed_tokens("A")) == (11, 10)
    run_to_completion(sched)


def test_lookahead_slots_are_allocated_with_the_request():
    sched = make_scheduler(num_blocks=16, block_size=4, lookahead=3)
    sched.add_request(make_request("A", range(100, 107), max_tokens=3))
    out = sched.schedule()
    assert out.new_reqs[0].block_ids == [0, 1, 2]   # 7 tokens + 3 lookahead slots
    sched.update_from_output(out, fake_output(sched, out))
    run_to_completion(sched)


def test_lookahead_slots_stop_at_max_model_len():
    sched = make_scheduler(num_blocks=16, block_size=4, max_model_len=8, lookahead=3)
    sched.add_request(make_request("A", range(100, 107), max_tokens=1))
    out = sched.schedule()
    assert out.new_reqs[0].block_ids == [0, 1]   # 7 + 3 slots would be 3 blocks, but no token goes past 8
    sched.update_from_output(out, fake_output(sched, out))
    assert_all_free(sched)


def test_no_draft_slots_are_reserved_while_the_batch_is_too_large_to_draft():
    """disable_by_batch_size=2: the worker drafts nothing after a step of 3 requests, so none of them gets lookahead
    slots; once one finishes, the two left get theirs again (the same step without the limit reserves at once)."""
    sched = make_scheduler(num_blocks=32, block_size=4, lookahead=3, disable_by_batch_size=2)
    for rid, first, max_tokens in (("A", 100, 8), ("B", 200, 8), ("C", 300, 1)):
        sched.add_request(make_request(rid, range(first, first + 7), max_tokens=max_tokens))
    out = sched.schedule()
    assert [r.block_ids for r in out.new_reqs] == [[0, 1], [2, 3], [4, 5]]   # 7 tokens each, nothing more
    sched.update_from_output(out, fake_output(sched, out))                     # C is done (max_tokens=1)
    out = sched.schedule()                                                       # A and B: 1 token + 3 slots each
    assert per_request(out.cached_reqs) == [("A", [6], 7), ("B", [7], 7)]
    sched.update_from_output(out, fake_output(sched, out))
    run_to_completion(sched)
    unlimited = make_scheduler(num_blocks=32, block_size=4, lookahead=3)
    for rid, first in (("A", 100), ("B", 200), ("C", 300)):
        unlimited.add_request(make_request(rid, range(first, first + 7), max_tokens=1))
    assert [r.block_ids for r in unlimited.schedule().new_reqs] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_drafts_after_a_step_without_reserved_slots_get_slots_when_scheduled():
    """A waiting request that was not admitted after all kept the step within the limit, so the worker drafted
    although the scheduler had reserved nothing: the drafts are then scheduled and allocated like other tokens."""
    sched = make_scheduler(num_blocks=32, block_size=4, lookahead=3, disable_by_batch_size=1, chunked=False,
                           budget=12, max_model_len=12)
    sched.add_request(make_request("A", range(100, 107), max_tokens=4))
    sched.add_request(make_request("B", range(200, 207), max_tokens=4))   # does not fit the budget with A
    out = sched.schedule()
    assert [(r.req_id, r.block_ids) for r in out.new_reqs] == [("A", [0, 1])]   # 2 requests known: no reservation
    sched.update_from_output(out, fake_output(sched, out, drafts={"A": [1, 2, 3]}))  # a step of 1 drafts
    out = sched.schedule()
    assert out.spec_token_ids == {"A": [1, 2, 3]}
    assert dict(zip(out.req_ids, out.num_scheduled_tokens)) == {"A": 4, "B": 7}
    assert per_request(out.cached_reqs) == [("A", [2], 7)]                     # 11 tokens: a third block
    assert [(r.req_id, r.block_ids) for r in out.new_reqs] == [("B", [3, 4])]
    sched.update_from_output(out, fake_output(sched, out))
    run_to_completion(sched)


def test_request_filling_the_whole_pool_finishes_with_lookahead():
    """Regression: a pool of exactly cdiv(max_model_len, block_size) blocks (what the engine checks for) must
    serve one max_model_len request; lookahead slots past max_model_len made it preempt itself forever."""
    sched = make_scheduler(num_blocks=4, block_size=16, max_model_len=64, lookahead=3)
    sched.add_request(make_request("A", range(60), max_tokens=4))
    trace = run_to_completion(sched, max_steps=10)
    assert scheduled_trace(trace) == [{"A": 60}, {"A": 1}, {"A": 1}, {"A": 1}]
    assert all(out.finished_req_ids == [] for out, _ in trace)


@pytest.mark.parametrize(
    "eos, max_tokens, kept, reason",
    [
        ((), 3, [11, 12], FinishReason.LENGTH),   # max_tokens reached inside the accepted drafts
        ((12,), 20, [11, 12], FinishReason.STOP),  # EOS among the accepted drafts
    ],
)
def test_stop_inside_accepted_drafts_discards_the_rest(eos, max_tokens, kept, reason):
    sched = make_scheduler(num_blocks=16, block_size=4)
    sched.add_request(make_request("A", range(100, 107), max_tokens=max_tokens, eos=eos))
    out = sched.schedule()
    sched.update_from_output(out, runner_output(["A"], [[50]], {"A": [11, 12, 13]}))
    out = sched.schedule()
    outputs = news(sched.update_from_output(out, runner_output(["A"], [[11, 12, 13, 80]])))
    assert [(o.new_token_ids, o.finish_reason) for o in outputs] == [(kept, reason)]
    assert_all_free(sched)


def test_preemption_clears_drafts():
    sched = _preemption_setup(drafts={"C": [1, 2]})
    c = sched.requests["C"]
    assert c.spec_token_ids == [1, 2]
    out = sched.schedule()   # C is preempted before its drafts are verified
    assert out.finished_req_ids == ["C"] and out.spec_token_ids == {}
    assert c.spec_token_ids == [] and c.num_tokens_with_spec == 7
    sched.update_from_output(out, runner_output(["A", "B"], [[TOKEN], [TOKEN]]))
    out, _ = step(sched)     # C resumes with its 7 final tokens only
    assert out.scheduled()["C"] == 3 and out.spec_token_ids == {}
    run_to_completion(sched)


def test_drafts_are_cut_at_max_model_len():
    sched = make_scheduler(num_blocks=16, block_size=4, max_model_len=10)
    a = make_request("A", range(100, 107), max_tokens=20)
    sched.add_request(a)
    out = sched.schedule()
    sched.update_from_output(out, runner_output(["A"], [[50]], {"A": [11, 12, 13]}))
    out = sched.schedule()
    assert out.scheduled() == {"A": 3} and out.spec_token_ids == {"A": [11, 12]}   # room for 10 tokens
    outputs = news(sched.update_from_output(out, runner_output(["A"], [[11, 12, 99]])))
    assert [(o.new_token_ids, o.finish_reason) for o in outputs] == [([11, 12], FinishReason.LENGTH)]
    assert a.num_tokens == 10
    assert_all_free(sched)


# ---------------------------------------------------------------------------------------- stress test
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_stress(policy, seed):
    run_stress(seed, policy=policy)


@pytest.mark.parametrize("seed", [3, 4])
@pytest.mark.parametrize("variant", [dict(chunked=False, budget=40), dict(caching=False), dict(lookahead=0),
                                     dict(num_blocks=10)])   # a pool of exactly one max_model_len request
def test_randomized_stress_variants(seed, variant):
    run_stress(seed, **variant)


def run_stress(seed: int, policy: str = "fcfs", chunked: bool = True, budget: int = 24, caching: bool = True,
               lookahead: int = 2, num_blocks: int = 20, max_num_seqs: int = 6) -> None:
    """Many requests of random lengths sharing random prefixes, a small pool, random aborts, priorities and
    drafts; invariants checked after every schedule and update; every block free at the end."""
    rng = random.Random(seed)
    block_size, max_model_len = 4, 40
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, budget=budget, max_num_seqs=max_num_seqs,
                           policy=policy, max_model_len=max_model_len, lookahead=lookahead, chunked=chunked,
                           caching=caching)
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    pending = []
    for i in range(40):
        prompt = rng.choice(prefixes)[:rng.randint(0, 12)] + [rng.randrange(50) for _ in range(rng.randint(1, 16))]
        max_tokens = rng.randint(1, min(12, max_model_len - len(prompt)))
        pending.append(make_request(f"r{i}", prompt, max_tokens=max_tokens, eos={0},
                                    priority=rng.randint(0, 3), arrival=float(i), ignore_eos=rng.random() < 0.3,
                                    salt="s" if rng.random() < 0.1 else None))
    all_requests = {r.request_id: r for r in pending}
    aborted: set[str] = set()
    streamed: dict[str, list[int]] = {}
    finish: dict[str, FinishReason] = {}
    totals = Counter()

    steps = 0
    while pending or sched.has_unfinished_requests():
        steps += 1
        assert steps < 3000, "no progress"
        for _ in range(rng.randint(0, 3)):
            if pending:
                sched.add_request(pending.pop(0))
        live = sorted(sched.requests)
        if live and rng.random() < 0.08:
            victim = rng.choice(live)
            sched.abort_requests([victim])
            aborted.add(victim)
        out = sched.schedule()
        check_invariants(sched)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens) <= budget
        req_ids, sampled, drafts = [], [], {}
        for rid in out.req_ids:
            request = sched.requests[rid]
            req_ids.append(rid)
            if sched.num_computed_tokens(rid) < request.num_tokens:
                sampled.append([])
                continue
            spec = out.spec_token_ids.get(rid, [])
            sampled.append(spec[:rng.randint(0, len(spec))] + [rng.randrange(50)])
            if rng.random() < 0.3:
                drafts[rid] = [rng.randrange(50) for _ in range(rng.randint(1, 3))]
        if req_ids and rng.random() < 0.05:   # an abort that lands while the step runs
            victim = rng.choice(req_ids)
            sched.abort_requests([victim])
            aborted.add(victim)
        for o in news(sched.update_from_output(out, runner_output(req_ids, sampled, drafts))):
            streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                finish[o.request_id] = o.finish_reason
        check_invariants(sched)
        stats = sched.make_stats()
        totals.update(preemptions=stats.num_preemptions, hits=stats.prefix_cache_hits)

    assert_all_free(sched)
    assert totals["preemptions"] > 0                      # the pool really ran short
    assert (totals["hits"] > 0) == caching                 # and prefixes were shared
    for rid, request in all_requests.items():
        assert request.is_finished
        assert streamed.get(rid, []) == request.output_token_ids
        if rid in aborted and rid not in finish:
            assert request.status == RequestStatus.FINISHED_ABORTED
            continue
        assert request.num_output_tokens <= request.max_tokens
        if finish[rid] == FinishReason.LENGTH:
            assert request.num_output_tokens == request.max_tokens or request.num_tokens >= max_model_len
        else:
            last = request.output_token_ids[-1]
            params = request.sampling_params
            assert (last == 0 and not params.ignore_eos) or last in params.stop_token_ids


# ------------------------------------------------------------------------------------------------ layering
def test_kv_and_sched_import_no_torch():
    """kv/ and sched/ (and the plain modules they use) stay importable without torch (DESIGN.md section 4)."""
    import ast
    from pathlib import Path

    import pagellm

    root = Path(pagellm.__file__).parent
    files = [*(root / "kv").glob("*.py"), *(root / "sched").glob("*.py"), root / "request.py", root / "config.py",
             root / "sampling_params.py", root / "metrics" / "stats.py"]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "torch" or n.startswith("torch.") for n in names), f"{path} imports torch"

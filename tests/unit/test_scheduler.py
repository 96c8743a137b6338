"""Exact tests of the token-budget scheduler (the budget, the prefix cache, preemption, aborts), driven by the
fake model output of ``sched_fakes`` (no model, no torch)."""

from __future__ import annotations

import pytest
from sched_fakes import (
    TOKEN,
    assert_all_free,
    check_invariants,
    fake_output,
    final_outputs,
    make_request,
    make_scheduler,
    news,
    per_request,
    preemption_setup,
    run_to_completion,
    runner_output,
    scheduled_trace,
    step,
    tokens_by_request,
)

from pagellm.config import CacheConfig, SchedulerConfig
from pagellm.request import FinishReason, RequestStatus
from pagellm.sched.output import ModelRunnerOutput, SchedulerOutput
from pagellm.sched.scheduler import Scheduler


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


def test_long_prefill_token_threshold_leaves_room_for_other_prompts():
    """With the cap a long prompt computes at most 16 tokens a step, so a short prompt behind it starts (and gets its
    first token) in the first step, and a second long one shares the steps."""
    sched = make_scheduler(budget=64, chunk_cap=16)
    sched.add_request(make_request("A", range(1000, 1100), max_tokens=2))
    sched.add_request(make_request("B", range(2000, 2008), max_tokens=2))
    sched.add_request(make_request("C", range(3000, 3040), max_tokens=2))
    assert scheduled_trace(run_to_completion(sched)) == [
        {"A": 16, "B": 8, "C": 16}, {"A": 16, "B": 1, "C": 16}, {"A": 16, "C": 8}, {"A": 16, "C": 1},
        {"A": 16}, {"A": 16}, {"A": 4}, {"A": 1}]
    uncapped = make_scheduler(budget=64)
    for rid, start, n in (("A", 1000, 100), ("B", 2000, 8), ("C", 3000, 40)):
        uncapped.add_request(make_request(rid, range(start, start + n), max_tokens=2))
    assert scheduled_trace(run_to_completion(uncapped))[0] == {"A": 64}
    with pytest.raises(ValueError, match="needs enable_chunked_prefill"):
        make_scheduler(budget=1024, chunked=False, chunk_cap=16)
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0"):
        make_scheduler(chunk_cap=-1)


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


def test_max_num_active_seqs_and_max_num_scheduled_tokens_narrow_the_step():
    """vLLM's ``max_num_active_seqs`` caps the running requests below ``max_num_seqs``, and
    ``max_num_scheduled_tokens`` the tokens a step hands out below ``max_num_batched_tokens``; either past its
    ceiling is refused by name."""
    config = SchedulerConfig(max_num_seqs=8, max_num_active_seqs=2, max_num_batched_tokens=64,
                             max_num_scheduled_tokens=8)
    for fast_path in (True, False):
        sched = Scheduler(config, CacheConfig(block_size=16), 64, 1024, fast_path=fast_path)
        for rid in "ABC":
            sched.add_request(make_request(rid, range(6), max_tokens=2))
        trace = run_to_completion(sched)
        # 8 tokens a step at most; C waits in step 2 though 3 tokens are left: two requests run already
        assert scheduled_trace(trace) == [{"A": 6, "B": 2}, {"A": 1, "B": 4}, {"B": 1, "C": 6}, {"C": 1}]
    for fields, message in (({"max_num_active_seqs": 9}, r"max_num_active_seqs \(9\) must be at most max_num_seqs"),
                            ({"max_num_scheduled_tokens": 0}, "max_num_scheduled_tokens must be >= 1")):
        with pytest.raises(ValueError, match=message):
            SchedulerConfig(max_num_seqs=8, **fields)
    with pytest.raises(ValueError, match=r"max_num_scheduled_tokens \(128\) must be at most max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=64, max_num_scheduled_tokens=128).token_budget(1024)


def _admission_trace(fast_path: bool, **fields) -> list[dict[str, int]]:
    """A running request R (3 blocks of 4 tokens) and, from the second step, A (a 24-token prompt: 6 blocks) and B
    (4 tokens) in a pool of 9 blocks with no prefix caching: what each step schedules."""
    config = SchedulerConfig(max_num_batched_tokens=8, **fields)
    sched = Scheduler(config, CacheConfig(block_size=4, enable_prefix_caching=False), 8, 64, fast_path=fast_path)
    sched.add_request(make_request("R", range(8), max_tokens=3))
    trace = [step(sched)]
    sched.add_request(make_request("A", range(100, 124), max_tokens=1))
    sched.add_request(make_request("B", range(200, 204), max_tokens=1))
    return scheduled_trace(trace + run_to_completion(sched))


def test_an_admission_needs_room_for_the_whole_prompt_and_the_watermark():
    """vLLM's ``scheduler_reserve_full_isl`` (on by default): A, whose whole prompt (6 blocks) the 6 free blocks beside
    R cannot hold with R's next one, waits for R to end rather than start chunk by chunk; off, it starts at once.
    ``watermark`` keeps a fraction of the pool free while others run: B too waits for R then. The native fast path
    and the Python path schedule alike."""
    waits = [{"R": 8}, {"R": 1}, {"R": 1}, {"A": 8}, {"A": 8}, {"A": 8}, {"B": 4}]
    for fast_path in (True, False):
        assert _admission_trace(fast_path) == waits
        assert _admission_trace(fast_path, scheduler_reserve_full_isl=False) == [
            {"R": 8}, {"R": 1, "A": 7}, {"R": 1, "A": 7}, {"A": 8}, {"A": 2, "B": 4}]
        assert _admission_trace(fast_path, scheduler_reserve_full_isl=False, watermark=0.5) == waits
    with pytest.raises(ValueError, match=r"watermark must be in \[0, 1\)"):
        SchedulerConfig(watermark=1.0)


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
def test_fcfs_preempts_the_newest_and_resumes_it_first():
    sched = preemption_setup()
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
    sched = preemption_setup()
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

"""The scheduler's stop rules and draft tokens, driven by the fake model output of ``sched_fakes``."""

from __future__ import annotations

import pytest
from sched_fakes import (
    TOKEN,
    TokenFn,
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

from pagellm.request import FinishReason


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
    sched = preemption_setup(drafts={"C": [1, 2]})
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

"""Randomized runs of the scheduler (shared prefixes, a small pool, aborts, priorities, drafts): every invariant of
``sched_fakes.check_invariants`` after every step, every request's outcome, every block free at the end."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from sched_fakes import assert_all_free, check_invariants, make_request, make_scheduler, news, runner_output

from pagellm.request import FinishReason, RequestStatus


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
    pending = _random_requests(rng, max_model_len)
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
        req_ids, sampled, drafts = _fake_model(rng, sched, out)
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
    _check_outcomes(all_requests, streamed, finish, aborted, max_model_len)


def _random_requests(rng: random.Random, max_model_len: int) -> list:
    """40 requests whose prompts start with a random cut of one of three shared prefixes."""
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    pending = []
    for i in range(40):
        prompt = rng.choice(prefixes)[:rng.randint(0, 12)] + [rng.randrange(50) for _ in range(rng.randint(1, 16))]
        max_tokens = rng.randint(1, min(12, max_model_len - len(prompt)))
        pending.append(make_request(f"r{i}", prompt, max_tokens=max_tokens, eos={0},
                                    priority=rng.randint(0, 3), arrival=float(i), ignore_eos=rng.random() < 0.3,
                                    salt="s" if rng.random() < 0.1 else None))
    return pending


def _fake_model(rng: random.Random, sched, out) -> tuple[list[str], list[list[int]], dict[str, list[int]]]:
    """A step's output: nothing for rows still prefilling, else a random accepted part of the drafts plus one
    token, and sometimes new drafts."""
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
    return req_ids, sampled, drafts


def _check_outcomes(all_requests: dict, streamed: dict[str, list[int]], finish: dict[str, FinishReason],
                    aborted: set[str], max_model_len: int) -> None:
    """Every request finished, streamed exactly its output, and stopped for the reason its output shows."""
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

"""The scheduler's fast paths against their plain twin.

``Scheduler`` skips ``KVCacheManager.allocate_slots`` for a running request whose step fits in the blocks it holds,
and rules out stop conditions for a single sampled token with one set look-up and one length comparison. The twin
below forces the general path every step (``allocate_slots`` for every scheduled request, ``_check_stop`` for every
token). Both are driven in lockstep through random traces (shared prefixes, chunked prefill, drafts, preemptions,
aborts, EOS / stop tokens / min_tokens / max_model_len); every step's SchedulerOutput, every EngineCoreOutput and
every block table and the prefix-cache table must be identical.
"""

from __future__ import annotations

import random

import msgspec
import pytest

from pagellm.config import CacheConfig, SchedulerConfig
from pagellm.kv.manager import KVCacheManager
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams
from pagellm.sched.output import EngineCoreOutput, ModelRunnerOutput
from pagellm.sched.scheduler import Scheduler


class _AlwaysAllocate(KVCacheManager):
    def allocate_slots(self, request, *args, **kwargs):
        blocks = super().allocate_slots(request, *args, **kwargs)
        request.kv_slots = -1  # no step "fits": the scheduler calls allocate_slots again next time
        return blocks


class _PlainScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kv = _AlwaysAllocate(self.kv.pool.num_blocks, self.kv.block_size, self.kv.enable_caching)

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        request.length_limit = 0  # every token goes through _check_stop


def _make(cls: type[Scheduler], caching: bool, lookahead: int, num_blocks: int, limit: int | None) -> Scheduler:
    return cls(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24), CacheConfig(block_size=4,
               enable_prefix_caching=caching), num_blocks, 40, lookahead, limit)


def _requests(rng: random.Random) -> list[tuple]:
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    specs = []
    for i in range(40):
        prompt = rng.choice(prefixes)[:rng.randint(0, 12)] + [rng.randrange(50) for _ in range(rng.randint(1, 16))]
        max_tokens = rng.randint(1, 40 - len(prompt))
        params = dict(max_tokens=max_tokens, ignore_eos=rng.random() < 0.3,
                      min_tokens=rng.choice([0, 0, 2]) % (max_tokens + 1), stop_token_ids=rng.choice([None, [3, 4]]))
        specs.append((f"r{i}", prompt, params, float(i)))
    return specs


def _cache_state(sched: Scheduler) -> tuple:
    pool = sched.kv.pool
    return ({h: b.block_id for h, b in pool.cached.items()}, [b.block_hash for b in pool.blocks],
            dict(sched.kv.num_cached_blocks))


def _strip_times(outputs: list[EngineCoreOutput]) -> bytes:
    return msgspec.msgpack.encode([(o.request_id, o.new_token_ids, o.finish_reason, o.stop_reason,
                                    o.num_cached_tokens, o.times is not None) for o in outputs])


# limit: disable_by_batch_size (no draft slots reserved in steps with more requests).
@pytest.mark.parametrize("seed,caching,lookahead,num_blocks,limit", [(0, True, 2, 20, None), (1, True, 0, 12, None),
                                                                     (2, False, 2, 20, None), (3, True, 0, 40, None),
                                                                     (4, True, 3, 20, 3)])
def test_fast_paths_match_the_general_path(seed, caching, lookahead, num_blocks, limit):
    rng = random.Random(seed)
    specs = _requests(rng)
    fast, plain = (_make(cls, caching, lookahead, num_blocks, limit) for cls in (Scheduler, _PlainScheduler))
    steps = preemptions = 0
    while specs or fast.has_unfinished_requests():
        steps += 1
        assert steps < 3000, "no progress"
        for _ in range(rng.randint(0, 3)):
            if specs:
                rid, prompt, params, arrival = specs.pop(0)
                for sched in (fast, plain):
                    sched.add_request(Request(rid, prompt, SamplingParams(**params), frozenset({0}), arrival))
        if fast.requests and rng.random() < 0.05:
            victim = rng.choice(sorted(fast.requests))
            fast.abort_requests([victim])
            plain.abort_requests([victim])
        out, ref = fast.schedule(), plain.schedule()
        assert msgspec.msgpack.encode(out) == msgspec.msgpack.encode(ref)
        assert {r: [b.block_id for b in bs] for r, bs in fast.kv.req_blocks.items()} == \
            {r: [b.block_id for b in bs] for r, bs in plain.kv.req_blocks.items()}
        assert _cache_state(fast) == _cache_state(plain)   # the same blocks registered in the prefix cache
        req_ids, sampled, drafts = [], [], {}
        for rid in out.num_scheduled_tokens:
            request = fast.requests[rid]
            req_ids.append(rid)
            if request.num_computed_tokens < request.num_tokens:
                sampled.append([])
                continue
            spec = out.spec_token_ids.get(rid, [])
            sampled.append(spec[:rng.randint(0, len(spec))] + [rng.randrange(8)])
            if lookahead and rng.random() < 0.3:
                drafts[rid] = [rng.randrange(8) for _ in range(rng.randint(1, lookahead))]
        runner_out = ModelRunnerOutput(req_ids, sampled, drafts)
        copy = msgspec.msgpack.decode(msgspec.msgpack.encode(runner_out), type=ModelRunnerOutput)
        assert _strip_times(fast.update_from_output(out, runner_out)) == \
            _strip_times(plain.update_from_output(ref, copy))
        preemptions += fast.make_stats().num_preemptions
        plain.make_stats()
    assert not plain.has_unfinished_requests()
    assert preemptions > 0 or num_blocks == 40   # the small pools really ran short

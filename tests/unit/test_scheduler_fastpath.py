"""The scheduler's fast paths against their plain twin.

``Scheduler`` hands the token budget out with one cumulative sum over the running batch's columns, calls the KV
manager only for the rows whose step needs it (a block to allocate or one that fills), serves those in one
``allocate_running`` call, appends every sampled token in one pass, and looks at a request in Python only when it
may stop or gets its first output. The twin below takes the plain path every step: the budget handed out one request
at a time, ``allocate_slots`` for every scheduled request one by one, every token appended and checked one at a time
against every stop rule, and (under the priority policy) the running list sorted every step. Both are driven in
lockstep through random traces (shared prefixes, chunked prefill, drafts, preemptions, aborts before and in the
middle of a step, EOS / stop tokens / min_tokens / max_model_len, priorities); every step's SchedulerOutput and
StepOutput, the running batch's columns, every block table and the prefix-cache table must be identical.
"""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest

from pagellm.config import CacheConfig, SchedulerConfig
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams
from pagellm.sched.output import ModelRunnerOutput, StepOutput
from pagellm.sched.scheduler import Scheduler


class _PlainScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs, fast_path=False)  # every hook below is Python

    def schedule(self):
        self._needs_sort = True  # sort every step
        return super().schedule()

    def _grant(self, computed, tokens, num_spec, budget):
        grant = np.zeros_like(computed)
        for row, request in enumerate(self.running.requests):
            if budget <= 0:
                break
            want = min(len(request.all_token_ids) + len(request.spec_token_ids), self.max_model_len) - computed[row]
            if self.chunk_cap:  # long_prefill_token_threshold
                want = min(want, self.chunk_cap)
            grant[row] = max(0, min(want, budget))
            budget -= grant[row]
        return grant

    @staticmethod
    def _needs_kv(grant, room, final, kv_slots, kv_next_full):
        return grant > 0  # every scheduled request meets the KV manager

    def _serve_kv(self, events, computed, grant, room, final, new_block_ids):
        for row in events.tolist():
            if row >= len(self.running) or not self._allocate_row(row, int(computed[row]), int(grant[row]),
                                                                   new_block_ids):
                break

    def _append_all(self, lists, counts, sampled, flat):
        pass  # _check_tokens appends them one at a time

    def _needs_look(self, after, check_at, counts, flat):
        return np.ones(len(counts), dtype=bool)

    def _check_tokens(self, request, tokens, num_before):
        for num_kept, token in enumerate(tokens, start=1):
            request.append_output_token(token)
            status = self.stop_rules.check(request, token, len(request.all_token_ids))
            if status is not None:
                self._finish(request, status)
                return num_kept
        return len(tokens)


class _NativeCounting(Scheduler):
    """The scheduler with its native fast path, counting the steps that path took."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        assert self._native is not None, "the native scheduler fast path did not build (g++, libssl-dev)"
        self.native_steps = self.native_intakes = 0

    def _schedule_running_native(self, budget):
        part = super()._schedule_running_native(budget)
        self.native_steps += part is not None
        return part

    def _look_native(self, looked, flat, out):
        self.native_intakes += 1
        return super()._look_native(looked, flat, out)


class _NumpyScheduler(Scheduler):
    """The scheduler with its numpy fast paths only (where the native one does not build)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs, fast_path=False)


def _make(cls: type[Scheduler], caching: bool, lookahead: int, num_blocks: int, policy: str,
          limit: int | None, cap: int) -> Scheduler:
    return cls(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, scheduling_policy=policy,
                               long_prefill_token_threshold=cap),
               CacheConfig(block_size=4, enable_prefix_caching=caching), num_blocks, 40, lookahead, limit)


def _requests(rng: random.Random) -> list[tuple]:
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    specs = []
    for i in range(40):
        prompt = rng.choice(prefixes)[:rng.randint(0, 12)] + [rng.randrange(50) for _ in range(rng.randint(1, 16))]
        max_tokens = rng.randint(1, 40 - len(prompt))
        params = dict(max_tokens=max_tokens, ignore_eos=rng.random() < 0.3,
                      min_tokens=rng.choice([0, 0, 2]) % (max_tokens + 1), stop_token_ids=rng.choice([None, [3, 4]]))
        specs.append((f"r{i}", prompt, params, float(i), rng.randrange(3), "salt" if i % 4 == 3 else None))
    return specs


def _state(sched: Scheduler) -> tuple:
    """Everything the two schedulers must agree on, after checking the running batch's columns against the
    requests and the KV manager they mirror."""
    pool, batch, n = sched.kv.pool, sched.running, len(sched.running)
    for row, request in enumerate(batch.requests):
        assert batch.token_lists[row] is request.all_token_ids
        assert batch.num_tokens[row] == request.num_tokens and batch.num_spec[row] == len(request.spec_token_ids)
        assert (batch.kv_slots[row], batch.kv_next_full[row]) == sched.kv.slots_and_next_full(request.request_id)
        assert batch.check_at[row] == (request.length_limit if request.num_output_tokens
                                       else request.num_prompt_tokens + 1)
    columns = [getattr(batch, name)[:n].tolist() for name in ("computed", "num_tokens", "num_spec", "check_at")]
    return ({r: [b.block_id for b in bs] for r, bs in sched.kv.req_blocks.items()},
            {h: b.block_id for h, b in pool.cached.items()}, [b.block_hash for b in pool.blocks],
            dict(sched.kv.num_cached_blocks), batch.req_ids, columns,
            [b.block_id for b in pool.free_queue], pool.num_free_blocks, pool.num_evictions,
            [(b.block_id, b.ref_cnt) for b in pool.blocks],
            [(r.request_id, r.all_token_ids, r.spec_token_ids, r.status) for r in sched.requests.values()])


def _strip_times(out: StepOutput) -> bytes:
    return msgspec.msgpack.encode((out.req_ids, out.num_new_tokens, out.new_token_ids, out.finish_reasons,
                                   out.stop_reasons, {r: f.num_cached_tokens for r, f in out.first.items()}))


def _runner_output(sched: Scheduler, out, rng: random.Random, lookahead: int) -> ModelRunnerOutput:
    """A runner's answer: one token per request that reached its last token (after accepting a random prefix of
    its drafts), none mid-prompt; sometimes new drafts."""
    rows, drafts = [], {}
    before = out.cached_reqs.num_computed_tokens + [r.num_computed_tokens for r in out.new_reqs]
    for rid, start, count in zip(out.req_ids, before, out.num_scheduled_tokens):
        spec = out.spec_token_ids.get(rid, [])
        if start + count - len(spec) < sched.requests[rid].num_tokens:
            rows.append([])
            continue
        rows.append(spec[:rng.randint(0, len(spec))] + [rng.randrange(8)])
        if lookahead and rng.random() < 0.3:
            drafts[rid] = [rng.randrange(8) for _ in range(rng.randint(1, lookahead))]
    return ModelRunnerOutput.from_rows(list(out.req_ids), rows, drafts)


# limit: disable_by_batch_size (no draft slots reserved in steps that may hold more requests); cap:
# long_prefill_token_threshold (the most tokens a request computes in a step).
@pytest.mark.parametrize("seed,caching,lookahead,num_blocks,policy,limit,cap", [
    (0, True, 2, 20, "fcfs", None, 0), (1, True, 0, 12, "fcfs", None, 0), (2, False, 2, 20, "fcfs", None, 0),
    (3, True, 0, 40, "fcfs", None, 0), (4, True, 2, 14, "priority", None, 0), (5, True, 0, 40, "priority", None, 0),
    (6, True, 3, 20, "fcfs", 3, 0), (7, True, 3, 14, "priority", 3, 0), (8, True, 0, 20, "fcfs", None, 5),
    (9, True, 2, 14, "priority", None, 3)])
@pytest.mark.parametrize("fast_cls", [_NativeCounting, _NumpyScheduler], ids=["native", "numpy"])
def test_fast_paths_match_the_plain_path(seed, caching, lookahead, num_blocks, policy, limit, cap, fast_cls):
    rng = random.Random(seed)
    specs = _requests(rng)
    fast, plain = (_make(cls, caching, lookahead, num_blocks, policy, limit, cap)
                   for cls in (fast_cls, _PlainScheduler))
    steps = preemptions = mid_step_aborts = 0
    while specs or fast.has_unfinished_requests():
        steps += 1
        assert steps < 3000, "no progress"
        for _ in range(rng.randint(0, 3)):
            if specs:
                rid, prompt, params, arrival, priority, salt = specs.pop(0)
                for sched in (fast, plain):
                    sched.add_request(Request(rid, prompt, SamplingParams(**params), frozenset({0}), arrival,
                                              priority, salt))
        if fast.requests and rng.random() < 0.05:
            victim = rng.choice(sorted(fast.requests))
            fast.abort_requests([victim])
            plain.abort_requests([victim])
        out, ref = fast.schedule(), plain.schedule()
        assert msgspec.msgpack.encode(out) == msgspec.msgpack.encode(ref)
        assert _state(fast) == _state(plain)
        runner_out = _runner_output(fast, out, rng, lookahead)
        copy = msgspec.msgpack.decode(msgspec.msgpack.encode(runner_out), type=ModelRunnerOutput)
        if fast.running.requests and rng.random() < 0.05:  # an abort between schedule() and update_from_output()
            victim = rng.choice(fast.running.req_ids)
            fast.abort_requests([victim])
            plain.abort_requests([victim])
            mid_step_aborts += 1
        assert _strip_times(fast.update_from_output(out, runner_out)) == \
            _strip_times(plain.update_from_output(ref, copy))
        assert _state(fast) == _state(plain)
        preemptions += fast.make_stats().num_preemptions
        plain.make_stats()
    assert not plain.has_unfinished_requests()
    assert preemptions > 0 or num_blocks == 40   # the small pools really ran short
    assert mid_step_aborts > 0
    if fast_cls is _NativeCounting and not lookahead:  # native: most steps (not those of a short pool, or drafts)
        assert fast.native_steps > steps // 4 and fast.native_intakes > steps // 4, (fast.native_steps, steps)


def test_native_calls_refuse_inputs_outside_their_contract():
    """The native calls check what they index with (rows, counts, column layout) and raise instead of reading or
    writing past the running batch's columns."""
    from pagellm.sched.native import fastpath

    native = fastpath()
    assert native is not None, "the native scheduler fast path did not build (g++, libssl-dev)"
    columns = np.arange(48, dtype=np.int64).reshape(6, 8)
    with pytest.raises(ValueError, match="ascending"):
        native.compact_rows(columns, 4, [2, 1])
    with pytest.raises(ValueError, match="columns of 8"):
        native.compact_rows(columns, 9, [0])
    with pytest.raises(TypeError, match="int64"):
        native.compact_rows(columns.astype(np.int32), 4, [0])
    for counts, flat in (([1, 1], [5]), ([-1, 2], [5])):
        with pytest.raises(ValueError, match="do not match"):
            native.take_tokens(columns, 2, counts, flat, [[], []], {})
    names, ids = ["a", "b", "c", "d"], [10, 11, 12, 13]
    with pytest.raises(ValueError, match="list of the 4 rows"):
        native.compact_rows(columns, 4, [1], names, ids[:3])
    assert columns.tolist() == np.arange(48).reshape(6, 8).tolist()  # nothing was touched
    assert names == ["a", "b", "c", "d"] and ids == [10, 11, 12, 13]
    native.compact_rows(columns, 4, [1, 2], names, ids)
    assert columns[0, :2].tolist() == [0, 3] and columns[5, :2].tolist() == [40, 43]
    assert names == ["a", "d"] and ids == [10, 13]  # the lists lose the same rows


def test_native_block_hashes_equal_the_python_ones_and_leave_bad_tokens_to_them():
    """``extend_block_hashes`` of the native path (the scheduler hashes every arriving unsalted prompt with it) gives
    the Python twin's chained hashes, from scratch and when extending; a token outside int32 makes it answer False
    with the hashes as they were, so the Python twin raises its own error."""
    from pagellm.kv.hashing import ROOT_HASH, extend_block_hashes
    from pagellm.sched.native import fastpath

    native = fastpath()
    assert native is not None, "the native scheduler fast path did not build (g++, libssl-dev)"
    rng = random.Random(7)
    for block_size in (1, 4, 16):
        tokens = [rng.randrange(-2**31, 2**31) for _ in range(5 * block_size + 3)]
        ours, theirs = [], []
        for end in (0, block_size - 1, 2 * block_size, len(tokens)):  # nothing new, one block, the rest
            assert native.extend_block_hashes(ours, tokens[:end], block_size, ROOT_HASH) is True
            extend_block_hashes(theirs, tokens[:end], block_size)
            assert ours == theirs and len(ours) == end // block_size
    hashes = []
    assert native.extend_block_hashes(hashes, [1, 2, 3, 4, 5, 2**31, 7, 8], 4, ROOT_HASH) is False
    assert hashes == []  # the first block's hash, appended before the bad token, was taken back
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), CacheConfig(block_size=4), 16, 64)
    assert sched.kv.native_hashes is native.extend_block_hashes

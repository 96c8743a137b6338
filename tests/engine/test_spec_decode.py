"""Speculative decoding end to end on tiny random models: greedy output is token-identical with and without
each proposer (also under preemption and prefix-cache hits), sampled requests verify drafts by rejection
sampling, and no KV block (target or draft cache) leaks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagellm import LLM, SamplingParams

SMALL_KV = 256 * 16 * 2 * 2 * 2 * 16 * 4  # 256 blocks of the tiny model's float32 KV (2 layers)


def _prompts(seed: int, n: int = 6) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for length in (5, 12, 19, 33, 40, 70)[:n]:
        p = torch.randint(0, 256, (length,), generator=gen).tolist()
        out.append(p + p[:8] + p)  # repetition gives the n-gram proposer material
    return out


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _drafted(llm: LLM) -> tuple[int, int]:
    stats = [s.spec_decoding for s in llm.last_stats if s.spec_decoding is not None]
    return sum(d.num_draft_tokens for d in stats), sum(d.num_accepted_tokens for d in stats)


def assert_no_leaks(llm: LLM) -> None:
    """Every target block is free; the worker (which hears of finished requests at the next step) holds draft
    state and draft-cache blocks only for requests it still tracks, and the draft pool's accounting is exact."""
    kv = llm.engine.core.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    runner = llm.engine.core.executor.worker.runner
    assert set(runner.drafts) <= set(runner.states)
    pool = getattr(runner.proposer, "pool", None)
    if pool is not None:
        held = runner.proposer.req_blocks
        assert set(held) <= set(runner.states)
        assert pool.num_free + sum(len(b) for b in held.values()) == pool.num_blocks
        assert len({b for blocks in held.values() for b in blocks}) == sum(len(b) for b in held.values())
    # One more request makes the worker forget the finished ones: only that request's state may remain.
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    assert len(runner.states) <= 1 and set(runner.drafts) <= set(runner.states)
    if pool is not None:
        assert pool.num_free + sum(len(b) for b in runner.proposer.req_blocks.values()) == pool.num_blocks
        assert set(runner.proposer.req_blocks) <= set(runner.states)


GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
ANY_BATCH = {"disable_by_batch_size": None}  # draft in batches of any size (the tests below run 6 requests)


@pytest.fixture(scope="module")
def plain(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV)


def test_ngram_sampled_requests_verify_drafts(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  **ANY_BATCH})
    params = SamplingParams(temperature=0.3, top_p=0.95, seed=5, max_tokens=24, ignore_eos=True)
    first = _run(llm, _prompts(1), params)
    drafted, accepted = _drafted(llm)
    assert drafted > 0 and 0 <= accepted <= drafted  # a flat random model rarely agrees with n-gram drafts
    assert all(len(t) == 24 for t in first)
    assert _run(llm, _prompts(1), params) == first  # seeded requests reproduce
    assert_no_leaks(llm)


@pytest.mark.parametrize("spec", [
    {"method": "draft_model", "num_speculative_tokens": 3, "draft_layers": 1},
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
], ids=["self-spec", "ngram"])
def test_greedy_identical_with_and_without_speculation(tiny_llama: Path, plain: LLM, spec: dict[str, Any]) -> None:
    prompts = _prompts(2)
    expected = _run(plain, prompts, GREEDY)
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV, speculative_config={**spec, **ANY_BATCH})
    assert _run(llm, prompts, GREEDY) == expected
    drafted, accepted = _drafted(llm)
    assert drafted > 0 and accepted > 0
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)  # again, now from prefix-cache hits
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert sum(s.prefix_cache_hits for s in llm.last_stats) > 0
    # Each request's own counts (what usage reports for predicted outputs) add up to the engine's.
    assert (sum(o.metrics.num_draft_tokens for o in outputs),
            sum(o.metrics.num_accepted_draft_tokens for o in outputs)) == _drafted(llm)
    assert_no_leaks(llm)


def test_self_speculation_with_every_layer_accepts_sampled_drafts(tiny_llama: Path) -> None:
    """A draft that is the whole target proposes from the target's own distribution, so rejection sampling must
    accept (nearly) every draft: this fails if the draft distributions are not threaded through verification."""
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV,
              speculative_config={"method": "draft_model", "num_speculative_tokens": 3, "draft_layers": 2})
    params = SamplingParams(temperature=0.9, top_k=50, seed=3, max_tokens=16, ignore_eos=True)
    outs = _run(llm, _prompts(3, n=4), params)
    drafted, accepted = _drafted(llm)
    assert all(len(t) == 16 for t in outs)
    assert drafted > 20 and accepted >= 0.95 * drafted
    assert _run(llm, _prompts(3, n=4), params) == outs
    assert_no_leaks(llm)


def test_draft_model_greedy_identical_under_preemption(tiny_llama: Path, plain: LLM,
                                                                       tiny_model_factory) -> None:
    draft_dir = tiny_model_factory("llama", seed=1)  # a different random model with the same vocabulary
    prompts = _prompts(4)
    expected = _run(plain, prompts, GREEDY)
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV // 8, max_num_seqs=6,
              speculative_config={"method": "draft_model", "num_speculative_tokens": 4, "model": str(draft_dir),
                                  **ANY_BATCH})
    assert _run(llm, prompts, GREEDY) == expected
    assert sum(s.num_preemptions for s in llm.last_stats) > 0, "the pool was meant to force preemptions"
    assert _drafted(llm)[0] > 0
    assert_no_leaks(llm)


def test_speculation_is_off_while_the_batch_is_large(tiny_llama: Path, plain: LLM) -> None:
    """disable_by_batch_size=2: after a step of more than 2 requests nothing is drafted and no draft slot is
    reserved; as requests finish and 2 remain, drafting resumes. Greedy output is unchanged and no block leaks."""
    prompts = _prompts(2)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (6, 12, 18, 24, 40, 48)]
    expected = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "disable_by_batch_size": 2})
    sched, steps = llm.engine.core.scheduler, []
    schedule = sched.schedule

    def recording_schedule():
        out = schedule()
        extra = sum(len(sched.kv.req_blocks[r]) - -(-sched.num_computed_tokens(r) // sched.kv.block_size)
                    for r in out.req_ids)  # blocks held beyond the step's tokens: draft slots
        steps.append((len(out.req_ids), sum(map(len, out.spec_token_ids.values())), extra))
        return out

    sched.schedule = recording_schedule
    assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert all(previous[0] <= 2 for previous, (_, drafts, _) in zip(steps, steps[1:]) if drafts)
    first_draft = next(i for i, (_, drafts, _) in enumerate(steps) if drafts)
    assert steps[first_draft - 1][0] == 2 and all(batch > 2 for batch, _, _ in steps[:first_draft - 1])
    assert all(extra == 0 for _, _, extra in steps[:first_draft - 1])  # no draft slot while drafting was off
    assert sum(drafts for _, drafts, _ in steps) > 20              # drafting resumed for the last requests
    assert_no_leaks(llm)


class _OracleTreeProposer:
    """Test proposer: a static [3, 2, 2] tree whose siblings are random distractors except that, along the
    target's true greedy continuation, the right token sits at a random sibling rank. Verification must find that
    path through the tree mask, positions and KV compaction, or the output changes."""

    def __init__(self, continuations: list[list[int]], seed: int) -> None:
        from pagellm.spec.tree import static_tree

        self.parents = static_tree([3, 2, 2])
        self.num_lookahead_tokens = len(self.parents)
        self.continuations = continuations
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, requests):
        from pagellm.spec.base import Draft

        return [self._tree(r.token_ids) for r in requests]

    def _tree(self, token_ids):
        from pagellm.spec.base import Draft

        full = next((c for c in self.continuations if _is_prefix(token_ids, c)), None)
        tokens = torch.randint(0, 256, (len(self.parents),), generator=self.gen).tolist()
        on_path = {-1}  # nodes whose tokens are the true continuation so far (the root always is)
        for parent in [-1] + list(range(len(self.parents))):
            kids = [n for n, p in enumerate(self.parents) if p == parent]
            index = len(token_ids) + (0 if parent < 0 else _depth(self.parents, parent))
            if parent not in on_path or not kids or full is None or index >= len(full):
                continue
            if torch.rand((), generator=self.gen) < 0.8:  # sometimes the truth is missing from the tree
                pick = kids[int(torch.randint(0, len(kids), (), generator=self.gen))]
                tokens[pick] = full[index]
                on_path.add(pick)
        return Draft(tokens, None, list(self.parents))

    def release(self, req_ids):
        pass


def _depth(parents, node):
    depth = 1
    while parents[node] >= 0:
        node, depth = parents[node], depth + 1
    return depth


def _is_prefix(token_ids, full):
    return len(token_ids) <= len(full) and list(full[:len(token_ids)]) == list(token_ids)


@pytest.mark.parametrize("backend", ["torch_ref", "cpu_paged"])
def test_tree_verification_is_greedy_identical(tiny_llama: Path, plain: LLM, backend: str) -> None:
    prompts = _prompts(5, n=4)
    expected = _run(plain, prompts, GREEDY)
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV, attention_backend=backend,
              speculative_config={"method": "ngram", "num_speculative_tokens": 1})
    proposer = _OracleTreeProposer([p + e for p, e in zip(prompts, expected)], seed=0)
    llm.engine.core.executor.worker.runner.proposer = proposer
    llm.engine.core.scheduler.num_lookahead_tokens = proposer.num_lookahead_tokens
    assert _run(llm, prompts, GREEDY) == expected
    drafted, accepted = _drafted(llm)
    assert drafted > 0 and accepted > len(prompts) * 4
    assert_no_leaks(llm)


@pytest.fixture(scope="module")
def medusa_file(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Medusa heads trained for the tiny model with the train-draft pipeline (a few steps, tiny prompts)."""
    from pagellm.spec.train import flatten, generate_sequences, train_medusa, training_llm

    llm = training_llm(str(tiny_llama), "float32", kv_cache_memory=SMALL_KV)
    codes = ["def add(a, b):\n    ", "for i in range(10):\n", "hello there, how are you?"]
    sequences = generate_sequences(llm, [[{"role": "user", "content": "hi"}]], codes, max_tokens=24)
    assert all(len(s.tokens) > s.prompt_len for s in sequences)
    hidden, tokens = flatten(sequences)
    lm_head = llm.engine.core.executor.worker.runner.model.lm_head.plain_weight().float()
    heads, losses = train_medusa(hidden, tokens, lm_head, num_heads=3, steps=30, batch=16, lr=1e-2, seed=0)
    assert losses[-1] < losses[0]
    path = tmp_path_factory.mktemp("medusa") / "heads.safetensors"
    heads.save(path)
    return path


def test_medusa_targets_skip_sequence_breaks() -> None:
    from pagellm.spec.train import targets_for

    tokens = torch.tensor([5, 6, 7, -1, 8, 9])
    assert targets_for(tokens, 2).tolist() == [[6, 7], [7, -1], [-1, -1], [-1, -1], [9, -1], [-1, -1]]


@pytest.mark.parametrize("tree", [None, [2, 2, 1]], ids=["chain", "tree"])
def test_medusa_greedy_identical(tiny_llama: Path, plain: LLM, medusa_file: Path, tree) -> None:
    prompts = _prompts(6, n=4)
    expected = _run(plain, prompts, GREEDY)
    spec = {"method": "medusa", "num_speculative_tokens": 3, "model": str(medusa_file), "tree": tree}
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV, speculative_config=spec)
    assert _run(llm, prompts, GREEDY) == expected
    assert _drafted(llm)[0] > 0
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True)
    assert all(len(t) == 12 for t in _run(llm, prompts, sampled))
    assert_no_leaks(llm)


def test_a_predicted_output_is_drafted_first_and_changes_nothing_but_the_steps(tiny_llama: Path) -> None:
    """OpenAI's predicted outputs: the reply is expected to repeat most of a text (an edit of it); drafting from it
    cuts the steps, and verification keeps every token what it would be without it, whatever the prediction."""
    llm = LLM(str(tiny_llama), dtype="float32", speculative_config={
        "method": "ngram", "num_speculative_tokens": 6, "disable_by_batch_size": None})
    greedy = dict(temperature=0, max_tokens=40, ignore_eos=True)

    def run_with(prediction: list[int] | None) -> tuple[list[int], int, int]:
        out = llm.generate(["Edit this:"], SamplingParams(**greedy, prediction_token_ids=prediction),
                           use_tqdm=False)[0].outputs[0].token_ids
        accepted = sum(s.spec_decoding.num_accepted_tokens for s in llm.last_stats if s.spec_decoding is not None)
        return out, accepted, len(llm.last_stats)

    plain, plain_accepted, plain_steps = run_with(None)
    edited = plain[:15] + [5, 6] + plain[15:]  # the model's own reply with two tokens inserted
    tokens, accepted, steps = run_with(edited)
    assert tokens == plain and accepted > plain_accepted and steps < plain_steps / 2
    wrong = list(range(100, 140))
    assert run_with(wrong)[0] == plain
